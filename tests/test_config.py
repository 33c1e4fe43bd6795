"""Loading configs: defaults, YAML files, `key=value` overrides, field-level errors, and the YAML round trip.

Cross-field rules, `derive` and `explain` are tested in test_config_rules.py.
"""
import os

import pytest

from phaserl.config import (
    Config,
    RewardFunctionConfig,
    config_from_dict,
    derive,
    dump_yaml,
    explain,
    load_config,
    to_dict,
    to_yaml,
)
from phaserl.errors import ConfigError

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "configs")
GRPO_SMALL = os.path.join(FIXTURES, "grpo_small.yaml")


def write(tmp_path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def error_of(path, overrides=(), world_size=1) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides, world_size=world_size)
    return str(e.value)


# ---- what loads -----------------------------------------------------------------------------------

def test_none_gives_the_schema_defaults():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.reward.functions == [RewardFunctionConfig(name="tiny_exact", weight=1.0, kwargs={})]


def test_yaml_file_then_overrides_with_lists_nulls_and_bools():
    cfg = load_config(GRPO_SMALL, ["ppo.mini_batch_size=32", "ppo.num_mini_batches=2", "rollout.n=4",
                                   "data.train_files=[a.jsonl,b.jsonl]",
                                   "reward.functions=[tiny_exact]", "model.tokenizer_path=null",
                                   "data.shuffle=false", "actor.optim.lr=2e-6"])
    assert cfg.model.path == "/models/qwen2-0.5b" and cfg.model.dtype == "bfloat16"  # from the file
    assert cfg.rollout.n == 4 and cfg.ppo.mini_batch_size == 32  # 16 prompts × 4 = 64 responses = 32 × 2
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"]
    assert cfg.reward.functions == [RewardFunctionConfig(name="tiny_exact")]
    assert cfg.model.tokenizer_path is None and cfg.data.shuffle is False
    assert cfg.actor.optim.lr == 2e-6 and cfg.actor.optim.warmup_steps == 5  # sibling kept from the file


def test_reward_functions_accept_plain_names_and_mappings():
    cfg = load_config(GRPO_SMALL)
    assert cfg.reward.functions == [
        RewardFunctionConfig(name="math_verify"),
        RewardFunctionConfig(name="rules/format.py:has_boxed", weight=0.1, kwargs={"strict": True}),
    ]


def test_yaml_1e_minus_3_is_a_float_and_integral_floats_are_ints():
    # PyYAML alone reads `1e-3` as the string '1e-3'.
    cfg = load_config(GRPO_SMALL, ["rollout.n=8.0"])
    assert cfg.algorithm.kl_coef == pytest.approx(1e-3) and isinstance(cfg.algorithm.kl_coef, float)
    assert cfg.rollout.n == 8 and isinstance(cfg.rollout.n, int)


def test_a_section_override_changes_only_the_keys_it_names():
    cfg = load_config(GRPO_SMALL, ["actor={optim: {lr: 3.0e-6}}"])
    assert cfg.actor.optim.lr == 3e-6 and cfg.actor.optim.warmup_steps == 5


def test_an_empty_section_means_its_defaults(tmp_path):
    assert load_config(write(tmp_path, "rollout:\n# n: 8\n")) == Config()


def test_an_empty_config_file_is_an_error_not_all_defaults(tmp_path):
    """Bug: an empty file was taken as "all defaults", i.e. the built-in tiny task."""
    for text in ("", "# only a comment\n"):
        path = write(tmp_path, text)
        with pytest.raises(ConfigError, match=rf"config file '{path}' is empty.*phaserl train --defaults"):
            load_config(path)
    assert load_config(write(tmp_path, "{}\n")) == Config()   # an explicit empty mapping still means defaults


def test_seed_batch_size_keys_keep_their_meaning():
    """verl-style keys: rollout.batch_size prompts/GPU/generate call; reward_model.batch_size sequences/GPU/scoring
    call; ppo.mini_batch_size 8 × num_mini_batches 4 = 32 responses per step (8 prompts × n 4)."""
    cfg = load_config(os.path.join(FIXTURES, "verl_batch_sizes.yaml"))
    assert (cfg.rollout.batch_size, cfg.rollout.max_new_tokens) == (32, 128)
    assert (cfg.reward_model.batch_size, cfg.reward_model.truncation) == (16, True)
    assert (cfg.ppo.mini_batch_size, cfg.ppo.num_mini_batches) == (8, 4)
    d = derive(cfg, world_size=2)
    assert d.prompts_per_rank == 4 and d.generate_calls_per_rank == 1  # ceil(4 prompts / 32 per call)
    assert d.responses_per_rank == 16 and d.reward_model_scoring_calls_per_rank == 1  # ceil(16 / 16)
    assert d.mini_batch_size == 8 and d.mini_batch_per_rank == 4 and d.optimizer_steps_per_rl_step == 4


# ---- round trip ------------------------------------------------------------------------------------

ODD_VALUES = ["model.path=yes", "model.tokenizer_path='1e-6'", "trainer.resume=/ckpt/step_10",
              "reward_model.enable=true", "reward_model.path=/models/rm", "reward_model.chat_template="
              "\"{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\\n{% endfor %}\"",
              "algorithm.kl_target=0.05", "critic.optim.betas=[0.8, 0.95]", "actor.fsdp.param_dtype=bfloat16"]


