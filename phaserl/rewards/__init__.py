"""Rule rewards: built-in functions, loading your own from a file, and their weighted sum.

`RuleRewards([(name, weight, kwargs), ...]).score(prompts, responses, ground_truths, rows)` is what the
trainer's score phase calls; the reward model lives in `phaserl.roles.reward_model`.
"""
from phaserl.rewards.registry import RuleRewards, WeightedReward, resolve_reward_fn
from phaserl.rewards.rules import BUILTIN_REWARDS, boxed_math, format_reward, gsm8k, last_boxed, tiny_exact

__all__ = ["BUILTIN_REWARDS", "RuleRewards", "WeightedReward", "resolve_reward_fn",
           "boxed_math", "format_reward", "gsm8k", "last_boxed", "tiny_exact"]
