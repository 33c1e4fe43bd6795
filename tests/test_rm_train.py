"""Reward-model training (phaserl.rm): the Bradley–Terry loss, held-out pairwise accuracy, an export that
transformers loads and scores identically, the train-rm config and CLI, tiny-world pairs, critic init."""
import json
import math
import os

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from _tiny_run import make_model_dir
from _tiny_tokenizer import build_tiny_tokenizer
from phaserl.cli import cli_train_rm
from phaserl.data import PreferenceRow, load_preference_rows, write_records
from phaserl.errors import ConfigError
from phaserl.models import load_pretrained, load_tokenizer, load_value_model
from phaserl.rewards import tiny_exact
from phaserl.rm import (
    SequenceScorer,
    evaluate_pairs,
    init_critic,
    load_rm_config,
    make_tiny_preference_records,
    train_reward_model,
)
from phaserl.rm.tiny_prefs import near_misses
from phaserl.rm.train import last_non_pad_index
from phaserl.roles import RewardModelWrapper
from phaserl.world.tokenizer import build_tokenizer as build_world_tokenizer

torch.set_num_threads(1)
VERL_STYLE_TEMPLATE = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}{% endfor %}"


def toy_pairs(start: int, n: int) -> list:
    """A preference anyone can learn: 'good' beats 'bad'. Prompts differ between train and held-out sets."""
    return [PreferenceRow(prompt=f"question {i}?", chosen_response="good", rejected_response="bad",
                          source=f"toy:row {i}", index=i) for i in range(start, start + n)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One small training run shared by the export tests: (stats, policy dir, RM dir)."""
    root = tmp_path_factory.mktemp("rm")
    policy = make_model_dir(str(root))
    stats = train_reward_model(policy, None, toy_pairs(0, 32), toy_pairs(100, 16), steps=25, lr=3e-3, batch_size=8,
                               max_length=64, apply_chat_template=True, seed=0, out_dir=str(root / "rm"))
    return stats, policy, str(root / "rm")


def test_last_non_pad_index_is_transformers_pooling():
    ids = torch.tensor([[5, 6, 0, 0], [5, 6, 7, 8], [0, 5, 0, 0]])  # pad id 0; row 3 starts with a pad
    assert last_non_pad_index(ids, 0).tolist() == [1, 3, 1]
    assert last_non_pad_index(ids, None).tolist() == [3, 3, 3]  # no pad id: the last position


def test_first_step_loss_is_log2_and_held_out_accuracy_rises(trained):
    stats, _, _ = trained
    # A causal LM starts with a zero score head: every margin is 0, and -log sigmoid(0) = log 2.
    assert stats.losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert stats.val_before.accuracy == 0.0 and stats.val_before.pairs == 16  # ties count as wrong
    assert stats.val_after.accuracy == 1.0 and stats.val_after.margin_mean > 0.5
    assert stats.losses[-1] < 0.3 and len(stats.losses) == len(stats.accuracies) == 25


def test_export_loads_in_transformers_and_scores_like_our_decoder(trained):
    stats, _, rm_dir = trained
    assert stats.out_dir == rm_dir
    hf = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    assert hf.config.num_labels == 1 and hf.config.architectures == ["Qwen2ForSequenceClassification"]
    tokenizer = load_tokenizer(rm_dir)
    ours = RewardModelWrapper(SequenceScorer(load_value_model(rm_dir)), tokenizer)
    theirs = RewardModelWrapper(hf, tokenizer)
    prompts, responses = ["question 7?", "q", "question 123?"], ["good", "bad", "a longer answer"]
    torch.testing.assert_close(theirs.score(prompts, responses), ours.score(prompts, responses), atol=1e-5, rtol=0)
    # Without the wrapper: transformers on the formatted text, batch of one (no padding at all).
    text = ours.format(prompts[0], responses[0])
    with torch.no_grad():
        logit = hf(**tokenizer(text, add_special_tokens=False, return_tensors="pt")).logits[0, 0]
    assert float(logit) == pytest.approx(float(ours.score(prompts[:1], responses[:1])[0]), abs=1e-5)
    # transformers' scores equal ours within float32 rounding (the kernels differ by version), not bit for bit
    theirs_pairs = evaluate_pairs(theirs, toy_pairs(100, 16))
    assert (theirs_pairs.accuracy, theirs_pairs.pairs) == (stats.val_after.accuracy, stats.val_after.pairs)
    assert theirs_pairs.margin_mean == pytest.approx(stats.val_after.margin_mean, abs=1e-5)
    record = json.load(open(os.path.join(rm_dir, "phaserl_rm.json")))
    assert record["apply_chat_template"] is True and record["val_after"]["accuracy"] == 1.0


def test_a_custom_template_is_saved_with_the_rm_so_scoring_uses_the_training_format(tmp_path):
    policy = make_model_dir(str(tmp_path))
    tokenizer = build_tiny_tokenizer(chat_template=None)  # no template of its own
    train_reward_model(policy, tokenizer, toy_pairs(0, 8), [], steps=2, lr=1e-3, batch_size=4, max_length=64,
                       apply_chat_template=True, chat_template=VERL_STYLE_TEMPLATE, out_dir=str(tmp_path / "rm"))
    loaded = RewardModelWrapper.from_pretrained(str(tmp_path / "rm"), apply_chat_template=True)
    assert loaded.format("Hi?", "Yes.") == "user: Hi?assistant: Yes."
    assert tokenizer.chat_template is None  # the caller's tokenizer is left alone


def test_training_from_a_reward_model_directory_keeps_its_head(trained, tmp_path):
    stats, _, rm_dir = trained
    again = train_reward_model(rm_dir, None, toy_pairs(0, 8), toy_pairs(100, 16), steps=1, lr=1e-9, batch_size=4,
                               max_length=64, apply_chat_template=True)
    assert again.val_before == stats.val_after  # the trained head was loaded, not a fresh zero one


def test_bad_arguments_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="steps=0"):
        train_reward_model("unused", None, toy_pairs(0, 2), [], steps=0, lr=1e-3, batch_size=1, max_length=64,
                           apply_chat_template=False)


def test_tiny_pairs_prefer_the_correct_sum_over_a_near_miss(tmp_path):
    assert near_misses(57, 68) == {"dropped_carry": 15, "off_by_one": 126, "off_by_ten": 135,
                                   "swapped_digits": 152, "dropped_digit": 25}
    records = make_tiny_preference_records("val", 50, seed=3)
    assert records == make_tiny_preference_records("val", 50, seed=3)
    assert len({r["prompt"][0]["content"] for r in records}) == 50
    for r in records:
        truth = r["chosen_response"]
        assert tiny_exact(r["prompt"], r["chosen_response"], truth) == 1.0
        assert tiny_exact(r["prompt"], r["rejected_response"], truth) == 0.0
    write_records(tmp_path / "prefs.jsonl", records)
    rows = load_preference_rows([str(tmp_path / "prefs.jsonl")])  # the preference schema
    assert rows[0].chosen_response == records[0]["chosen_response"] and len(rows) == 50


def test_init_critic_from_the_policy_or_from_the_reward_model(trained, tmp_path):
    _, policy, rm_dir = trained
    from_policy = init_critic("policy", policy)
    assert torch.count_nonzero(from_policy.score.weight) == 0
    torch.testing.assert_close(from_policy.model.embed_tokens.weight, load_pretrained(policy).model.embed_tokens.weight)
    from_rm = init_critic("reward_model", rm_dir, policy_tokenizer=load_tokenizer(policy))
    torch.testing.assert_close(from_rm.score.weight, load_value_model(rm_dir).score.weight)
    assert torch.count_nonzero(from_rm.score.weight) > 0


def test_init_critic_refuses_what_cannot_be_a_critic(trained):
    _, policy, rm_dir = trained
    with pytest.raises(ConfigError, match="not describe a \\*ForSequenceClassification.*init_from = policy"):
        init_critic("reward_model", policy)
    with pytest.raises(ConfigError, match="set critic.path or reward_model.path"):
        init_critic("reward_model", None)
    with pytest.raises(ConfigError, match="maps tokens to other ids than the policy's.*init_from = policy"):
        init_critic("reward_model", rm_dir, policy_tokenizer=build_world_tokenizer())


def test_build_roles_starts_the_critic_from_the_configured_source(trained, tmp_path):
    from _tiny_run import make_run_dir
    from phaserl.config import load_config
    from phaserl.trainer.build import build_roles

    _, _, rm_dir = trained
    overrides = make_run_dir(str(tmp_path)) + ["algorithm.adv_estimator=gae", "reward_model.enable=true",
                                               f"reward_model.path={rm_dir}", "critic.init_from=reward_model"]
    roles = build_roles(load_config(None, overrides))
    torch.testing.assert_close(roles.critic.model.score.weight, load_value_model(rm_dir).score.weight)
    assert roles.reward.reward_model is not None


def test_config_is_strict_and_the_cli_trains_and_exports(trained, tmp_path):
    _, policy, _ = trained
    cfg_file = tmp_path / "rm.yaml"
    cfg_file.write_text("steps: 3\nbatch_size: 2\nstpes: 4\n")
    with pytest.raises(ConfigError, match=r"rm.yaml: unknown key stpes in a train-rm config; did you mean steps\?"):
        load_rm_config(str(cfg_file))
    write_records(tmp_path / "train.jsonl", [{"prompt": p.prompt, "chosen_response": "good",
                                              "rejected_response": "bad"} for p in toy_pairs(0, 4)])
    cfg_file.write_text(f"model_path: {policy}\ntrain_files: [{tmp_path / 'train.jsonl'}]\n"
                        f"val_files: [{tmp_path / 'train.jsonl'}]\nsteps: 2\nbatch_size: 2\ndevice: cpu\n")
    assert cli_train_rm([str(cfg_file), f"out_dir={tmp_path / 'run'}", "log_every=0"]) == 0
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "model").config.num_labels == 1
    summary = json.load(open(tmp_path / "run" / "train_rm_stats.json"))
    assert summary["steps"] == 2 and summary["val_after"]["pairs"] == 4 and len(summary["losses"]) == 2


def test_the_built_in_tiny_rm_is_trained_once_and_retrained_when_its_recipe_changes(tmp_path, monkeypatch):
    import phaserl.rm.tiny_model as rm
    from phaserl.resolve import resolve_reward_model_path

    runs = []

    def fake_run(cfg):  # stands in for the minute of training
        runs.append(cfg)
        os.makedirs(os.path.join(cfg.out_dir, "model"), exist_ok=True)
        open(os.path.join(cfg.out_dir, "model", "config.json"), "w").write("{}")

    monkeypatch.setattr(rm, "run_train_rm", fake_run)
    first = rm.prepare_tiny_reward_model(str(tmp_path))
    assert rm.prepare_tiny_reward_model(str(tmp_path)) == first == str(tmp_path / "model") and len(runs) == 1
    assert runs[0].model_path.endswith("tiny-sft") and runs[0].device == "cpu"
    monkeypatch.setattr(rm, "_fingerprint", lambda model_dir: "another recipe")
    rm.prepare_tiny_reward_model(str(tmp_path))
    assert len(runs) == 2
    assert resolve_reward_model_path("runs/rm/model") == "runs/rm/model" and resolve_reward_model_path(None) is None


@pytest.mark.slow  # a short RM training run on the transformers path
def test_a_transformers_path_reward_model_trains_exports_and_starts_a_critic(tmp_path):
    """train-rm on an architecture without our decoder (GPT-2) used to stop at its start (AttributeError: the
    value head wrapped `backbone.model`). It now trains the transformers model's backbone with a one-output head
    (HFValueModel), exports transformers' own GPT2ForSequenceClassification that scores what training scored,
    and a PPO critic starts from that directory with its trained head."""
    import transformers

    from phaserl.models.hf_fallback import HFValueModel

    tokenizer = build_tiny_tokenizer()
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    # held-out prompts as long as the training ones: GPT-2's learned absolute positions, briefly trained, do not
    # carry 'good' over 'bad' to a response one position later (a 3-digit question)
    stats = train_reward_model(str(tmp_path / "policy"), None, toy_pairs(10, 32), toy_pairs(60, 8), steps=25,
                               lr=3e-3, batch_size=8, max_length=64, apply_chat_template=True, seed=0,
                               out_dir=str(tmp_path / "rm"))
    assert stats.val_after.accuracy > stats.val_before.accuracy  # it learned 'good' over 'bad'
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    assert type(hf).__name__ == "GPT2ForSequenceClassification" and hf.config.num_labels == 1
    theirs = RewardModelWrapper(hf, load_tokenizer(tmp_path / "rm"))
    assert evaluate_pairs(theirs, toy_pairs(60, 8)) == stats.val_after  # the export scores what training did
    critic = init_critic("reward_model", str(tmp_path / "rm"), policy_tokenizer=tokenizer)
    assert isinstance(critic, HFValueModel)
    torch.testing.assert_close(critic.score.weight, hf.score.weight)


def test_an_rm_of_an_architecture_without_a_classifier_is_refused_before_training(tmp_path, monkeypatch):
    """Gemma 4 has no *ForSequenceClassification in transformers: train-rm used to train all its steps and then
    fail at the export."""
    import transformers

    from test_model_coverage import tiny_config

    tokenizer = build_tiny_tokenizer()
    config = tiny_config("gemma4_text", len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    policy = str(tmp_path / "policy")

    def no_training(*args):
        raise AssertionError("training started")
    monkeypatch.setattr("phaserl.rm.train._pair_order", no_training)
    with pytest.raises(ConfigError, match="gemma4_text"):
        train_reward_model(policy, None, toy_pairs(0, 4), [], steps=1000, lr=1e-3, batch_size=2, max_length=32,
                           apply_chat_template=True, out_dir=str(tmp_path / "rm"))
    assert not os.path.exists(tmp_path / "rm")
