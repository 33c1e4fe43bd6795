"""The RL controller: `RLTrainer` and the builder that turns a Config into roles and settings."""
from .core import RLTrainer

__all__ = ["RLTrainer"]
