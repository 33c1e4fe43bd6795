"""Rule rewards: the built-ins on right and wrong answers, loading functions from files, weighting,
and the errors for functions that raise or return something that is not one finite number."""
import math
import sys
import threading

import numpy as np
import pytest
import torch

from phaserl.errors import ConfigError, RewardError
from phaserl.rewards import (
    BUILTIN_REWARDS,
    RuleRewards,
    boxed_math,
    format_reward,
    gsm8k,
    last_boxed,
    resolve_reward_fn,
    tiny_exact,
)


@pytest.mark.parametrize("response,truth,expected", [
    ("68", 68, 1.0), ("  68\n", "68", 1.0), ("-7", -7, 1.0), ("-7", " -7 ", 1.0),
    ("67", 68, 0.0), ("68 apples", 68, 0.0), ("", 68, 0.0), ("+68", 68, 0.0), ("6 8", 68, 0.0), ("7", -7, 0.0),
])
def test_tiny_exact(response, truth, expected):
    assert tiny_exact("12+56=", response, truth) == expected


def test_tiny_exact_rejects_a_non_integer_ground_truth():
    with pytest.raises(RewardError, match="'sixty'.*whole number"):
        tiny_exact("p", "60", "sixty")


@pytest.mark.parametrize("response,truth,expected", [
    ("48/2 = 24 clips.\n#### 24", "24", 1.0),
    ("#### 1,234.", 1234, 1.0),            # commas removed, trailing period
    ("#### 72.0", "72", 1.0),              # compared by value
    ("#### $18", "18", 1.0),
    ("first #### 5, then #### 7", "7", 1.0),  # the last "####" counts
    ("first #### 7, then #### 5", "7", 0.1),
    ("#### -3", "-3", 1.0),
    ("#### 25", "24", 0.1),                # formatted but wrong: format_score
    ("the answer is 24", "24", 0.0),       # unformatted: 0 even though the number is right
    ("#### twenty-four", "24", 0.0),       # "####" without a number is unformatted
])
def test_gsm8k(response, truth, expected):
    assert gsm8k("q", response, truth, format_score=0.1) == expected


def test_gsm8k_default_format_score_is_zero_and_full_solution_ground_truth_works():
    assert gsm8k("q", "#### 5", "4") == 0.0
    assert gsm8k("q", "#### 5", "2 + 3 = 5\n#### 5") == 1.0


def test_gsm8k_rejects_a_non_numeric_ground_truth():
    with pytest.raises(RewardError, match="'nan' is not a number"):
        gsm8k("q", "#### 5", "nan")


def test_last_boxed_balances_braces_and_skips_an_unclosed_box():
    assert last_boxed(r"so \boxed{\frac{3}{4}} done") == r"\frac{3}{4}"
    assert last_boxed(r"\boxed{1} then \boxed{2}") == "2"
    assert last_boxed(r"\boxed{2} and a cut-off \boxed{\frac{1}{") == "2"
    assert last_boxed("no box here") is None


@pytest.mark.parametrize("response,truth,expected", [
    (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{3}{4}}", "3/4", 1.0),
    (r"\boxed{1} no wait \boxed{2}", "2", 1.0),
    (r"\boxed{1} no wait \boxed{2}", "1", 0.0),
    (r"\boxed{3}", "4", 0.0),
    ("4", "4", 0.0),                        # no \boxed: nothing to compare
    (r"\boxed{4}", 4, 1.0),                 # int ground truth
])
def test_boxed_math(response, truth, expected):
    assert boxed_math("q", response, truth) == expected


def test_boxed_math_works_outside_the_main_thread():
    # math-verify's signal-based timeouts raise ValueError in a worker thread unless switched off.
    results = []
    worker = threading.Thread(target=lambda: results.append(boxed_math("q", r"\boxed{\frac{1}{2}}", "0.5")))
    worker.start()
    worker.join()
    assert results == [1.0]


