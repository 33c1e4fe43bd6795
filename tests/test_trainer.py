"""The RL step end to end on a tiny random model: every estimator runs, metrics land where docs/metrics.md says."""
import dataclasses
import json
import logging
import math
import os

import pytest
import torch

from _tiny_run import make_run_dir
from phaserl.config import load_config
from phaserl.trainer import RLTrainer


def _run(tmp_path, *extra):
    cfg = load_config(None, make_run_dir(str(tmp_path)) + ["trainer.loggers=[jsonl]", *extra])
    trainer = RLTrainer.from_config(cfg)
    trainer.fit()
    lines = [json.loads(raw) for raw in open(os.path.join(tmp_path, "logs", "metrics.jsonl"))]
    return trainer, lines


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo", "reinforce_plus_plus",
                                       "reinforce_plus_plus_baseline", "remax"])
def test_every_estimator_runs_a_step_and_logs_brief_metrics(tmp_path, estimator):
    torch.manual_seed(0)
    trainer, lines = _run(tmp_path, f"algorithm.adv_estimator={estimator}", "ppo.num_mini_batches=2")
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert "val/score_mean" in lines[0] and "val/score_mean" in lines[-1]
    for key in ("train/reward_mean", "timing_s/step", "perf/tokens_per_s", "actor/grad_norm", "actor/entropy",
                "timing_s/rollout", "timing_s/update", "train/advantage_mean", "actor/pg_clipfrac"):
        assert key in lines[1], key
    assert ("critic/vf_loss" in lines[1]) == (estimator == "gae")
    assert trainer.step == 2


@pytest.mark.slow
def test_the_actor_learns_something_it_is_rewarded_for(tmp_path):
    """Rewarded for digits in its answer, GRPO makes a random policy write more digits (the loop really learns)."""
    reward_file = tmp_path / "digits.py"
    reward_file.write_text("def digits(prompt, response, ground_truth, **row):\n"
                           "    return float(sum(c.isdigit() for c in response))\n")
    trainer, lines = _run(tmp_path, f"reward.functions=[{{name: '{reward_file}:digits'}}]", "trainer.total_steps=14",
                          "rollout.max_new_tokens=6", "actor.optim.lr=1e-2", "algorithm.kl_placement=none",
                          "rollout.n=4", "data.val_files=[]")
    first = sum(line["train/reward_mean"] for line in lines[:3]) / 3
    last = sum(line["train/reward_mean"] for line in lines[-3:]) / 3
    assert last > first + 0.5, (first, last)


@pytest.mark.slow
def test_kl_in_reward_and_in_loss_both_report_kl(tmp_path):
    _, loss_lines = _run(tmp_path / "loss", "algorithm.kl_placement=loss", "algorithm.kl_coef=0.1")
    _, reward_lines = _run(tmp_path / "reward", "algorithm.kl_placement=reward", "algorithm.kl_coef=0.1",
                           "algorithm.kl_target=0.01")
    assert "actor/kl_loss" in loss_lines[-1] and "train/kl" in loss_lines[-1]
    assert reward_lines[-1]["train/kl_coef"] != 0.1  # the adaptive controller moved


@pytest.mark.slow
def test_only_the_actor_logs_mode_switches(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="phaserl"):
        _run(tmp_path, "algorithm.adv_estimator=gae")
    switches = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[HybridEngine]")]
    assert any("from training to rollout mode" in s for s in switches)
    assert any("from rollout to training mode" in s for s in switches)
    assert all(s.startswith("[HybridEngine] Switching actor ") for s in switches)


@pytest.mark.slow
def test_gspo_dual_clip_and_aggregation_settings_reach_the_actors_loss_and_train(tmp_path):
    """The settings arrive where the loss reads them (the loss math itself: test_algo_policy_loss.py)."""
    from phaserl.algo import POLICY_LOSSES

    trainer, lines = _run(tmp_path, "actor.policy_loss=gspo", "actor.clip_ratio_low=0.0003",
                          "actor.clip_ratio_high=0.0004", "actor.dual_clip_c=2.5",
                          "actor.loss_agg_mode=seq-mean-token-mean")
    loss = trainer.actor.loss
    assert loss.loss_fn.func is POLICY_LOSSES["gspo"]  # bound once with its own hyper-parameters
    assert loss.loss_fn.keywords == dict(clip_low=0.0003, clip_high=0.0004, dual_clip_c=2.5)
    assert loss.agg_mode == "seq-mean-token-mean"
    assert [line["step"] for line in lines if "actor/pg_loss" in line] == [1, 2]
    assert all(math.isfinite(line["actor/pg_loss"]) and line["train/skipped_step"] == 0.0 for line in lines
               if "actor/pg_loss" in line)


