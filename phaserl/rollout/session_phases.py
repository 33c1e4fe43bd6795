"""What lets a DecodeSession outlive a rollout phase: phases, pause, loss, and giving slots back.

An asynchronous rollout on an engine kept awake through training (rollout.partial_kv=keep) holds one DecodeSession
across its phases. Each phase runs inside `with session.phase():` (inference mode; the engine's weight copies
refilled from the updated model first). `pause()` ends a phase without losing what decodes: the turns in progress
report their ids so far and keep their slots, KV and decode state, to continue with no prefill next phase.
`lost` says when the engine laid out or freed its slots since (or the weights moved): such a session must not
decode again, and its callers re-prefill from the ids they recorded. `drop()` frees one sequence whatever it is
doing; `close()` all of them.
This is a part of DecodeSession (rollout/session.py: the slots, the steps, the host bookkeeping), kept apart so that
each module reads on its own; it uses that class's state and calls the runner. Nothing here decides when to keep a
session (trainer/stream.py does) or what the engine reuses (RolloutEngine.open_session).
"""
from __future__ import annotations

import heapq
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Hashable, Optional

import torch

from phaserl.rollout.runner import ModelRunner, module_tensors


@dataclass
class Turn:
    """One ended model turn of a sequence (DecodeSession.step, suspend, pause)."""

    key: Hashable
    token_ids: list      # the sampled ids, in order (a stop token included when one ended the turn)
    logprobs: list       # the sampler's log-prob of each id
    stopped: bool        # True: a stop token ended it; False: its cap did
    partial: bool = False  # True: suspend() cut it or pause() paused it (neither a stop token nor its cap ended it)


class PhasedSession:
    """DecodeSession's phases (its base class): the state it reads is DecodeSession's, set by `_begin_phases`."""

    def _begin_phases(self, runner: ModelRunner) -> None:
        self._epoch = runner.epoch               # the runner's layout this session was begun in (runner.begin)
        self._marks = weight_marks(runner)       # where the weights it reads sit: moved = lost
        self._fresh = True                       # begun just now: the first phase needs no weight refill
        self.closed = False
        self.phases = 0                          # phases run (phase() calls)
        self.last_phase: dict = {}               # the last phase's SessionStats counts (what it added)

    @property
    def lost(self) -> Optional[str]:
        """Why this session's slots can no longer be decoded (None: they can). Its sequences' KV and decode state
        are gone or reused once the runner was laid out again or released (a generate() call, another session,
        engine.release / a sleep that frees, a model moved or cast: RolloutEngine._follow_model), or the weights
        its graphs and copies read moved (a checkpoint loaded into new tensors)."""
        if self.closed:
            return "the session was closed"
        if self.runner.epoch != self._epoch:
            return ("the engine laid out or freed its slots since (a generate() call, another session, a release, "
                    "or the model moved)")
        if weight_marks(self.runner) != self._marks:
            return "the model's parameters moved (new tensors, another dtype or device)"
        return None

    @contextmanager
    def phase(self):
        """One rollout phase: the runner's calls run in inference mode, after the engine's weight copies (fused
        projections, merged LoRA) are refilled from the model's parameters, which an update changed in place
        (captured graphs read the same buffers). A lost session raises: its KV must not be read."""
        reason = self.lost
        if reason is not None:
            raise RuntimeError(f"DecodeSession.phase: the session is lost: {reason}; start a new one")
        before = self._counts()
        with torch.inference_mode():
            if not self._fresh:
                self.runner.refresh_weights()
            self._fresh, self._last_decode = False, None  # the gap across training is no decode step's time
            yield self
        self.phases += 1
        self.last_phase = {k: v - before[k] for k, v in self._counts().items()}

    def _counts(self) -> dict:
        return {k: v for k, v in vars(self.stats).items() if k != "extra"}

    def pause(self) -> tuple[list[Turn], list[Turn]]:
        """End a phase without losing what decodes: (turns that had ended, turns in progress so far).

        As in suspend() the device is synchronised once and a sequence whose last step ended its turn comes back as
        an ended Turn (then parked, as after any step). Every other decoding sequence comes back as a `partial` Turn
        with the ids sampled since its last report, and keeps its slot, KV and decode state: the next phase's steps
        continue it where it was, no prefill (the next step feeds its last sampled id; its noise is keyed by sequence
        and position, so its draws are those of an uncut turn), and the Turn that ends it holds the ids after those
        reported here. Queued prefills and extends stay queued. Parked sequences stay."""
        queued = {id(live) for live in self._starts} | {id(item[0]) for item in self._extends}
        running = [live for live in self.by_slot if live is not None and live.decoding and id(live) not in queued]
        ended, paused = [], []
        if running:
            for live, (toks, lps, done) in zip(running, self._outputs([live.slot for live in running], flags=True)):
                new, new_lps = toks[live.reported:], lps[live.reported:]
                if done:
                    ended.append(self._end_turn(live, toks, lps))
                else:
                    live.reported = len(toks)
                    paused.append(Turn(live.key, new, new_lps, stopped=False, partial=True))
                self.stats.new_tokens += len(new)
        self._known = None  # every running slot was read just now
        self.stats.turns += len(ended)
        return ended, paused

    def held(self, key: Hashable) -> int:
        """Ids of the sequence whose KV its slot holds or is computing (a turn in progress: those reported so far):
        what a re-prefill of it would cost."""
        live = self.live[key]
        return live.length + live.reported

    def drop(self, key: Hashable) -> None:
        """Free a sequence's slot whatever it is doing (decoding, queued or parked): for a sample given up between
        phases (restarted for staleness, its group dropped). A decoding slot is stopped on the device."""
        live = self.live.pop(key)
        self._prompts.pop(key, None)
        self._starts = [lv for lv in self._starts if lv is not live]
        extends = [item for item in self._extends if item[0] is not live]
        queued_extend = len(extends) != len(self._extends)
        self._extends = extends
        if live.decoding:  # a queued start is not decoding yet; a queued extend is, and is not on the device yet
            self._decoding -= 1
        if live.decoding and not queued_extend and self.lost is None:
            with torch.inference_mode():
                self.runner.state.finished[live.slot] = True  # its steps write nothing but its trash column now
        live.decoding = False
        self.by_slot[live.slot] = None
        heapq.heappush(self.free, live.slot)

    def close(self) -> None:
        """Give every slot back and mark the session lost (closed). The runner's slots are this session's while it is
        not lost: then every one is stopped on the device, in one write."""
        if self.lost is None and self.runner.state is not None:
            with torch.inference_mode():
                self.runner.state.finished.fill_(True)
        self.live.clear()
        self._prompts.clear()
        self._starts, self._extends, self._known, self._decoding = [], [], None, 0
        self.by_slot = [None] * self.num_slots
        self.free = list(range(self.num_slots))
        self.closed = True


def weight_marks(runner: ModelRunner) -> tuple:
    """Where the weights a session's copies and graphs read sit now: every layer parameter's address, and the output
    head's address, dtype and device. Training changes them in place (the same marks); new tensors do not."""
    out = runner.model.output_weight
    layers = runner.model.model.layers
    return tuple(t.data_ptr() for layer in layers for t in module_tensors(layer)), out.data_ptr(), out.dtype, out.device
