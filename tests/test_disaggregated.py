"""Rollout ranks that train: the engine refresh after an in-flight weight update, and GRPO runs of 2 and 3 gloo
processes (trainer ranks + one rollout rank) that train, keep the staleness bound, hold the trainer's weights after
every sync and stop with one line when the rollout rank dies (docs/distributed.md, "Rollout ranks").

The multi-process cases fork their ranks (tests/_multiproc.py) and each rank saves what the test checks.
"""
import json
import os
import signal
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from _multiproc import free_port, start_method
from phaserl.models.lora import LoRASettings, apply_lora
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams
from tests.test_rollout_engine import PROMPTS, tiny_model

torch.set_num_threads(1)


def _sample_in_session(engine, params, *, swap_after: int = 0, new_model=None) -> dict:
    """Each of PROMPTS run to its end in one session; after `swap_after` steps the engine's model takes
    `new_model`'s weights in place and the engine is refreshed; sequences started after that see only them."""
    got, step = {}, 0
    waiting = list(range(len(PROMPTS)))
    with engine.session(params, slot_len=40, eos_token_ids=[], generator=torch.Generator().manual_seed(5)) as s:
        while waiting or not s.idle:
            if new_model is not None and step == swap_after:
                with torch.no_grad():
                    for p, q in zip(engine.model.parameters(), new_model.parameters()):
                        p.copy_(q)
                engine.refresh_weights()
            while waiting and s.free_slots and step >= swap_after:
                key = waiting.pop(0)
                s.start(key, PROMPTS[key], params.max_new_tokens, noise_key=key)
            for turn in s.step():
                got[turn.key] = (turn.token_ids, turn.logprobs)
                s.release(turn.key)
            step += 1
    return got


@pytest.mark.parametrize("lora", [False, True])
def test_a_refreshed_engine_samples_what_a_freshly_built_one_does(lora):
    """Weights copied into the model in the middle of a session, then refresh_weights(): every sequence started after
    it samples the tokens and log-probs an engine built on the new weights does (the fused [q;k;v], [gate;up] and
    LoRA-merged copies refilled); without the refresh it does not."""
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    if lora:
        for m, seed in ((old, 2), (new, 3)):
            apply_lora(m, LoRASettings(rank=4, alpha=8,
                                       target_modules=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")))
            with torch.no_grad():
                g = torch.Generator().manual_seed(seed)
                for name, p in m.named_parameters():
                    if "lora" in name:
                        p.copy_(0.3 * torch.randn(p.shape, generator=g))
    expected = _sample_in_session(RolloutEngine(new, EngineConfig(max_slots=4)), params)
    engine = RolloutEngine(old, EngineConfig(max_slots=4))
    got = _sample_in_session(engine, params, swap_after=2, new_model=new)
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key][0] == expected[key][0]
        torch.testing.assert_close(torch.tensor(got[key][1]), torch.tensor(expected[key][1]))

    if not lora:  # the bug this guards against: parameters swapped, the fused copies kept
        stale = RolloutEngine(tiny_model(seed=0), EngineConfig(max_slots=4))
        stale.refresh_weights = lambda: None
        assert _sample_in_session(stale, params, swap_after=2, new_model=tiny_model(seed=1)) != expected


# ----- rollout ranks under one launch (gloo, forked processes) -------------------------------------------------

TIMEOUT_S = 20.0   # the collective timeout of these runs: a hang would pass it


def _overrides(root: str, *extra) -> list:
    return [f"trainer.log_dir={root}/logs", f"trainer.checkpoint_path={root}/ckpt", "trainer.total_steps=3",
            "trainer.val_interval=0", "trainer.val_before_train=false", "trainer.loggers=[jsonl]",
            "trainer.save_interval=3", "rollout.prompts_per_step=8", "rollout.batch_size=8", "rollout.n=4",
            "rollout.ranks=1", "rollout.max_staleness=1", *extra]


def _fingerprint(model) -> list:
    """Every parameter's float64 sum, in model order (an FSDP2 parameter gathered whole: a collective)."""
    return [float((p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double().sum())
            for _, p in model.named_parameters()]


def _rank_main(rank: int, world: int, port: int, root: str, extra: list, die_after_sends: int) -> None:
    from phaserl.cli import QUICKSTART_CONFIG
    from phaserl.config import load_config
    from phaserl.parallel.launch import destroy
    from phaserl.parallel.sample_channel import SampleSender
    from phaserl.trainer import RLTrainer
    from phaserl.trainer.rollout_worker import RolloutWorker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from datetime import timedelta
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    out = {"rank": rank, "weights": []}
    start = time.monotonic()
    try:
        if die_after_sends:
            send, sends = SampleSender.send, []

            def send_then_die(self, groups):
                send(self, groups)
                sends.append(1)
                if len(sends) == die_after_sends:
                    self.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
            SampleSender.send = send_then_die
        runner = RLTrainer.from_config(load_config(QUICKSTART_CONFIG, _overrides(root, *extra), world_size=world))
        out["role"] = "rollout" if isinstance(runner, RolloutWorker) else "trainer"
        if isinstance(runner, RolloutWorker):
            runner.on_weights.append(lambda w: out["weights"].append((w.version, _fingerprint(w.actor.model))))
        else:
            runner.add_hook("on_train_start",
                            lambda t: out["weights"].append((t.step_num, _fingerprint(t.actor.model))))
            runner.add_hook("on_step_end", lambda t: out["weights"].append((t.step_num, _fingerprint(t.actor.model))))
        runner.fit()
    except Exception as exc:  # the test reads it
        out["error"] = str(exc)
        out["error_type"] = type(exc).__name__
        out["traceback"] = traceback.format_exc()
    out["seconds"] = time.monotonic() - start
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    destroy()


def _launch(tmp_path, world: int, *extra, die_after_sends: int = 0, limit_s: float = 90.0) -> list:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_rank_main, args=(world, free_port(), str(tmp_path), list(extra), die_after_sends),
                             nprocs=world, join=False, start_method=start_method())
    deadline = time.monotonic() + limit_s
    for process in ctx.processes:
        process.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in ctx.processes if p.is_alive()]
    for process in alive:
        process.kill()
    assert not alive, f"{len(alive)} rank(s) still running after {limit_s} s (a hang)"
    return [json.loads(p.read_text()) if (p := tmp_path / f"rank{r}.json").exists() else None for r in range(world)]


