"""Partial rollouts kept across an update (rollout.partial_kv; DecodeSession.pause / phase / lost; docs/async.md).

On the CPU the engine's logits do not depend on the batch, so with unchanged weights a response paused at a phase's
end and continued in its kept slot samples exactly the ids (and log-probs) of the same response cut and re-prefilled,
and of one never interrupted. Checked for the session, for the token stream (AsyncStream._decode with a stand-in
trainer), for agent episodes parked across a phase end (EpisodeRunner.run_phase), for the fallback when the kept
session is lost in between (a validation generate()), and for the setting's checks.
"""
from types import SimpleNamespace

import pytest
import torch

from phaserl.agents.episodes import EpisodeRunner
from phaserl.agents.loader import EnvironmentFactory
from phaserl.agents.workers import Workers
from phaserl.config.auto import partial_kv_choice
from phaserl.errors import ConfigError
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams
from phaserl.trainer.stream import AsyncStream, Group, Sample
from tests import _agent_envs as envs
from tests.test_agents_episodes import EOS, SAMPLE, TOK, limits, starts
from tests.test_async_stream import _finish
from tests.test_rollout_engine import PROMPTS, tiny_model

torch.set_num_threads(1)
PARAMS = SamplingParams(max_new_tokens=9, temperature=1.0)
SEED = 11


def _engine(model=None, slots: int = 4) -> RolloutEngine:
    return RolloutEngine(model or tiny_model(), EngineConfig(max_slots=slots, keep_awake=True))


def _uncut(engine, keys: list) -> dict:
    """Each key's response decoded start to end in one session (the reference)."""
    got, prompts = {k: ([], []) for k in keys}, {k: PROMPTS[k % 6] for k in keys}
    with engine.session(PARAMS, slot_len=40, eos_token_ids=[], generator=torch.Generator().manual_seed(SEED)) as s:
        _finish(s, PARAMS, prompts, got, prompts)
    return got


def test_a_response_paused_in_its_slot_continues_with_no_prefill_and_samples_what_an_uncut_one_does():
    engine = _engine()
    keys = [0, 1, 2, 3]
    expected = _uncut(engine, keys)
    s = engine.open_session(PARAMS, slot_len=40, eos_token_ids=[], generator=torch.Generator().manual_seed(SEED))
    got = {k: ([], []) for k in keys}
    for phase_steps in (4, 3, 100):  # three phases: pauses after 4 and 3 steps, then to the end
        with s.phase():
            if phase_steps == 4:
                for key in keys:
                    s.start(key, PROMPTS[key], PARAMS.max_new_tokens, noise_key=key)
            for _ in range(phase_steps):
                if s.idle:
                    break
                for turn in s.step():
                    got[turn.key][0].extend(turn.token_ids), got[turn.key][1].extend(turn.logprobs)
                    s.release(turn.key)
            ended, paused = s.pause()
        assert not ended and all(t.partial for t in paused) or phase_steps == 100
        for turn in ended + paused:
            got[turn.key][0].extend(turn.token_ids), got[turn.key][1].extend(turn.logprobs)
            if not turn.partial:
                s.release(turn.key)
        if phase_steps == 4:
            assert {t.key for t in paused} == set(keys) and s.free_slots == 0  # slots kept through the "update"
    assert s.stats.prefill_tokens == sum(len(PROMPTS[k]) for k in keys)  # the prompts once: nothing re-prefilled
    assert s.free_slots == 4 and s.idle
    for key in keys:
        assert got[key][0] == expected[key][0], key
        torch.testing.assert_close(torch.tensor(got[key][1]), torch.tensor(expected[key][1]), atol=1e-5, rtol=0)


def test_a_generate_call_between_phases_loses_the_kept_session_and_it_refuses_to_decode():
    engine = _engine()
    s = engine.open_session(PARAMS, slot_len=40, eos_token_ids=[], generator=torch.Generator().manual_seed(SEED))
    with s.phase():
        s.start(0, PROMPTS[0], PARAMS.max_new_tokens, noise_key=0)
        s.step()
        s.pause()
    assert s.lost is None
    engine.generate([PROMPTS[1]], PARAMS, eos_token_ids=[], pad_token_id=0)  # e.g. validation: reuses the slots
    assert "generate() call" in s.lost
    with pytest.raises(RuntimeError, match="lost"):
        with s.phase():
            pass
    s2 = engine.open_session(PARAMS, slot_len=40, eos_token_ids=[])
    engine.release()
    assert s2.lost is not None


