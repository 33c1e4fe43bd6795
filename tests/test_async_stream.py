"""The asynchronous rollout (rollout.max_staleness >= 1, trainer/stream.py; docs/async.md).

- A response cut by DecodeSession.suspend and continued in a new session (its ids re-prefilled) samples exactly
  the tokens and log-probs an uncut one does (noise keyed by sample and position; the CPU's logits do not depend
  on the batch).
- The staleness bound: a sample whose oldest token would be more than k versions behind starts over (restart)
  or its group is dropped (drop), counted.
- A run trains with every token at most k versions behind, its tokens carry their versions, the decoupled
  correction is in force, and max_staleness 0 is the synchronous step.
- Bad settings are refused with the key named.
"""
import json

import pytest
import torch

from phaserl.algo import rollout_correction
from phaserl.errors import ConfigError
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams
from phaserl.trainer.stream import AsyncStream, Group, Sample
from tests.test_rollout_engine import PROMPTS, tiny_model

torch.set_num_threads(1)


def _finish(s, params, starts: dict, got: dict, prompts: dict = None) -> None:
    """Run sequences {key: ids to start from} to their end in session s, slots refilled; their turns into got.
    prompts: {key: its prompt} (default PROMPTS[key % 3]), what of the start ids is not sampled."""
    waiting = list(starts)
    while waiting or not s.idle:
        while waiting and s.free_slots:
            key = waiting.pop(0)
            prompt = prompts[key] if prompts is not None else PROMPTS[key % 3]
            s.start(key, starts[key], params.max_new_tokens - (len(starts[key]) - len(prompt)), noise_key=key)
        for turn in s.step():
            got[turn.key][0].extend(turn.token_ids), got[turn.key][1].extend(turn.logprobs)
            s.release(turn.key)


def _uncut(engine, params, keys):
    got = {k: ([], []) for k in keys}
    with engine.session(params, slot_len=40, eos_token_ids=[], generator=torch.Generator().manual_seed(3)) as s:
        _finish(s, params, {k: PROMPTS[k % 3] for k in keys}, got)
    return got


@pytest.mark.parametrize("cut_after", [1, 3, 6])
def test_a_response_cut_by_suspend_and_continued_samples_what_an_uncut_one_does(cut_after):
    engine = RolloutEngine(tiny_model(), EngineConfig(max_slots=4))
    params = SamplingParams(max_new_tokens=9, temperature=1.0)
    keys = [0, 1, 2, 3, 4, 5]   # six sequences, four slots: two wait and two are queued when cut
    expected = _uncut(engine, params, keys)
    got = {k: ([], []) for k in keys}
    with engine.session(params, slot_len=40, eos_token_ids=[], generator=torch.Generator().manual_seed(3)) as s:
        waiting = list(keys)
        for _ in range(cut_after):
            while waiting and s.free_slots:
                key = waiting.pop(0)
                s.start(key, PROMPTS[key % 3], params.max_new_tokens, noise_key=key)
            for turn in s.step():
                got[turn.key][0].extend(turn.token_ids), got[turn.key][1].extend(turn.logprobs)
                s.release(turn.key)
        ended, cut = s.suspend()
        assert s.free_slots == 4 and s.idle
    assert {t.key for t in cut} and all(t.partial for t in cut) and not any(t.partial for t in ended)
    for turn in ended + cut:
        got[turn.key][0].extend(turn.token_ids), got[turn.key][1].extend(turn.logprobs)
    # a new session (as after an update): each unfinished one restarts from its prompt + ids so far
    with engine.session(params, slot_len=40, eos_token_ids=[], generator=torch.Generator().manual_seed(3)) as s:
        _finish(s, params, {k: PROMPTS[k % 3] + got[k][0] for k in keys if len(got[k][0]) < params.max_new_tokens},
                got)
    for key in keys:
        assert len(got[key][0]) == params.max_new_tokens
        assert got[key][0] == expected[key][0], key
        torch.testing.assert_close(torch.tensor(got[key][1]), torch.tensor(expected[key][1]), atol=1e-5, rtol=0)


def _stream(on_stale: str, k: int = 1) -> AsyncStream:
    return AsyncStream(max_staleness=k, on_stale=on_stale, n=2, prompts_per_rank=2, slots=4, noise_seed=0,
                       dataset=None)


def _group(order: int, *versions) -> Group:
    return Group(order, order, None, [Sample(order * 10 + i, ids=[1] * len(v), logprobs=[0.0] * len(v),
                                             versions=list(v), finish="stop" if v else None)
                                      for i, v in enumerate(versions)])


