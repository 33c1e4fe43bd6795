"""Runtime guards checked every step: non-finite advantages, losses and gradients, and rewards stuck at
one value. What to do about a non-finite value (`trainer.on_nonfinite`: stop or skip) is decided
here, and agreed by every rank, so that all ranks skip or stop together."""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch

from ..errors import PreflightError
from ..parallel import all_reduce_sum

log = logging.getLogger("phaserl")


class RuntimeGuard:
    def __init__(self, on_nonfinite: str = "stop", constant_reward_steps: int = 5):
        self.on_nonfinite = on_nonfinite
        self.constant_reward_steps = constant_reward_steps
        self._constant_run = 0

    def check_update(self, stats: dict, step: int) -> None:
        bad = {k: v for k, v in stats.items() if k.endswith(("loss", "grad_norm")) and not math.isfinite(v)}
        if not bad:
            return
        what = ", ".join(f"{k}={v}" for k, v in bad.items())
        cause = ("a non-finite loss usually comes from non-finite advantages or rewards (reward-model input "
                 "format, see `phaserl doctor`), or a learning rate too high for this model (lower actor.optim.lr)")
        if self.on_nonfinite == "skip":
            log.warning(f"step {step + 1}: {what}; the optimizer step was skipped (trainer.on_nonfinite=skip). {cause}")
            return
        raise PreflightError(f"step {step + 1}: {what}. {cause}. Set trainer.on_nonfinite=skip to skip such steps.")

    def advantages_ok(self, cause: Optional[str], step: int) -> bool:
        """`cause` from advantage_phase.nonfinite_advantage_cause (this rank's): True to update; else stop
        (raise) or skip the update (False). A collective: a cause on any rank stops or skips every rank."""
        ranks_with_cause = float(all_reduce_sum(torch.tensor(float(cause is not None))))
        if cause is None and ranks_with_cause > 0:
            cause = "non-finite advantages on another rank"
        if cause is None:
            return True
        if self.on_nonfinite == "skip":
            log.warning(f"step {step + 1}: {cause}; the update was skipped (trainer.on_nonfinite=skip)")
            return False
        raise PreflightError(f"step {step + 1}: {cause}. Set trainer.on_nonfinite=skip to skip such steps.")

    def check_rewards(self, scores, step: int) -> None:
        if float(scores.max() - scores.min()) > 1e-6:
            self._constant_run = 0
            return
        self._constant_run += 1
        if self._constant_run == self.constant_reward_steps:
            log.warning(
                f"step {step + 1}: every response of the last {self._constant_run} steps got the same reward "
                f"({float(scores[0]):.4g}); group advantages are all zero and nothing is learned. Check the reward "
                "function / reward-model input format (`phaserl doctor CONFIG`) or the task difficulty.")