# ----- the token stream ------------------------------------------------------------------------------------------
class _Actor:
    def __init__(self, engine):
        self.engine = engine

    def decode_session(self, params, *, keep=False, **kwargs):
        return self.engine.open_session(params, **kwargs) if keep else self.engine.session(params, **kwargs)


def _trainer(engine):
    run = SimpleNamespace(sampling=PARAMS, ignore_eos=True, eos_token_ids=[], reward=object(),
                          sampling_generator=torch.Generator())
    return SimpleNamespace(run=run, actor=_Actor(engine))


def _group(order: int, keys: list) -> Group:
    return Group(order, order, SimpleNamespace(prompt_ids=tuple(PROMPTS[keys[0] % 6])),
                 [Sample(k) for k in keys])


def _stream_phases(engine, partial_kv: str, expected: dict, between=None) -> tuple:
    """Three phases of a k = 1 stream of one-group batches (n = 2) in 3 slots. The first response starts with 4 of its
    ids already sampled (as if continued from before), so the lengths are staggered and phases end with the next
    group's responses part-way (paused or cut). Returns ({key: (ids, logprobs, versions)}, per-phase stats,
    the stream)."""
    stream = AsyncStream(max_staleness=1, on_stale="restart", n=2, prompts_per_rank=1, slots=3, noise_seed=SEED,
                         dataset=None, partial_kv=partial_kv)
    trainer = _trainer(engine)
    stream.groups = [_group(0, [0, 6]), _group(1, [1, 7])]
    head = stream.groups[0].samples[0]
    head.ids, head.logprobs, head.versions = expected[0][0][:4], expected[0][1][:4], [0] * 4
    done, phases = {}, []
    for version in range(3):
        stats = dict.fromkeys(stream.PHASE_STATS, 0.0)
        stream._decode(trainer, version, stats)
        phases.append(stats)
        batch, stream.groups = stream.groups[0], stream.groups[1:] + [_group(version + 2, [version + 2, version + 8])]
        assert batch.complete
        done.update({s.key: (s.ids, s.logprobs, s.versions) for s in batch.samples})
        if between is not None:
            between(version)
        if stream.session is not None and stream.session.lost is None:  # no slot leaked: the held ones are in flight
            held = [s.key for g in stream.groups for s in g.samples if s.in_session]
            assert sorted(stream.session.live) == sorted(held)
            assert stream.session.free_slots == stream.session.num_slots - len(held)
    stream.close()
    return done, phases, stream


@pytest.mark.parametrize("partial_kv", ["keep", "prefill"])
def test_the_token_stream_keeps_or_re_prefills_its_partial_responses_and_samples_the_same_ids(partial_kv):
    engine = _engine(slots=3)
    expected = _uncut(engine, [0, 6, 1, 7, 2, 8])
    done, phases, stream = _stream_phases(engine, partial_kv, expected)
    assert sorted(done) == [0, 1, 2, 6, 7, 8]
    for key, (ids, logprobs, versions) in done.items():
        assert ids == expected[key][0], key
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected[key][1]), atol=1e-5, rtol=0)
        assert len(versions) == len(ids) == PARAMS.max_new_tokens
    carried = [k for k, (_, _, v) in done.items() if len(set(v)) > 1]
    assert carried, "no response was continued across a phase end"
    kept = sum(p["async/kept_sequences"] for p in phases)
    reprefilled = sum(p["async/reprefill_tokens"] for p in phases[1:])  # the first phase re-prefills the head
    assert phases[0]["async/reprefill_tokens"] == len(PROMPTS[0]) + 4
    if partial_kv == "keep":
        assert kept > 0 and reprefilled == 0 and sum(p["async/kept_tokens"] for p in phases) > 0
        assert stream.session is None and engine.runner.state.finished.all()  # closed: no slot left decoding
    else:
        assert kept == 0 and reprefilled > 0
    assert all(p["async/cut_samples"] >= 1 for p in phases[:2])


