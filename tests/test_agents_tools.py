"""Tools: schemas from typed functions, call parsing, argument checks, errors and timeouts as observations."""
import json
import threading
import time
from typing import Literal, Optional

import pytest

from phaserl.agents import env as env_contract
from phaserl.agents.tool_env import ToolEnvironment
from phaserl.agents.tool_parsers import TOOL_PARSERS, ParsedTurn, get_tool_parser, register_tool_parser
from phaserl.agents.tools import Tool, ToolCall, run_tool_calls, tool, validate_arguments


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend,
            which may be negative
    """
    return a + b


@tool(name="lookup", description="Find a word.")
def _lookup(word: str, lang: Literal["en", "de"] = "en", limit: Optional[int] = None) -> dict:
    return {"word": word, "lang": lang, "limit": limit}


def test_schema_from_a_typed_function():
    assert add.schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"], "properties": {
            "a": {"type": "integer", "description": "the first addend"},
            "b": {"type": "integer", "description": "the second addend, which may be negative"}}}}}
    params = _lookup.parameters
    assert params["required"] == ["word"]
    assert params["properties"]["lang"] == {"enum": ["en", "de"]}
    assert params["properties"]["limit"] == {"type": ["integer", "null"]}
    assert add(a=2, b=3) == 5


def test_schema_rejects_what_json_cannot_describe():
    with pytest.raises(ValueError, match=r"parameter 'x'.*no JSON-schema form"):
        def bad(x: complex):
            return x
        tool(bad)
    with pytest.raises(ValueError, match="OpenAI's rule"):
        Tool("has space", "", {"type": "object"}, print)


def test_hermes_parser_reads_calls_and_reports_broken_ones():
    text = ('Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call><tool_call>{"arguments": {}}</tool_call>')
    turn = get_tool_parser("hermes")(text)
    assert turn.content == "Let me add."
    assert [(c.name, c.arguments) for c in turn.calls] == [("add", {"a": 2, "b": 3})]
    assert turn.calls[0].id.startswith("call_")
    assert len(turn.errors) == 2 and "not valid JSON" in turn.errors[0] and "no 'name'" in turn.errors[1]
    # A turn cut off at EOS inside an open block still yields the call; plain prose yields none.
    cut = get_tool_parser("hermes")('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 1}"}')
    assert cut.calls[0].arguments == {"a": 1, "b": 1}
    assert get_tool_parser("hermes")("The answer is 5.") == ParsedTurn("The answer is 5.")


def test_llama3_and_mistral_parsers():
    llama = get_tool_parser("llama3_json")
    turn = llama('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                 '{"name": "lookup", "parameters": {"word": "a;b"}}')
    assert [(c.name, c.arguments) for c in turn.calls] == [("add", {"a": 1, "b": 2}), ("lookup", {"word": "a;b"})]
    assert llama("{not json, just braces in prose}").calls == []
    mistral = get_tool_parser("mistral")
    turn = mistral('ok [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "abc123XYZ"}]')
    assert turn.content == "ok" and turn.calls[0].id == "abc123XYZ"
    assert mistral("[TOOL_CALLS][{oops").errors
    # Decoded with skip_special_tokens=True, the marker is gone; the bare call list still counts.
    assert mistral('[{"name": "add", "arguments": {"a": 1, "b": 2}}]').calls[0].arguments == {"a": 1, "b": 2}
    assert mistral('[{"x": 1}] is a list').calls == []


def test_parser_registry_suggests_names_and_takes_new_ones():
    with pytest.raises(ValueError, match="Did you mean 'hermes'"):
        get_tool_parser("hermess")

    @register_tool_parser("always_add")
    def always_add(text):
        return ParsedTurn("", [ToolCall("add", {"a": 1, "b": 1})])

    try:
        assert ToolEnvironment([add], parser="always_add").step("anything").observation[0]["content"] == "2"
    finally:
        del TOOL_PARSERS["always_add"]


def test_argument_validation_messages():
    assert validate_arguments(add.parameters, {"a": 1, "b": 2}) == []
    errors = validate_arguments(add.parameters, {"a": "1", "c": 3})
    assert any("arguments.a must be of type integer, got string" in e for e in errors)
    assert any("missing the required 'b'" in e for e in errors)
    assert any("unknown 'c'" in e for e in errors)
    assert validate_arguments(_lookup.parameters, {"word": "x", "lang": "fr"}) == \
        ['arguments.lang must be one of [\'en\', \'de\'], got "fr"']
    assert validate_arguments({"type": "array", "items": {"type": "number"}}, [1, "x"]) == \
        ['arguments[1] must be of type number, got string "x"']


def test_errors_become_outcomes_never_exceptions():
    def boom(x: int):
        raise RuntimeError("disk full")

    tools = {"add": add, "boom": tool(boom)}
    calls = [ToolCall("add", {"a": 2.0, "b": 3}), ToolCall("nope", {}), ToolCall("add", {"a": "x", "b": 1}),
             ToolCall("boom", {"x": 1})]
    outcomes = run_tool_calls(calls, tools, timeout_s=5)
    assert [o.status for o in outcomes] == ["ok", "unknown_tool", "invalid_arguments", "error"]
    assert outcomes[0].content == "5"  # 2.0 became the integer 2
    assert "no tool named 'nope'" in outcomes[1].content and "add, boom" in outcomes[1].content
    assert "RuntimeError: disk full" in outcomes[3].content


def test_a_hanging_tool_is_cut_off_and_others_run_meanwhile():
    release = threading.Event()

    def hang() -> str:
        release.wait(30)
        return "late"

    def slow(x: int) -> int:
        time.sleep(0.5)
        return x

    tools = {"hang": tool(hang), "slow": tool(slow)}
    start = time.perf_counter()
    outcomes = run_tool_calls([ToolCall("hang", {})] + [ToolCall("slow", {"x": i}) for i in range(4)],
                              tools, timeout_s=0.8)
    elapsed = time.perf_counter() - start
    release.set()
    assert outcomes[0].status == "timeout" and "did not finish within 0.8 s" in outcomes[0].content
    assert [o.content for o in outcomes[1:]] == ["0", "1", "2", "3"]
    assert 0.75 < elapsed < 1.6  # one deadline for all; the four 0.5 s calls overlapped (in turn: 2.8 s)


def test_tool_environment_turns_and_metrics():
    env = ToolEnvironment([add], final_reward="tiny_exact")
    assert isinstance(env, env_contract.Environment)
    assert env.tool_schemas == [add.schema]
    assert env.reset({"prompt": [{"role": "user", "content": "2+3="}], "ground_truth": 5}, seed=0) == ""
    result = env_contract.as_step_result(
        env.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'), where="test")
    assert not result.done and result.reward == 0.0
    (message,) = result.observation
    assert (message["role"], message["content"], message["name"]) == ("tool", "5", "add")
    assert message["tool_call_id"].startswith("call_")
    metrics = result.info["metrics"]
    assert (metrics["tool_calls"], metrics["tool_errors"], metrics["tool_timeouts"]) == (1, 0, 0)
    # A malformed call is an error observation, and counts as an error.
    bad = env.step("<tool_call>{oops</tool_call>")
    assert not bad.done and bad.observation[0]["content"].startswith("Error: tool call 1: not valid JSON")
    assert bad.info["metrics"]["tool_errors"] == 1
    # No call: the final answer, scored by the rule reward.
    assert env.step("5").done and env.step("5").reward == 1.0
    assert env.step("6").reward == 0.0


def test_tool_environment_timeout_can_end_the_episode():
    def hang() -> str:
        time.sleep(5)
        return "late"

    env = ToolEnvironment([tool(hang)], timeout_s=0.2, on_timeout="end", observation_role="user")
    env.reset({"prompt": "x"}, seed=0)
    result = env.step('<tool_call>{"name": "hang", "arguments": {}}</tool_call>')
    assert result.done and result.info["end_reason"] == "tool_timeout"
    assert result.info["metrics"]["tool_timeouts"] == 1
    cont = ToolEnvironment([tool(hang)], timeout_s=0.2, observation_role="user")
    obs = cont.step('<tool_call>{"name": "hang", "arguments": {}}</tool_call>').observation
    assert obs[0]["role"] == "user" and obs[0]["content"].startswith("[hang] Error: tool hang did not finish")


def test_tool_environment_final_reward_callable_and_bad_settings(tmp_path):
    def longer_is_better(prompt, response, ground_truth, scale=1.0, **row):
        return scale * len(response)

    env = ToolEnvironment([add], final_reward=longer_is_better, reward_kwargs={"scale": 0.5})
    env.reset({"prompt": "p", "ground_truth": None}, seed=0)
    assert env.step("abcd").reward == 2.0
    with pytest.raises(ValueError, match="on_timeout='stop'"):
        ToolEnvironment([add], on_timeout="stop")
    with pytest.raises(ValueError, match="unique"):
        ToolEnvironment([add, add])
    spec = tmp_path / "my_tools.py"
    spec.write_text("def mul(a: int, b: int) -> int:\n    '''Multiply.'''\n    return a * b\n")
    env = ToolEnvironment([f"{spec}:mul"])
    assert env.tool_schemas[0]["function"]["name"] == "mul"
    step = env.step('<tool_call>{"name": "mul", "arguments": {"a": 3, "b": 4}}</tool_call>')
    assert step.observation[0]["content"] == "12"


def test_schemas_reach_a_real_chat_template():
    """The schema is what transformers' apply_chat_template(tools=...) takes: the tool shows up in the prompt."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, unk_token="x")), unk_token="x")
    tok.chat_template = ("{% for t in tools %}<tools>{{ t | tojson }}</tools>{% endfor %}"
                         "{% for m in messages %}{{ m.content }}{% endfor %}")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[add.schema], tokenize=False)
    assert json.loads(text[len("<tools>"):text.index("</tools>")]) == add.schema


