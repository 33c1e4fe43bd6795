"""docs/metrics.md is checked against the metric names the code emits: every name a GRPO run
(KL in the loss, a custom reward function), a PPO run (critic, KL in the reward, 2 epochs × 2 mini-batches),
a DAPO run (dynamic sampling, overlong shaping, IcePop), a multi-turn agent run and a harness run (agent.harness)
write to metrics.jsonl has a row, and every row's name is written by one of them (or is GPU-only)."""
import json
import os
import re

import pytest

from _tiny_run import make_run_dir
from phaserl.config import load_config
from phaserl.trainer import RLTrainer

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "metrics.md")
GPU_ONLY = {"perf/mfu", "perf/peak_memory_gb", "hybrid/memory_after_rollout_switch_gb",
            "hybrid/memory_after_training_switch_gb"}  # absent on CPU, as their rows say
MOE_ONLY = {"actor/router_aux_loss"}  # MoE runs only: tests/test_moe_replay.py's train step writes it
# asynchronous agent runs only: tests/test_async_stream.py's agent run checks it is written
ASYNC_AGENT_ONLY = {"async/parked_episodes"}
FLOAT16_ONLY = {"actor/loss_scale", "actor/overflow_skipped"}  # model.dtype=float16: tests/test_float16.py's run
RUNS = {"grpo": ["algorithm.adv_estimator=grpo", "algorithm.kl_placement=loss"],
        "ppo": ["algorithm.adv_estimator=gae", "algorithm.kl_placement=reward", "critic.enable=true",
                "ppo.num_mini_batches=2", "ppo.epochs=2"],
        # DAPO's dynamic sampling and overlong shaping, with a mismatch correction
        "dapo": ["algorithm.adv_estimator=grpo", "algorithm.kl_placement=none", "algorithm.dynamic_sampling=true",
                 "algorithm.dynamic_sampling_max_rounds=2", "algorithm.overlong_buffer=2",
                 "algorithm.overlong_penalty=1.0", "algorithm.rollout_correction=icepop"],
        "async": ["algorithm.adv_estimator=grpo", "rollout.max_staleness=1"]}  # the asynchronous stream
AGENT_CONFIG = os.path.join(os.path.dirname(DOC), "..", "phaserl", "world", "agent_quickstart.yaml")
HARNESS_CONFIG = os.path.join(os.path.dirname(DOC), "..", "examples", "agent_harness.yaml")
HARNESS = os.path.join(os.path.dirname(DOC), "..", "examples", "agent_harness.py")


def documented_names() -> list:
    """The backticked names in the first column of every table row of docs/metrics.md."""
    names = []
    for line in open(DOC, encoding="utf-8"):
        if line.startswith("| `"):
            names += re.findall(r"`([^`]+)`", line.split("|")[1])
    return names


def _pattern(name: str) -> re.Pattern:
    return re.compile("^" + re.sub(r"\\\{[a-z_]+\\\}", ".+", re.escape(name)) + "$")


@pytest.fixture(scope="module")
def emitted(tmp_path_factory) -> set:
    # the harness run's example drives the endpoint with the openai client: without the `agents` extra these
    # tests skip
    pytest.importorskip("openai", reason="the example harness uses the openai client (the `agents` extra)")
    names = set()
    for run, extra in RUNS.items():
        root = tmp_path_factory.mktemp(run)
        reward = root / "my_reward.py"
        reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                          "    return float(solution_str.strip() == ground_truth)\n")
        cfg = load_config(None, make_run_dir(str(root)) + extra + [
            "trainer.total_steps=1", "trainer.loggers=[jsonl]",
            f"reward.functions=[{{name: tiny_exact}}, {{name: '{reward}:compute_score'}}]"])
        names |= _run_names(cfg, root / "logs")
    root = tmp_path_factory.mktemp("agent")  # the multi-turn world: the agent/ metrics
    small = ["trainer.total_steps=1", "trainer.loggers=[jsonl]", "rollout.prompts_per_step=4", "rollout.n=2",
             "rollout.batch_size=4", "data.val_max_prompts=4"]
    cfg = load_config(AGENT_CONFIG, [f"trainer.log_dir={root / 'logs'}", f"trainer.checkpoint_path={root / 'ckpt'}"]
                      + small)
    names |= _run_names(cfg, root / "logs")
    root = tmp_path_factory.mktemp("harness")  # an external harness: the agent/harness_* and endpoint metrics
    cfg = load_config(HARNESS_CONFIG, [f"trainer.log_dir={root / 'logs'}", f"trainer.checkpoint_path={root / 'ckpt'}",
                                       f"agent.harness={HARNESS}:harness"] + small)
    return names | _run_names(cfg, root / "logs")


def _run_names(cfg, log_dir) -> set:
    RLTrainer.from_config(cfg).fit()
    with open(log_dir / "metrics.jsonl") as f:
        return {name for line in f for name in json.loads(line)} - {"step"}


def test_every_emitted_metric_has_a_row(emitted):
    patterns = [_pattern(n) for n in documented_names()]
    missing = sorted(n for n in emitted if not any(p.match(n) for p in patterns))
    assert not missing, f"add rows to docs/metrics.md for {missing}"
    assert "train/reward/compute_score" in emitted  # a custom function logs under its own name


def test_every_row_names_a_metric_the_code_emits(emitted):
    exact = [n for n in documented_names() if "{" not in n]
    stale = sorted(n for n in exact
                   if n not in emitted and n not in GPU_ONLY | MOE_ONLY | ASYNC_AGENT_ONLY | FLOAT16_ONLY)
    assert not stale, f"docs/metrics.md documents metrics no run logs: {stale}"
