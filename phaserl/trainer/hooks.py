"""User hooks: `trainer.add_hook(event, fn)`; `fn(trainer)` runs at that point of the run.

A hook that raises stops the run with a message naming the hook and the event; work already on disk
(checkpoints, metrics) stays.
"""
from __future__ import annotations

import difflib

from ..errors import PhaserlError

EVENTS = ("on_train_start", "on_step_end", "on_validation_end", "on_save_checkpoint", "on_train_end")


class HookError(PhaserlError, RuntimeError):
    """A user hook raised."""


class HookRunner:
    def __init__(self):
        self._hooks = {event: [] for event in EVENTS}

    def add(self, event: str, fn) -> None:
        if event not in self._hooks:
            hint = difflib.get_close_matches(event, EVENTS, n=1)
            fix = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ValueError(f"unknown hook event {event!r}{fix}; events: {', '.join(EVENTS)}")
        if not callable(fn):
            raise TypeError(f"hook for {event!r} must be callable, got {type(fn).__name__}")
        self._hooks[event].append(fn)

    def fire(self, event: str, trainer) -> None:
        for fn in self._hooks[event]:
            try:
                fn(trainer)
            except Exception as exc:
                name = getattr(fn, "__qualname__", repr(fn))
                raise HookError(f"hook {name} for event {event!r} raised {type(exc).__name__}: {exc} "
                                f"(step {trainer.step}); checkpoints already written are kept") from exc
