"""Per-role parallel settings (classic mistake 1: one FSDP config for every role).

Each role owns an `FSDPSettings`; only the actor owns `HybridSettings`. The settings accept the
verl-style plain dicts (`fsdp_config=dict(sharding_strategy="FULL_SHARD")`) or config dataclasses, and
reject unknown keys by name. Applying them to a device mesh lives in `phaserl.parallel`.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import ConfigError

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
_ONLY_ACTOR = "Only HybridActor switches between rollout and training mode;"


def _from_any(cls, value, what: str):
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if not isinstance(value, dict):
        raise ConfigError(f"{what} must be a dict or {cls.__name__}, got {type(value).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    for key in value:
        if key not in names:
            hint = difflib.get_close_matches(key, names, n=1)
            fix = f"; did you mean {hint[0]!r}?" if hint else f"; valid keys: {', '.join(names)}"
            raise ConfigError(f"{what}: unknown key {key!r}{fix}")
    return cls(**value)


@dataclass(frozen=True)
class FSDPSettings:
    sharding_strategy: str = "FULL_SHARD"
    cpu_offload: bool = False
    param_dtype: Optional[str] = None
    reshard_after_forward: bool = True

    def __post_init__(self):
        if self.sharding_strategy not in SHARDING_STRATEGIES:
            raise ConfigError(f"fsdp sharding_strategy={self.sharding_strategy!r}: expected one of "
                              f"{', '.join(SHARDING_STRATEGIES)}")

    @classmethod
    def from_any(cls, value, *, role: str) -> "FSDPSettings":
        if isinstance(value, dict):
            _reject_hybrid_keys(role, value)
        return _from_any(cls, value, f"{role} fsdp_config")


@dataclass(frozen=True)
class HybridSettings:
    enable_rollout_optimization_switch: bool = True
    offload_optimizer: bool = False

    @classmethod
    def from_any(cls, value) -> "HybridSettings":
        return _from_any(cls, value, "actor hybrid_engine_config")


def _reject_hybrid_keys(role: str, fsdp_config: dict) -> None:
    """Classic mistake 1 written as one dict: mode-switch keys inside a role's fsdp_config."""
    mixed = [key for key in fsdp_config if key in {f.name for f in dataclasses.fields(HybridSettings)}]
    if not mixed:
        return
    if role == "actor":
        raise ConfigError(f"actor fsdp_config has hybrid-engine key(s) {', '.join(mixed)}: pass them separately, "
                          f"HybridActor(model, fsdp_config=..., hybrid_engine_config=dict({mixed[0]}=...))")
    name = {"critic": "Critic", "ref": "ReferencePolicy"}.get(role, role)
    raise ConfigError(f"{name}: fsdp_config has the actor's hybrid-engine key(s) {', '.join(mixed)}. {_ONLY_ACTOR} "
                      f"a {name} given the actor's config would be resharded with the actor (the classic OOM / "
                      f"all_reduce failure). Give the {name} its own fsdp_config, e.g. "
                      f"dict(sharding_strategy=\"FULL_SHARD\"), without {mixed[0]}.")


def reject_hybrid_config(role: str, hybrid_engine_config) -> None:
    """Only the actor switches between rollout and training (classic mistake 1)."""
    if hybrid_engine_config:
        raise ConfigError(
            f"{role}: hybrid_engine_config={hybrid_engine_config!r} is not allowed. {_ONLY_ACTOR} a {role} that "
            f"joined the switch would be resharded with the actor (the classic OOM / all_reduce failure). Remove "
            f"hybrid_engine_config from the {role}.")


def device_memory_gb(device: torch.device) -> Optional[float]:
    """Allocated accelerator memory in GB, or None on the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_allocated(device) / 2**30