def test_boxed_math_without_math_verify_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` raise ImportError
    with pytest.raises(RewardError, match="pip install math-verify"):
        boxed_math("q", r"\boxed{1}", "1")


def test_format_reward_default_and_custom_pattern():
    assert format_reward("q", "Thus\n\\boxed{12}.\n", None) == 1.0
    assert format_reward("q", "Thus 12.", None) == 0.0
    assert format_reward("q", r"\boxed{}", None) == 0.0
    assert format_reward("q", " 42 \n", None, pattern=r"\d+") == 1.0
    assert format_reward("q", "42 apples", None, pattern=r"\d+") == 0.0


def test_builtin_names():
    assert set(BUILTIN_REWARDS) == {"tiny_exact", "gsm8k", "boxed_math", "format"}
    assert resolve_reward_fn("format") is format_reward


def test_unknown_builtin_suggests_the_closest_name():
    with pytest.raises(ConfigError, match="Did you mean 'gsm8k'"):
        resolve_reward_fn("gsm8")


USER_FILE = '''
LIMIT = 3

def length_penalty(prompt, response, ground_truth, max_chars=10, **row):
    return -1.0 if len(response) > max_chars else 0.0

def uses_source(prompt, response, ground_truth, data_source):
    return 1.0 if data_source == "openai/gsm8k" else 0.0

def _private(prompt, response, ground_truth, **row):
    return 0.0
'''


@pytest.fixture
def user_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_FILE)
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.chdir(tmp_path)  # names below use paths relative to the working directory
    return tmp_path


def test_custom_function_from_a_relative_file(user_file):
    fn = resolve_reward_fn("my_rewards.py:length_penalty")
    assert fn("p", "short", None) == 0.0 and fn("p", "x" * 11, None) == -1.0


def test_custom_file_errors_name_the_problem(user_file):
    with pytest.raises(ConfigError, match="nope.py not found"):
        resolve_reward_fn("nope.py:f")
    with pytest.raises(ConfigError, match="defines no 'lenght_penalty'.*length_penalty, uses_source") as info:
        resolve_reward_fn("my_rewards.py:lenght_penalty")
    assert "_private" not in str(info.value)
    with pytest.raises(ConfigError, match="LIMIT in my_rewards.py is a int, not a function"):
        resolve_reward_fn("my_rewards.py:LIMIT")
    with pytest.raises(ConfigError, match="importing broken.py failed with ModuleNotFoundError"):
        resolve_reward_fn("broken.py:f")


def test_weighted_total_and_raw_scores_by_name():
    rewards = RuleRewards([("tiny_exact", 1.0, {}), ("gsm8k", 0.5, {"format_score": 0.2}), ("tiny_exact", -2.0, {})])
    totals, raw = rewards.score(["q", "q"], ["12", "#### 13"], [12, 12], [{}, {}])
    assert raw == {"tiny_exact": [1.0, 0.0], "gsm8k": [0.0, 0.2], "tiny_exact_2": [1.0, 0.0]}
    # row 0: 1*1 + 0.5*0 - 2*1 = -1.0; row 1: 0 + 0.5*0.2 - 0 = 0.1
    assert totals == pytest.approx([-1.0, 0.1])


def test_row_fields_and_config_kwargs_reach_the_function(user_file):
    rewards = RuleRewards([("my_rewards.py:length_penalty", 1.0, {"max_chars": 3}),
                           ("my_rewards.py:uses_source", 1.0, {})])
    # "prompt" in the row must not collide with the positional prompt; uses_source has no **row and
    # receives only data_source.
    rows = [{"prompt": "q", "data_source": "openai/gsm8k", "extra_info": {}, "__source__": "train.jsonl row 4"},
            {"prompt": "q", "data_source": "other", "extra_info": {}}]
    totals, raw = rewards.score(["q", "q"], ["abcd", "ab"], [None, None], rows)
    assert raw == {"length_penalty": [-1.0, 0.0], "uses_source": [1.0, 0.0]}
    assert totals == [0.0, 0.0]


def test_misspelt_kwarg_of_a_builtin_is_an_error():
    with pytest.raises(ConfigError, match="unknown kwarg 'formt_score'.*Did you mean 'format_score'"):
        RuleRewards([("gsm8k", 1.0, {"formt_score": 0.1})])


def test_bad_weight_and_bad_signature_are_config_errors(user_file):
    with pytest.raises(ConfigError, match=r"reward.functions\[0\].*weight must be a finite number"):
        RuleRewards([("gsm8k", float("nan"), {})])
    (user_file / "two_args.py").write_text("def f(prompt, response):\n    return 0.0\n")
    with pytest.raises(ConfigError, match=r"fits neither calling convention(.|\n)*phaserl: def fn\(prompt, response, "
                                          r"ground_truth, \*\*row\)(.|\n)*verl: +def compute_score\(data_source"):
        RuleRewards([("two_args.py:f", 1.0, {})])


def _rewards_with(fn, monkeypatch):
    monkeypatch.setitem(BUILTIN_REWARDS, "probe_fn", fn)
    return RuleRewards([("probe_fn", 1.0, {})])


def test_a_raising_function_is_named_with_row_source_and_response(monkeypatch):
    def crashes_on_long(prompt, response, ground_truth, **row):
        return 1.0 / (len(response) < 5)

    rewards = _rewards_with(crashes_on_long, monkeypatch)
    rows = [{}, {"__source__": "data/train.parquet row 17"}]
    with pytest.raises(RewardError) as info:
        rewards.score(["q", "q"], ["ok", "a much longer response"], [1, 1], rows)
    message = str(info.value)
    for part in ("'probe_fn'", "ZeroDivisionError", "row 1 of the batch", "data/train.parquet row 17",
                 "'a much longer response'"):
        assert part in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize("value", [None, "1.0", [1.0], torch.tensor([0.5, 0.5]), 1j])
def test_a_non_number_is_an_error(value, monkeypatch):
    rewards = _rewards_with(lambda prompt, response, ground_truth, **row: value, monkeypatch)
    with pytest.raises(RewardError, match=r"'probe_fn' returned .* on row 0 of the batch.*one number"):
        rewards.score(["q"], ["r"], [1], [{}])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), torch.tensor(float("-inf"))])
def test_nan_or_inf_is_an_error(value, monkeypatch):
    rewards = _rewards_with(lambda prompt, response, ground_truth, **row: value, monkeypatch)
    with pytest.raises(RewardError, match=r"'probe_fn' returned (nan|inf|-inf) on row 0.*must be finite"):
        rewards.score(["q"], ["r"], [1], [{}])


@pytest.mark.parametrize("value,expected", [
    (True, 1.0), (False, 0.0), (2, 2.0), (np.float32(0.25), 0.25), (np.int64(3), 3.0),
    (torch.tensor(0.5), 0.5), (torch.tensor([0.75]), 0.75), (np.array(1.5), 1.5),
])
def test_numbers_of_every_kind_are_accepted(value, expected, monkeypatch):
    rewards = _rewards_with(lambda prompt, response, ground_truth, **row: value, monkeypatch)
    totals, raw = rewards.score(["q"], ["r"], [1], [{}])
    assert raw["probe_fn"] == [expected] and isinstance(totals[0], float) and math.isfinite(totals[0])


def test_smoke_test_calls_each_function_on_an_empty_response(monkeypatch):
    def breaks_on_empty(prompt, response, ground_truth, **row):
        return float(response.split()[-1] == str(ground_truth))

    rewards = _rewards_with(breaks_on_empty, monkeypatch)
    with pytest.raises(RewardError, match="IndexError on row 0 of the batch"):
        rewards.smoke_test("q", 5, {})
    builtins = RuleRewards([(name, 1.0, {}) for name in ("tiny_exact", "gsm8k", "boxed_math", "format")])
    builtins.smoke_test("1+1?", 2, {"data_source": "x"})
