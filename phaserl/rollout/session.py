"""DecodeSession: sequences that live across turns in one engine layout (multi-turn episodes).

A sequence starts from its prompt ids, decodes one turn (until a stop token or the turn's cap), then
is *parked*: its slot and KV stay where they are while the caller (an episode runner) asks its
environment what happens next. `extend(key, ids, cap)` appends the observation's ids at the slot's
next positions, prefills only those (attending the kept KV: no re-prefill of the conversation so
far) and starts the next turn from them; `release(key)` frees the slot for a new sequence. Every
`step()` runs the queued prefills, one decode step over the occupied slots and returns the turns that
ended. Like `RolloutEngine.generate`, the host runs one step ahead: it reads the finished flags of
the previous step after launching the next one. A decode step covers the slots up to the last decoding
one only; when that makes the steps meaningfully smaller, resumed sequences move down into slots that are not
decoding (exchanging KV with the parked sequence or free slot there: `_pack` states the rule), so that while some
sequences wait for their environment the others decode in a smaller step; otherwise a sequence resumes in its own slot.
A vision-language model's sequences may carry images (data.images.ImageInputs): a start's for its prompt ids, an
extend's for the ids it appends. Their features replace the image tokens there and their M-RoPE positions continue
the slot's (rollout/images.py); the image-token count is checked against the images', a mismatch a ValueError.

Sampling noise is keyed per sequence (start's noise_key) and position, and moves with the sequence's slot
(runner.swap_slots): a sequence samples the same tokens whatever slot it takes, whatever decodes beside it and
in whatever order the sequences resume (exactly so where the logits do not depend on the batch: the CPU).
A session may outlive a rollout phase (RolloutEngine.open_session, on an engine kept awake across training): at a
phase's end `pause()` reports what the turns in progress sampled so far and leaves them decoding in their slots
(KV and decode state kept), parked sequences stay parked, and the next `with session.phase():` refills the engine's
weight copies from the updated model and continues them with no prefill. The session is *lost* (`lost` names why)
once anything lays out or frees the engine's slots in between (a generate() call, another session, release, the
model's parameters moved); a lost session must not decode again: its callers re-prefill from the ids they recorded.
Those phase methods live in session_phases.py (PhasedSession, this class's base).
Made by `RolloutEngine.session(...)` / `open_session(...)`. Host-side bookkeeping plus calls into the runner; no
threads, no environments, no tokenizer (phaserl.agents drives it).
"""
from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Optional

import torch

from phaserl.errors import DataError
from phaserl.rollout.images import vision_prefills
from phaserl.rollout.kv_pool import slot_index
from phaserl.rollout.runner import ModelRunner
from phaserl.rollout.session_phases import PhasedSession, Turn

FIRST_GATHER_S = 0.01  # before the first step: resets answering within this of the first one prefill together
PACK_SHRINK = 0.25  # resumed sequences move down only when the decode step loses at least this share of its rows


@dataclass(eq=False)
class _Live:
    key: Hashable
    slot: int
    length: int = 0          # ids held by the slot's sequence (the last sampled one not yet fed)
    last_token: int = -1
    turn: int = 0            # turns started so far
    since: int = 0           # the decode step its turn began at: finished flags of earlier steps are not this turn's
    decoding: bool = False
    cap: int = 0
    noise_key: int = 0       # its draws' noise is keyed by (the session's seed, this, the position)
    reported: int = 0        # ids of the turn in progress already handed out by pause()


@dataclass
class SessionStats:
    steps: int = 0
    turns: int = 0
    new_tokens: int = 0
    prefill_tokens: int = 0      # prompt ids prefilled (shared prompts counted once)
    extend_tokens: int = 0       # observation ids appended to kept KV
    busy_slot_steps: int = 0     # sum over decode steps of slots decoding (the rest were parked or free)
    stepped_rows: int = 0        # sum over decode steps of the rows the step ran (its bucket): what the steps cost
    swaps: int = 0               # sequences moved down into a free or parked slot (DecodeSession._pack, _compact)
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