def test_an_async_tool_runs_like_a_plain_one():
    import asyncio

    @tool
    async def double(x: int) -> int:
        """Twice x."""
        await asyncio.sleep(0.01)
        return 2 * x

    (outcome,) = run_tool_calls([ToolCall("double", {"x": 21})], {"double": double}, timeout_s=5)
    assert (outcome.status, outcome.content) == ("ok", "42")


@pytest.mark.slow
def test_tool_environment_inside_the_episode_runner():
    """The two halves of multi-turn tools together: ToolEnvironment run by agents-core's EpisodeRunner (skipped
    on a branch without it). A stand-in parser calls `add` for any turn not starting with a digit, so
    the random tiny model produces both tool turns and final answers."""
    episodes_mod = pytest.importorskip("phaserl.agents.episodes")
    import torch

    from phaserl.agents.loader import EnvironmentFactory
    from phaserl.data.prompts import PromptItem
    from phaserl.data.rows import PromptRow
    from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams
    from phaserl.world.tokenizer import build_tokenizer
    from tests.test_rollout_engine import tiny_model

    tok = build_tokenizer()

    def digit_or_call(text):
        if text[:1].isdigit():
            return ParsedTurn(text)
        return ParsedTurn("", [ToolCall("add", {"a": len(text), "b": 1})])

    def is_digit_answer(prompt, response, ground_truth, **row):
        return float(response[:1].isdigit())

    kwargs = dict(tools=[add], parser=digit_or_call, final_reward=is_digit_answer, observation_role="user")
    limits = episodes_mod.AgentLimits(max_turns=4, max_turn_tokens=4, max_episode_tokens=96, context_limited=False,
                                      step_timeout_s=10.0, on_env_error="end", workers=4, overlap=False)
    runner = episodes_mod.EpisodeRunner(EnvironmentFactory(ToolEnvironment, kwargs), tok, limits)
    starts = []
    for i in range(4):
        prompt = [{"role": "user", "content": "12+34="}]
        row = PromptRow(prompt=prompt, data_source="t", ground_truth="46", extra_info={}, source=f"t:row {i}",
                        index=i, raw={"prompt": prompt})
        text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        item = episodes_mod.EpisodeStart(PromptItem(row, tuple(tok.encode(text, add_special_tokens=False)), text),
                                         seed=i, label=f"t:row {i}")
        starts.append(item)
    model = tiny_model(vocab_size=len(tok), max_position_embeddings=128)
    engine = RolloutEngine(model, EngineConfig(max_slots=4))
    with engine.session(SamplingParams(max_new_tokens=4, temperature=1.0), slot_len=96,
                        eos_token_ids=[tok.eos_token_id], generator=torch.Generator().manual_seed(0)) as session:
        episodes = runner.run_session(session, starts)
    assert sum(ep.metrics.get("tool_calls", 0) for ep in episodes) > 0
    for ep in episodes:
        observations = [s for s in ep.segments if s.kind == "observation"]
        calls = ep.metrics.get("tool_calls", 0)
        assert all(tok.decode(s.token_ids).startswith("<|user|>") for s in observations)
        if ep.finish_reason == "done":  # ended by an answer starting with a digit
            assert ep.reward == 1.0 and calls == len(observations)  # one tool message per call turn
        else:  # a limit ended it, possibly right after a call turn whose result was not appended
            assert ep.finish_reason in ("max_turns", "max_tokens")
            assert len(observations) <= calls <= len(observations) + 1