@pytest.mark.parametrize("on_stale", ["restart", "drop"])
def test_samples_past_the_bound_start_over_or_their_group_is_dropped(on_stale):
    stream = _stream(on_stale, k=1)
    fresh, old, unstarted = _group(0, [4, 5], [5]), _group(1, [3, 4, 5], [5]), _group(2, [], [])
    stream.groups = [fresh, old, unstarted]
    stats = {"async/restarted_samples": 0.0, "async/dropped_groups": 0.0}
    stream._enforce_bound(5, stats)   # training version 5, k = 1: tokens of version 4 are the oldest allowed
    if on_stale == "restart":
        assert stream.groups == [fresh, old, unstarted] and stats["async/restarted_samples"] == 1
        assert old.samples[0].ids == [] and old.samples[0].finish is None and old.samples[0].key != 10
        assert old.samples[1].ids == [1]                                 # its group mate is kept
    else:
        assert stream.groups == [fresh, unstarted] and stats["async/dropped_groups"] == 1


def test_the_decoupled_correction_weighs_by_proximal_over_behaviour_and_masks_past_the_cap():
    proximal = torch.tensor([[-1.0, -0.5, -2.0]])
    behaviour = torch.tensor([[-1.5, -0.5, -0.4]])     # rho = e^0.5, 1, e^-1.6
    mask = torch.ones(1, 3)
    w, _ = rollout_correction(proximal, behaviour, mask, mode="decoupled", cap=1.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, torch.exp(torch.tensor(-1.6)).item()]]))  # e^0.5 > 1.5


def _tiny_cfg(tmp_path, *extra):
    from phaserl.cli import QUICKSTART_CONFIG
    from phaserl.config import load_config

    return load_config(QUICKSTART_CONFIG, [f"trainer.log_dir={tmp_path / 'logs'}", "trainer.total_steps=4",
                                           "trainer.val_interval=0", "trainer.val_before_train=false",
                                           f"trainer.checkpoint_path={tmp_path / 'ckpt'}", "trainer.loggers=[jsonl]",
                                           "rollout.prompts_per_step=8", "rollout.batch_size=4",
                                           "rollout.engine_max_slots=32", *extra])  # fewer slots than samples in flight


@pytest.mark.slow
def test_an_async_run_trains_on_tokens_at_most_k_versions_behind_and_records_them(tmp_path):
    from phaserl.trainer import RLTrainer

    trainer = RLTrainer.from_config(_tiny_cfg(tmp_path, "rollout.max_staleness=1", "rollout.max_new_tokens=6"))
    seen = []
    update = trainer.update

    def spy(train):
        seen.append((trainer.step_num, train.rollout.token_versions.clone(), train.rollout.loss_mask.clone()))
        return update(train)
    trainer.update = spy
    trainer.fit()
    assert trainer.actor.loss.correction.keywords["mode"] == "tis"   # auto with max_staleness >= 1
    lines = [json.loads(line) for line in open(tmp_path / "logs" / "metrics.jsonl")]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    behind = []
    for step, versions, mask in seen:
        sampled = versions[mask.bool()]
        assert (versions[~mask.bool()] == -1).all() and (sampled >= 0).all() and (sampled <= step).all()
        behind.append(int((step - sampled).max()))
    assert max(behind) == 1, behind                      # some tokens were sampled before the last update...
    assert all(m["async/staleness_max"] <= 1 for m in lines)   # ...and none further back
    assert any(m["async/cut_samples"] > 0 for m in lines)
    for m in lines:
        assert m["async/token_share/behind_0"] + m["async/token_share/behind_1"] == pytest.approx(1.0)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_every_phase_keeps_the_pace_so_groups_do_not_fall_into_lock_step_cohorts(tmp_path, k):
    """Slots for every sample in flight and responses of one length (6, ignore_eos): the first phase decodes the
    two batches it may start to the end together. Without a pace the next phase would find its batch ready and
    decode nothing, and the stream would alternate 6 steps / 0 steps (cohorts, as slow as lock-step). With it
    every later phase decodes ceil(6 / 2) = 3 steps: each group's tokens are spread over two phases. At k = 2 too:
    a response starts at most max(1, k - 1) = 1 step before its batch, so no token is more than 1 version old."""
    from phaserl.trainer import RLTrainer

    trainer = RLTrainer.from_config(_tiny_cfg(tmp_path, f"rollout.max_staleness={k}", "rollout.max_new_tokens=6",
                                              "rollout.ignore_eos=true", "rollout.engine_max_slots=512",
                                              "trainer.total_steps=5"))
    trainer.fit()
    lines = [json.loads(line) for line in open(tmp_path / "logs" / "metrics.jsonl")]
    assert [m["async/phase_steps"] for m in lines] == [6, 3, 3, 3, 3]
    assert all(m["async/staleness_max"] <= 1 for m in lines)


