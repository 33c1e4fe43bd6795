"""EpisodeRunner: token-exact multi-turn episodes, limits, environment failures and concurrency.

A tiny random decoder (CPU, the engine's eager path) and the tiny world's character tokenizer; the
environments are in tests/_agent_envs.py.
"""
import logging
import math
import time

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from phaserl.agents.episodes import AgentLimits, EpisodeRunner, EpisodeStart
from phaserl.agents.loader import EnvironmentFactory
from phaserl.data.prompts import PromptItem
from phaserl.data.rows import PromptRow
from phaserl.errors import AgentError
from phaserl.roles.forward import batch_logprobs
from phaserl.rollout import EngineConfig, GenerationResult, RolloutEngine, SamplingParams, generate
from phaserl.trainer.episode_batch import EpisodeScores, episodes_batch, turn_ends
from phaserl.world.tokenizer import build_tokenizer
from tests import _agent_envs as envs
from tests.test_rollout_engine import tiny_model

torch.set_num_threads(1)
TOK = build_tokenizer()
EOS = TOK.eos_token_id
SAMPLE = SamplingParams(max_new_tokens=4, temperature=1.0)


def limits(**overrides) -> AgentLimits:
    base = dict(max_turns=4, max_turn_tokens=4, max_episode_tokens=64, context_limited=False, step_timeout_s=10.0,
                on_env_error="end", workers=4, overlap=False)
    return AgentLimits(**{**base, **overrides})


def item(i: int, question: str = "12+34=") -> PromptItem:
    prompt = [{"role": "user", "content": question}]
    row = PromptRow(prompt=prompt, data_source="t", ground_truth="46", extra_info={"index": i},
                    source=f"t.jsonl:row {i}", index=i, raw={"prompt": prompt})
    text = TOK.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return PromptItem(row, tuple(TOK.encode(text, add_special_tokens=False)), text)


def starts(num_rows: int = 3, n: int = 2) -> list:
    return [EpisodeStart(item(i), seed=10 * i + k, label=f"t.jsonl:row {i}, sample {k}")
            for i in range(num_rows) for k in range(n)]


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=len(TOK), max_position_embeddings=64)


def run_engine(model, env_cls, lim=None, *, kwargs=None, params=SAMPLE, seed=0, episodes=None):
    lim = lim or limits()
    runner = EpisodeRunner(EnvironmentFactory(env_cls, kwargs or {}), TOK, lim)
    engine = RolloutEngine(model, EngineConfig(max_slots=4))
    with engine.session(params, slot_len=lim.max_episode_tokens, eos_token_ids=[EOS],
                        generator=torch.Generator().manual_seed(seed)) as session:
        return runner.run_session(session, episodes or starts()), engine


def test_episodes_hold_the_sampled_and_appended_ids_and_the_trainer_recomputes_their_logprobs(model):
    episodes, engine = run_engine(model, envs.Feedback, kwargs=dict(turns=3, observation="ab"))
    obs_ids = TOK.encode("ab", add_special_tokens=False)
    for ep in episodes:
        kinds = [s.kind for s in ep.segments]
        assert kinds == ["prompt", "model", "observation", "model", "observation", "model"] and ep.num_turns == 3
        assert all(s.token_ids == obs_ids for s in ep.segments if s.kind == "observation")
        assert ep.finish_reason == "done" and ep.reward == pytest.approx(1.5)
    assert engine.last_stats["extend_tokens"] == 6 * 2 * len(obs_ids)  # observations appended, never re-read
    batch = episodes_batch(episodes, 2, tokenizer=TOK, pad_token_id=0, group_offset=0, device="cpu")
    mask = batch.loss_mask.bool()
    assert (batch.loss_mask <= batch.response_mask).all() and mask.sum() < batch.response_mask.sum()
    for i, ep in enumerate(episodes):  # the trained ids are exactly the episode's ids
        resp = ep.response_ids()
        assert batch.response_ids[i, :len(resp)].tolist() == resp
    recomputed = batch_logprobs(model, batch, temperature=1.0, token_budget=4096)  # [B, R]
    torch.testing.assert_close(recomputed[mask], batch.rollout_logprobs[mask], atol=1e-4, rtol=0)
    scores = EpisodeScores().score(batch)
    assert scores.total.tolist() == [pytest.approx(1.5)] * 6
    for i, ep in enumerate(episodes):  # one reward per turn, on that turn's last sampled token
        assert scores.token_rewards[i].nonzero().squeeze(1).tolist() == turn_ends(ep)
        assert all(batch.loss_mask[i, c] == 1 for c in turn_ends(ep))


