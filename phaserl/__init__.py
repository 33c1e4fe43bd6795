"""phaserl: RL post-training for LLMs (PPO, GRPO, RLOO, REINFORCE++, ReMax) in readable phases.

Public names follow verl's: HybridActor, Critic, ReferencePolicy, RewardModelWrapper, RLTrainer.
"""
from .errors import ConfigError, DataError, PhaserlError, PreflightError, RewardError

__version__ = "0.1.0"

_LAZY = {
    "HybridActor": "phaserl.roles", "Critic": "phaserl.roles", "ReferencePolicy": "phaserl.roles",
    "RewardModelWrapper": "phaserl.roles", "RLTrainer": "phaserl.trainer", "load_config": "phaserl.config",
    "Config": "phaserl.config",
}


def __getattr__(name):
    # Lazy so that `import phaserl` (and the CLI's --help) stays fast.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'phaserl' has no attribute {name!r}")


__all__ = ["HybridActor", "Critic", "ReferencePolicy", "RewardModelWrapper", "RLTrainer", "load_config", "Config",
           "ConfigError", "DataError", "PhaserlError", "PreflightError", "RewardError"]
