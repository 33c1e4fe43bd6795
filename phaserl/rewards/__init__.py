"""Rule rewards: built-in functions, loading your own from a file, and their weighted sum.

`RuleRewards([(name, weight, kwargs), ...]).score(prompts, responses, ground_truths, rows)` scores with
rule functions; `RewardSources` (sources.py) adds a reward model's scores, weighted, and is what the
trainer's score phase calls. The reward model itself lives in `phaserl.roles.reward_model`.
"""
from phaserl.rewards.registry import RuleRewards, WeightedReward, resolve_reward_fn
from phaserl.rewards.rules import BUILTIN_REWARDS, boxed_math, format_reward, gsm8k, last_boxed, tiny_exact
from phaserl.rewards.sources import RewardSources

__all__ = ["BUILTIN_REWARDS", "RewardSources", "RuleRewards", "WeightedReward", "resolve_reward_fn",
           "boxed_math", "format_reward", "gsm8k", "last_boxed", "tiny_exact"]
