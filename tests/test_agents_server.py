"""The OpenAI-compatible endpoint: the official client talks to it, and the record is token-exact."""
import json
import threading
import time

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from phaserl.agents.completion import CompletionRequest, FakeBackend, GenerateBackend
from phaserl.agents.harness import run_harness
from phaserl.agents.server import ChatServer
from phaserl.agents.tools import tool
from tests._tiny_tokenizer import CHARS, SPECIAL_TOKENS, build_tiny_tokenizer

try:
    import openai
except ImportError:  # the device machine has no openai: only the stdlib-client tests run there
    openai = None
needs_openai = pytest.mark.skipif(openai is None, reason="needs the openai client (pip install 'phaserl[agents]')")

# Hermes/Qwen2.5-style: tools in the system turn, calls as <tool_call> JSON, results as <tool_response>.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}"
    "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EOS = 1  # <|im_end|> in the tiny tokenizer


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture
def tok():
    return build_tiny_tokenizer(HERMES_TEMPLATE)


def scripted(tokenizer, *replies):
    """A fake model that answers the k-th request of a conversation with replies[k] (+ EOS)."""
    def reply(prompt_ids):
        turn = tokenizer.decode(prompt_ids).count("<|im_start|>assistant") - 1
        return tokenizer(replies[min(turn, len(replies) - 1)], add_special_tokens=False)["input_ids"] + [EOS]
    return FakeBackend(reply, eos_token_ids=(EOS,))


def post_json(url, body):
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def client_for(url):
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)


@needs_openai
def test_models_and_a_tool_calling_conversation_with_the_openai_client(tok):
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    backend = scripted(tok, call, "It is 5.")
    with ChatServer(backend, tok, parser="hermes") as server:
        client = client_for(server.base_url)
        assert [m.id for m in client.models.list().data] == ["phaserl-policy"]
        messages = [{"role": "user", "content": "2+3?"}]
        first = client.chat.completions.create(model="phaserl-policy", messages=messages, tools=[add.schema],
                                               max_tokens=80, logprobs=True)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        (tc,) = choice.message.tool_calls
        assert tc.function.name == "add" and json.loads(tc.function.arguments) == {"a": 2, "b": 3}
        assert [round(e.logprob, 6) for e in choice.logprobs.content][:3] == [-0.1, -0.2, -0.3]
        assert first.usage.completion_tokens == len(call) + 1
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tc.id, "content": "5"}]
        second = client.chat.completions.create(model="phaserl-policy", messages=messages, tools=[add.schema])
        assert second.choices[0].message.content == "It is 5." and second.choices[0].finish_reason == "stop"
    # The tools reached the template: the first prompt carries the schema.
    assert json.dumps(add.schema) in tok.decode(list(backend.requests[0].prompt_ids))
    (conv_id,) = server.store.ids()
    (episode,) = server.store.pop(conv_id).episodes(row={"id": 7}, reward=1.0)
    sampled = [list(r) for r in (tok(call, add_special_tokens=False)["input_ids"] + [EOS],
                                 tok("It is 5.", add_special_tokens=False)["input_ids"] + [EOS])]
    kinds = [s.kind for s in episode.segments]
    assert kinds == ["prompt", "model", "observation", "model"]
    assert [s.token_ids for s in episode.segments if s.kind == "model"] == sampled
    assert tok.decode(episode.segments[2].token_ids) == ("\n<|im_start|>user\n<tool_response>5</tool_response>"
                                                         "<|im_end|>\n<|im_start|>assistant\n")
    assert episode.prompt_ids == list(backend.requests[0].prompt_ids)
    assert episode.prompt_ids + episode.response_ids()[:-len(sampled[1])] == list(backend.requests[1].prompt_ids)
    assert episode.loss_mask() == ([1] * len(sampled[0]) + [0] * len(episode.segments[2].token_ids)
                                   + [1] * len(sampled[1]))
    assert episode.metrics["prefix_mismatches"] == 0 and episode.reward == 1.0 and episode.num_turns == 2


def merging_tokenizer():
    """Char-level plus one merge '1'+'2' -> '12': the model may sample '1','2' separately, but re-encoding
    the decoded text yields the merged token: the re-tokenization drift, in miniature."""
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARS)}
    vocab["12"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("1", "2")], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        unk_token="<unk>")
    tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


