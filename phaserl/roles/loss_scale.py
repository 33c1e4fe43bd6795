"""Float16 training: dynamic loss scaling with overflow skipping, and float32 master weights for AdamW.

float16 keeps 10 mantissa bits (bf16: 7), so the rollout engine and the trainer round less apart, but its range is
small: gradients below ~6e-8 vanish and AdamW's second moment (gradient squared) and eps underflow in float16. So
a role whose parameters are float16 (model.dtype = float16) trains like torch.amp's GradScaler with master weights:
  backward   of loss x scale (`LossScaler.scaled`), so small gradients survive in float16;
  step       gradients copied into float32 and divided by the scale; any inf/nan among them (an overflow) skips
             the step (weights, moments and the schedule unchanged) and halves the scale; after GROWTH_INTERVAL
             clean steps in a row the scale doubles;
  AdamW      runs on float32 copies of the weights (its moments float32 too); the float16 weights are the copies
             rounded after each step.
The role reports the scale and the skipped steps (actor/loss_scale, actor/overflow_skipped). A skipped step logs a
grad norm of 0: nothing was applied, and the runtime guard's non-finite check is for real divergence.
Not here: the optimizer and its schedule (optim.py), what dtype the model has (the builder's model.dtype).
"""
from __future__ import annotations

import torch

INIT_SCALE = 2.0 ** 16      # torch.amp.GradScaler's defaults
GROWTH_INTERVAL = 2000
BACKOFF, GROWTH = 0.5, 2.0
MIN_SCALE = 1.0


class LossScaler:
    """The scale and its rule: `overflowed()` halves it, `clean()` counts towards doubling it."""

    def __init__(self, scale: float = INIT_SCALE, growth_interval: int = GROWTH_INTERVAL):
        self.scale, self.growth_interval = float(scale), growth_interval
        self.clean_steps = 0     # clean steps since the last change
        self.skipped = 0         # overflowed steps, over the run

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def overflowed(self) -> None:
        self.scale = max(self.scale * BACKOFF, MIN_SCALE)
        self.clean_steps = 0
        self.skipped += 1

    def clean(self) -> None:
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= GROWTH
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps, self.skipped = state["scale"], state["clean_steps"], state["skipped"]


class Float16Step:
    """AdamW over float32 masters of float16 parameters, with loss scaling. `weights` are AdamW's parameters (the
    masters); `refresh()` remakes them from the float16 weights (after a checkpoint load), as optim._HostStep."""

    def __init__(self, params: list):
        self.params = params
        with torch.no_grad():
            self.weights = [p.detach().float().requires_grad_(True) for p in params]  # [same shapes] float32
        self.scaler = LossScaler()

    def step(self, opt: torch.optim.Optimizer, clip: float) -> tuple[float, bool]:
        """Unscale into the masters' gradients, check, clip, step, round back. Returns (grad norm, skipped)."""
        inv = 1.0 / self.scaler.scale
        for p, w in zip(self.params, self.weights):
            w.grad = None if p.grad is None else p.grad.float().mul_(inv)  # [p's shape] float32
        grads = [w for w in self.weights if w.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(grads, clip) if grads else torch.zeros(())
        if not torch.isfinite(norm):
            self.scaler.overflowed()
            for w in self.weights:
                w.grad = None
            return 0.0, True
        opt.step()
        with torch.no_grad():
            for p, w in zip(self.params, self.weights):
                p.copy_(w)
                w.grad = None
        self.scaler.clean()
        return float(norm), False

    def refresh(self) -> None:
        with torch.no_grad():
            for w, p in zip(self.weights, self.params):
                w.copy_(p.detach())