def test_a_kept_session_lost_to_a_validation_generate_falls_back_to_re_prefill_and_samples_the_same_ids():
    engine = _engine(slots=3)
    expected = _uncut(engine, [0, 6, 1, 7, 2, 8])

    def validate(version: int) -> None:  # after the first update, a validation generate() reuses the slots
        if version == 0:
            engine.generate([PROMPTS[5]], PARAMS, eos_token_ids=[], pad_token_id=0)
    done, phases, _ = _stream_phases(engine, "keep", expected, between=validate)
    assert phases[1]["async/lost_sessions"] == 1 and phases[1]["async/reprefill_tokens"] > 0
    assert phases[2]["async/lost_sessions"] == 0 and phases[2]["async/reprefill_tokens"] == 0  # kept again
    assert phases[1]["async/kept_sequences"] > 0
    for key, (ids, logprobs, _) in done.items():
        assert ids == expected[key][0], key


@pytest.mark.parametrize("on_stale", ["restart", "drop"])
def test_a_sample_restarted_or_dropped_for_staleness_gives_its_kept_slot_back(on_stale):
    engine = _engine(slots=3)
    stream = AsyncStream(max_staleness=1, on_stale=on_stale, n=2, prompts_per_rank=1, slots=3, noise_seed=SEED,
                         dataset=None, partial_kv="keep")
    stream.groups = [_group(0, [0, 6]), _group(1, [1, 7])]
    head = stream.groups[0].samples[0]  # staggered lengths: the phase ends with sample 7 part-way
    head.ids, head.logprobs, head.versions = [1, 2, 3, 4], [0.0] * 4, [0] * 4
    stream._decode(_trainer(engine), 0, dict.fromkeys(stream.PHASE_STATS, 0.0))
    held = [s for g in stream.groups for s in g.samples if s.in_session]
    assert [s.key for s in held] == [7] and stream.session.free_slots == 2
    stats = {"async/restarted_samples": 0.0, "async/dropped_groups": 0.0}
    stream._enforce_bound(2, stats)  # version 2, k = 1: tokens of version 0 are past the bound
    assert stats["async/restarted_samples" if on_stale == "restart" else "async/dropped_groups"] >= 1
    assert stream.session.free_slots == 3 and not stream.session.live and stream.session.idle
    assert not any(s.in_session for g in stream.groups for s in g.samples)
    stream.close()


# ----- agent episodes ------------------------------------------------------------------------------------------
def test_an_episode_parked_across_a_phase_end_continues_with_extend_and_is_token_exact():
    model = tiny_model(vocab_size=len(TOK), max_position_embeddings=64)
    lim = limits(overlap=False)
    factory = EnvironmentFactory(envs.Feedback, dict(turns=3, observation="ab"))
    engine = RolloutEngine(model, EngineConfig(max_slots=4, keep_awake=True))
    with engine.session(SAMPLE, slot_len=lim.max_episode_tokens, eos_token_ids=[EOS],
                        generator=torch.Generator().manual_seed(0)) as s:
        expected = EpisodeRunner(factory, TOK, lim).run_session(s, starts(2, 2))
    reference_prefill = engine.last_stats["prefill_tokens"]

    workers = Workers(4)
    runner = EpisodeRunner(factory, TOK, lim, workers=workers)
    try:
        runs = runner.begin_runs(starts(2, 2), first_index=0)
        s = engine.open_session(SAMPLE, slot_len=lim.max_episode_tokens, eos_token_ids=[EOS],
                                generator=torch.Generator().manual_seed(0))
        parked = kept = 0
        for version in range(40):
            with s.phase():
                begun = s.stats.steps
                left = runner.run_phase(s, runs, version=version, keep=True,
                                        enough=lambda: s.stats.steps - begun >= 3)
            kept += left["kept"]
            parked += sum(1 for r in runs if r.in_session and r.future is not None)  # waiting for its answer
            assert left["released"] == 0 and left["reprefilled"] == 0
            if all(r.finish_reason for r in runs):
                break
    finally:
        workers.shutdown()
    assert parked > 0 and kept > 0, "no episode was kept across a phase end"
    assert s.stats.prefill_tokens == reference_prefill and s.stats.extend_tokens > 0  # prompts once, then extends
    assert s.free_slots == 4
    for ep, run in zip(expected, runs):
        got = runner.episode(run)
        assert [seg.token_ids for seg in got.segments] == [seg.token_ids for seg in ep.segments]
        assert got.finish_reason == ep.finish_reason == "done"
        for seg_got, seg_ep in zip(got.segments, ep.segments):
            if seg_got.kind == "model":
                torch.testing.assert_close(torch.tensor(seg_got.logprobs), torch.tensor(seg_ep.logprobs), atol=1e-5,
                                           rtol=0)
                assert len(seg_got.versions) == len(seg_got.token_ids)