@needs_openai
def test_drift_is_spliced_away_the_model_sees_and_trains_on_its_sampled_ids():
    tok = merging_tokenizer()
    one, two = tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("2")
    sampled = [one, two, EOS]  # "12" as two tokens
    assert tok("12", add_special_tokens=False)["input_ids"] != [one, two]  # re-encoding drifts
    backend = FakeBackend(lambda prompt: sampled, eos_token_ids=(EOS,))
    with ChatServer(backend, tok) as server:
        client = client_for(server.conversation_url("conv-a"))
        messages = [{"role": "user", "content": "hi"}]
        reply = client.chat.completions.create(model="m", messages=messages).choices[0].message
        assert reply.content == "12"
        messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "again"}]
        client.chat.completions.create(model="m", messages=messages)
    first, second = (list(r.prompt_ids) for r in backend.requests)
    assert second[:len(first) + 3] == first + sampled  # the sampled ids, not the re-encoded "12"
    (episode,) = server.store.pop("conv-a").episodes(row=None, reward=0.0)
    assert episode.segments[1].token_ids == sampled
    assert episode.metrics["spliced_turns"] == 1 and episode.metrics["prefix_mismatches"] == 0
    assert server.metrics["spliced_turns"] == 1


@needs_openai
def test_an_edited_history_starts_a_new_piece_with_a_warning(tok, caplog):
    backend = scripted(tok, "a", "b")
    with ChatServer(backend, tok) as server:
        client = client_for(server.conversation_url("c1"))
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "EDITED"},
                                                            {"role": "assistant", "content": "a"},
                                                            {"role": "user", "content": "y"}])
    assert "does not continue the previous completion" in caplog.text
    episodes = server.store.pop("c1").episodes(row=None, reward=0.5)
    assert len(episodes) == 2 and all(e.metrics["prefix_mismatches"] == 1 for e in episodes)
    assert episodes[1].prompt_ids == list(backend.requests[1].prompt_ids)
    assert [e.reward for e in episodes] == [0.5, 0.5]


@needs_openai
def test_bad_requests_get_openai_errors_that_say_what_to_change(tok):
    backend = scripted(tok, "a")
    with ChatServer(backend, tok, max_context=40) as server:
        client = client_for(server.base_url)
        cases = [(dict(messages=[{"role": "robot", "content": "x"}]), "role='robot'"),
                 (dict(messages=[{"role": "user", "content": "x"}], n=2), "one request per sample"),
                 (dict(messages=[{"role": "user", "content": "x"}], stop=["ab"]), "single tokens"),
                 (dict(messages=[{"role": "user", "content": "x" * 60}]), "context holds 40"),
                 (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]),
                  "'image_url' part")]
        for kwargs, expected in cases:
            with pytest.raises(openai.BadRequestError, match=expected):
                client.chat.completions.create(model="m", **kwargs)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="m", prompt="x")
        ok = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=500)
        assert ok.usage.total_tokens <= 40  # max_tokens clamped to the room left in the context
    assert server.metrics["errors"] == len(cases)


def test_generate_backend_batches_concurrent_requests():
    calls = []

    def fake_generate(prompts, params, **kw):
        calls.append(len(prompts))
        time.sleep(0.05)
        from phaserl.rollout.generate import GenerationResult
        return GenerationResult([[p[-1], EOS] for p in prompts], [[-1.0, -2.0]] * len(prompts), ["stop"] * len(prompts))

    backend = GenerateBackend(fake_generate, eos_token_ids=[EOS], pad_token_id=0, gather_s=0.02)
    results = [None] * 8
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, backend.complete(CompletionRequest((5, 6, i + 10), 4)))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.token_ids for r in results] == [[i + 10, EOS] for i in range(8)]
    assert sum(calls) == 8 and len(calls) < 8  # several requests shared one generate call
    backend.close()
    assert not backend._worker.is_alive()
    with pytest.raises(RuntimeError, match="worker stopped"):
        backend.complete(CompletionRequest((5,), 4))


