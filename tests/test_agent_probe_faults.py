"""the doctor's agent probe judges environment faults as training would meet them.

With agent.on_env_error=end (the default) an environment that raises, hangs or returns a bad observation on some
episodes made the preflight FAIL, advising "set agent.on_env_error=end", the setting in force. Now: a WARN naming
the environment, the fault and how many probe episodes it hit; a FAIL only under `stop`, or when every probe
episode hit it, each with advice that fits.
"""
import os

import pytest

from phaserl.doctor import FAIL, WARN, load_doctor_config, run_doctor

ENVS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_agent_envs.py")
QUICK = os.path.join(os.path.dirname(os.path.dirname(ENVS)), "phaserl", "world", "agent_quickstart.yaml")


def _probe(*overrides):
    results = run_doctor(load_doctor_config(QUICK, ["trainer.device=cpu", *overrides]))
    return next(r for r in results if r.name == "agent episode")


@pytest.mark.parametrize("fault, says", [("raise", "step() raised ValueError: the simulator lost its state"),
                                         ("dict", "step() returned an observation of type dict"),
                                         ("hang", "step() did not return within 0.5 s")])
def test_faults_on_some_episodes_are_a_warning_under_end(fault, says):
    line = _probe(f"agent.env={ENVS}:FaultyEvenSeeds", f"agent.kwargs={{fault: {fault}, turns: 3}}",
                  "agent.step_timeout_s=0.5")
    assert line.status == WARN, (line.message, line.fix)
    assert line.message.startswith("environment FaultyEvenSeeds: 2 of 4 probe episodes hit a fault")
    assert says in line.message
    assert "agent/ended/env_error" in line.fix and "set agent.on_env_error=end" not in line.fix


def test_under_stop_the_same_faults_fail_with_advice_for_stop():
    line = _probe(f"agent.env={ENVS}:FaultyEvenSeeds", "agent.on_env_error=stop")
    assert line.status == FAIL and "2 of 4 probe episodes" in line.message
    assert line.fix.startswith("agent.on_env_error=stop: the run would stop") and "on_env_error=end" in line.fix


def test_a_fault_on_every_episode_fails_without_advising_to_end_them():
    line = _probe(f"agent.env={ENVS}:RaisesOnSecondStep", "agent.kwargs={turns: 4}")
    assert line.status == FAIL and "4 of 4 probe episodes" in line.message
    assert "fix the environment" in line.fix and "on_env_error" not in line.fix


def _train(tmp_path, *overrides):
    import subprocess
    import sys

    small = ["rollout.prompts_per_step=4", "rollout.n=2", "rollout.batch_size=4", "trainer.total_steps=1",
             "data.val_files=[]", f"trainer.log_dir={tmp_path}", f"trainer.checkpoint_path={tmp_path / 'ckpt'}",
             "trainer.loggers=[console,jsonl]", f"agent.env={ENVS}:FaultyEvenSeeds"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "phaserl", "train", QUICK, *small, *overrides],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_under_end_the_run_trains_and_counts_the_faulty_episodes(tmp_path):
    import json

    done = _train(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "WARN agent episode" in done.stdout
    line = [json.loads(raw) for raw in open(tmp_path / "metrics.jsonl")][-1]
    assert line["agent/ended/env_error"] > 0 and line["train/skipped_step"] == 0


@pytest.mark.slow
def test_under_stop_the_run_stops_with_the_fault_as_its_last_line(tmp_path):
    done = _train(tmp_path, "agent.on_env_error=stop", "--skip-doctor")
    assert done.returncode == 1
    lines = [raw.strip() for raw in done.stdout.replace("\r", "\n").splitlines() if raw.strip()]
    assert lines[-1].startswith("phaserl train: error: environment FaultyEvenSeeds ("), lines[-3:]
    assert "step() raised ValueError: the simulator lost its state; set agent.on_env_error=end" in lines[-1]
