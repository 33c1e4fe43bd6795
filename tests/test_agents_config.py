"""agent.* config: the environment class named by file or module, its kwargs, clear errors for bad
names, and the doctor's one-episode probe."""
import os

import pytest

from phaserl.agents.loader import EnvironmentFactory, load_environment_class
from phaserl.config import load_config
from phaserl.doctor import FAIL, OK, load_doctor_config, run_doctor
from phaserl.errors import ConfigError

ENVS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_agent_envs.py")
QUICK = os.path.join(os.path.dirname(os.path.dirname(ENVS)), "phaserl", "world", "agent_quickstart.yaml")


def test_a_class_is_found_by_file_or_module_path_and_each_make_is_a_fresh_instance():
    by_file = EnvironmentFactory.from_spec(f"{ENVS}:Feedback", {"turns": 3})
    assert by_file.name == "Feedback" and by_file.make() is not by_file.make() and by_file.make().turns == 3
    assert load_environment_class("phaserl.world.agent_task:RetryArithmetic").__name__ == "RetryArithmetic"
    assert load_environment_class("phaserl.world.agent_task.RetryArithmetic").__name__ == "RetryArithmetic"


@pytest.mark.parametrize("spec, kwargs, message", [
    ("missing.py:Env", {}, "file missing.py not found"),
    (f"{ENVS}:Nope", {}, "defines no 'Nope'; classes defined there: Feedback"),
    ("phaserl.nothing_here:Env", {}, "cannot import phaserl.nothing_here"),
    ("phaserl.world.agent_task:Environment", {"x": 1}, "agent.kwargs \\['x'\\] do not fit Environment"),
    (f"{ENVS}:math", {}, "must be a class with reset"),
])
def test_bad_environment_names_say_what_is_wrong(spec, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EnvironmentFactory.from_spec(spec, kwargs)


def test_the_config_section_and_its_ranges():
    cfg = load_config(QUICK, ["agent.max_turns=2", "agent.kwargs={feedback: nope}"])
    assert cfg.agent.env == "phaserl.world.agent_task:RetryArithmetic" and cfg.agent.kwargs == {"feedback": "nope"}
    with pytest.raises(ConfigError, match="agent.on_env_error"):
        load_config(QUICK, ["agent.on_env_error=retry"])
    assert load_config(None).agent.env is None  # single-turn unless set


def _agent_line(overrides):
    results = run_doctor(load_doctor_config(QUICK, ["trainer.device=cpu", *overrides]))
    return next(r for r in results if r.name == "agent episode")


@pytest.mark.slow  # the doctor / a trainer step end to end
def test_the_doctor_runs_one_episode_and_shows_its_mask():
    line = _agent_line([])
    assert line.status == OK and "RetryArithmetic on " in line.message and "model turn(s), ended by" in line.message
    assert "(masked)" in line.details[0] and "the loss sees" in line.details[0]


def test_the_doctor_fails_on_an_environment_that_raises():
    line = _agent_line([f"agent.env={ENVS}:RaisesOnSecondStep", "agent.kwargs={turns: 4}"])
    assert line.status == FAIL
    assert "environment RaisesOnSecondStep: 4 of 4 probe episodes hit a fault" in line.message
    # no advice to end them all
    assert "step() raised RuntimeError" in line.message and "on_env_error=end" not in line.fix


def test_episode_budgets_are_checked_against_the_other_sizes():
    with pytest.raises(ConfigError, match="agent.max_episode_tokens = 16 < data.max_prompt_length"):
        load_config(QUICK, ["agent.max_episode_tokens=16"])
    with pytest.raises(ConfigError, match="ppo.micro_batch_tokens = 100 cannot hold one whole episode"):
        load_config(QUICK, ["agent.max_episode_tokens=200", "ppo.micro_batch_tokens=100"])
    load_config(None, ["agent.max_episode_tokens=2"])  # no agent.env: the section is not used


@pytest.mark.slow  # the doctor / a trainer step end to end
def test_a_multi_turn_step_on_the_transformers_fallback_path(tmp_path):
    """rollout.engine=hf: every turn re-prefills through generate(); the step still trains on episodes."""
    from phaserl.trainer import RLTrainer

    cfg = load_config(QUICK, ["rollout.engine=hf", "rollout.prompts_per_step=4", "rollout.n=2", "rollout.batch_size=4",
                              "trainer.total_steps=1", f"trainer.log_dir={tmp_path}", "trainer.loggers=[jsonl]",
                              f"trainer.checkpoint_path={tmp_path / 'ckpt'}"])
    trainer = RLTrainer.from_config(cfg)
    metrics = trainer.train_step()
    assert trainer.actor.engine is None and metrics["agent/turns_mean"] >= 1
    assert metrics["train/skipped_step"] == 0 and "agent/ended/max_turns" in metrics


@pytest.mark.slow  # a trainer fit end to end
def test_fit_leaves_no_idle_environment_threads_behind(tmp_path):
    """The run's environment worker pool used to keep its daemon threads after fit() (42 across the agent
    test files); they now exit when fit() returns."""
    import threading

    from phaserl.trainer import RLTrainer

    cfg = load_config(QUICK, ["rollout.prompts_per_step=2", "rollout.n=2", "rollout.batch_size=4",
                              "trainer.total_steps=1", f"trainer.log_dir={tmp_path}", "trainer.loggers=[jsonl]",
                              f"trainer.checkpoint_path={tmp_path / 'ckpt'}"])
    trainer = RLTrainer.from_config(cfg)
    pool = trainer.run.agent.workers

    def alive() -> int:
        return sum(t.name.startswith(pool.name + "-") and t.is_alive() for t in threading.enumerate())

    before = alive()
    trainer.fit()
    assert pool._started > 0  # the episodes ran on the pool's threads
    for _ in range(500):
        if alive() <= before:
            break
        threading.Event().wait(0.01)
    assert alive() <= before and pool.threads == 0


@pytest.mark.slow  # the doctor end to end
@pytest.mark.parametrize("agent", ["env", "harness"])
def test_the_doctor_probes_a_qwen35_policy_through_the_engine(tmp_path, agent):
    """Qwen3.5 decodes only on the rollout engine (its recurrent state is the engine's); the doctor's one-episode
    probes decoded with the plain KV-cache path and failed with NotImplementedError on a model training runs."""
    import transformers

    from _tiny_run import make_prompt_files
    from _tiny_tokenizer import build_tiny_tokenizer
    from test_model_coverage import tiny_config

    if getattr(transformers, "Qwen3_5TextConfig", None) is None:
        pytest.skip("this transformers has no Qwen3.5")
    tokenizer = build_tiny_tokenizer()
    config = tiny_config("qwen3_5_text", len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    train, val = make_prompt_files(str(tmp_path), n_train=4, n_val=2)
    root = os.path.dirname(os.path.dirname(ENVS))
    spec = (f"agent.env={ENVS}:Feedback" if agent == "env"
            else f"agent.harness={os.path.join(root, 'examples', 'agent_harness.py')}:harness")
    results = {r.name: r for r in run_doctor(load_doctor_config(None, [
        f"model.path={tmp_path / 'model'}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        "data.max_prompt_length=32", "rollout.max_new_tokens=4", "trainer.device=cpu", spec, "agent.max_turns=2",
        "agent.max_episode_tokens=96", f"trainer.log_dir={tmp_path / 'logs'}",
        f"trainer.checkpoint_path={tmp_path / 'ckpt'}"]))}
    probe = results["agent episode"]
    assert probe.status == OK, (probe.message, probe.fix)
    assert "model turn" in probe.message