@needs_openai
@pytest.mark.slow
def test_run_harness_returns_episodes_and_survives_failing_and_hanging_harnesses(tok):
    backend = scripted(tok, '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>', "2")

    def harness(base_url, row):
        client = client_for(base_url)
        messages = [{"role": "user", "content": row["q"]}]
        for _ in range(4):
            msg = client.chat.completions.create(model="m", messages=messages, tools=[add.schema]).choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                break
            for c in msg.tool_calls:
                messages.append({"role": "tool", "tool_call_id": c.id,
                                 "content": str(add(**json.loads(c.function.arguments)))})
        if row["q"] == "boom":
            raise RuntimeError("harness bug")
        if row["q"] == "hang":
            time.sleep(60)  # abandoned by run_harness (a daemon thread)
        return None  # scored by the rule reward below

    rows = [{"q": "1+1", "prompt": "1+1", "ground_truth": 2}, {"q": "boom", "ground_truth": 2},
            {"q": "hang", "ground_truth": 2}]
    with ChatServer(backend, tok) as server:
        client_for(server.base_url).models.list()  # the client's first call is slow (lazy imports): not in the timing
        episodes = run_harness(harness, rows, server, samples_per_row=2, timeout_s=6, reward="tiny_exact")
    assert [e.row["q"] for e in episodes] == ["1+1", "1+1", "boom", "boom", "hang", "hang"]
    assert [e.reward for e in episodes] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert [e.finish_reason for e in episodes] == ["done", "done", "env_error", "env_error", "env_error", "env_error"]
    assert all(e.num_turns == 2 and [s.kind for s in e.segments] == ["prompt", "model", "observation", "model"]
               for e in episodes)
    assert episodes[4].metrics["harness_timeouts"] == 1 and episodes[2].metrics["harness_errors"] == 1
    with ChatServer(backend, tok) as server:
        tagged = run_harness(harness, rows[:1], server, reward="tiny_exact", episode_rows=["row-object"])
    assert [e.row for e in tagged] == ["row-object"] and tagged[0].reward == 1.0
    with pytest.raises(RuntimeError, match="row 0: RuntimeError: nope"):
        with ChatServer(backend, tok) as server:
            run_harness(lambda url, row: (_ for _ in ()).throw(RuntimeError("nope")), rows[:1], server)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.slow
