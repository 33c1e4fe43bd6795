"""Rule rewards: built-in functions, loading your own from a file, and their weighted sum.

`RuleRewards([(name, weight, kwargs), ...]).score(prompts, responses, ground_truths, rows)` scores with
rule functions, in the main process or in a pool of worker processes (`workers=`, pool.py); `RewardSources`
(sources.py) adds a reward model's scores, weighted, and is what the trainer's score phase calls. The reward
model itself lives in `phaserl.roles.reward_model`. Names load on first use, so that a reward worker process
(worker.py) imports neither torch nor the batch types.
"""
import importlib

_LAZY = {
    "RuleRewards": "registry", "RuleScoring": "registry", "WeightedReward": "registry", "resolve_reward_fn": "registry",
    "BUILTIN_REWARDS": "rules", "boxed_math": "rules", "format_reward": "rules", "gsm8k": "rules",
    "last_boxed": "rules", "tiny_exact": "rules", "RewardSources": "sources", "PendingScores": "sources",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"phaserl.rewards.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'phaserl.rewards' has no attribute {name!r}")


__all__ = sorted(_LAZY)
