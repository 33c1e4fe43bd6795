"""Optimizer, learning-rate schedule and the clipped step shared by the trainable roles.

`Optimizer.offload_step()` (actor.optimizer_offload, the memory plan) moves AdamW to the CPU for good: its moments
and a host copy of each trained weight live there, and each step copies the clipped gradients down, runs AdamW on
the CPU and copies the updated weights back, bucket by bucket so that the copies overlap the CPU's work. The
weights on the device are updated exactly as an on-device AdamW of the same dtype would update them (the same
kernel when the run is on the CPU). Not here: deciding to offload (memory/plan.py), the rollout-mode offload of an
on-device AdamW (`offload_state`, actor.hybrid_engine.offload_optimizer).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .loss_scale import Float16Step

BUCKET_BYTES = 256 * 2**20  # weights per copy-and-step bucket of the offloaded step


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
        # float16 weights: loss scaling, AdamW on float32 masters (loss_scale.py)
        half = bool(self.params) and all(p.dtype == torch.float16 for p in self.params)
        self.half: Optional[Float16Step] = Float16Step(self.params) if half else None
        trained = self.half.weights if half else self.params
        # One fused kernel per step on plain CUDA tensors (foreach launches several per parameter group);
        # FSDP's DTensors and CPU runs keep the default implementation.
        fused = bool(self.params) and all(p.is_cuda and not hasattr(p, "placements") for p in trained)
        self.opt = torch.optim.AdamW(trained, lr=settings.lr, betas=tuple(settings.betas),
                                     weight_decay=settings.weight_decay, fused=fused or None)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda i: _lr_factor(i, settings))
        self._pinned: dict[tuple, torch.Tensor] = {}  # offload_state: (id(param), state key) -> pinned CPU copy
        self.host = self.half  # AdamW's own weights beside the model's (offload_step: on the CPU; float16: masters)

    @property
    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    @property
    def offloaded(self) -> bool:
        """AdamW steps its own copies of the weights (on the CPU, or float32 masters of float16 ones)."""
        return self.host is not None

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: times the loss scale for float16 weights, else itself."""
        return loss if self.half is None else self.half.scaler.scaled(loss)

    def scale_stats(self, prefix: str) -> dict:
        """float16 weights: {prefix/loss_scale, prefix/overflow_skipped (steps skipped over the run)}; else {}."""
        if self.half is None:
            return {}
        s = self.half.scaler
        return {f"{prefix}/loss_scale": s.scale, f"{prefix}/overflow_skipped": float(s.skipped)}

    def offload_step(self) -> None:
        """From now on AdamW's state and step live on the CPU (see the module docstring). Called before the first
        step (the builder does); the schedule and its settings carry over."""
        if self.opt.state:
            raise RuntimeError("Optimizer.offload_step() must come before the first step")
        if self.half is not None:
            from ..errors import ConfigError

            raise ConfigError("actor.optimizer_offload = true with model.dtype = float16 is not supported: the "
                              "float16 step keeps float32 master weights on the device; use bfloat16, or "
                              "actor.optimizer_offload = false")
        if self.host is None and self.params:
            self.host = _HostStep(self.params)
            s = self.settings
            # CUDA weights: torch's fused CPU AdamW (one pass, float32 math like the fused CUDA kernel); a CPU run
            # keeps the kernel its on-device optimizer runs, so the two give the same weights
            gpu = self.host.device.type == "cuda"
            self.opt = torch.optim.AdamW(self.host.weights, lr=s.lr, betas=tuple(s.betas), weight_decay=s.weight_decay,
                                         fused=True if gpu else None, foreach=None if gpu else False)
            self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda i: _lr_factor(i, s))

    def step(self) -> float:
        clip = self.settings.grad_clip if self.settings.grad_clip > 0 else float("inf")
        if self.half is not None:  # float16: unscale, skip an overflowed step (loss_scale.py)
            norm, skipped = self.half.step(self.opt, clip)
            if not skipped:
                self.sched.step()
            for p in self.params:
                p.grad = None
            return norm
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        if torch.isfinite(grad_norm):  # a skipped update does not advance the schedule either
            if self.host is not None:
                self.host.step(self.opt)
            else:
                self.opt.step()
            self.sched.step()
        for p in self.params:
            p.grad = None
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


class _HostStep:
    """AdamW on the CPU for weights that live on a device: a host copy of each weight (pinned on CUDA), the
    gradients copied down into pinned buffers, the step, and the updated weights copied back, per bucket of about
    BUCKET_BYTES: the gradients of later buckets cross while the CPU steps earlier ones, and each updated bucket
    crosses back while the CPU steps the next."""

    def __init__(self, params: list):
        self.params = params
        self.device = params[0].device
        pin = self.device.type == "cuda"
        self.weights = [self._host_like(p, pin).requires_grad_(True) for p in params]  # AdamW's parameters
        self.refresh()
        self.grads = [self._host_like(p, pin) for p in params]  # each weight's .grad during its bucket's step
        self.stream = torch.cuda.Stream(self.device) if pin else None
        self.buckets, size = [[]], 0
        for i, p in enumerate(params):
            if self.buckets[-1] and size + p.numel() * p.element_size() > BUCKET_BYTES:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += p.numel() * p.element_size()

    @staticmethod
    def _host_like(p: torch.Tensor, pin: bool) -> torch.Tensor:
        return torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)

    @torch.no_grad()
    def step(self, opt: torch.optim.Optimizer) -> None:
        """One AdamW step of `opt` (over self.weights) from the device gradients; the device weights updated."""
        if self.stream is None:
            return self._step_here(opt)
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the backward's gradients (and the clip's scaling) are written
        arrived = []
        with torch.cuda.stream(self.stream):
            for bucket in self.buckets:
                for i in bucket:
                    grad = self.params[i].grad
                    grad.record_stream(self.stream)  # dropped after the step while its copy may still run
                    self.grads[i].copy_(grad, non_blocking=True)
                arrived.append(self.stream.record_event())
            for bucket, event in zip(self.buckets, arrived):
                event.synchronize()  # this bucket's gradients are on the host
                self._step_bucket(opt, bucket)
                for i in bucket:
                    self.params[i].data.copy_(self.weights[i].detach(), non_blocking=True)
        compute.wait_stream(self.stream)  # the next forward reads the updated weights

    @torch.no_grad()
    def _step_here(self, opt: torch.optim.Optimizer) -> None:
        for bucket in self.buckets:
            for i in bucket:
                self.grads[i].copy_(self.params[i].grad)
            self._step_bucket(opt, bucket)
            for i in bucket:
                self.params[i].data.copy_(self.weights[i].detach())

    def _step_bucket(self, opt: torch.optim.Optimizer, bucket: list) -> None:
        """AdamW on this bucket's weights only: the others have no gradient, which AdamW skips."""
        for i in bucket:
            self.weights[i].grad = self.grads[i]
        opt.step()
        for i in bucket:
            self.weights[i].grad = None

    def refresh(self) -> None:
        """The host copies from the device weights (after a checkpoint filled the device weights)."""
        with torch.no_grad():
            for w, p in zip(self.weights, self.params):
                w.copy_(p.detach())
