"""The verl-style API works as written, with `phaserl` in place of `verl`.

The snippet below is the one verl users write (from the article behind docs/five-mistakes.md),
changed only where it builds models (our tiny CPU models, saved by tests/_tiny_run.py and
tests/_tiny_rm.py), where `actor_fsdp_config` (left undefined by the snippet) is given, and where its
/shared/... paths become a temporary directory.
"""
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForSequenceClassification

from _tiny_rm import make_reward_model_dir
from _tiny_run import make_run_dir
from phaserl import load_config
from phaserl.config import derive, explain
from phaserl.errors import ConfigError
from phaserl.models import ValueModel, load_pretrained

torch.set_num_threads(1)
VERL_STYLE_TEMPLATE = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("seed")
    overrides = make_run_dir(str(root))
    return {"root": root, "overrides": overrides, "rm_dir": make_reward_model_dir(str(root))}


def run_verl_style_snippet(setup, policy_model, tmp_path, capsys, caplog):
    cfg = load_config(None, setup["overrides"])
    path = cfg.model.path
    value_model = ValueModel(load_pretrained(path))
    reward_model = LlamaForSequenceClassification.from_pretrained(setup["rm_dir"])  # saved with its tokenizer
    actor_fsdp_config = dict(sharding_strategy="FULL_SHARD")
    shared = tmp_path  # the snippet writes to /shared/ckpt/run1 and /shared/tb/run1

    # ---- the snippet, verbatim from here ----
    from phaserl import Critic, HybridActor, ReferencePolicy, RewardModelWrapper, RLTrainer
    actor = HybridActor(model=policy_model, fsdp_config=actor_fsdp_config,
                        hybrid_engine_config=dict(enable_rollout_optimization_switch=True))
    critic = Critic(model=value_model, fsdp_config=dict(sharding_strategy="FULL_SHARD"))
    ref_policy = ReferencePolicy(model=AutoModelForCausalLM.from_pretrained(path))  # frozen by itself
    rm = RewardModelWrapper(model=reward_model, apply_chat_template=False, response_key="chosen_response")
    rm = RewardModelWrapper(model=reward_model, apply_chat_template=True,
                            chat_template=VERL_STYLE_TEMPLATE)
    trainer = RLTrainer(actor=actor, critic=critic, ref_policy=ref_policy, reward=rm, config=cfg,
                        checkpoint_path=f"{shared}/ckpt/run1", log_dir=f"{shared}/tb/run1",
                        save_interval=1000, keep_checkpoint_num=3)
    trainer.add_hook("on_save_checkpoint",
                     lambda trainer: print(f"[Rank {trainer.rank}] Saved checkpoint to {trainer.checkpoint_path}"))
    with caplog.at_level(logging.INFO, logger="phaserl"):
        trainer.fit()
    # ---- end of the snippet ----
    return trainer, ref_policy, capsys.readouterr().out, caplog.text


