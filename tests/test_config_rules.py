"""Cross-field rules (`validate`), derived batch arithmetic (`derive`), `check_context_length` and `explain`.

Every error must show its arithmetic; the numbers in the asserts are worked out by hand.
"""
import random
import warnings

import pytest

from phaserl.config import Config, check_context_length, derive, explain, load_config, validate
from phaserl.errors import ConfigError
from phaserl.roles.reward_scoring import token_groups


def error_of(overrides, world_size=1) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides, world_size=world_size)
    return str(e.value)


def loads_quietly(overrides, world_size=1) -> Config:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_config(None, overrides, world_size=world_size)


# ---- batch arithmetic ----------------------------------------------------------------------------

def test_prompts_per_step_must_split_over_ranks():
    msg = error_of(["rollout.prompts_per_step=30"], world_size=4)
    assert "rollout.prompts_per_step = 30 is not divisible by world_size = 4" in msg
    assert "30 / 4 = 7.5" in msg and "e.g. 28 or 32" in msg


def test_mini_batch_times_count_must_equal_responses_per_step():
    # Seed values 8 × 4 = 32 against the default step: 32 prompts × 4 samples = 128 responses.
    msg = error_of(["ppo.mini_batch_size=8", "ppo.num_mini_batches=4"])
    assert "ppo.mini_batch_size × ppo.num_mini_batches = 8 × 4 = 32 responses" in msg
    assert "rollout.prompts_per_step × rollout.n = 32 × 4 = 128 responses per step" in msg
    assert "ppo.mini_batch_size = 32 (128 / 4) or ppo.num_mini_batches = 16 (128 / 8)" in msg
    assert "default config + 2 command line overrides" in msg


def test_derived_mini_batch_needs_an_even_split():
    msg = error_of(["ppo.num_mini_batches=3"])
    assert "32 × 4 = 128 responses per step do not split into ppo.num_mini_batches = 3" in msg
    assert "128 / 3 = 42.6667" in msg and "1, 2, 4, 8" in msg


def test_mini_batch_must_split_over_ranks():
    # 24 prompts × 2 = 48 = 6 × 8; 6 responses over 4 ranks = 1.5 each.
    msg = error_of(["rollout.prompts_per_step=24", "rollout.n=2", "ppo.mini_batch_size=6",
                    "ppo.num_mini_batches=8"], world_size=4)
    assert "ppo.mini_batch_size = 6 responses per optimizer step (global) is not divisible by world_size = 4" in msg
    assert "6 / 4 = 1.5 per rank" in msg


def test_world_size_must_be_positive():
    assert "world_size = 0: expected an integer >= 1" in error_of([], world_size=0)


def test_a_wrong_mini_batch_is_not_also_reported_per_rank():
    msg = error_of(["ppo.num_mini_batches=3"], world_size=4)  # 128 / 3 is wrong; 42 / 4 would be noise
    assert "not divisible by world_size" not in msg


def test_all_broken_rules_are_reported_together():
    msg = error_of(["rollout.n=1", "actor.clip_ratio_low=1.0", "rollout.val_n=2"])
    assert "3 problems" in msg and "rollout.n >= 2" in msg and "clip_ratio_low" in msg and "val_n" in msg


# ---- roles an algorithm needs --------------------------------------------------------------------

@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_baselines_need_two_samples(estimator):
    msg = error_of([f"algorithm.adv_estimator={estimator}", "rollout.n=1"])
    assert f"algorithm.adv_estimator = {estimator} needs rollout.n >= 2, got rollout.n = 1" in msg


@pytest.mark.parametrize("estimator", ["remax", "reinforce_plus_plus"])
def test_single_sample_estimators_accept_n_1(estimator):
    assert loads_quietly([f"algorithm.adv_estimator={estimator}", "rollout.n=1"]).rollout.n == 1


def test_greedy_rollout_with_a_group_baseline_learns_nothing():
    assert "all advantages are 0" in error_of(["rollout.temperature=0"])