def test_to_yaml_reads_back_to_an_equal_config(tmp_path):
    cfg = load_config(GRPO_SMALL, ODD_VALUES)
    assert cfg.model.path == "yes" and cfg.model.tokenizer_path == "1e-6"  # strings that look like bool/float
    path = str(tmp_path / "out" / "resolved.yaml")
    dump_yaml(cfg, path)
    assert load_config(path) == cfg
    assert config_from_dict(to_dict(cfg), source="dict") == cfg
    assert load_config(write(tmp_path, to_yaml(cfg))) == cfg


def test_explain_output_is_itself_the_same_config(tmp_path):
    cfg = load_config(GRPO_SMALL, ODD_VALUES)
    assert load_config(write(tmp_path, explain(cfg, world_size=4))) == cfg


# ---- unknown keys -----------------------------------------------------------------------------------

def test_unknown_key_in_the_wrong_section_suggests_the_right_section(tmp_path):
    path = write(tmp_path, "rollout:\n  n: 4\n  mini_batch_size: 16\n")
    msg = error_of(path)
    assert path in msg and "unknown key rollout.mini_batch_size" in msg
    assert "did you mean ppo.mini_batch_size?" in msg and "GLOBAL" in msg  # the suggestion's help text


def test_misspelled_override_key_names_the_command_line_and_the_fix():
    msg = error_of(GRPO_SMALL, ["ppo.mini_bach_size=16"])
    assert "command line override 'ppo.mini_bach_size=16'" in msg
    assert "unknown key ppo.mini_bach_size; did you mean ppo.mini_batch_size?" in msg


def test_misspelled_section_and_list_item_keys(tmp_path):
    assert "unknown key rolout; did you mean rollout?" in error_of(write(tmp_path, "rolout: {n: 4}\n"))
    msg = error_of(None, ["reward.functions=[{nam: tiny_exact}]"])
    assert "unknown key reward.functions[0].nam; did you mean reward.functions[0].name?" in msg


def test_an_unguessable_key_lists_the_section_keys():
    msg = error_of(None, ["rollout.xyz=1"])
    assert "unknown key rollout.xyz; valid keys here: prompts_per_step, n, batch_size" in msg


def test_a_key_that_exists_in_several_sections_lists_them():
    msg = error_of(None, ["trainer.path=/x"])
    assert "did you mean one of model.path, reward_model.path, critic.path, ref.path?" in msg


def test_overrides_cannot_reach_inside_values_or_lists():
    assert "rollout.n is a single value; it has no key 'x'" in error_of(None, ["rollout.n.x=1"])
    assert "reward.functions is a list: give it whole" in error_of(None, ["reward.functions.0.weight=2"])
    assert "expected key=value" in error_of(None, ["rollout.n"])


# ---- wrong values -----------------------------------------------------------------------------------

@pytest.mark.parametrize("override, expected", [
    ("rollout.n=0", "rollout.n = 0: expected an integer >= 1"),
    ("rollout.n=2.5", "rollout.n = 2.5: expected an integer >= 1"),
    ("rollout.n=four", "rollout.n = 'four': expected an integer >= 1"),
    ("rollout.n=true", "rollout.n = true: expected an integer >= 1"),
    ("data.shuffle=yes", "data.shuffle = 'yes': expected true or false"),
    ("data.shuffle=1", "data.shuffle = 1: expected true or false"),
    ("model.path=[a, b]", "model.path = ['a', 'b']: expected a string"),
    ("data.train_files=a.jsonl", "data.train_files = 'a.jsonl': expected a list, each item a string (write [a.jsonl]"),
    ("rollout.top_p=1.5", "rollout.top_p = 1.5: expected a number in [0.0, 1.0]"),
    ("actor.optim.lr=.nan", "actor.optim.lr = nan: expected a number >= 0.0"),
    ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator = 'ppo': expected one of 'gae', 'grpo'"),
    ("trainer.loggers=[console, wandbb]", "trainer.loggers[1] = 'wandbb': expected one of 'console'"),
    ("actor.fsdp.param_dtype=bf16", "expected one of null, 'float32', 'bfloat16', 'float16'"),
    ("data.val_max_prompts=0", "data.val_max_prompts = 0: expected null or an integer >= 1"),
    ("reward.functions=[3]", "reward.functions[0] = 3: expected a name or a mapping with keys name, weight, kwargs"),
    ("model.path=[unclosed", "is not valid YAML"),
])
def test_wrong_values_name_key_value_and_expectation(override, expected):
    msg = error_of(None, [override])
    assert f"command line override {override!r}" in msg and expected in msg


def test_wrong_type_in_a_file_names_the_file(tmp_path):
    path = write(tmp_path, "ppo:\n  num_mini_batches: '4'\n")
    assert f"{path}: ppo.num_mini_batches = '4': expected an integer >= 1" in error_of(path)


def test_broken_files(tmp_path):
    assert "appears twice" in error_of(write(tmp_path, "rollout: {n: 4}\nrollout: {n: 8}\n"))
    msg = error_of(write(tmp_path, "rollout:\n  n: [4\n"))
    assert "not valid YAML" in msg and "line 2" in msg
    assert "expected a mapping with keys model, data" in error_of(write(tmp_path, "- rollout\n"))
    assert "does not exist" in error_of(str(tmp_path / "missing.yaml"))