# ----- the setting -----------------------------------------------------------------------------------------------
def test_the_setting_resolves_auto_by_the_kept_engine_and_refuses_keep_without_one():
    assert partial_kv_choice("auto", max_staleness=1, rollout_ranks=0, keep_awake=True).value == "keep"
    assert partial_kv_choice("auto", max_staleness=1, rollout_ranks=0, keep_awake=False).value == "prefill"
    assert partial_kv_choice("prefill", max_staleness=1, rollout_ranks=0, keep_awake=True).value == "prefill"
    assert partial_kv_choice("keep", max_staleness=0, rollout_ranks=0, keep_awake=False) is None  # synchronous
    with pytest.raises(ConfigError, match=r"rollout\.partial_kv=keep.*engine_keep_awake=true"):
        partial_kv_choice("keep", max_staleness=1, rollout_ranks=0, keep_awake=False)


def test_keep_on_an_engine_that_sleeps_is_refused_when_the_run_is_built(tmp_path):
    from phaserl.trainer import RLTrainer
    from tests.test_async_stream import _tiny_cfg

    with pytest.raises(ConfigError, match=r"rollout\.partial_kv=keep"):
        RLTrainer.from_config(_tiny_cfg(tmp_path, "rollout.max_staleness=1", "rollout.partial_kv=keep"))
    with pytest.raises(ConfigError, match=r"rollout\.partial_kv"):
        _tiny_cfg(tmp_path, "rollout.partial_kv=sometimes")


@pytest.mark.parametrize("overrides, status, words", [
    (["rollout.max_staleness=1"], "OK", "rollout.partial_kv=auto, rollout.engine_keep_awake=auto"),
    (["rollout.max_staleness=1", "rollout.engine_keep_awake=true"], "OK", "partial_kv=auto -> keep"),
    (["rollout.max_staleness=1", "rollout.partial_kv=prefill"], "OK", "partial_kv=prefill -> prefill"),
    (["rollout.max_staleness=1", "rollout.partial_kv=keep", "rollout.engine_keep_awake=false"], "WARN",
     "refuses to start"),
])
def test_the_doctor_names_what_partial_rollouts_keep(overrides, status, words):
    from phaserl.doctor import load_doctor_config
    from phaserl.doctor.checks import Context
    from phaserl.doctor.rollout_mode import check_rollout_mode

    result = check_rollout_mode(Context(cfg=load_doctor_config(None, overrides), world_size=1))
    assert result.status == status and words in result.message + result.fix, (result.message, result.fix)


# ----- whole runs (the CPU engine kept awake by the setting) ---------------------------------------------------------
def _versions_ok(seen: list) -> None:
    for step, versions, mask in seen:
        sampled = versions[mask.bool()]
        assert (versions[~mask.bool()] == -1).all() and (sampled >= step - 1).all() and (sampled <= step).all()


def _fit_checking_versions(trainer, log_dir) -> list:
    """Train to the end, every update's batch checked by _versions_ok; the metrics lines."""
    import json

    seen, update = [], trainer.update
    trainer.update = lambda train: (seen.append((trainer.step_num, train.rollout.token_versions.clone(),
                                                 train.rollout.loss_mask.clone())), update(train))[1]
    trainer.fit()
    _versions_ok(seen)
    return [json.loads(line) for line in open(log_dir / "metrics.jsonl")]


