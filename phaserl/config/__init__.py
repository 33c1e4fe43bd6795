"""Typed, validated configuration: the schema (`schema.py`), loading and overrides (`load.py`),
cross-field rules and derived batch arithmetic (`validate.py`), and `--explain` output (`explain.py`)."""
from phaserl.config.explain import explain
from phaserl.config.load import config_from_dict, dump_yaml, load_config, to_dict, to_yaml
from phaserl.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    CriticConfig,
    DataConfig,
    FSDPConfig,
    HybridEngineConfig,
    ModelConfig,
    OptimConfig,
    PPOConfig,
    RefConfig,
    RewardConfig,
    RewardFunctionConfig,
    RewardModelConfig,
    RolloutConfig,
    TrainerConfig,
)
from phaserl.config.validate import Derived, check_context_length, derive, validate

__all__ = [
    "ActorConfig", "AlgorithmConfig", "Config", "CriticConfig", "DataConfig", "FSDPConfig", "HybridEngineConfig",
    "ModelConfig", "OptimConfig", "PPOConfig", "RefConfig", "RewardConfig", "RewardFunctionConfig",
    "RewardModelConfig", "RolloutConfig", "TrainerConfig",
    "load_config", "config_from_dict", "validate", "derive", "Derived", "explain", "check_context_length",
    "to_dict", "to_yaml", "dump_yaml",
]