def test_the_fallback_path_re_prefills_and_gives_the_same_greedy_episodes(model):
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    kwargs = dict(turns=3, observation=[{"role": "user", "content": "no 12+34="}])
    fast, _ = run_engine(model, envs.Feedback, kwargs=kwargs, params=greedy)
    runner = EpisodeRunner(EnvironmentFactory(envs.Feedback, kwargs), TOK, limits())
    slow = runner.run_generate(lambda prompts: generate(model, prompts, greedy, eos_token_ids=[EOS], pad_token_id=0),
                               starts())
    assert [e.response_ids() for e in fast] == [e.response_ids() for e in slow]
    rendered = TOK.encode("<|user|>no 12+34=<|assistant|>", add_special_tokens=False)
    assert fast[0].segments[2].token_ids == rendered  # chat messages rendered as the template's continuation


def test_message_observations_render_the_template_probe_once(monkeypatch):
    """The template's text for the probe conversation is the same for every observation, so it is rendered once
    per renderer, not once per observation (a Jinja render is ~0.1-1 ms, paid by every episode at every turn);
    the ids are the template's continuation either way."""
    from phaserl.agents.render import ObservationRenderer

    renders = []
    original = TOK.apply_chat_template
    monkeypatch.setattr(TOK, "apply_chat_template", lambda *a, **k: renders.append(a[0]) or original(*a, **k))
    renderer = ObservationRenderer(TOK)
    message = [{"role": "user", "content": "no 12+34="}]
    first, second = renderer.ids(message), renderer.ids(message)
    assert first == second == TOK.encode("<|user|>no 12+34=<|assistant|>", add_special_tokens=False)
    assert len(renders) == 3  # the probe once, then each observation's conversation


def _bpe_tokenizer() -> PreTrainedTokenizerFast:
    """'a' and 'b' are tokens, and so is their merge 'ab': decode -> encode of [a, b] gives [ab]."""
    vocab = {"<eos>": 0, "a": 1, "b": 2, "ab": 3, "x": 4}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<eos>")


def test_re_tokenizing_the_decoded_text_would_drift_and_the_batch_keeps_the_sampled_ids():
    tok = _bpe_tokenizer()
    sampled = [1, 2, 0]  # the model sampled "a", "b", EOS: two tokens whose text re-tokenizes as one
    text = tok.decode(sampled, skip_special_tokens=True)
    assert text == "ab" and tok.encode(text, add_special_tokens=False) == [3]  # the drift verl #6719 trains on
    prompt = PromptItem(PromptRow("x", "t", None, {"index": 0}, "t.jsonl:row 0", 0, {}), (4,), "x")
    runner = EpisodeRunner(EnvironmentFactory(envs.Feedback, dict(turns=2, observation="ab")), tok, limits())
    episodes = runner.run_generate(lambda prompts: GenerationResult([sampled] * len(prompts),
                                                                    [[-0.5] * 3] * len(prompts),
                                                                    ["stop"] * len(prompts)),
                                   [EpisodeStart(prompt, 0, "t.jsonl:row 0, sample 0")])
    assert envs.MADE[-1].actions == ["ab", "ab"]  # the environment reads text...
    batch = episodes_batch(episodes, 1, tokenizer=tok, pad_token_id=0, group_offset=0, device="cpu")
    assert batch.response_ids[0].tolist() == [1, 2, 0, 3, 1, 2, 0]  # ...the trainer reads the sampled ids
    assert batch.loss_mask[0].tolist() == [1, 1, 1, 0, 1, 1, 1]      # the observation ("ab" -> [3]) is masked


def test_limits_end_episodes_with_their_reason(model):
    eps, _ = run_engine(model, envs.NeverDone, limits(max_turns=3))
    assert {e.finish_reason for e in eps} == {"max_turns"} and {e.num_turns for e in eps} == {3}
    eps, _ = run_engine(model, envs.NeverDone, limits(max_episode_tokens=20))
    assert {e.finish_reason for e in eps} == {"max_tokens"}
    assert all(len(e.prompt_ids) + len(e.response_ids()) <= 20 for e in eps)
    eps, _ = run_engine(model, envs.NeverDone, limits(max_episode_tokens=20, context_limited=True))
    assert {e.finish_reason for e in eps} == {"context"}


def test_a_fresh_environment_per_episode_each_closed(model):
    before = len(envs.MADE)
    run_engine(model, envs.Feedback)
    made = envs.MADE[before:]
    assert len(made) == 6 and len({id(e) for e in made}) == 6
    deadline = time.monotonic() + 10  # close() runs on a worker thread: wait for it, however busy the machine
    while not all(e.closed for e in made) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(e.closed for e in made)
    assert sorted(e.seed for e in made) == sorted(s.seed for s in starts())