def test_tiny_model_through_the_openai_client_records_its_own_logprobs(device):
    """The real path: phaserl's tiny model behind GenerateBackend; the recorded episode's log-probs are
    what the model computes for those exact ids (teacher-forced), so training sees the sampled tokens.
    On CUDA the engine decodes with CUDA graphs, in float32."""
    from transformers import AutoTokenizer

    from phaserl.models.hf_io import load_pretrained
    from phaserl.rollout.engine import RolloutEngine
    from phaserl.world import prepare_tiny_world

    world = prepare_tiny_world()
    model = load_pretrained(world.model_dir, device=device).eval()
    tokenizer = AutoTokenizer.from_pretrained(world.tokenizer_dir)
    backend = GenerateBackend(RolloutEngine(model), eos_token_ids=[tokenizer.eos_token_id],
                              pad_token_id=tokenizer.pad_token_id)
    with ChatServer(backend, tokenizer, default_max_tokens=6) as server:
        url = server.conversation_url("tiny") + "/chat/completions"  # a stdlib client: the device has no openai
        messages = [{"role": "user", "content": "23+45="}]
        first = post_json(url, {"model": "tiny", "messages": messages, "seed": 1})["choices"][0]["message"]
        messages += [{"role": "assistant", "content": first["content"]}, {"role": "user", "content": "12+30="}]
        post_json(url, {"model": "tiny", "messages": messages, "temperature": 0.7, "seed": 2})
    (episode,) = server.store.pop("tiny").episodes(row=None, reward=0.0)
    assert [s.kind for s in episode.segments] == ["prompt", "model", "observation", "model"]
    ids = episode.prompt_ids + episode.response_ids()
    with torch.inference_mode():
        logits = model.logits(model(torch.tensor([ids], device=device))[0]).cpu()  # [T, V]
    start = len(episode.prompt_ids)
    temps = iter([1.0, 0.7])
    for seg in episode.segments[1:]:
        if seg.kind == "model":
            expected = (logits[start - 1:start - 1 + len(seg.token_ids)] / next(temps)).log_softmax(-1)
            expected = expected.gather(-1, torch.tensor(seg.token_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(seg.logprobs), expected, atol=1e-4, rtol=0)
        start += len(seg.token_ids)
    assert tokenizer.decode(episode.segments[2].token_ids) == "<|user|>12+30=<|assistant|>"


@needs_openai
@pytest.mark.slow
def test_the_openai_harness_example_runs(capsys):
    import runpy

    episodes = runpy.run_path("examples/openai_harness.py")["main"]()
    assert len(episodes) == 8 and all([s.kind for s in e.segments] == ["prompt", "model", "observation", "model"]
                                      for e in episodes)
    assert "8 episodes" in capsys.readouterr().out


def test_a_conversation_past_max_turns_is_refused_and_its_episode_ends_with_max_turns(tok):
    """Episode limits on the endpoint: a harness that never stops calling gets a clear HTTP 400 at
    agent.max_turns; its episode keeps its turns, ends with max_turns (not env_error), and is scored."""
    import urllib.error

    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    backend = scripted(tok, call)  # the model always calls the tool: a naive loop would never end
    refusals = []

    def looping(base_url, row):
        messages = [{"role": "user", "content": row["q"]}]
        while True:
            try:
                reply = post_json(base_url + "/chat/completions",
                                  dict(model="m", messages=messages, tools=[add.schema], max_tokens=500))
            except urllib.error.HTTPError as exc:
                refusals.append((exc.code, json.loads(exc.read())["error"]))
                if row["q"] == "catches":
                    return 0.5  # a harness that catches the refusal keeps its own reward
                raise
            message = reply["choices"][0]["message"]
            messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "2"}]

    rows = [{"q": "raises", "ground_truth": 2}, {"q": "catches", "ground_truth": 2}]
    with ChatServer(backend, tok, max_turns=2, max_turn_tokens=90) as server:
        episodes = run_harness(looping, rows, server, reward=lambda prompt, response, ground_truth, **row: 0.25)
        assert server.metrics["refused_at_limit"] == 2
    assert [(status, err["code"]) for status, err in refusals] == [(400, "max_turns_exceeded")] * 2
    assert "agent.max_turns=2" in refusals[0][1]["message"] and "return its reward" in refusals[0][1]["message"]
    assert [e.finish_reason for e in episodes] == ["max_turns", "max_turns"]
    assert [e.num_turns for e in episodes] == [2, 2]
    assert [e.reward for e in episodes] == [0.25, 0.5]  # raised: the rule reward judges; caught: its own
    assert all(e.metrics["harness_errors"] == 0 for e in episodes)
    with ChatServer(scripted(tok, "a" * 20), tok, max_turn_tokens=7) as server:  # rollout.max_new_tokens caps a turn
        reply = post_json(server.base_url + "/chat/completions",
                          dict(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=500))
    assert reply["usage"]["completion_tokens"] == 7 and reply["choices"][0]["finish_reason"] == "length"


def test_a_conversation_that_outgrows_the_episode_budget_ends_with_max_tokens(tok):
    import urllib.error

    with ChatServer(scripted(tok, "a" * 20), tok, max_context=60) as server:
        url = server.conversation_url("long") + "/chat/completions"
        messages = [{"role": "user", "content": "x"}]
        first = post_json(url, dict(model="m", messages=messages))
        messages += [first["choices"][0]["message"], {"role": "user", "content": "y" * 30}]
        with pytest.raises(urllib.error.HTTPError) as refused:
            post_json(url, dict(model="m", messages=messages))
        error = json.loads(refused.value.read())["error"]
        assert refused.value.code == 400 and error["code"] == "context_length_exceeded"
        assert "agent.max_episode_tokens" in error["message"]
        assert server.store.get("long").ended == "max_tokens" and server.metrics["refused_at_limit"] == 1


@needs_openai
def test_the_openai_client_shows_the_max_turns_refusal(tok):
    with ChatServer(scripted(tok, "a"), tok, max_turns=1) as server:
        client = client_for(server.conversation_url("c1"))
        first = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert first.model_extra["phaserl"]["turns_left"] == 0
        messages = [{"role": "user", "content": "x"}, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "again"}]
        with pytest.raises(openai.BadRequestError, match="agent.max_turns=1"):
            client.chat.completions.create(model="m", messages=messages)
        assert server.store.get("c1").ended == "max_turns"