def test_gae_needs_the_critic_and_an_unused_critic_warns():
    assert "gae needs value estimates, but critic.enable = false" in error_of(
        ["algorithm.adv_estimator=gae", "critic.enable=false"])
    assert derive(loads_quietly(["algorithm.adv_estimator=gae"])).critic_enabled is True  # null → on for gae
    with pytest.warns(UserWarning, match="critic.enable = true but algorithm.adv_estimator = grpo does not use"):
        load_config(None, ["critic.enable=true"])


def test_a_kept_engine_with_a_sharded_actor_warns_on_several_ranks():
    cfg = loads_quietly(["rollout.engine_keep_awake=true"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate(cfg, 1)  # one rank: the weights stay where they are, graphs are replayed
    with pytest.warns(UserWarning, match="FULL_SHARD on 2 ranks: the weights gathered for each rollout"):
        validate(cfg, 2)
    replicated = loads_quietly(["rollout.engine_keep_awake=true", "actor.fsdp.sharding_strategy=NO_SHARD"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate(replicated, 2)


def test_critic_never_gets_a_hybrid_engine():
    """Classic mistake 1: the critic wrapped and switched like the actor."""
    msg = error_of(["critic.hybrid_engine={enable_rollout_optimization_switch: true}"])
    assert "critic.hybrid_engine must be null" in msg and "only the actor switches" in msg
    assert "classic mistake 1" in msg


def test_kl_needs_the_reference():
    msg = error_of(["ref.enable=false"])
    assert "algorithm.kl_placement = loss measures the KL to the reference policy, but ref.enable = false" in msg
    assert derive(loads_quietly(["ref.enable=false", "algorithm.kl_placement=none"])).ref_enabled is False


def test_some_reward_is_required_and_the_reward_model_needs_a_path():
    assert "no reward: reward.functions is empty" in error_of(["reward.functions=[]"])
    assert "reward_model.enable = true needs reward_model.path" in error_of(["reward_model.enable=true"])
    cfg = loads_quietly(["reward.functions=[]", "reward_model.enable=true", "reward_model.path=/rm"])
    assert cfg.reward_model.enable


def test_clip_ratio_low_below_one():
    assert "1 - clip_ratio_low = 1 - 1.5 = -0.5 is not positive" in error_of(["actor.clip_ratio_low=1.5"])


def test_one_full_sequence_must_fit_each_token_budget():
    msg = error_of(["data.max_prompt_length=100", "rollout.max_new_tokens=200", "ppo.micro_batch_tokens=256",
                    "ppo.forward_micro_batch_tokens=299"])
    assert "2 problems" in msg and "data.max_prompt_length + rollout.max_new_tokens = 100 + 200 = 300 tokens" in msg
    assert "set ppo.micro_batch_tokens >= 300" in msg and "set ppo.forward_micro_batch_tokens >= 300" in msg


def test_several_greedy_validation_samples_are_pointless():
    msg = error_of(["rollout.val_n=4"])
    assert "rollout.val_n = 4 with rollout.val_temperature = 0" in msg and "same response 4 times" in msg
    assert loads_quietly(["rollout.val_n=4", "rollout.val_temperature=0.7"]).rollout.val_n == 4


@pytest.mark.parametrize("value", ["latest", "Auto", "none", "''"])
def test_resume_is_auto_never_or_a_path(value):
    assert "expected auto (newest complete checkpoint), never, or a checkpoint path" in error_of(
        [f"trainer.resume={value}"])


@pytest.mark.parametrize("value", ["auto", "never", "/shared/ckpt/run1/step_100", "./latest"])
def test_resume_accepts(value):
    assert loads_quietly([f"trainer.resume={value}"]).trainer.resume == value


def test_bad_betas():
    assert "actor.optim.betas = [0.9, 1.0]: expected two numbers in [0, 1)" in error_of(
        ["actor.optim.betas=[0.9, 1.0]"])


def test_validate_on_a_hand_built_config_names_its_source():
    cfg = Config()
    cfg.rollout.n = 1
    with pytest.raises(ConfigError, match=r"^my run: algorithm.adv_estimator = grpo needs rollout.n >= 2"):
        validate(cfg, 1, source="my run")


# ---- context length ------------------------------------------------------------------------------

def test_context_length_shows_the_sum_and_the_fix():
    cfg = loads_quietly(["data.max_prompt_length=1024", "rollout.max_new_tokens=1500"])
    check_context_length(cfg, 4096, "Qwen2-0.5B")  # 2524 fits
    with pytest.raises(ConfigError) as e:
        check_context_length(cfg, 2048, "/models/qwen2-0.5b/config.json")
    msg = str(e.value)
    assert "1024 + 1500 = 2524 tokens" in msg and "max_position_embeddings = 2048" in msg
    assert "/models/qwen2-0.5b/config.json" in msg and "rollout.max_new_tokens = 1024" in msg


# ---- derive and explain --------------------------------------------------------------------------

HAND_WORKED = ["rollout.prompts_per_step=64", "rollout.n=8", "rollout.batch_size=6", "ppo.num_mini_batches=4",
               "ppo.epochs=2", "reward_model.enable=true", "reward_model.path=/rm", "reward_model.batch_size=24",
               "trainer.total_steps=5", "data.max_prompt_length=100", "rollout.max_new_tokens=156",
               "ppo.micro_batch_tokens=1024"]


def test_derive_hand_worked_numbers():
    cfg = loads_quietly(HAND_WORKED, world_size=4)
    d = derive(cfg, world_size=4)
    assert d.world_size == 4
    assert d.prompts_per_rank == 16  # 64 / 4
    assert d.responses_per_step == 512 and d.responses_per_rank == 128  # 64 × 8, 16 × 8
    assert d.generate_calls_per_rank == 3  # ceil(16 / 6)
    assert d.mini_batch_size == 128 and d.mini_batch_per_rank == 32  # 512 / 4, 128 / 4
    assert d.num_mini_batches == 4 and d.optimizer_steps_per_rl_step == 8  # 2 epochs × 4
    assert d.reward_model_scoring_calls_per_rank == 6  # ceil(128 / 24)
    assert d.total_responses == 2560  # 5 × 512
    assert d.max_sequence_tokens == 256 and d.sequences_per_micro_batch == 4  # 100 + 156, floor(1024 / 256)
    assert d.max_grad_accum_steps == 8  # ceil(32 responses per rank / 4 per micro-batch)
    assert (d.critic_enabled, d.ref_enabled) == (False, True)
    assert cfg.ppo.mini_batch_size is None  # derive resolves without mutating the config


def test_reward_model_calls_follow_the_engine_that_scores():
    # 128 responses per rank. transformers: reward_model.batch_size = 24 rows per call, ceil(128 / 24) = 6.
    # phaserl: floor(micro_batch_tokens 2048 / max_length 512) = 4 full-length inputs per forward at least,
    # so ceil(128 / 4) = 32 forwards at most. auto, directory not read: the bound of either engine, 32.
    cfg = loads_quietly(HAND_WORKED + ["reward_model.micro_batch_tokens=2048"], world_size=4)
    by_engine = {e: derive(cfg, world_size=4, reward_model_engine=e) for e in ("transformers", "phaserl", None)}
    assert [(d.reward_model_engine, d.reward_model_inputs_per_call, d.reward_model_scoring_calls_per_rank)
            for d in by_engine.values()] == [("transformers", 24, 6), ("phaserl", 4, 32), ("auto", 4, 32)]
    # A budget under max_length still scores one input per forward: 128 forwards.
    short = derive(loads_quietly(HAND_WORKED + ["reward_model.micro_batch_tokens=300", "reward_model.engine=phaserl"],
                                 world_size=4), world_size=4)
    assert (short.reward_model_inputs_per_call, short.reward_model_scoring_calls_per_rank) == (1, 128)
    off = derive(loads_quietly(["reward_model.micro_batch_tokens=300"]))
    assert (off.reward_model_inputs_per_call, off.reward_model_scoring_calls_per_rank) == (0, 0)
    with pytest.raises(ValueError, match="reward_model_engine='vllm'"):
        derive(cfg, world_size=4, reward_model_engine="vllm")


@pytest.mark.parametrize("packed", [True, False])
def test_the_phaserl_scoring_bound_holds_for_any_input_lengths(packed):
    # Inputs of 1..10 tokens (max_length 10) in a 25-token budget: floor(25 / 10) = 2 per forward at least, so
    # 9 inputs take at most ceil(9 / 2) = 5 forwards, whatever their lengths; nine 10-token inputs take exactly 5.
    cfg = loads_quietly(["rollout.prompts_per_step=9", "rollout.n=1", "algorithm.adv_estimator=remax",
                         "reward_model.enable=true", "reward_model.path=/rm", "reward_model.max_length=10",
                         "reward_model.micro_batch_tokens=25"])
    assert derive(cfg, reward_model_engine="phaserl").reward_model_scoring_calls_per_rank == 5
    assert len(token_groups([10] * 9, 25, packed=packed)) == 5
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 10) for _ in range(9)]
        assert len(token_groups(lengths, 25, packed=packed)) <= 5, lengths


def test_derive_rejects_broken_arithmetic():
    cfg = Config()
    with pytest.raises(ConfigError, match="32 / 3 = 10.6667"):
        derive(cfg, world_size=3)


def test_explain_shows_formulas_numbers_and_what_each_batch_size_counts():
    text = explain(loads_quietly(HAND_WORKED, world_size=4), world_size=4)
    assert "Derived batch arithmetic (world_size = 4)" in text
    for line in ["responses per step", "rollout.prompts_per_step × rollout.n = 64 × 8 = 512",
                 "rollout.prompts_per_step / world_size = 64 / 4 = 16",
                 "ceil(prompts per rank / rollout.batch_size) = ceil(16 / 6) = 3",
                 "ceil(128 / min(24, max(1, floor(16384 / 512)))) = 6   (at most; reward_model.engine = auto",
                 "responses per step / ppo.num_mini_batches = 512 / 4 = 128",
                 "mini-batch size / world_size = 128 / 4 = 32",
                 "ppo.epochs × ppo.num_mini_batches = 2 × 4 = 8",
                 "floor(ppo.micro_batch_tokens / max sequence tokens) = floor(1024 / 256) = 4",
                 "ceil(32 / 4) = 8", "trainer.total_steps × responses per step = 5 × 512 = 2560"]:
        assert line in text, line
    batch_lines: dict = {}  # the first line of each key: its batch-size line (the speed settings come later)
    for line in text.splitlines():
        if line.startswith("#   ") and " = " in line:
            batch_lines.setdefault(line.split()[1], line)
    assert "#   ppo.micro_batch_tokens     = 1024 (set: the rule is not applied)" in text  # a speed setting too
    assert "prompts per GPU (rank) per generate call" in batch_lines["rollout.batch_size"]
    assert "sequences per GPU (rank) per scoring call" in batch_lines["reward_model.batch_size"]
    assert "null → 128" in batch_lines["ppo.mini_batch_size"] and "GLOBAL" in batch_lines["ppo.mini_batch_size"]
    assert "per rank" in batch_lines["ppo.micro_batch_tokens"]
    assert "ref.enable = null → on, because algorithm.kl_placement = loss" in text
    assert "  n: 8" in text and "# responses sampled per prompt" in text  # the annotated YAML


def test_gspo_sapo_gmpo_off_the_papers_aggregation_warn_and_the_recipes_do_not():
    for extra, word in ((["actor.policy_loss=gspo"], "GSPO paper"),
                        (["actor.policy_loss=sapo"], "seq-mean-token-mean")):
        with pytest.warns(UserWarning, match=word):
            load_config(None, extra)
    for recipe in ("gspo", "sapo", "gmpo"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            load_config(f"examples/{recipe}.yaml")


def test_new_algorithm_rules_name_the_key_and_the_fix():
    for extra, message in ((["algorithm.dynamic_sampling=true", "rollout.n=1", "algorithm.adv_estimator=remax"],
                            "dynamic_sampling = true needs rollout.n >= 2"),
                           (["algorithm.overlong_buffer=999"], "overlong_buffer = 999"),
                           (["actor.policy_loss=cispo", "actor.clip_ratio_low=1.5"], "clip_ratio_low = 1.5"),
                           (["algorithm.rollout_correction=tis", "algorithm.rollout_correction_cap=1.0"],
                            "rollout_correction_cap = 1.0")):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            load_config(None, extra)