def test_an_environment_that_raises_ends_its_episode_with_a_message_naming_it_and_the_row(model, caplog):
    with caplog.at_level(logging.WARNING, logger="phaserl"):
        eps, _ = run_engine(model, envs.RaisesOnSecondStep, kwargs=dict(turns=4))
    assert {e.finish_reason for e in eps} == {"env_error"} and {e.num_turns for e in eps} == {2}
    assert {e.reward for e in eps} == {0.5}  # the first step's reward is kept
    assert "environment RaisesOnSecondStep (t.jsonl:row 0, sample 0): step() raised RuntimeError: the sandbox " \
           "crashed" in caplog.text
    with pytest.raises(AgentError, match=r"RaisesOnSecondStep \(t.jsonl:row 0, sample 0\).*on_env_error=end"):
        run_engine(model, envs.RaisesOnSecondStep, limits(on_env_error="stop"), kwargs=dict(turns=4))


def test_a_non_finite_reward_ends_the_episode(model, caplog):
    with caplog.at_level(logging.WARNING, logger="phaserl"):
        eps, _ = run_engine(model, envs.NanReward)
    assert {e.finish_reason for e in eps} == {"env_error"} and {e.reward for e in eps} == {0.0}
    assert "environment NanReward (t.jsonl:row 0, sample 0): step() returned a non-finite reward (nan)" in caplog.text


def test_a_hanging_step_times_out_and_the_other_episodes_finish(model, caplog):
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="phaserl"):
        eps, _ = run_engine(model, envs.Hangs, limits(step_timeout_s=0.5, overlap=True))
    assert time.monotonic() - t0 < 10
    assert [e.finish_reason for e in eps] == ["env_timeout"] * 2 + ["done"] * 4
    assert "step() did not return within 0.5 s (agent.step_timeout_s)" in caplog.text


def test_decoding_goes_on_while_an_environment_waits(model):
    envs.SlowFirstRow.ENDED.clear()
    run_engine(model, envs.SlowFirstRow, limits(overlap=True), kwargs=dict(delay=3.0, turns=3))
    ended = envs.SlowFirstRow.ENDED
    slow = min(t for (row, _), t in ended.items() if row == 0)
    assert all(t < slow - 1.0 for (row, _), t in ended.items() if row != 0)  # finished while row 0 waited


def test_without_overlap_a_seeded_rollout_repeats_exactly(model):
    a, _ = run_engine(model, envs.Feedback, kwargs=dict(turns=3), seed=5)
    b, _ = run_engine(model, envs.Feedback, kwargs=dict(turns=3), seed=5)
    c, _ = run_engine(model, envs.Feedback, kwargs=dict(turns=3), seed=6)
    ids = lambda eps: [e.response_ids() for e in eps]  # noqa: E731
    assert ids(a) == ids(b) != ids(c)


def test_with_overlap_and_random_environment_latency_the_episodes_are_those_of_overlap_false(model):
    """Sampling noise is keyed by the episode (EpisodeStart.noise_key) and the position, not by the slot or the
    decode step an episode resumes at, so environment timing changes the schedule but not the samples (on the
    CPU the logits do not depend on the batch either). 8 episodes through 4 slots: some wait for a slot."""
    kwargs = dict(turns=3)
    fixed, _ = run_engine(model, envs.Jittery, kwargs=kwargs, seed=5, episodes=starts(4, 2))
    assert {e.num_turns for e in fixed} == {3}
    for _ in range(2):
        eps, _ = run_engine(model, envs.Jittery, limits(overlap=True), kwargs=kwargs, seed=5, episodes=starts(4, 2))
        assert [e.response_ids() for e in eps] == [e.response_ids() for e in fixed]
        for a, b in zip(eps, fixed):
            got = [lp for s in a.segments if s.kind == "model" for lp in s.logprobs]
            want = [lp for s in b.segments if s.kind == "model" for lp in s.logprobs]
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
    assert len({tuple(e.response_ids()) for e in fixed}) > 1  # samples, not one repeated answer


def test_tool_schemas_go_into_the_prompt_and_an_environment_may_name_its_end(model):
    import copy

    tok = copy.deepcopy(TOK)
    tok.chat_template = "{% if tools %}<|system|>{{ tools[0]['function']['name'] }}{% endif %}" + TOK.chat_template
    runner = EpisodeRunner(EnvironmentFactory(envs.WithTools, {}), tok, limits())
    engine = RolloutEngine(model)
    with engine.session(SAMPLE, slot_len=64, eos_token_ids=[EOS]) as session:
        eps = runner.run_session(session, starts(1, 2))
    assert tok.decode(eps[0].prompt_ids) == "<|system|>add<|user|>12+34=<|assistant|>"
    assert [e.finish_reason for e in eps] == ["tool_timeout"] * 2
    from phaserl.trainer.episode_batch import episode_metrics

    m = episode_metrics(eps)
    assert m["agent/ended/tool_timeout"] == 1.0 and m["agent/tool_calls_mean"] == 2.0 and m["agent/ended/done"] == 0


