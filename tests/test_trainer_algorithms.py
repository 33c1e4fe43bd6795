"""The 2026 algorithm menu in the RL step: every estimator/loss/correction runs, mismatch is measured every step,
zero-variance groups are named, DAPO's dynamic sampling and overlong shaping do what they say."""
import json
import logging
import math
import os

import pytest
import torch

from _tiny_run import make_run_dir
from phaserl.config import load_config
from phaserl.trainer import RLTrainer

MISMATCH = ("mismatch/k3", "mismatch/abs_diff_mean", "mismatch/abs_diff_max", "mismatch/ratio_out_frac")


def _run(tmp_path, *extra):
    cfg = load_config(None, make_run_dir(str(tmp_path)) + ["trainer.loggers=[jsonl]", "data.val_files=[]", *extra])
    trainer = RLTrainer.from_config(cfg)
    trainer.fit()
    lines = [json.loads(raw) for raw in open(os.path.join(tmp_path, "logs", "metrics.jsonl"))]
    return trainer, lines


def _reward_file(tmp_path, body: str) -> str:
    path = tmp_path / "reward.py"
    path.write_text(f"def fn(prompt, response, ground_truth, **row):\n    {body}\n")
    return f"reward.functions=[{{name: '{path}:fn'}}]"


@pytest.mark.parametrize("extra", [
    ["algorithm.adv_estimator=grpo_passk"], ["algorithm.adv_estimator=opo"],
    ["algorithm.adv_estimator=gpg", "actor.policy_loss=gpg"],
    ["actor.policy_loss=cispo", "actor.clip_ratio_low=1.0", "actor.clip_ratio_high=1.0"],
    ["actor.policy_loss=sapo", "actor.loss_agg_mode=seq-mean-token-mean"],
    ["actor.policy_loss=geo_mean", "actor.clip_ratio_low=0.4", "actor.clip_ratio_high=0.4"],
    ["actor.policy_loss=dro"], ["actor.policy_loss=dppo_tv"],
    ["actor.policy_loss=dppo_kl", "algorithm.kl_estimator=k3+"],
    ["actor.loss_agg_mode=token-sum", "algorithm.kl_estimator=low_var_kl", "actor.entropy_coef=0.01"],
    ["algorithm.rollout_correction=tis"], ["algorithm.rollout_correction=icepop"],
    ["algorithm.rollout_correction=masked_is", "ppo.num_mini_batches=2"],
    ["algorithm.rollout_correction=seq_mask", "algorithm.rollout_correction_cap=1.01"],
    ["algorithm.adv_estimator=gae", "actor.loss_agg_mode=seq-mean-token-sum-norm", "algorithm.kl_estimator=abs"],
], ids=lambda extra: ",".join(e.split(".", 1)[1] for e in extra))
def test_each_new_setting_runs_steps_and_logs_the_mismatch(tmp_path, extra):
    torch.manual_seed(0)
    trainer, lines = _run(tmp_path, *extra)
    assert [line["step"] for line in lines] == [1, 2]
    for key in ("train/reward_mean", "actor/grad_norm", "actor/pg_clipfrac", "train/zero_variance_group_frac",
                *MISMATCH):
        assert key in lines[-1], key
    if any(e.startswith("algorithm.rollout_correction") for e in extra):
        # on the CPU in float32 sampler and trainer agree (ratio ~1): nothing rejected, weights ~1
        assert lines[-1]["mismatch/correction_rejected_frac"] == 0.0
        assert lines[-1]["mismatch/correction_weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert lines[-1]["actor/pg_clipfrac"] <= 1.0
    if "algorithm.adv_estimator=gae" in extra:
        assert trainer.critic.agg_mode == "seq-mean-token-sum-norm"  # the value loss follows the mode


@pytest.mark.parametrize("engine, minibatches", [("builtin", 1), ("builtin", 2), ("hf", 1), ("hf", 2)])
def test_rollout_and_trainer_logprobs_agree_on_every_path(tmp_path, engine, minibatches):
    """Both generation paths report log-probs of softmax(logits / T) at the rollout temperature, so on CPU in
    float32 the trainer's own log-probs of the same tokens match: on the old log-prob pass (2 mini-batches) and
    when the update measures it (1 mini-batch, the pass skipped)."""
    _, lines = _run(tmp_path, f"rollout.engine={engine}", f"ppo.num_mini_batches={minibatches}",
                    "rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.top_k=20")
    for line in lines:
        assert line["mismatch/abs_diff_max"] < 1e-3 and line["mismatch/ratio_out_frac"] == 0.0, line
        assert 0.0 <= line["mismatch/k3"] < 1e-6


def test_a_temperature_mismatch_would_show(tmp_path):
    """The metric can fail: a trainer that forgot the temperature sees the sampler's distribution as far off."""
    trainer, _ = _run(tmp_path, "rollout.temperature=0.5", "trainer.total_steps=1")
    from phaserl.algo import mismatch_metrics
    from phaserl.roles.forward import batch_logprobs

    items = trainer.run.train_prompts.next_items()
    with trainer.actor.rollout_mode():
        batch = trainer._generate(items, trainer.run.sampling, 2)
    wrong = batch_logprobs(trainer.actor.model, batch, temperature=1.0, token_budget=4096, packing=False)
    assert mismatch_metrics(wrong, batch.rollout_logprobs, batch.response_mask)["mismatch/abs_diff_max"] > 0.05


def test_all_equal_rewards_are_named_on_the_first_step_and_logged_every_step(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="phaserl"):
        _, lines = _run(tmp_path, _reward_file(tmp_path, "return 1.0"), "trainer.total_steps=3")
    assert [line["train/zero_variance_group_frac"] for line in lines] == [1.0, 1.0, 1.0]
    warnings = [r.getMessage() for r in caplog.records if "add nothing to the update" in r.getMessage()]
    assert len(warnings) == 1 and "step 0: every group" in warnings[0] and "dynamic_sampling" in warnings[0]


def test_dynamic_sampling_keeps_only_informative_groups(tmp_path):
    # rewards differ within a group only for some prompts (ground truth < 5), so rounds drop the others
    reward = _reward_file(tmp_path, "return float(int(ground_truth) < 5) * (len(response) % 2)")
    _, lines = _run(tmp_path, reward, "algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_max_rounds=8",
                    "rollout.n=4", "trainer.total_steps=3")
    for line in lines:
        assert line["sampling/rounds"] >= 1
        if line["sampling/filled_groups"] == 0:
            assert line["train/zero_variance_group_frac"] == 0.0
    assert any(line["sampling/rounds"] > 1 for line in lines)  # some step needed more than one round
    assert all(line["sampling/informative_group_frac"] < 1.0 for line in lines if line["sampling/rounds"] > 1)


def test_dynamic_sampling_at_its_cap_fills_the_step_and_says_so(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="phaserl"):
        trainer, lines = _run(tmp_path, _reward_file(tmp_path, "return 0.0"), "algorithm.dynamic_sampling=true",
                              "algorithm.dynamic_sampling_max_rounds=2", "trainer.total_steps=1")
    assert lines[-1]["sampling/rounds"] == 3.0 and lines[-1]["sampling/filled_groups"] == 4.0
    assert any("filled with 4 zero-variance groups" in r.getMessage() for r in caplog.records)
    state = trainer.run.train_prompts.state_dict()  # 3 rounds of 4 prompts drawn from the 64-prompt stream
    assert state["epoch"] * 64 + state["position"] == 12


def test_overlong_shaping_penalizes_responses_in_the_buffer(tmp_path):
    _, lines = _run(tmp_path, "rollout.ignore_eos=true", "algorithm.overlong_buffer=2",
                    "algorithm.overlong_penalty=0.5", "trainer.total_steps=1")
    # every response runs to max_new_tokens (4) = the end of the buffer: penalty -0.5
    assert lines[-1]["train/reward/overlong"] == pytest.approx(-0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, engine", [("float32", "builtin"), ("bfloat16", "builtin"), ("bfloat16", "hf")])
def test_gpu_mismatch_is_logged_and_small(tmp_path, dtype, engine):
    """On the GPU the engine's kernels (CUDA graphs, its attention) differ from the trainer's forward: the
    mismatch is measured, not 0, and stays far below what would break the PPO ratio."""
    _, lines = _run(tmp_path, "trainer.device=cuda", f"model.dtype={dtype}", f"rollout.engine={engine}",
                    "ppo.num_mini_batches=2")
    for line in lines:
        assert line["mismatch/k3"] < (1e-6 if dtype == "float32" else 1e-2), line
        assert line["mismatch/ratio_out_frac"] < (1e-6 if dtype == "float32" else 1e-2), line


@pytest.mark.gpu
def test_gpu_ppo_with_a_bf16_critic_trains(tmp_path):
    """PPO's critic on the GPU in bf16: the ValueModel head once stayed float32 on the CPU (found on two H200s by
    benchmarks/multi_gpu.py's ppo_rm scenario, 2026-12-04); one rank is enough to show it."""
    trainer, lines = _run(tmp_path, "trainer.device=cuda", "model.dtype=bfloat16", "algorithm.adv_estimator=gae",
                          "trainer.total_steps=2")
    assert {p.device.type for p in trainer.critic.model.parameters()} == {"cuda"}
    assert {p.dtype for p in trainer.critic.model.parameters()} == {torch.bfloat16}
    assert all(math.isfinite(line["critic/vf_loss"]) for line in lines)