class DecodeSession(PhasedSession):
    def __init__(self, runner: ModelRunner, *, num_slots: int, slot_len: int, max_turn_tokens: int,
                 stop_ids: list[int], vocab_size: int):
        self.runner, self.num_slots, self.slot_len = runner, num_slots, slot_len
        self.max_turn_tokens, self.stop_ids, self.vocab_size = max_turn_tokens, set(stop_ids), vocab_size
        self.live: dict = {}                     # key -> _Live
        self.by_slot: list = [None] * num_slots  # slot -> its _Live or None
        self.free = list(range(num_slots))      # a heap: the lowest free slot comes out first
        self._starts: list[_Live] = []           # queued prefills: (live), prompt ids in _prompts
        self._prompts: dict = {}                 # key -> (prompt ids, its ImageInputs or None)
        self._extends: list = []                 # queued (live, ids, start, cap, ImageInputs or None)
        self._known = None                       # the previous step's snapshot
        self._pinned: list = []                  # CUDA: two host buffers for the finished flags, alternating
        self._side = None                        # CUDA: the stream that gathers ended turns beside the next step
        self._decoding = 0                       # sequences decoding a turn (kept as they change: read every step)
        self._last_decode = None                 # host clock at the last decode launch
        self._gaps: deque = deque(maxlen=16)     # wall between the recent decode launches
        self._started = 0                        # sequences started so far (the default noise keys)
        self._pass_seconds = 0.0                 # host wall of the last prefill or extend call (eager: its launches)
        self.stats = SessionStats()
        self._t0 = time.perf_counter()
        self._begin_phases(runner)               # a session may outlive a phase (session_phases.py)

    # ----- what the caller asks -------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self.free)

    @property
    def decoding(self) -> int:
        return self._decoding

    @property
    def idle(self) -> bool:
        """Nothing queued or decoding: step() would return no turn."""
        return not (self._starts or self._extends or self.decoding)

    @property
    def step_seconds(self) -> float:
        """A decode step's wall time, as the host sees it: launches run one step ahead, so their spacing is
        the step's time; the least of the recent gaps (a gap that waited for something else is only longer)."""
        return min(self._gaps, default=0.0)

    @property
    def gather_seconds(self) -> float:
        """How long a caller may hold sequences that could resume, to resume more of them together: what a
        separate resumption would cost, one decode step or one more prefill/extend call (whichever is more; an
        eager extend pass is tens of ms of launches on a GPU host, during which nothing else decodes: H200,
        0.5B, 2026-12-03: 37-42 ms of wall for 2.8k-8.4k tokens alike).
        The last prefill call stands in for an extend pass before the first one; FIRST_GATHER_S before any step."""
        if not self._gaps:
            return FIRST_GATHER_S
        return max(self.step_seconds, self._pass_seconds)

    def room(self, key: Hashable) -> int:
        """Positions left in the sequence's slot (for appended ids plus the next turn)."""
        return self.slot_len - self.live[key].length

    def length(self, key: Hashable) -> int:
        return self.live[key].length

    def start(self, key: Hashable, prompt_ids: list[int], cap: int, noise_key: Optional[int] = None,
              images=None) -> None:
        """Take a free slot for a new sequence; its prompt is prefilled at the next step().

        noise_key: an integer that names the sequence for its sampling noise: every token it samples is a
        function of (the session's seed, noise_key, its position, the logits) alone, whatever slot it sits in,
        which sequences decode beside it and when it resumes. None: `key` when it is an int, else the count of
        sequences started before it in this session (then reproducible only for the same order of starts).
        images: the ImageInputs of the prompt's image tokens (a vision-language model), else None."""
        if key in self.live:
            raise KeyError(f"sequence {key!r} is already in the session")
        if not self.free:
            raise RuntimeError("DecodeSession.start: no free slot (check free_slots first)")
        self._check_ids(prompt_ids, key)
        if not 1 <= cap <= self.max_turn_tokens or len(prompt_ids) + cap > self.slot_len:
            raise DataError(f"sequence {key!r}: {len(prompt_ids)} prompt ids + a turn of {cap} do not fit a slot of "
                            f"{self.slot_len} (turn cap at most {self.max_turn_tokens})")
        if noise_key is None:
            noise_key = key if isinstance(key, int) else self._started
        if not isinstance(noise_key, int) or isinstance(noise_key, bool):
            raise TypeError(f"sequence {key!r}: noise_key={noise_key!r} must be an int")
        self._started += 1
        live = _Live(key, heapq.heappop(self.free), length=len(prompt_ids), cap=cap,
                     noise_key=(noise_key + 2**63) % 2**64 - 2**63)  # the int64 with the same low 64 bits
        self.live[key] = live
        self.by_slot[live.slot] = live
        self._starts.append(live)
        self._prompts[key] = (tuple(prompt_ids), images)  # equal ids with other images are another prompt

    def extend(self, key: Hashable, ids: list[int], cap: int, images=None) -> None:
        """Append `ids` to a parked sequence (its KV kept) and start its next turn of at most `cap` ids. images: the
        ImageInputs of the image tokens among `ids` (a vision-language model), else None."""
        live = self.live[key]
        if live.decoding or live.last_token < 0:
            raise RuntimeError(f"sequence {key!r} is not parked (still decoding, or not yet started)")
        self._check_ids(ids, key)
        if cap < 1 or cap > self.max_turn_tokens or len(ids) + cap > self.room(key):
            raise DataError(f"sequence {key!r}: {len(ids)} appended ids + a turn of {cap} exceed the {self.room(key)} "
                            f"positions left in its slot")
        # The last sampled id has no KV yet (a stopped slot is never fed): it is prefilled with the new ids.
        self._extends.append((live, [live.last_token, *ids], live.length - 1, cap, images))
        live.length += len(ids)
        live.cap, live.turn, live.decoding = cap, live.turn + 1, True
        self._decoding += 1
        self.stats.extend_tokens += len(ids)

    def routes(self, key: Hashable) -> Optional[torch.Tensor]:
        """The experts every MoE layer chose at each position the parked sequence's slot holds, for routing replay
        (the engine's record_routes): [length, L, k] int16, -1 at the last sampled id (never fed, as
        RolloutEngine.generate's routes). None when the engine records none. Read it before release()."""
        routes = self.runner.routes
        if routes is None:
            return None
        live = self.live[key]
        if live.decoding:
            raise RuntimeError(f"sequence {key!r} is still decoding; read its routes once its turn has ended")
        row = routes[live.slot, :live.length].clone()  # [length, L, k]
        row[live.length - 1] = -1
        return row

    def release(self, key: Hashable) -> None:
        """Free a parked sequence's slot."""
        live = self.live.pop(key)
        if live.decoding:
            raise RuntimeError(f"sequence {key!r} is still decoding; release it once its turn has ended")
        self.by_slot[live.slot] = None
        heapq.heappush(self.free, live.slot)

    def suspend(self) -> tuple[list[Turn], list[Turn]]:
        """Stop every turn in progress and free its slot: (turns that had ended, turns cut short).

        For an asynchronous rollout that must hand a batch to training now: the device is synchronised once, a
        sequence whose last step ended its turn comes back as an ended Turn, every other decoding (or queued)
        one as a `partial` Turn with the ids sampled so far (possibly none). Either way its slot is released:
        the caller continues a cut turn later by start()-ing the sequence again with those ids appended (its
        KV re-prefilled, under whatever weights the model has then). Parked sequences stay."""
        queued = {id(live) for live in self._starts} | {id(item[0]) for item in self._extends}
        running = [live for live in self.by_slot if live is not None and live.decoding and id(live) not in queued]
        ended, cut = [], []
        if running:
            for live, (toks, lps, done) in zip(running, self._outputs([live.slot for live in running], flags=True)):
                stopped = bool(toks) and toks[-1] in self.stop_ids
                toks, lps = toks[live.reported:], lps[live.reported:]  # after a pause(): the ids not yet handed out
                turn = Turn(live.key, toks, lps, stopped=stopped, partial=not done)
                (ended if done else cut).append(turn)
        cut += [Turn(live.key, [], [], stopped=False, partial=True)
                for live in [*self._starts, *(item[0] for item in self._extends)]]
        for live in [*running, *self._starts, *(item[0] for item in self._extends)]:
            self._prompts.pop(live.key, None)
            live.decoding = False
            self.live.pop(live.key)
            self.by_slot[live.slot] = None
            self.free.append(live.slot)
        heapq.heapify(self.free)
        self._starts, self._extends, self._known, self._decoding = [], [], None, 0
        self.stats.turns += len(ended)
        self.stats.new_tokens += sum(len(t.token_ids) for t in ended) + sum(len(t.token_ids) for t in cut)
        return ended, cut

    # ----- one step -------------------------------------------------------------------------------
    def step(self) -> list[Turn]:
        """Queued prefills, one decode step, and the turns the previous step ended."""
        self._prefill()
        latest = None
        if self.decoding:
            span = self._compact(self._span())
            rows = self.runner.bucket_for(span)
            self.runner.decode(rows)
            self.stats.stepped_rows += rows
            now = time.perf_counter()
            if self._last_decode is not None:
                self._gaps.append(now - self._last_decode)
            self._last_decode = now
            self.stats.steps += 1
            self.stats.busy_slot_steps += self.decoding
            latest = self._snapshot(span)
        ended = self._retire(self._known) if self._known is not None else []
        self._known = latest
        self.stats.seconds = time.perf_counter() - self._t0
        return ended

    def _prefill(self) -> None:
        if self._starts:
            groups: dict = {}
            for live in self._starts:
                groups.setdefault(self._prompts.pop(live.key), []).append(live)
                live.turn, live.decoding, live.since = 1, True, self.stats.steps + 1
            self._decoding += len(self._starts)
            t0 = time.perf_counter()
            prompts = [(prompt, images) for prompt, images in groups]
            made = vision_prefills(self.runner.model, [p for p, _ in prompts], [im for _, im in prompts])
            lives = list(groups.values())
            self.runner.vision = {lives[i][0].noise_key: inputs for i, inputs in made.items()}  # images.place_images
            self.runner.prefill([(prompt, [lv.slot for lv in group], [lv.cap for lv in group],
                                  [lv.noise_key for lv in group]) for (prompt, _), group in zip(prompts, lives)])
            self._pass_seconds = time.perf_counter() - t0
            self.stats.prefill_tokens += sum(len(p) for p, _ in prompts)
            self._starts = []
        if self._extends:
            for live, *_ in self._extends:
                live.since = self.stats.steps + 1  # its first decode step is the next one
            self._pack([item[0] for item in self._extends])
            t0 = time.perf_counter()
            self.runner.extend([(live.slot, *item) for live, *item in self._extends])
            self._pass_seconds = time.perf_counter() - t0
            self._extends = []

    def _pack(self, resumed: list) -> None:
        """Move resumed sequences down into free or parked slots, only where that makes every decode step smaller.

        The rule: with the resumed sequences in their own slots the steps run bucket_for(span) rows; packed as low as
        moving resumed ones alone allows (the sequences already decoding stay where they are), bucket_for(max(top + 1,
        n)) rows, `top` the highest slot decoding before, `n` the sequences decoding after. They move only when
        that drops at least PACK_SHRINK (a quarter) of the rows, and then only those at or above the smaller bucket,
        each into the lowest slot below it that is not decoding (a parked sequence there takes the mover's slot:
        the two exchange KV and decode state, runner.swap_slots). Otherwise every sequence resumes in its own slot
        and no KV moves: answers that come in together (a 0 ms tool, lock-step turns) never move anything.

        Why a quarter: a decode step's cost grows with its rows (CPU, the benchmarks' tiny shape, 256 slots of 480:
        7.4 ms at 64 rows, 20 ms at 128, 30 ms at 256; a 0.5B step on a GPU: 2.0 ms at 256 rows, of which attention
        0.6 ms and the GEMMs 1.1 ms scale with the rows), while at most (old - new bucket) sequences move, each
        exchanging one slot of KV (CPU: 0.2 ms a pair, one row of one step; 0.5B, 480 positions: ~24 MB read and
        written, ~10 us of HBM): a step with a quarter fewer rows repays the moves within its first few steps of a
        turn. Smaller gains (a row or two on the CPU, where the buckets are exact) are not worth a pass of moves,
        and they vanish as soon as the next answers come in."""
        movable = {id(live) for live in resumed}
        top = n = 0  # top: one past the highest slot decoding before; n: sequences decoding now
        span = 0
        for slot, live in enumerate(self.by_slot):
            if live is not None and live.decoding:
                n, span = n + 1, slot + 1
                if id(live) not in movable:
                    top = slot + 1
        now, packed = self.runner.bucket_for(span), self.runner.bucket_for(max(top, n))
        if now - packed < PACK_SHRINK * now:
            return
        self._move_down(sorted((live for live in resumed if live.slot >= packed), key=lambda lv: lv.slot), packed)

    def _span(self) -> int:
        """One past the last decoding slot. Slots past it are parked or free: not stepped at all (a parked slot's KV
        and state wait unchanged; its continuation re-writes its last token's KV, see extend())."""
        return self.num_slots - next(i for i, lv in enumerate(reversed(self.by_slot)) if lv is not None and lv.decoding)

    def _compact(self, span: int) -> int:
        """Move the highest decoding sequences down when fewer decode than the step covers: when sequences end
        turns or finish while others (a long response's tail) decode on in high slots, the step would keep running
        rows up to the highest of them. Same rule as _pack: only when that drops PACK_SHRINK of the rows.

        Moving a sequence that is still decoding is safe with the host one step behind: its state (finished flag,
        outputs) moves with it, and a turn the last snapshot saw end in its old slot is retired from the new slot
        one step later (_retire takes a flag only from the slot the sequence holds now). Returns the span after."""
        now, packed = self.runner.bucket_for(span), self.runner.bucket_for(self.decoding)
        if now - packed < PACK_SHRINK * now:
            return span
        self._move_down([live for live in self.by_slot[packed:span] if live is not None and live.decoding], packed)
        return self._span()

    def _move_down(self, movers: list, packed: int) -> None:
        """Each mover (in slot order) into the lowest slot below `packed` that is not decoding; a parked sequence there
        takes the mover's slot (the two exchange KV and decode state), a free slot becomes free in its place."""
        holes = [slot for slot in range(packed) if self.by_slot[slot] is None or not self.by_slot[slot].decoding]
        pairs, free = [], set(self.free)
        for live, target in zip(movers, holes):  # holes >= movers: packed >= n, and packed > top
            other = self.by_slot[target]
            pairs.append((live.slot, target))
            self.by_slot[live.slot], self.by_slot[target] = other, live
            if other is None:  # a free slot: the mover's old slot is free instead
                free.discard(target)
                free.add(live.slot)
            else:
                other.slot = live.slot
            live.slot = target
        if pairs:
            self.free = sorted(free)  # a sorted list is a heap
            self.runner.swap_slots(pairs)
            self.stats.swaps += len(pairs)

    def _snapshot(self, span: int):
        """Finished flags after the step just launched (copied without waiting), the slots' sequences then and the
        step's number: one list slice per step, no object per slot (the garbage collector's pauses grow with what
        every step allocates)."""
        flags = self.runner.state.finished
        ran = (self.by_slot[:span], self.stats.steps)
        if flags.device.type != "cuda":
            return flags.clone(), ran, None
        if not self._pinned:
            self._pinned = [torch.empty(flags.shape, dtype=torch.bool, pin_memory=True) for _ in range(2)]
        self._pinned.reverse()  # the other buffer still holds the previous step's flags, read after this launch
        host = self._pinned[0]
        host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, ran, event

    def _retire(self, snapshot) -> list[Turn]:
        flags, (lives, at), event = snapshot
        self._wait(event)
        # A flag is this turn's when the slot still holds the sequence it held then, decoding a turn begun by then.
        # Only flagged slots are looked at (the rest decode on); parked and free slots are flagged too, and skipped.
        stopped = []
        for slot in flags[:len(lives)].nonzero().view(-1).tolist():
            live = lives[slot]
            if live is not None and live.decoding and live.since <= at and live.slot == slot:
                stopped.append(live)
        if not stopped:
            return []
        ended = [self._end_turn(live, toks, lps)
                 for live, (toks, lps) in zip(stopped, self._outputs([live.slot for live in stopped], after=event))]
        self.stats.turns += len(ended)
        self.stats.new_tokens += sum(len(t.token_ids) for t in ended)
        return ended

    def _end_turn(self, live: _Live, toks: list, lps: list) -> Turn:
        """The sequence's turn ended with `toks` (all of the turn): it parks; the Turn holds the ids not yet reported
        by pause()."""
        live.decoding, live.last_token = False, toks[-1]
        self._decoding -= 1
        live.length += len(toks)
        done, live.reported = live.reported, 0
        return Turn(live.key, toks[done:], lps[done:], stopped=toks[-1] in self.stop_ids)

    @staticmethod
    def _wait(event) -> None:
        """The host waits for the snapshot's step to end (CUDA; one step behind the launches: the device's time,
        not the host's work)."""
        if event is not None:
            event.synchronize()

    def _outputs(self, slots: list[int], after=None, flags: bool = False) -> list:
        """Each slot's sampled ids and log-probs, as lists of its length (with flags: and its finished flag), in one
        wait for the device rather than a round trip per tensor: gathered there, copied into pinned host memory,
        then one synchronize; only each row's own length is converted to Python numbers.

        after: the CUDA event of the step whose flags ended these turns. Then the gather runs on a side stream
        behind that event, beside the decode step launched since, so the host does not wait for that step to end
        before it hands the turns over (the step writes nothing these slots' outputs hold: a finished row's step
        stores into its trash column and adds 0 to its count)."""
        runner = self.runner
        if runner.device.type != "cuda":
            host = [*runner.collect(slots), *([runner.state.finished[slots]] if flags else [])]
        else:
            if after is not None and self._side is None:
                self._side = torch.cuda.Stream(runner.device)
            stream = self._side if after is not None else torch.cuda.current_stream(runner.device)
            with torch.cuda.stream(stream):
                if after is not None:
                    stream.wait_event(after)
                gathered = [*runner.collect(slots)]
                if flags:
                    gathered.append(runner.state.finished[slot_index(runner.device, slots)])
                host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in gathered]
                for h, t in zip(host, gathered):
                    h.copy_(t, non_blocking=True)
            stream.synchronize()
        tokens, logprobs, lengths = host[:3]
        n = lengths.tolist()
        width = max(n, default=0)
        rows = [(t[:k], lp[:k]) for t, lp, k in zip(tokens[:, :width].tolist(), logprobs[:, :width].tolist(), n)]
        return [(*row, done) for row, done in zip(rows, host[3].tolist())] if flags else rows

    def _check_ids(self, ids: list[int], key: Hashable) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise DataError(f"sequence {key!r}: token ids {bad[:5]} are outside the model's vocabulary "
                            f"[0, {self.vocab_size})")


def session_slots(requested: Optional[int], max_slots: int, fit: Optional[int], slot_len: int, capacity: int) -> int:
    """Slots a session gets: the request, capped by the engine's max_slots and what the KV cache holds."""
    from phaserl.errors import ConfigError

    slots = min(requested or max_slots, max_slots)
    if fit is not None:
        if fit < 1:
            raise ConfigError(f"the rollout KV cache holds {capacity} tokens, less than one episode slot of "
                              f"{slot_len}; raise token_budget / memory_fraction or lower agent.max_episode_tokens")
        slots = min(slots, fit)
    return slots