@pytest.mark.parametrize("override, expected", [
    ("rollout.max_staleness=-1", "rollout.max_staleness"),
    ("rollout.max_staleness=1.5", "rollout.max_staleness"),
    ("rollout.on_stale=later", "rollout.on_stale"),
])
def test_bad_async_settings_name_the_key(tmp_path, override, expected):
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        _tiny_cfg(tmp_path, override)


def test_settings_async_cannot_run_with_are_refused_before_training(tmp_path):
    from phaserl.trainer import RLTrainer

    with pytest.raises(ConfigError, match=r"rollout\.max_staleness=2.*dynamic_sampling"):
        RLTrainer.from_config(_tiny_cfg(tmp_path, "rollout.max_staleness=2", "algorithm.dynamic_sampling=true"))


@pytest.mark.slow
def test_async_agent_episodes_carry_over_phases_and_their_observations_have_no_version(tmp_path):
    from phaserl.cli import QUICKSTART_CONFIGS
    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer

    cfg = load_config(QUICKSTART_CONFIGS["agent"], [
        f"trainer.log_dir={tmp_path / 'logs'}", f"trainer.checkpoint_path={tmp_path / 'ckpt'}", "trainer.total_steps=4",
        "trainer.val_interval=0", "trainer.val_before_train=false", "trainer.loggers=[jsonl]",
        "rollout.prompts_per_step=8", "rollout.engine_max_slots=24", "rollout.max_staleness=1"])  # 24 slots: some wait
    trainer = RLTrainer.from_config(cfg)
    seen = []
    update = trainer.update
    trainer.update = lambda train: (seen.append((trainer.step_num, train.rollout)), update(train))[1]
    trainer.fit()
    lines = [json.loads(line) for line in open(tmp_path / "logs" / "metrics.jsonl")]
    assert all("async/parked_episodes" in m and m["async/staleness_max"] <= 1 for m in lines)
    carried = 0
    for step, batch in seen:
        versions, sampled = batch.token_versions, batch.loss_mask.bool()
        assert (versions[sampled] >= step - 1).all() and (versions[sampled] <= step).all()
        assert (versions[~sampled] == -1).all()      # observations and padding: nothing sampled them
        for ep in batch.episodes:                    # one model segment per turn, however many phases it took
            kinds = [seg.kind for seg in ep.segments[1:]]
            assert all(a != b or a != "model" for a, b in zip(kinds, kinds[1:]))
            carried += len({v for seg in ep.segments if seg.kind == "model" for v in seg.versions}) > 1
    assert carried > 0, "no episode was continued across an update"


@pytest.mark.slow
def test_agent_phases_keep_the_pace_so_episodes_do_not_fall_into_lock_step_cohorts(tmp_path):
    """The agent world's episodes begun together mostly end together: without a pace the stream alternates a phase
    that decodes two batches to the end with one that decodes nothing (11 / 0 steps), and every tool waits at
    once. With the token stream's pace (the last batch's most model tokens over lookahead + 1 phases) every phase
    decodes, and turns are cut and continued across the updates."""
    from phaserl.cli import QUICKSTART_CONFIGS
    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer

    cfg = load_config(QUICKSTART_CONFIGS["agent"], [
        f"trainer.log_dir={tmp_path / 'logs'}", f"trainer.checkpoint_path={tmp_path / 'ckpt'}", "trainer.total_steps=5",
        "trainer.val_interval=0", "trainer.val_before_train=false", "trainer.loggers=[jsonl]",
        "rollout.prompts_per_step=8", "rollout.max_staleness=1"])
    trainer = RLTrainer.from_config(cfg)
    trainer.fit()
    lines = [json.loads(line) for line in open(tmp_path / "logs" / "metrics.jsonl")]
    assert trainer.run.stream.pace_steps() > 0
    assert all(m["async/phase_steps"] > 0 for m in lines), [m["async/phase_steps"] for m in lines]
    assert sum(m["async/cut_samples"] for m in lines[1:]) > 0
    assert all(m["async/staleness_max"] <= 1 for m in lines)


@pytest.mark.parametrize("overrides, status, words", [
    ([], "OK", "synchronous"),
    (["rollout.max_staleness=1"], "OK", "correction: tis"),
    (["rollout.max_staleness=1", "algorithm.rollout_correction=none"], "WARN", "rollout_correction=none"),
    (["rollout.max_staleness=4", "actor.optim.lr=1e-5"], "WARN", "lower k or the learning rate"),
])
def test_the_doctor_names_the_mode_the_bound_and_the_correction(overrides, status, words):
    from phaserl.doctor import load_doctor_config
    from phaserl.doctor.checks import Context
    from phaserl.doctor.rollout_mode import check_rollout_mode

    result = check_rollout_mode(Context(cfg=load_doctor_config(None, overrides), world_size=1))
    assert result.status == status and words in result.message + result.fix, (result.message, result.fix)