def check_run(trainer, ref_policy, out, log, tmp_path):
    assert trainer.step == 2 and "train/reward/reward_model" in trainer.metrics
    assert "critic/vf_loss" in trainer.metrics and "train/kl" in trainer.metrics
    assert all(not p.requires_grad for p in ref_policy.model.parameters())
    assert f"[Rank 0] Saved checkpoint to {tmp_path}/ckpt/run1" in out
    assert "[HybridEngine] Switching actor from training to rollout mode" in log
    assert "[HybridEngine] Switching actor from rollout to training mode" in log
    assert all("Switching actor" in line for line in log.splitlines() if "[HybridEngine]" in line)
    assert (tmp_path / "tb" / "run1" / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_the_verl_style_snippet_trains_with_our_policy_loader(setup, tmp_path, capsys, caplog):
    policy_model = load_pretrained(load_config(None, setup["overrides"]).model.path)
    check_run(*run_verl_style_snippet(setup, policy_model, tmp_path, capsys, caplog), tmp_path)


@pytest.mark.slow
def test_the_verl_style_snippet_trains_with_a_transformers_policy(setup, tmp_path, capsys, caplog):
    policy_model = AutoModelForCausalLM.from_pretrained(load_config(None, setup["overrides"]).model.path)
    check_run(*run_verl_style_snippet(setup, policy_model, tmp_path, capsys, caplog), tmp_path)


def test_the_verl_style_reward_model_formats(setup):
    from phaserl import RewardModelWrapper

    reward_model = LlamaForSequenceClassification.from_pretrained(setup["rm_dir"])
    plain = RewardModelWrapper(model=reward_model, apply_chat_template=False, response_key="chosen_response")
    rows = [{"prompt": "How do I change a tyre?", "chosen_response": "Loosen the nuts first.",
             "rejected_response": "I can't help."},
            {"prompt": "Name a colour.", "chosen_response": "Blue.", "rejected_response": "No."}]
    text = plain.format(rows[0]["prompt"], rows[0]["chosen_response"])
    assert text == "How do I change a tyre?Loosen the nuts first."
    assert plain.score_rows(rows).shape == (2,)
    templated = RewardModelWrapper(model=reward_model, apply_chat_template=True, chat_template=VERL_STYLE_TEMPLATE)
    assert templated.format("Hi?", "Yes.") == "user: Hi?assistant: Yes."


VERL_STYLE_YAML = """\
rollout:      {batch_size: 32, max_new_tokens: 128}   # prompts per GPU per generate call
reward_model: {batch_size: 16, truncation: true}      # sequences per GPU per scoring call
ppo:          {mini_batch_size: 8, num_mini_batches: 4}
"""


def test_the_verl_style_yaml_keys_keep_their_meaning(tmp_path):
    path = tmp_path / "seed.yaml"
    # 8 × 4 = 32 responses per step: with our default rollout.n = 4 that is 8 prompts per step.
    path.write_text(VERL_STYLE_YAML)
    with pytest.raises(ConfigError, match=r"8 × 4 = 32 responses, but rollout.prompts_per_step × rollout.n = "
                                          r"32 × 4 = 128 responses per step"):
        load_config(str(path))
    cfg = load_config(str(path), ["rollout.prompts_per_step=8"])
    d = derive(cfg, world_size=1)
    assert (d.mini_batch_size, d.num_mini_batches, d.responses_per_step) == (8, 4, 32)
    assert (cfg.rollout.batch_size, cfg.reward_model.batch_size, cfg.reward_model.truncation) == (32, 16, True)
    text = explain(cfg)
    assert "rollout.batch_size               = 32         prompts per GPU (rank) per generate call" in text
    assert "reward_model.batch_size          = 16         sequences per GPU (rank) per scoring call" in text


def test_the_trainer_keyword_arguments_are_checked_like_their_yaml_keys(setup, tmp_path):
    """Regression: RLTrainer(keep_checkpoint_num=0) was set past validation and read as 1."""
    from phaserl import HybridActor, RLTrainer

    cfg = load_config(None, setup["overrides"])
    actor = HybridActor(model=load_pretrained(cfg.model.path))
    with pytest.raises(ConfigError, match="trainer.keep_checkpoint_num = 0: expected") as from_yaml:
        load_config(None, setup["overrides"] + ["trainer.keep_checkpoint_num=0"])
    with pytest.raises(ConfigError, match=r"^RLTrainer\(keep_checkpoint_num=0\): ") as from_kwarg:
        RLTrainer(actor=actor, config=cfg, keep_checkpoint_num=0)
    assert str(from_kwarg.value).partition(": ")[2] == str(from_yaml.value).partition(": ")[2]
    with pytest.raises(ConfigError, match=r"trainer.save_interval = -1: expected"):
        RLTrainer(actor=actor, config=cfg, save_interval=-1)
    trainer = RLTrainer(actor=actor, config=cfg, checkpoint_path=str(tmp_path / "ckpt"), keep_checkpoint_num=2)
    assert (trainer.checkpoint_path, trainer.run.checkpointer.keep) == (str(tmp_path / "ckpt"), 2)
    assert cfg.trainer.keep_checkpoint_num == 3  # the caller's config is left as it was