@pytest.mark.slow
@pytest.mark.parametrize("val_interval", [0, 2])
def test_a_kept_token_stream_trains_valid_batches_and_a_validation_falls_back_to_re_prefill(tmp_path, val_interval):
    """k = 1 with the engine kept awake on the CPU: partial responses stay in their slots (nothing re-prefilled, every
    token's version recorded). A validation generate() between steps loses the kept session: the next phase says so
    and re-prefills its responses, then keeps again."""

    from phaserl.trainer import RLTrainer
    from tests.test_async_stream import _tiny_cfg

    trainer = RLTrainer.from_config(_tiny_cfg(
        tmp_path, "rollout.max_staleness=1", "rollout.max_new_tokens=6", "rollout.engine_keep_awake=true",
        f"trainer.val_interval={val_interval}", "trainer.total_steps=5"))
    assert trainer.run.speed.partial_kv.line() == ("rollout.partial_kv=auto -> keep: the engine is kept awake: "
                                                   "unfinished responses keep their slots and KV")
    lines = _fit_checking_versions(trainer, tmp_path / "logs")
    assert sum(m["async/kept_sequences"] for m in lines) > 0 and any(m["async/staleness_max"] == 1 for m in lines)
    lost = [m["async/lost_sessions"] for m in lines]
    if val_interval:
        assert lost == [0, 0, 1, 0, 1] and lines[2]["async/reprefill_tokens"] > 0  # validated after steps 2 and 4
    else:
        assert lost == [0] * 5 and all(m["async/reprefill_tokens"] == 0 for m in lines)
    assert trainer.run.stream.session is None  # closed at the end of fit


@pytest.mark.slow
def test_kept_agent_episodes_train_with_their_versions_and_nothing_re_prefilled(tmp_path):

    from phaserl.cli import QUICKSTART_CONFIGS
    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer

    cfg = load_config(QUICKSTART_CONFIGS["agent"], [
        f"trainer.log_dir={tmp_path / 'logs'}", f"trainer.checkpoint_path={tmp_path / 'ckpt'}", "trainer.total_steps=4",
        "trainer.val_interval=0", "trainer.val_before_train=false", "trainer.loggers=[jsonl]",
        "rollout.prompts_per_step=8", "rollout.max_staleness=1", "rollout.engine_keep_awake=true"])
    trainer = RLTrainer.from_config(cfg)
    lines = _fit_checking_versions(trainer, tmp_path / "logs")
    assert sum(m["async/kept_sequences"] for m in lines) > 0
    assert all(m["async/reprefill_tokens"] == 0 and m["async/parked_episodes"] == 0 for m in lines)


def test_a_kept_qwen35_session_refills_its_merged_lora_copies_after_an_update(tmp_path_factory):
    """The hybrid runner's own copies (the DeltaNet projections' merged LoRA weights) are refilled at a kept
    session's next phase, as the attention layers' are: the update changed the adapters in place."""
    from _qwen35_pair import make_pair
    from phaserl.models import CausalLM
    from phaserl.models.linear_attention import decode_weights
    from phaserl.models.lora import LoRASettings, apply_lora, resolve_targets

    _, ours, _ = make_pair(tmp_path_factory)
    model = CausalLM(ours.config)
    model.load_state_dict(ours.state_dict())
    apply_lora(model, LoRASettings(rank=4, alpha=8.0, target_modules=resolve_targets(["all-linear"])))
    model.eval()
    engine = RolloutEngine(model, EngineConfig(max_slots=2, keep_awake=True))
    s = engine.open_session(SamplingParams(max_new_tokens=8, temperature=1.0), slot_len=64, eos_token_ids=[],
                            generator=torch.Generator().manual_seed(0))
    with s.phase():
        s.start(0, [5, 6, 7, 8], 8, noise_key=0)
        s.step(), s.step()
        _, paused = s.pause()
    assert paused and paused[0].partial
    with torch.no_grad():  # the update: adapters change in place
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(std=0.5, generator=torch.Generator().manual_seed(len(name)))
    runner = engine.runner
    linear = [m for m in model.model.layers if m.linear]
    first = [m.linear for m in model.model.layers].index(True)
    with torch.no_grad():
        fresh = {i: decode_weights(m.linear_attn).qkv for i, m in enumerate(model.model.layers) if m.linear}
    assert linear and not torch.equal(runner.linear_weights[first].qkv, fresh[first])  # stale until the next phase
    with s.phase():  # refilled before anything decodes
        for i, qkv in fresh.items():
            torch.testing.assert_close(runner.linear_weights[i].qkv, qkv, atol=0, rtol=0)
        while not s.idle:
            for turn in s.step():
                s.release(turn.key)
    assert s.free_slots == 2


