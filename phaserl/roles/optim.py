"""Optimizer, learning-rate schedule and the clipped step shared by the trainable roles."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OptimSettings:
    lr: float
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    grad_clip: float = 1.0          # 0 = off
    warmup_steps: int = 0
    lr_schedule: str = "constant"   # constant | cosine
    total_steps: int = 1            # optimizer steps over the whole run (for cosine)


def _lr_factor(step: int, s: OptimSettings) -> float:
    if s.warmup_steps and step < s.warmup_steps:
        return (step + 1) / s.warmup_steps
    if s.lr_schedule == "cosine":
        span = max(s.total_steps - s.warmup_steps, 1)
        progress = min((step - s.warmup_steps) / span, 1.0)
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


class Optimizer:
    """AdamW + LambdaLR + gradient clipping: `step()` returns the pre-clip gradient norm."""

    def __init__(self, params, settings: OptimSettings):
        self.params = [p for p in params if p.requires_grad]
        self.settings = settings
        # One fused kernel per step on plain CUDA tensors (foreach launches several per parameter group);
        # FSDP's DTensors and CPU runs keep the default implementation.
        fused = bool(self.params) and all(p.is_cuda and not hasattr(p, "placements") for p in self.params)
        self.opt = torch.optim.AdamW(self.params, lr=settings.lr, betas=tuple(settings.betas),
                                     weight_decay=settings.weight_decay, fused=fused or None)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda i: _lr_factor(i, settings))
        self._pinned: dict[tuple, torch.Tensor] = {}  # offload_state: (id(param), state key) -> pinned CPU copy

    @property
    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    def step(self) -> float:
        clip = self.settings.grad_clip if self.settings.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        if torch.isfinite(grad_norm):  # a skipped update does not advance the schedule either
            self.opt.step()
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return float(grad_norm)

    def state_dict(self) -> dict:
        return {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])

    def offload_state(self, device) -> None:
        """Move AdamW moments to `device` (CPU while the actor is in rollout mode) and back.

        The moments keep their identity (plain tensors and FSDP's DTensors alike): each one's data is
        copied into a pinned CPU buffer kept for the next switch, then its GPU storage is released
        (resized to 0 bytes); coming back re-grows the storage and copies the data in. Pinned memory
        makes both copies run at PCIe speed without a stall per tensor; the caller synchronizes.
        """
        offload = torch.device(device).type == "cpu"
        for param, st in self.opt.state.items():
            for k, v in st.items():
                if not torch.is_tensor(v) or k == "step":
                    continue
                local = v.to_local() if hasattr(v, "to_local") else v  # a DTensor's shard shares its storage
                if local.device.type == "cpu":  # nothing to move (a CPU run)
                    continue
                storage, key = local.untyped_storage(), (id(param), k)
                if offload and storage.size() > 0:
                    if key not in self._pinned:
                        self._pinned[key] = torch.empty(storage.size(), dtype=torch.uint8, pin_memory=True)
                    self._pinned[key].untyped_storage().copy_(storage, non_blocking=True)
                    storage.resize_(0)  # stream-ordered: the copy above reads it before any reuse
                elif not offload and storage.size() == 0:
                    pinned = self._pinned[key]
                    storage.resize_(pinned.numel())
                    storage.copy_(pinned.untyped_storage(), non_blocking=True)
