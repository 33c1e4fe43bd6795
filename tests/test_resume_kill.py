"""Exact resume after SIGKILL: a run killed during rollout, during the update and while saving, and started
again with the same command each time, ends with the same weights, optimizer states and metrics.jsonl lines
(timing_s/* and perf/* aside) as a run that was never interrupted.

The child process is this file run as a script: it loads the config, builds the trainer, and trains, as
`phaserl train` does. To kill it at a known moment it wraps one call (the actor's `generate`, the actor's
`update_mini_batch`, or `torch.distributed.checkpoint.save`) so that, at the chosen step, the call prints
`PAUSED` and sleeps; the parent SIGKILLs it on seeing the line. Nothing in phaserl exists for this test.

The signal chain sends SIGINT (twice: out at once; once: stop after the step with a checkpoint) and SIGTERM
from inside the rollout of a step, and checks the exit codes, the checkpoints and the same final state.

With rollout.max_staleness=1 (the asynchronous stream) the same chain holds: the responses in flight at a
checkpoint, their ids, log-probs and versions, are saved with it, and the resumed run continues them.

The chain: kill in the rollout of step 3 (resume from step_2), kill in the update of step 5 (resume from
step_4), kill while step 6 is being written (the temporary directory is reported and skipped; resume from
step_4 again), then run to the end. The same chain runs with LoRA adapters on the actor and the critic
(their checkpoints hold the adapters and their optimizer state only).
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytestmark = pytest.mark.slow  # an end-to-end run (see README, "Tests")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARD = '''
def score(prompt, response, ground_truth, **row):
    """Varied, deterministic rewards so that a tiny random policy gets real gradients."""
    return (sum(map(ord, response)) % 7) / 6.0
'''
NOT_COMPARED = ("timing_s/", "perf/", "hybrid/to_")  # times (hybrid/to_*_s: the mode switches)


# ---------------------------------------------------------------------------------------------- the child

def _pause(label: str) -> None:
    print(f"\nPAUSED {label}", flush=True)  # own line: the progress bar's text has no newline before it
    time.sleep(600)


def _install_pause(trainer, spec: str) -> None:
    if spec == "none":
        return
    moment, step = spec.split(":")
    step = int(step)
    in_step = lambda: trainer.step_num + 1 == step  # noqa: E731  (step_num counts finished steps)
    if moment in ("sigint", "sigterm", "double"):
        generate, sent = trainer.actor.generate, []

        def signalled_generate(prompts, params, **kwargs):
            if in_step() and params is trainer.run.sampling and not sent:   # as if Ctrl-C came during the rollout
                sent.append(True)
                os.kill(os.getpid(), signal.SIGTERM if moment == "sigterm" else signal.SIGINT)
                if moment == "double":
                    time.sleep(0.2)                  # the first handler runs; signals do not queue
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(5)
            return generate(prompts, params, **kwargs)
        trainer.actor.generate = signalled_generate
    elif moment == "rollout":
        generate, session = trainer.actor.generate, trainer.actor.decode_session

        def paused_generate(prompts, params, **kwargs):
            if in_step() and params is trainer.run.sampling:   # the step's rollout, not a validation
                _pause(spec)
            return generate(prompts, params, **kwargs)
        trainer.actor.generate = paused_generate

        def paused_session(params, **kwargs):                  # the asynchronous stream's rollout phase
            if in_step() and params is trainer.run.sampling:
                _pause(spec)
            return session(params, **kwargs)
        trainer.actor.decode_session = paused_session
    elif moment == "update":
        update = trainer.actor.update_mini_batch

        def paused_update(*args, **kwargs):
            stats = update(*args, **kwargs)   # one optimizer step of this RL step has happened in memory
            if in_step():
                _pause(spec)
            return stats
        trainer.actor.update_mini_batch = paused_update
    elif moment == "save":
        import torch.distributed.checkpoint as dcp

        save = dcp.save

        def paused_save(*args, **kwargs):
            result = save(*args, **kwargs)    # the weights are in .tmp_step_N_*/dcp, nothing else yet
            if trainer.step_num == step:
                _pause(spec)
            return result
        dcp.save = paused_save
    else:
        raise ValueError(spec)


def child(cfg_path: str, spec: str, final_path: str) -> None:
    sys.path.insert(0, ROOT)
    import logging

    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer
    from phaserl.trainer.stop import RunStopped

    trainer = RLTrainer.from_config(load_config(cfg_path))
    _install_pause(trainer, spec)
    try:
        trainer.fit()
    except RunStopped as stop:   # what `phaserl train` does with it
        print(f"STOPPED {stop}", flush=True)
        sys.exit(stop.exit_code)
    torch.save({"actor": trainer.actor.model.state_dict(), "critic": trainer.critic.model.state_dict(),
                "actor_optim": trainer.actor.optimizer.state_dict(),
                "critic_optim": trainer.critic.optimizer.state_dict(),
                "kl_coef": trainer.run.kl_controller.value}, final_path)


# ---------------------------------------------------------------------------------------------- the parent

# LoRA on both trainable roles: checkpoints hold adapters (+ the critic's value head) and their optimizer state only
LORA = ["actor.lora.rank=4", "actor.lora.alpha=8", "critic.lora.rank=4", "critic.lora.alpha=8",
        "actor.optim.lr=3e-2", "critic.optim.lr=3e-2"]


def _write_config(tmp, name: str, extra: tuple = ()) -> str:
    from _tiny_run import make_run_dir
    from phaserl.config import dump_yaml, load_config

    base = tmp / "base"
    if not base.exists():
        base.mkdir()
        (base / "reward.py").write_text(REWARD)
        (base / "overrides.json").write_text(json.dumps(make_run_dir(str(base))))
    run = tmp / name
    overrides = json.loads((base / "overrides.json").read_text()) + [
        f"trainer.log_dir={run / 'logs'}", f"trainer.checkpoint_path={run / 'ckpt'}",
        "trainer.total_steps=6", "trainer.save_interval=2", "trainer.keep_checkpoint_num=2", "trainer.val_interval=2",
        "trainer.loggers=[console,jsonl]", "algorithm.adv_estimator=gae", "algorithm.kl_placement=reward",
        "algorithm.kl_target=0.01", "algorithm.kl_horizon=100", "actor.entropy_coef=0.01",
        f"reward.functions=['{base / 'reward.py'}:score']", "ppo.num_mini_batches=2", *extra]
    path = str(tmp / f"{name}.yaml")
    dump_yaml(load_config(None, overrides), path)
    return path


def _start(cfg_path: str, spec: str, final_path: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "child", cfg_path, spec, final_path],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)


def _run_until_paused(cfg_path: str, spec: str, final_path: str) -> str:
    proc = _start(cfg_path, spec, final_path)
    watchdog = threading.Timer(150, proc.kill)  # never hang the suite if the marker does not come
    watchdog.start()
    out, paused = [], False
    try:
        for line in proc.stdout:
            out.append(line)
            if line.startswith(f"PAUSED {spec}"):
                paused = True
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait()
    finally:
        watchdog.cancel()
        proc.stdout.close()
    text = "".join(out)
    # Regression: the marker once shared a line with the progress bar, was never matched, and every kill waited
    # for the watchdog (150 s): the kill must come from the marker, not from the watchdog.
    assert paused and proc.returncode == -signal.SIGKILL, f"child did not pause:\n{text[-3000:]}"
    return text


def _finish(proc: subprocess.Popen, code: int = 0) -> str:
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == code, f"child exited with {proc.returncode}, expected {code}:\n{out[-3000:]}"
    return out


def _listing(ckpt) -> list:
    return sorted(os.listdir(ckpt))


def _comparable_metrics(log_dir) -> list:
    with open(os.path.join(log_dir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in records]


def _assert_same_state(a_path: str, b_path: str) -> None:
    import torch

    a, b = torch.load(a_path, weights_only=True), torch.load(b_path, weights_only=True)
    assert a["kl_coef"] == b["kl_coef"]
    for role in ("actor", "critic"):
        assert a[role].keys() == b[role].keys()
        for name in a[role]:
            assert torch.equal(a[role][name], b[role][name]), f"{role} weight {name} differs"
        sa, sb = a[f"{role}_optim"]["optimizer"]["state"], b[f"{role}_optim"]["optimizer"]["state"]
        for pid in sa:
            for key in sa[pid]:
                assert torch.equal(sa[pid][key], sb[pid][key]), f"{role} optimizer {key} of param {pid} differs"
        assert a[f"{role}_optim"]["scheduler"] == b[f"{role}_optim"]["scheduler"]


# the asynchronous stream: the responses in flight at a checkpoint are saved with it and continue on resume
ASYNC = ["rollout.max_staleness=1", "rollout.engine_max_slots=6"]  # 6 slots for 8 groups: some carried over


@pytest.mark.parametrize("extra", [(), tuple(LORA), tuple(ASYNC)], ids=["full", "lora", "async"])
def test_killed_at_rollout_update_and_save_resumes_exactly(tmp_path, extra):
    ref_cfg, cfg = _write_config(tmp_path, "reference", extra), _write_config(tmp_path, "killed", extra)
    reference = _start(ref_cfg, "none", str(tmp_path / "reference.pt"))   # runs alongside the chain
    try:
        _kill_resume_chain(tmp_path, cfg)
        _finish(reference)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.communicate()
    expected = _comparable_metrics(tmp_path / "reference" / "logs")
    assert [r["step"] for r in expected] == [0, 1, 2, 3, 4, 5, 6]
    if extra == tuple(ASYNC):  # the stream really carried responses over updates, and the resumed run continued them
        assert max(r["async/staleness_max"] for r in expected[1:]) == 1
    assert _comparable_metrics(tmp_path / "killed" / "logs") == expected
    _assert_same_state(str(tmp_path / "reference.pt"), str(tmp_path / "killed.pt"))
    if extra == tuple(LORA):  # the adapters really trained, so equal states are not equal zeros
        import torch

        final = torch.load(str(tmp_path / "killed.pt"), weights_only=True)
        for role in ("actor", "critic"):
            adapters = [v for k, v in final[role].items() if k.endswith(".lora_B")]
            assert adapters and max(float(v.abs().max()) for v in adapters) > 0, role


def _kill_resume_chain(tmp_path, cfg: str) -> None:
    ckpt = tmp_path / "killed" / "ckpt"
    _run_until_paused(cfg, "rollout:3", "unused")
    assert _listing(ckpt) == [".lock", "latest", "step_2"]   # SIGKILL: the lock stays behind

    out = _run_until_paused(cfg, "update:5", "unused")
    assert f"taking over the stale lock {ckpt / '.lock'}" in out
    assert f"resumed from {ckpt / 'step_2'} (step 2;" in out

    out = _run_until_paused(cfg, "save:6", "unused")
    assert f"resumed from {ckpt / 'step_4'} (step 4;" in out
    leftovers = [n for n in os.listdir(ckpt) if n.startswith(".tmp_step_6_")]
    assert leftovers, "the kill while saving should leave a temporary directory"

    out = _finish(_start(cfg, "none", str(tmp_path / "killed.pt")))
    assert f"skipping incomplete {ckpt / leftovers[0]}" in out
    assert f"resumed from {ckpt / 'step_4'} (step 4;" in out
    assert _listing(ckpt) == ["latest", "step_4", "step_6"]   # keep_checkpoint_num=2, no leftovers, no lock
    assert (ckpt / "latest").read_text() == "step_6\n"


@pytest.mark.slow
def test_sigint_and_sigterm_stop_after_the_step_with_a_checkpoint_and_resume_exactly(tmp_path):
    ref_cfg, cfg = _write_config(tmp_path, "reference"), _write_config(tmp_path, "killed")
    reference = _start(ref_cfg, "none", str(tmp_path / "reference.pt"))
    try:
        _signal_resume_chain(tmp_path, cfg)
        _finish(reference)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.communicate()
    assert _comparable_metrics(tmp_path / "killed" / "logs") == _comparable_metrics(tmp_path / "reference" / "logs")
    _assert_same_state(str(tmp_path / "reference.pt"), str(tmp_path / "killed.pt"))


def _signal_resume_chain(tmp_path, cfg: str) -> None:
    ckpt = tmp_path / "killed" / "ckpt"
    # Ctrl-C twice during step 3: out at once, no checkpoint of step 3, the lock released
    out = _finish(_start(cfg, "double:3", "unused"), code=130)
    assert "SIGINT (Ctrl-C) again: stopping now, without a checkpoint" in out and "Traceback" not in out
    assert _listing(ckpt) == ["latest", "step_2"]

    # Ctrl-C once during step 3: step 3 finishes and is saved (outside save_interval), exit 130
    out = _finish(_start(cfg, "sigint:3", "unused"), code=130)
    assert "SIGINT (Ctrl-C) received: stopping after the current step with a checkpoint" in out
    assert f"STOPPED stopped by SIGINT (Ctrl-C) after step 3; newest checkpoint {ckpt / 'step_3'}" in out
    assert "Traceback" not in out
    assert _listing(ckpt) == ["latest", "step_2", "step_3"]

    # SIGTERM during step 5: saved as step_5, exit 143
    out = _finish(_start(cfg, "sigterm:5", "unused"), code=143)
    assert f"resumed from {ckpt / 'step_3'} (step 3;" in out
    assert f"STOPPED stopped by SIGTERM after step 5; newest checkpoint {ckpt / 'step_5'}" in out
    assert _listing(ckpt) == ["latest", "step_4", "step_5"]

    out = _finish(_start(cfg, "none", str(tmp_path / "killed.pt")))
    assert f"resumed from {ckpt / 'step_5'} (step 5;" in out


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "child":
    child(*sys.argv[2:])
