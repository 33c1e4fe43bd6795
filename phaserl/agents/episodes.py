"""EpisodeRunner: runs multi-turn episodes of an environment, token-exact, beside decoding.

Each episode gets a fresh environment (EnvironmentFactory), `reset(row, seed=...)`, then alternates
a model turn (sampled ids, kept as they are) and `env.step(decoded turn)` until the environment says
done or a limit ends it. Environment calls run on worker threads (workers.py): with the engine's
DecodeSession (rollout/session.py) the other episodes keep decoding while one waits, its slot parked
with its KV kept, and its observation ids are appended to that slot when they arrive.

    overlap=True   an environment's answer is used when it arrives: decoding never waits for an
                   environment. Answers arriving close together resume together, in one prefill or extend
                   pass (each pass is paid in full whatever its size): an answered episode waits at most what
                   a separate resumption would cost (DecodeSession.gather_seconds). Which decode step an episode
                   resumes at then depends on timing, but its sampling noise does not (it is keyed by the
                   episode and the position: EpisodeStart.noise_key), so the episodes are those of
                   overlap=False wherever the logits do not depend on the batch (the CPU; on a GPU up to rare
                   near-ties, docs/agents.md).
    overlap=False  every answer is used at a fixed point (after the decode step that ended the turn,
                   in episode order): environments still run in parallel with each other, decoding
                   waits for them, and a seeded run is reproducible (and resumes bit-for-bit).

`run_generate` is the fallback for models the engine does not run: one `generate()` call per turn
over the whole conversation so far (re-prefilled every turn, still token-exact).
Limits end an episode with a reason, counted in its record: done | max_turns | max_tokens (the
agent.max_episode_tokens budget) | context (the model's context) | env_error | env_timeout.
An environment that raises, returns a bad value or hangs past step_timeout_s: with
on_env_error="end" the episode ends (its turns kept), with "stop" an AgentError stops the run; the
message names the environment class and the episode's row (file:row, sample k).
Not here: tools and tool-call parsing (tools.py, tool_parsers.py), turning episodes into a batch.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from phaserl.agents.env import Episode, ImageObservation, Segment, as_step_result, segment_images
from phaserl.agents.loader import EnvironmentFactory
from phaserl.agents.render import ObservationRenderer, ObservationVision
from phaserl.agents.workers import Workers
from phaserl.data.prompts import decode_responses
from phaserl.errors import AgentError

log = logging.getLogger("phaserl")
FINISH_REASONS = ("done", "max_turns", "max_tokens", "context", "env_error", "env_timeout")
WARN_AT_MOST = 3  # environment failures logged in full per rollout; the rest are counted


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int              # model turns per episode
    max_turn_tokens: int        # sampled ids per turn (rollout.max_new_tokens)
    max_episode_tokens: int     # prompt + every turn and observation, at most
    context_limited: bool       # the model's context (not agent.max_episode_tokens) set max_episode_tokens
    step_timeout_s: float       # per reset/step call
    on_env_error: str           # "end" | "stop"
    workers: int                # environment calls running at once
    overlap: bool = True

    @classmethod
    def from_config(cls, cfg, model_context: int) -> "AgentLimits":
        """agent.* and rollout.max_new_tokens of a Config (read here, at build time, by the trainer's builder and
        the doctor); the episode budget is capped by the model's context."""
        a = cfg.agent
        return cls(max_turns=a.max_turns, max_turn_tokens=cfg.rollout.max_new_tokens,
                   max_episode_tokens=min(a.max_episode_tokens, model_context),
                   context_limited=model_context < a.max_episode_tokens, step_timeout_s=a.step_timeout_s,
                   on_env_error=a.on_env_error, workers=a.workers, overlap=a.overlap)

    @property
    def budget_reason(self) -> str:
        return "context" if self.context_limited else "max_tokens"


@dataclass
class EpisodeStart:
    """One episode to run: the prompt item it starts from, its reset seed, and its name in messages."""

    item: object                 # PromptItem (row, prompt_ids)
    seed: int
    label: str                   # e.g. "train.jsonl:row 12, sample 3"
    noise_key: Optional[int] = None  # names the episode's sampling noise in the decode session (None: `seed`);
                                     # unique per episode and the same on any rank, e.g. its global index


