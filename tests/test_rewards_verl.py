"""verl's reward signature is called by name; a reward function that hangs is stopped by reward.timeout_s.

Bug: `compute_score(data_source, solution_str, ground_truth, extra_info=None)` was called
positionally, so `data_source` received the prompt; with **kwargs it failed with "got multiple values
for argument 'data_source'". A function that never returned blocked the run.
"""
import time

import pytest

from phaserl.errors import ConfigError, RewardError
from phaserl.rewards import RuleRewards

VERL_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Branches on data_source, as verl's default_compute_score does."""
    if data_source == "openai/gsm8k":
        return float(solution_str.strip().endswith(ground_truth))
    if data_source == "lighteval/MATH":
        return {"score": 0.5, "acc": True}          # verl allows a dict with "score"
    return -1.0 if extra_info is None else float(extra_info["index"])


def with_kwargs(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(len(kwargs)) + (10.0 if data_source == "openai/gsm8k" else 0.0)


def needs_more(data_source, solution_str, ground_truth, tokenizer):
    return 0.0


def hangs(prompt, response, ground_truth, **row):
    import time
    time.sleep(30)
    return 0.0
'''


@pytest.fixture
def funcs(tmp_path, monkeypatch):
    (tmp_path / "verl_rewards.py").write_text(VERL_FILE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _rows(*sources):
    return [{"data_source": s, "extra_info": {"index": i}, "reward_model": {"ground_truth": "4"}}
            for i, s in enumerate(sources)]


def test_verl_compute_score_is_called_by_name_with_data_source_and_extra_info(funcs):
    rules = RuleRewards([("verl_rewards.py:compute_score", 1.0, {})])
    prompts = [[{"role": "user", "content": "2+2"}]] * 3
    totals, _ = rules.score(prompts, ["so 4", "x", "y"], ["4", "4", "4"],
                            _rows("openai/gsm8k", "lighteval/MATH", "other"))
    assert totals == [1.0, 0.5, 2.0]   # gsm8k branch, the dict's score, extra_info["index"] of row 2


def test_verl_signature_with_kwargs_gets_no_duplicate_arguments(funcs):
    rules = RuleRewards([("verl_rewards.py:with_kwargs", 1.0, {"scale": 2})])
    totals, _ = rules.score(["p"], ["r"], ["4"], _rows("openai/gsm8k"))
    assert totals == [11.0]            # one config kwarg, the gsm8k branch taken


def test_a_verl_function_needing_more_arguments_shows_both_signatures(funcs):
    with pytest.raises(ConfigError, match=r"requires \['tokenizer'\](.|\n)*phaserl: def fn\(prompt, response, "
                                          r"ground_truth, \*\*row\)(.|\n)*verl: +def compute_score"):
        RuleRewards([("verl_rewards.py:needs_more", 1.0, {})])


def test_a_reward_function_that_hangs_stops_with_its_name_and_row(funcs):
    rules = RuleRewards([("verl_rewards.py:hangs", 1.0, {})], timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"'verl_rewards.py:hangs' did not return within 0.3 s on row 0 of the batch"
                                          r".*raise reward.timeout_s"):
        rules.score(["p"], ["r"], ["4"], _rows("x"))
    assert time.monotonic() - t0 < 5
    # the next call gets a fresh worker: a fast function still works after a timeout
    rules.rewards[0].fn = lambda prompt, response, ground_truth, **row: 1.0
    assert rules.score(["p"], ["r"], ["4"], _rows("x"))[0] == [1.0]
