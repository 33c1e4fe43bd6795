"""LoRA in the builder: `actor.lora` / `critic.lora` -> adapters on the built models, and the reference for free.

`add_lora(cfg, model, role, base_path)` puts the configured adapters on a freshly loaded model (nothing when
rank is 0); `lora_reference(cfg, actor)` is the reference of a LoRA actor whose reference starts
from the actor's own directory: the actor's model with its adapters off (`ReferencePolicy.base_of`), so no
second copy is loaded; None otherwise (the builder then loads one); the doctor asks the same question
(`resolve.reference_is_lora_base`). Not here: the adapters themselves (models/lora.py).
"""
from __future__ import annotations

import logging
from typing import Optional

from ..config import Config
from ..models.lora import LoRASettings, apply_lora, resolve_targets, trainable_summary
from ..parallel import rank_and_world
from ..resolve import reference_is_lora_base
from ..roles import HybridActor, ReferencePolicy

log = logging.getLogger("phaserl")


def lora_settings(c, key: str = "lora") -> LoRASettings:
    """actor.lora / critic.lora -> LoRASettings (target names resolved: short names, all-linear); `key` names the
    section in errors."""
    return LoRASettings(rank=c.rank, alpha=c.alpha, dropout=c.dropout,
                        target_modules=resolve_targets(c.target_modules, key=f"{key}.target_modules"))


def add_lora(cfg: Config, model, role: str, base_path: str) -> None:
    """Adapters from `{role}.lora` on `model` (the critic's value head `score` keeps training); rank 0: nothing."""
    c = getattr(cfg, role).lora
    if not c.rank:
        return
    keep = ("score",) if role == "critic" else ("visual",) if cfg.model.vision_trainable and hasattr(model, "visual") \
        else ()  # the critic's value head; a vision-language actor's tower when model.vision_trainable
    apply_lora(model, lora_settings(c, f"{role}.lora"), trainable=keep,
               base_path=base_path, key=f"{role}.lora")
    if rank_and_world()[0] == 0:
        s = model.lora_settings
        log.info(f"[HybridEngine] {role}: LoRA r={s.rank} alpha={s.alpha:g} on {','.join(s.target_modules)}, "
                 f"{trainable_summary(model)}")


def lora_reference(cfg: Config, actor: HybridActor) -> Optional[ReferencePolicy]:
    """The actor's base with adapters off as the reference, when that is what the config asks for; else None."""
    if not reference_is_lora_base(cfg):
        return None
    if rank_and_world()[0] == 0:
        log.info("[HybridEngine] reference = the actor's base weights with LoRA adapters off (no second copy)")
    return ReferencePolicy.base_of(actor.model, actor.fsdp)