def _metrics(tmp_path) -> list:
    return [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]


def _check_run(tmp_path, ranks: list, trainers: int) -> None:
    for r in ranks:
        assert r is not None and "error" not in r, r and r.get("traceback")
    assert [r["role"] for r in ranks] == ["trainer"] * trainers + ["rollout"]
    steps = _metrics(tmp_path)
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        assert 0 <= m["async/staleness_max"] <= 1                      # rollout.max_staleness
        assert m["async/token_share/behind_0"] + m["async/token_share/behind_1"] == pytest.approx(1.0)
        assert m["timing_s/weight_sync"] > 0 and "timing_s/rollout" in m
        assert m["train/reward_mean"] >= 0 and "actor/grad_norm" in m
    # the rollout rank holds the trainer's weights after every sync: versions 0 (the start), 1, 2, 3
    trainer_weights, rollout_weights = dict(map(tuple, ranks[0]["weights"])), dict(map(tuple, ranks[-1]["weights"]))
    assert sorted(rollout_weights) == [0, 1, 2, 3]
    for version, sums in rollout_weights.items():
        assert sums == trainer_weights[version], f"version {version}"
    assert trainer_weights[3] != trainer_weights[0]                   # it trained
    assert (tmp_path / "ckpt" / "step_3").is_dir()                     # written by the trainer ranks


@pytest.mark.slow
def test_one_trainer_and_one_rollout_rank_train_within_the_bound(tmp_path):
    _check_run(tmp_path, _launch(tmp_path, 2), trainers=1)


@pytest.mark.slow
def test_two_trainer_ranks_and_one_rollout_rank_train_within_the_bound(tmp_path):
    _check_run(tmp_path, _launch(tmp_path, 3), trainers=2)


@pytest.mark.slow
def test_a_killed_rollout_rank_stops_the_trainer_with_one_line(tmp_path):
    ranks = _launch(tmp_path, 2, die_after_sends=1)
    assert ranks[1] is None                                              # killed
    trainer = ranks[0]
    assert trainer["error_type"] == "RankFailure"
    message = trainer["error"]
    assert "\n" not in message and trainer["seconds"] < TIMEOUT_S + 15
    assert message.startswith("rank 0 of 2 (trainer)") and "rollout rank 1" in message
    assert ("phase 'rollout'" in message or "phase 'weight sync'" in message)   # whichever waits on it first
    assert "the peer's process is gone" in message