@dataclass(eq=False)
class _Run:
    index: int
    start: EpisodeStart
    segments: list
    env: object = None
    turn_rewards: list = field(default_factory=list)
    num_turns: int = 0
    metrics: dict = field(default_factory=dict)
    finish_reason: Optional[str] = None
    future: Optional[cf.Future] = None
    call: str = ""                # "reset" | "step": what the future is
    deadline: float = math.inf
    workers: object = None        # the pool the call runs on
    in_session: bool = False
    routes: object = None         # routing replay: the slot's expert record, read when the slot is released
    cut: tuple = ((), (), ())     # asynchronous rollout: the turn in progress when its phase ended (ids, log-probs,
                                  # versions), continued from there in the next phase

    @property
    def ids(self) -> list:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def length(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    @property
    def images(self):
        """The ImageInputs of the images in its ids so far, in order (None: none)."""
        return segment_images(self.segments)


class EpisodeRunner:
    """workers: a pool kept by the caller across rollouts (its threads start once); None: a pool of
    limits.workers threads for each run_* call, shut down after it. vision: a vision-language policy's processor
    (render.observation_vision): prompts and observations may then hold images (the engine path only)."""

    def __init__(self, factory: EnvironmentFactory, tokenizer, limits: AgentLimits, workers: Optional[Workers] = None,
                 vision: Optional[ObservationVision] = None):
        self.factory, self.tokenizer, self.limits, self.workers = factory, tokenizer, limits, workers
        self.renderer = ObservationRenderer(tokenizer, vision)
        self._warned = 0
        self._landed = 0     # environment calls that have ended (each call's done-callback counts, on its thread)
        self._submitted = 0  # calls submitted
        self._scan = None    # the last non-blocking look at the calls: _answers reuses it while nothing changed
        self._reprefills = [0, 0]  # this phase's episodes under way started again by a re-prefill: (runs, ids)

    # ----- the engine path ------------------------------------------------------------------------
    def run_session(self, session, starts: list[EpisodeStart]) -> list[Episode]:
        """Episodes decoded in `session` (a DecodeSession), environments on worker threads."""
        runs, workers = self._begin(starts)
        try:
            self._drive(session, runs, [], workers)
        finally:
            if workers is not self.workers:
                workers.shutdown()
        return [self._episode(r) for r in runs]

    def _drive(self, session, runs: list, waiting: list, workers: Workers, *, version: Optional[int] = None,
               enough: Callable[[], bool] = lambda: False) -> None:
        """The engine path's loop, shared by run_session (until every run has ended) and run_phase (until enough()):
        environment answers applied (as they come with overlap, else in episode order after each step), waiting
        runs started in free slots, one decode step, its ended turns handed to their environments."""
        by_key = {run.index: run for run in runs}
        held: dict = {}     # overlap: episode index -> when its answer was first seen, held while others decode
        overlap = self.limits.overlap
        while any(r.finish_reason is None for r in runs) and not enough():
            if overlap:
                for run in self._gathered(session, runs, self._answers(runs, block=False), held):
                    self._apply(session, run, waiting)
            waiting.sort(key=lambda r: r.index)
            while waiting and session.free_slots:
                self._start(session, waiting.pop(0))
            if not session.idle:
                self._ended_turns(session.step(), by_key, workers, version)  # most steps end no turn
                if not overlap:  # answers used in episode order after each step: reproducible
                    for run in self._answers(runs, block=True):
                        self._apply(session, run, waiting)
            elif not waiting or not session.free_slots:
                answered = self._answers(runs, block=True, first=overlap)
                assert answered or waiting or all(r.finish_reason for r in runs), "episode runner stalled"
                for run in self._gathered(session, runs, answered, held) if overlap else answered:
                    self._apply(session, run, waiting)

    def _gathered(self, session, runs: list, answered: list, held: dict) -> list:
        """The answered episodes to resume now, so that each resumption (a prefill or extend pass: on a GPU host
        tens of ms of launches, whatever its size, while nothing else decodes) serves as many as it can.

        With nothing decoding, the next step would run for the answered episodes alone: an answer due within what
        a separate resumption would cost (session.gather_seconds) joins them instead of trailing behind. While
        others decode, answers are held (their slots wait parked) until every call is in or the first one held
        has waited that long: then they resume together. Holding costs each held episode at most one pass's time
        and never stalls the others; resuming every trickle at once cost the H200's 0.5B lock-step benchmark nine
        passes of ~37 ms for three turn boundaries (2026-12-03)."""
        if not answered:
            return answered
        if not session.decoding:
            held.clear()
            return self._answers(runs, block=True, within=session.gather_seconds)
        now = time.monotonic()
        for run in answered:
            held.setdefault(run.index, now)
        outstanding = len(answered) < sum(1 for r in runs if r.future is not None)
        if outstanding and now - min(held[r.index] for r in answered) < session.gather_seconds:
            return []
        held.clear()
        return answered

    def _start(self, session, run: _Run) -> None:
        ids = run.ids + list(run.cut[0])  # a turn cut at the end of an asynchronous phase continues where it stopped
        cap = min(self.limits.max_turn_tokens - len(run.cut[0]), self.limits.max_episode_tokens - len(ids))
        if cap < 1:
            return self._finish(session, run, self.limits.budget_reason)
        key = run.start.seed if run.start.noise_key is None else run.start.noise_key
        # its samples do not depend on timing or slots
        session.start(run.index, ids, cap, noise_key=key, **_pixels(run.images))
        run.in_session = True
        if run.num_turns or run.cut[0]:  # an episode under way (a turn sampled): its ids so far prefilled again
            self._reprefills[0] += 1
            self._reprefills[1] += len(ids)

    def _apply(self, session, run: _Run, waiting: list) -> None:
        """An environment answered (or failed): start, continue or end the episode."""
        call, future = run.call, run.future
        run.future, run.call = None, ""
        outcome = self._outcome(run, call, future)
        if outcome is None:
            return self._finish(session, run, run.finish_reason or "env_error")
        if call == "reset":
            waiting.append(run)
            return
        obs = self._after_step(session, run, outcome)
        if obs is None:
            return
        cap = min(self.limits.max_turn_tokens, self.limits.max_episode_tokens - run.length - len(obs.token_ids))
        if cap < 1:
            return self._finish(session, run, self.limits.budget_reason)
        if obs.token_ids:
            run.segments.append(obs)
        if not run.in_session:  # asynchronous rollout: its slot went at the end of a phase; prefilled anew
            waiting.append(run)
            return
        session.extend(run.index, obs.token_ids, cap, **_pixels(obs.images))

    # ----- the asynchronous rollout: episodes that outlive a phase -----------------------------------
    def begin_runs(self, starts: list[EpisodeStart], first_index: int) -> list:
        """Episodes for trainer/agent_stream.py: their resets are submitted now, on the caller's pool (kept across
        phases), and they are driven by run_phase() until they end, over as many phases as it takes."""
        assert self.workers is not None, "begin_runs needs the caller's worker pool"
        runs = [_Run(first_index + i, s, [_prompt_segment(s)]) for i, s in enumerate(starts)]
        for run in runs:
            self._submit(self.workers, run, "reset", self._reset, run)
        return runs

    def run_phase(self, session, runs: list, *, version: int, enough: Callable[[], bool], keep: bool = False) -> dict:
        """Drive `runs` in `session` (this phase's DecodeSession, its weights tagged `version`) until enough() or
        every run has ended; then end the phase, nothing waiting for an environment. Turns still decoding keep
        their ids so far in run.cut (their versions per id) and continue next phase; parked episodes' environment
        calls go on, their answers used next phase.

        keep=False (a fresh session per phase): the turns are cut and parked episodes lose their slot; next phase
        both are prefilled again from their ids. keep=True (one session kept across phases, DecodeSession.pause):
        both keep their slot and KV; the cut turn decodes on with no prefill and the answer is appended with
        extend, as within a phase. Runs that hold no slot (a lost session's) restart by re-prefill either way.
        Returns {cut, released, kept, kept_tokens, reprefilled, reprefill_tokens}: the phase's carry-over."""
        self._warned = 0
        self._reprefills = [0, 0]
        by_key = {run.index: run for run in runs}
        # ready to (re)start: reset answered, a turn cut, or an observation that arrived after the last phase's end
        waiting = [r for r in runs if r.finish_reason is None and r.future is None and not r.in_session]
        self._drive(session, runs, waiting, self.workers, version=version, enough=enough)
        ended, cut = session.pause() if keep else session.suspend()  # suspend: their slots are free already
        for turn in ended:
            by_key[turn.key].in_session = keep  # kept: parked in its slot until the answer comes
        self._ended_turns(ended, by_key, self.workers, version)
        for turn in cut:
            run = by_key[turn.key]
            run.cut = ((*run.cut[0], *turn.token_ids), (*run.cut[1], *turn.logprobs),
                       (*run.cut[2], *[version] * len(turn.token_ids)))
            run.in_session = keep
        released = kept = kept_tokens = 0
        for run in runs:
            if run.in_session and keep:
                kept, kept_tokens = kept + 1, kept_tokens + session.held(run.index)
            elif run.in_session:  # parked, its environment still at work: the slot goes, the episode stays
                session.release(run.index)
                run.in_session, released = False, released + 1
        return {"cut": len(cut), "released": released, "kept": kept, "kept_tokens": kept_tokens,
                "reprefilled": self._reprefills[0], "reprefill_tokens": self._reprefills[1]}

    def forget_slot(self, run: _Run, session) -> None:
        """The run's slot in a kept session goes (it was abandoned, or the session was lost: `session` None or lost,
        then only the run forgets it); the run restarts by re-prefill if it goes on."""
        if run.in_session and session is not None and session.lost is None and run.index in session.live:
            session.drop(run.index)
        run.in_session = False

    def _ended_turns(self, ended: list, by_key: dict, workers: Workers, version: Optional[int]) -> None:
        """Hand turns that ended to their environments (their texts decoded in one batch call; none: no call)."""
        texts = decode_responses(self.tokenizer, [turn.token_ids for turn in ended]) if ended else []
        for turn, text in zip(ended, texts):
            self._turn_ended(by_key[turn.key], turn.token_ids, turn.logprobs, text, workers, version)

    def abandon(self, run: _Run) -> None:
        """Drop an episode that went stale (its environment closed on a worker; a call in progress is left to end)."""
        run.finish_reason = run.finish_reason or "abandoned"
        if run.future is not None and not run.future.done():
            run.workers.abandon(run.future)
        env, run.env = run.env, None
        if env is not None and callable(getattr(env, "close", None)):
            self.workers.submit(env.close)

    def episode(self, run: _Run) -> Episode:
        return self._episode(run)

    # ----- the fallback path (re-prefill every turn) ----------------------------------------------
    def run_generate(self, generate: Callable, starts: list[EpisodeStart]) -> list[Episode]:
        """Episodes decoded by `generate(list of id lists) -> GenerationResult`, one call per turn."""
        runs, workers = self._begin(starts)
        try:
            self._settle(runs, None)
            while True:
                active = [r for r in runs if r.finish_reason is None]
                for run in active:
                    if self.limits.max_episode_tokens - run.length < 1:
                        self._finish(None, run, self.limits.budget_reason)
                active = [r for r in active if r.finish_reason is None]
                if not active:
                    break
                if any(r.images is not None for r in active):
                    raise AgentError("episodes with images run on the built-in engine only (rollout.engine=auto or "
                                     "builtin): the generate() fallback takes no pixels")
                result = generate([r.ids for r in active])
                caps = [min(self.limits.max_turn_tokens, self.limits.max_episode_tokens - r.length) for r in active]
                ids = [turn_ids[:cap] for turn_ids, cap in zip(result.response_ids, caps)]
                texts = decode_responses(self.tokenizer, ids)
                for run, turn_ids, lps, cap, text in zip(active, ids, result.logprobs, caps, texts):
                    self._turn_ended(run, turn_ids, lps[:cap], text, workers)
                self._settle(runs, None)
        finally:
            if workers is not self.workers:
                workers.shutdown()
        return [self._episode(r) for r in runs]

    def _settle(self, runs: list, session) -> None:
        """Wait for every environment call, then use the answers in episode order."""
        for run in self._answers(runs, block=True):
            call, future = run.call, run.future
            run.future, run.call = None, ""
            outcome = self._outcome(run, call, future)
            if outcome is None:
                self._finish(session, run, run.finish_reason or "env_error")
            elif call == "step":
                obs = self._after_step(session, run, outcome)
                if obs is not None and obs.token_ids:
                    run.segments.append(obs)

    # ----- shared pieces --------------------------------------------------------------------------
    def _begin(self, starts: list[EpisodeStart]) -> tuple[list, Workers]:
        self._warned = 0
        workers = self.workers or Workers(self.limits.workers)
        runs = [_Run(i, s, [_prompt_segment(s)]) for i, s in enumerate(starts)]
        for run in runs:
            self._submit(workers, run, "reset", self._reset, run)
        return runs, workers

    def _submit(self, workers: Workers, run: _Run, call: str, fn, *args) -> None:
        run.call, run.future = call, workers.submit(fn, *args)
        run.deadline = time.monotonic() + self.limits.step_timeout_s
        run.workers = workers
        self._submitted += 1
        run.future.add_done_callback(self._count_landing)

    def _count_landing(self, future: cf.Future) -> None:
        # On the worker's thread, after the future is done. An increment lost to a race with another thread's still
        # changes the count, and the look that sees the change sees both calls done.
        self._landed += 1

    def _reset(self, run: _Run):
        t0 = time.perf_counter()
        run.env = self.factory.make()
        row = run.start.item.row
        record = dict(row.raw, prompt=row.prompt, data_source=row.data_source, ground_truth=row.ground_truth,
                      extra_info=row.extra_info)
        obs = run.env.reset(record, seed=run.start.seed)
        _add(run.metrics, "env_seconds", time.perf_counter() - t0)
        return obs

    def _step(self, run: _Run, text: str):
        t0 = time.perf_counter()
        result = run.env.step(text)
        _add(run.metrics, "env_seconds", time.perf_counter() - t0)
        return result

    def _turn_ended(self, run: _Run, ids: list, logprobs: list, text: str, workers: Workers,
                    version: Optional[int] = None) -> None:
        """A model turn is over: keep its ids, and hand its text (decoded with the step's other turns, one
        batch call) to the environment. version: the policy version that sampled the ids (asynchronous rollout;
        a turn cut by earlier phases is joined to its start, each id keeping its own version)."""
        versions = None if version is None else [*run.cut[2], *[version] * len(ids)]
        if run.cut[0]:
            ids, logprobs, run.cut = [*run.cut[0], *ids], [*run.cut[1], *logprobs], ((), (), ())
            text = decode_responses(self.tokenizer, [ids])[0]
        run.segments.append(Segment("model", ids, logprobs, versions))  # the caller's fresh lists: kept, not copied
        run.num_turns += 1
        self._submit(workers, run, "step", self._step, run, text)

    def _answers(self, runs: list, *, block: bool, first: bool = False, within: Optional[float] = None) -> list:
        """Runs whose environment call is over (answered, failed or timed out), in episode order.

        block: wait until every call (first=True: at least one) is over or past its deadline; within: for
        every call, but at most that many seconds. A non-blocking look (the decode loop's, every step) reuses the
        previous one while no call has ended, none was submitted and no deadline has passed: the same runs, less
        those applied since; not a scan of every run and a lock per future each step."""
        if not block:
            return self._look(runs)
        pending = [r for r in runs if r.future is not None]
        if block and pending:
            timeout = max(0.0, min(r.deadline for r in pending) - time.monotonic())
            if within is not None:
                cf.wait([r.future for r in pending], timeout=min(within, timeout))
            elif first:
                cf.wait([r.future for r in pending], timeout=timeout, return_when=cf.FIRST_COMPLETED)
            else:
                for run in pending:
                    cf.wait([run.future], timeout=max(0.0, run.deadline - time.monotonic()))
        now = time.monotonic()
        return [r for r in pending if r.future.done() or now >= r.deadline]

    def _look(self, runs: list) -> list:
        now, seen = time.monotonic(), (self._landed, self._submitted)  # read before the scan: a call ending during
        last = self._scan                                                # it changes the count for the next look
        if last is not None and last[0] is runs and last[1] == seen and now < last[3]:
            return [r for r in last[2] if r.future is not None]
        pending = [r for r in runs if r.future is not None]
        ready = [r for r in pending if r.future.done() or now >= r.deadline]
        self._scan = (runs, seen, ready, min((r.deadline for r in pending), default=math.inf))
        return ready

    def _outcome(self, run: _Run, call: str, future: cf.Future):
        """The call's value, or None after recording why the episode must end (stop: AgentError)."""
        if not future.done():
            future.cancel()
            run.workers.abandon(future)  # the stuck thread no longer counts: the pool keeps its size
            run.finish_reason = "env_timeout"
            self._failure(run, f"{call}() did not return within {self.limits.step_timeout_s:g} s "
                               "(agent.step_timeout_s)")
            return None
        exc = future.exception()
        if exc is not None:
            self._failure(run, f"{call}() raised {type(exc).__name__}: {exc}")
            return None
        value = future.result()
        if call == "step":
            try:
                return as_step_result(value, where=f"environment {self.factory.name} ({self._where(run)})")
            except ValueError as exc:
                self._failure(run, str(exc), full=True)
                return None
        tools = getattr(run.env, "tool_schemas", None) if call == "reset" else None
        if tools and run.segments[0].images is not None:
            self._failure(run, "tool_schemas with a prompt that holds images: the prompt cannot be rendered again "
                               "with its image tokens; give the tools in the prompt's text instead")
            return None
        if tools:  # the model must see the tools: the prompt is rendered with them
            try:
                run.segments[0] = Segment("prompt", self.renderer.prompt_ids(run.start.item.row.prompt, list(tools)))
            except Exception as exc:  # noqa: BLE001 - a template that cannot take tools= is the user's to fix
                self._failure(run, f"the chat template could not render the prompt with its tool_schemas: {exc}")
                return None
        if call == "reset" and value not in (None, "") and not isinstance(value, (str, list, ImageObservation)):
            self._failure(run, f"reset() returned {type(value).__name__}; return text, a list of chat messages or an "
                               "ImageObservation")
            return None
        if call == "reset" and value not in (None, ""):
            try:
                ids, images = self.renderer.render(value)
                run.segments.append(Segment("observation", ids, images=images))
            except (ValueError, TypeError) as exc:
                self._failure(run, f"reset() returned an observation that cannot be tokenized: {exc}")
                return None
        return True

    def _after_step(self, session, run: _Run, result) -> Optional[Segment]:
        """Record a step's reward and info; end the episode when it is over, else its observation segment."""
        run.turn_rewards.append(result.reward)
        for key, value in dict(result.info.get("metrics", {})).items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                _add(run.metrics, key, float(value))
        if result.done:  # an environment may name its own reason (ToolEnvironment: tool_timeout)
            reason = result.info.get("end_reason")
            return self._finish(session, run, reason if isinstance(reason, str) and reason else "done")
        if run.num_turns >= self.limits.max_turns:
            return self._finish(session, run, "max_turns")
        try:
            obs_ids, images = self.renderer.render(result.observation)
        except (ValueError, TypeError) as exc:
            self._failure(run, f"step() returned an observation that cannot be tokenized: {exc}")
            return self._finish(session, run, "env_error")
        if run.length + len(obs_ids) + 1 > self.limits.max_episode_tokens:
            return self._finish(session, run, self.limits.budget_reason)
        return Segment("observation", obs_ids, images=images)

    def _failure(self, run: _Run, what: str, *, full: bool = False) -> None:
        message = what if full else f"environment {self.factory.name} ({self._where(run)}): {what}"
        if self.limits.on_env_error == "stop":
            raise AgentError(message + "; set agent.on_env_error=end to end such episodes and go on")
        run.finish_reason = run.finish_reason or "env_error"
        self._warned += 1
        if self._warned <= WARN_AT_MOST:
            log.warning(message + " -> the episode ends (counted in agent/ended/*)")

    def _finish(self, session, run: _Run, reason: str) -> None:
        run.finish_reason = run.finish_reason or reason
        if session is not None and run.in_session:
            run.routes = session.routes(run.index)  # None unless the engine records experts (routing replay)
            session.release(run.index)
            run.in_session = False
        env, run.env = run.env, None
        if env is not None and callable(getattr(env, "close", None)):  # on a worker: a hanging close never waits
            closing = run.workers.submit(env.close)
            closing.add_done_callback(lambda f, where=self._where(run): f.exception() and log.warning(
                f"environment {self.factory.name} ({where}): close() raised {f.exception()!r}"))

    def _where(self, run: _Run) -> str:
        return run.start.label

    @staticmethod
    def _episode(run: _Run) -> Episode:
        return Episode(row=run.start.item.row, segments=run.segments, turn_rewards=list(run.turn_rewards),
                       finish_reason=run.finish_reason or "done", num_turns=run.num_turns, metrics=dict(run.metrics),
                       routes=run.routes)


def _prompt_segment(start: EpisodeStart) -> Segment:
    return Segment("prompt", list(start.item.prompt_ids), images=getattr(start.item, "images", None))


def _pixels(images) -> dict:
    """The images keyword of a session call: only when there are some (text sessions keep their signature)."""
    return {} if images is None else {"images": images}


def _add(metrics: dict, key: str, value: float) -> None:
    metrics[key] = metrics.get(key, 0.0) + value