@pytest.mark.gpu
def test_gpu_a_kept_session_replays_its_graphs_with_the_weights_of_the_update():
    """CUDA graphs and fused weight copies: after an in-place update between two phases, the next phase refills the
    copies the graphs read (equal to fresh ones), replays the graphs captured in the first phase (none captured
    again), ends every paused turn at its cap, and a generate() afterwards loses the session."""
    from phaserl.models import CausalLM, DecoderConfig
    from phaserl.rollout.runner import fused_weights

    torch.manual_seed(0)
    cfg = DecoderConfig(model_type="qwen2", vocab_size=4096, hidden_size=256, intermediate_size=768,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, attention_bias=True,
                        max_position_embeddings=1024)
    model = CausalLM(cfg).to("cuda", torch.bfloat16).eval()
    engine = RolloutEngine(model, EngineConfig(max_slots=8, keep_awake=True))
    params = SamplingParams(max_new_tokens=24, temperature=1.0)
    s = engine.open_session(params, slot_len=128, eos_token_ids=[], generator=torch.Generator().manual_seed(0))
    got = {k: [] for k in range(8)}
    with s.phase():
        for k in range(8):
            s.start(k, [k + 1] * (5 + k), params.max_new_tokens, noise_key=k)
        for _ in range(6):
            s.step()
        ended, paused = s.pause()
    assert not ended and len(paused) == 8
    for turn in paused:
        got[turn.key] += turn.token_ids
    graphs = dict(engine.runner.graphs)
    with torch.no_grad():  # the update, in place
        for p in model.parameters():
            p.mul_(1.01)
    with s.phase():
        for layer, w in zip(model.model.layers, engine.runner.weights):
            with torch.no_grad():
                fresh = fused_weights(layer)
            for a, b in zip(w, fresh):
                if isinstance(a, torch.Tensor):
                    assert torch.equal(a, b)
        while not s.idle:
            for turn in s.step():
                got[turn.key] += turn.token_ids
                s.release(turn.key)
    assert all(len(ids) == params.max_new_tokens for ids in got.values())
    assert all(engine.runner.graphs.get(key) is graph for key, graph in graphs.items())
    engine.generate([[1, 2, 3]], params, eos_token_ids=[], pad_token_id=0)
    assert s.lost is not None


@pytest.mark.slow
def test_a_kept_run_resumed_from_a_checkpoint_is_the_run_that_went_on(tmp_path):
    """A checkpoint ends the kept session (the responses in flight are saved as ids; a resume re-prefills them), so
    the run that goes on re-prefills them at its next phase too: a run resumed from step 2 trains steps 3-4 with
    the same metrics and ends with the same weights as the run that never stopped."""
    import json

    from phaserl.trainer import RLTrainer
    from tests.test_async_stream import _tiny_cfg

    def run(name: str, steps: int):
        extra = ["rollout.max_staleness=1", "rollout.max_new_tokens=6", "rollout.engine_keep_awake=true",
                 "trainer.save_interval=2", f"trainer.total_steps={steps}"]
        trainer = RLTrainer.from_config(_tiny_cfg(tmp_path / name, *extra))
        trainer.fit()
        lines = [json.loads(line) for line in open(tmp_path / name / "logs" / "metrics.jsonl")]
        kept = [{k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/", "hybrid/to_"))} for m in lines]
        return trainer, kept

    straight, expected = run("straight", 4)
    run("resumed", 2)
    resumed, got = run("resumed", 4)  # the same directory: resumes from its step_2
    assert [m["step"] for m in got] == [1, 2, 3, 4] and got[2:] == expected[2:]
    assert expected[2]["async/reprefill_tokens"] > 0 and expected[2]["async/lost_sessions"] == 0  # the save's end
    assert sum(m["async/kept_sequences"] for m in expected) > 0
    for (name, a), b in zip(straight.actor.model.state_dict().items(), resumed.actor.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_partial_kv_set_where_nothing_continues_is_warned_as_ignored(tmp_path):
    from tests.test_async_stream import _tiny_cfg

    with pytest.warns(UserWarning, match=r"rollout\.partial_kv = keep is ignored with rollout\.max_staleness = 0"):
        _tiny_cfg(tmp_path, "rollout.partial_kv=keep")