@pytest.mark.slow
def test_rollout_engine_setting_picks_the_generation_path(tmp_path):
    """rollout.engine: auto uses the builtin engine for our decoder; hf uses plain generate (no engine)."""
    auto, _ = _run(tmp_path / "auto", "trainer.total_steps=1")
    assert auto.actor.engine is not None
    hf, _ = _run(tmp_path / "hf", "trainer.total_steps=1", "rollout.engine=hf")
    assert hf.actor.engine is None


def test_builtin_engine_on_a_transformers_model_is_a_config_error(tmp_path):
    from transformers import AutoModelForCausalLM

    from phaserl import ConfigError, HybridActor

    cfg = load_config(None, make_run_dir(str(tmp_path)) + ["rollout.engine=builtin"])
    actor = HybridActor(model=AutoModelForCausalLM.from_pretrained(cfg.model.path))
    with pytest.raises(ConfigError, match="rollout.engine=builtin"):
        RLTrainer(actor=actor, config=cfg)


def _one_grpo_step(tmp_path, reuse: bool, *extra):
    from _tiny_run import make_model_dir

    torch.manual_seed(0)
    other = make_model_dir(str(tmp_path / "ref"), seed=1)  # a reference unlike the actor: KL is not 0
    cfg = load_config(None, make_run_dir(str(tmp_path)) + [
        "trainer.loggers=[jsonl]", "data.val_files=[]", "algorithm.kl_placement=loss", "algorithm.kl_coef=0.1",
        "actor.dual_clip_c=null", f"ref.path={other}", *extra])
    trainer = RLTrainer.from_config(cfg)
    trainer.run = dataclasses.replace(trainer.run, reuse_update_logprobs=reuse)  # RunSettings is frozen
    passes, compute = [], trainer.actor.compute_logprobs
    trainer.actor.compute_logprobs = lambda *a, **k: passes.append(1) or compute(*a, **k)
    metrics = trainer.train_step()
    return metrics, {n: p.detach().clone() for n, p in trainer.actor.model.named_parameters()}, len(passes)


@pytest.mark.slow
def test_one_optimizer_step_per_batch_skips_the_old_logprob_pass_with_the_same_update(tmp_path):
    """1 epoch x 1 mini-batch: the update's own detached log-probs are the old ones (ratio 1), as in TRL."""
    kept, kept_weights, kept_passes = _one_grpo_step(tmp_path / "kept", False)
    skipped, skipped_weights, skipped_passes = _one_grpo_step(tmp_path / "skipped", True)
    assert (kept_passes, skipped_passes) == (1, 0)
    for name, w in kept_weights.items():
        torch.testing.assert_close(skipped_weights[name], w, atol=1e-6, rtol=1e-5, msg=name)
    for key in ("train/kl", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert skipped[key] == pytest.approx(kept[key], rel=1e-4, abs=1e-7), key
    assert kept["train/kl"] > 1e-3 and kept["actor/kl_loss"] > 1e-3  # the comparison is not of zeros
    assert skipped["actor/ppo_kl"] == 0.0 and skipped["actor/pg_clipfrac"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("extra", [("ppo.num_mini_batches=2",), ("ppo.epochs=2",), ("algorithm.kl_placement=reward",)])
def test_the_old_logprob_pass_runs_when_something_reads_it(tmp_path, extra):
    """Several optimizer steps need the pre-update log-probs; KL in the reward reads them before the update."""
    _, _, passes = _one_grpo_step(tmp_path, True, *extra)
    assert passes == 1


@pytest.mark.slow
def test_ignore_eos_runs_every_response_to_max_new_tokens(tmp_path):
    torch.manual_seed(0)
    cfg = load_config(None, [  # the tiny world's warm model answers in a few tokens, then EOS
        "model.path=tiny", "data.train_files=[tiny]", "data.val_files=[]", "rollout.max_new_tokens=12",
        "data.max_prompt_length=32",
        "rollout.prompts_per_step=4", "rollout.n=2", "rollout.batch_size=4", "trainer.device=cpu",
        f"trainer.log_dir={tmp_path}/logs", f"trainer.checkpoint_path={tmp_path}/ckpt"])
    trainer = RLTrainer.from_config(cfg)
    with trainer.actor.rollout_mode():
        stopping = trainer._generate(trainer.run.train_prompts.next_items(), trainer.run.sampling, 2)
    assert set(stopping.finish_reasons) == {"stop"} and max(stopping.response_lengths().tolist()) < 12
    trainer.run = dataclasses.replace(trainer.run, ignore_eos=True)  # what rollout.ignore_eos=true sets
    with trainer.actor.rollout_mode():
        fixed = trainer._generate(trainer.run.train_prompts.next_items(), trainer.run.sampling, 2)
    assert set(fixed.finish_reasons) == {"length"} and set(fixed.response_lengths().tolist()) == {12}
    assert load_config(None, ["rollout.ignore_eos=true"]).rollout.ignore_eos is True
