"""Ctrl-C and SIGTERM during `fit()`: stop at the next safe point, with a checkpoint, and no traceback.

The first SIGINT or SIGTERM only sets a flag (one line on the console says so). The loop checks it
between steps (`StopSignals.check`): every rank agrees on it through one tiny all-reduce, so all ranks
stop after the same step; the step that was running finishes, a checkpoint of it is saved (unless
`trainer.save_on_signal=false`, or it is saved already), and `RunStopped` is raised. The CLI turns that
into one line and exit code 128 + signal (130 for SIGINT, 143 for SIGTERM). A second signal exits at once
(`os._exit`), without a checkpoint; the atomic saves keep the earlier ones whole. Under torchrun the
launcher forwards the signal to every rank and kills them 30 s later: a step longer than that ends as
if killed (the run resumes from the previous checkpoint).

Not here: what a checkpoint holds (phaserl.checkpoint), the launcher and peer watch (parallel/launch.py).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, Optional

import torch

from ..parallel import is_distributed, training_group

_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


class RunStopped(BaseException):
    """The run stopped on a signal at a safe point.  A BaseException: it is not a failure to report or retry."""

    def __init__(self, signum: int, step: int, checkpoint: Optional[str]):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum
        kept = (f"newest checkpoint {checkpoint}; the same command resumes from it" if checkpoint
                else "no checkpoint yet; the same command starts over")
        super().__init__(f"stopped by {_NAMES.get(signum, signum)} after step {step}; {kept}")


class StopSignals:
    """Context manager: SIGINT/SIGTERM handlers for the duration of fit() (main thread only)."""

    def __init__(self, *, rank: int, save: bool, on_exit_now: Callable[[], None]):
        self.rank, self.save, self.on_exit_now = rank, save, on_exit_now
        self.requested: Optional[int] = None
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in _NAMES:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.requested is None:
            self.requested = signum
            if self.rank == 0:
                again = "Ctrl-C" if signum == signal.SIGINT else "the signal"
                print(f"phaserl: {_NAMES[signum]} received: stopping after the current step"
                      + (" with a checkpoint" if self.save else "") + f" ({again} again stops at once, without one)",
                      file=sys.stderr, flush=True)
            return
        if self.rank == 0:
            print(f"phaserl: {_NAMES[signum]} again: stopping now, without a checkpoint (the earlier ones are intact)",
                  file=sys.stderr, flush=True)
        self.on_exit_now()
        os._exit(128 + signum)

    def agreed(self) -> Optional[int]:
        """The signal any rank received (the same answer on every rank), or None."""
        mine = self.requested or 0
        if is_distributed():
            import torch.distributed as dist

            t = torch.tensor([mine], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=training_group())  # the trainer ranks
            mine = int(t.item())
        return mine or None

    def check(self, trainer) -> None:
        """Between steps: when a signal came, save (if asked and not saved yet) and raise RunStopped."""
        signum = self.agreed()
        if signum is None:
            return
        saved = os.path.basename(trainer.last_checkpoint or "") == f"step_{trainer.step_num}"
        if self.save and not saved and trainer.step_num > 0 and trainer.run.checkpointer is not None:
            trainer.save_checkpoint()
        trainer.run.metrics_logger.close()
        raise RunStopped(signum, trainer.step_num, trainer.last_checkpoint)