def test_a_pool_kept_across_rollouts_starts_its_threads_once(model):
    from phaserl.agents.workers import Workers

    pool = Workers(4, name="t-kept")
    runner = EpisodeRunner(EnvironmentFactory(envs.Feedback, dict(turns=2, observation="ab")), TOK, limits(),
                           workers=pool)
    engine = RolloutEngine(model, EngineConfig(max_slots=4))
    for seed in range(2):
        with engine.session(SAMPLE, slot_len=64, eos_token_ids=[EOS],
                            generator=torch.Generator().manual_seed(seed)) as s:
            episodes = runner.run_session(s, starts())
        assert [e.num_turns for e in episodes] == [2] * 6
        if seed == 0:
            started = pool._started
    assert 1 <= started <= 4 and pool._started == started   # the second rollout reused the first one's threads
    assert pool.submit(lambda: "still open").result(timeout=5) == "still open"  # the runner did not shut it down


@pytest.mark.parametrize("window, merged", [(1.0, True), (0.0, False)])
def test_with_nothing_decoding_answers_due_within_a_step_resume_together(model, monkeypatch, window, merged):
    """Four episodes end a turn on the same step; their environments answer 0, 30, 60, 90 ms later. Nothing
    else decodes, so answers due within what a separate resumption costs (here set to `window`) join one extend pass."""
    from phaserl.rollout.session import DecodeSession

    monkeypatch.setattr(DecodeSession, "gather_seconds", property(lambda self: window))
    passes = []
    engine = RolloutEngine(model, EngineConfig(max_slots=4))
    real = engine.runner.extend
    monkeypatch.setattr(engine.runner, "extend", lambda items: (passes.append(len(items)), real(items)))
    runner = EpisodeRunner(EnvironmentFactory(envs.Staggered, dict(turns=2, observation="ab")), TOK,
                           limits(overlap=True, max_turn_tokens=4))
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    episodes = [EpisodeStart(item(i), seed=i, label=f"t.jsonl:row {i}") for i in range(4)]
    with engine.session(params, slot_len=64, eos_token_ids=[], generator=torch.Generator().manual_seed(0)) as s:
        out = runner.run_session(s, episodes)
    assert [e.num_turns for e in out] == [2] * 4 and sum(passes) == 4
    assert (passes == [4]) == merged, passes


def test_while_others_decode_answers_are_held_until_all_are_in_or_one_pass_has_passed():
    """With sequences decoding, each resumption is a pass of its own (on a GPU host ~37 ms of launches, nothing
    else decoding meanwhile): answered episodes wait parked until every environment call is in, or until the
    first one held has waited what a separate resumption costs (gather_seconds); then they resume together."""
    import concurrent.futures as cf
    from types import SimpleNamespace

    runner = EpisodeRunner(EnvironmentFactory(envs.Feedback, dict(turns=2)), TOK, limits(overlap=True))
    futures = [cf.Future() for _ in range(4)]
    runs = [SimpleNamespace(index=i, future=f, deadline=math.inf) for i, f in enumerate(futures)]
    session = SimpleNamespace(decoding=2, gather_seconds=1.0)
    held: dict = {}
    for f in futures[:2]:
        f.set_result("answer")
    assert runner._gathered(session, runs, runs[:2], held) == []      # two calls still out: held
    assert set(held) == {0, 1}
    for f in futures[2:]:
        f.set_result("answer")
    assert runner._gathered(session, runs, runs, held) == runs       # every call in: all four resume at once
    assert held == {}

    held = {}
    session.gather_seconds = 0.02
    assert runner._gathered(session, runs[:3] + [SimpleNamespace(index=3, future=cf.Future(), deadline=math.inf)],
                            runs[:3], held) == []
    time.sleep(0.03)                                                  # the first held has waited a pass's cost
    assert runner._gathered(session, runs[:3] + [SimpleNamespace(index=3, future=cf.Future(), deadline=math.inf)],
                            runs[:3], held) == runs[:3]

    session.gather_seconds = 0.0                                      # resumptions cost nothing: no holding
    assert runner._gathered(session, runs[:1] + [SimpleNamespace(index=1, future=cf.Future(), deadline=math.inf)],
                            runs[:1], {}) == runs[:1]
