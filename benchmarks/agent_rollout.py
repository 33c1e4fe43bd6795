"""Multi-turn rollout throughput: episodes with simulated tool latency vs the single-turn engine, one run.

One JSON line per measurement on stdout. Shape: Qwen2-0.5B architecture, random weights,
bf16; 256 episodes x 4 turns, prompt 128 tokens, 64 sampled tokens per turn (EOS ignored: fixed
lengths), a 32-token observation after each of the first 3 turns; every environment step sleeps the
simulated tool latency (0 / 50 / 500 ms) on its worker thread (one per episode, from one pool kept
across cases, as the trainer keeps it) while the engine decodes the other episodes. The single-turn
number is `RolloutEngine.generate` over the same 256 prompts with 4 x 64 = 256 new tokens each, in
the same process. Target: with 50 ms tools, multi-turn generated tokens/s >= 70% of single-turn.
In this fixed-length shape every episode ends its turn at the same step, so nothing is left to
decode while the tools run: the 3 x latency is idle device time by construction, and the best
possible ratio at 50 ms is single / (single + 0.15 s).

Both cases are timed the same way: after a warm-up of each (slot layout, fused weights, graph capture, compile, worker
threads: none of it in a timed region; each multi-turn case once more untimed), `--repeats` runs each, the median
reported. Instead of torch.profiler (whose tracing of graph replays slowed the single-turn case 10x on the H200),
every runner call is bracketed by CUDA events: device_s is the device time of each kind of call (decode steps,
prefills, extends of observation ids, output gathers) and device_busy their sum over the wall; host_s is where the
host's time went (multi-turn: inside session.step, handling ended turns, applying environment answers, waiting for
them); gc the garbage collector's pauses. Two of those are waits, not host work: session_retire holds session_wait
(the host waiting for the decode step before, as it runs one step ahead: about the device's decode time) besides
session_outputs (ended turns' outputs brought to the host, one wait each), and answers holds the waits for the
tools.

    python benchmarks/agent_rollout.py                      # H200: 0.5b, latencies 0 50 500
    python benchmarks/agent_rollout.py --smoke              # CPU: the tiny shape, a few episodes
    python benchmarks/agent_rollout.py --latency-ms 0 --profile-extend   # H200: where an extend pass's time goes
    python benchmarks/agent_rollout.py --latency-ms 0 --profile-extend --extend-kernel off   # the torch attention
    python benchmarks/agent_rollout.py --latency-ms 0 50 --jitter-ms 50 \
        --engine-compile off on             # H200: both variants, one engine each, in one run
    python benchmarks/agent_rollout.py --latency-ms 50 --jitter-ms 50 --async-phases 3 \
        --partial-kv keep prefill           # the async cases with kept slots vs re-prefilled ones, same engine

Variants (--engine-compile: off / on / auto each): each gets its own engine (EngineConfig.compile) and its own
single-turn baseline; every line names it. The last line (case=variants) sets them side by side per latency:
tokens/s and the ratio to single turn.

Async cases (--async-phases) also give partial_kv, kept_sequences (slots kept across phase ends), reprefill_tokens
(ids prefilled again for episodes under way) and prefill_tokens (all prefilled ids of the timed phases).

Fields: tokens_per_s (sampled tokens / median wall), vs_single_turn (that over the same engine's single-turn
tokens/s), extend_passes and extend_pass_ms (device ms per extend pass),
slot_occupancy (decoding slot-steps / (steps x slots): the rest were parked waiting for a tool or free),
decode_steps, swaps (resumed episodes moved down into a parked slot), extend_calls ([rows, device ms] of each extend
call of the median run), seconds (median) and seconds_all,
device_s, device_busy, host_s, calls, gc.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import os
import random
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from phaserl.agents import Environment, StepResult  # noqa: E402
from phaserl.agents.episodes import AgentLimits, EpisodeRunner, EpisodeStart  # noqa: E402
from phaserl.agents.loader import EnvironmentFactory  # noqa: E402
from phaserl.agents.workers import Workers  # noqa: E402
from phaserl.config.validate import async_lookahead  # noqa: E402
from phaserl.data.prompts import PromptItem  # noqa: E402
from phaserl.data.rows import PromptRow  # noqa: E402
from phaserl.models import CausalLM  # noqa: E402
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402
from phaserl.rollout import runner as runner_module  # noqa: E402
from qwen2_shapes import decoder_config  # noqa: E402


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


class IdsTokenizer:
    """Text is space-separated token ids: the environment's observation is exactly the ids it names."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


class SimulatedTool(Environment):
    """Each step sleeps `latency_s` (a tool call), then answers with `obs_tokens` token ids.

    jitter: each step sleeps uniformly in [latency_s - spread_s, latency_s + spread_s] instead (the mean kept;
    spread_s None: the whole latency, [0, 2 x latency_s]), drawn from the episode's seed."""

    def __init__(self, latency_s: float, obs_tokens: int, turns: int, jitter: bool = False,
                 spread_s: Optional[float] = None):
        self.latency_s, self.obs_tokens, self.turns, self.steps, self.jitter = latency_s, obs_tokens, turns, 0, jitter
        self.spread_s = latency_s if spread_s is None else min(spread_s, latency_s)

    def reset(self, row, *, seed):
        self.base = 100 + seed % 1000
        self.rng = random.Random(seed)
        return ""

    def step(self, action):
        time.sleep(self.latency_s + (self.spread_s * (2 * self.rng.random() - 1) if self.jitter else 0.0))
        self.steps += 1
        obs = " ".join(str(self.base + i) for i in range(self.obs_tokens))
        return StepResult(obs, 0.0, self.steps >= self.turns)


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, min(vocab, 4000), (n, length), generator=g).tolist()


def starts(ids: list[list[int]]) -> list:
    out = []
    for i, p in enumerate(ids):
        row = PromptRow("", "bench", None, {}, f"bench:row {i}", i, {})
        out.append(EpisodeStart(PromptItem(row, tuple(p), ""), seed=i, label=f"bench:row {i}"))
    return out


class Clock:
    """Time per kind of call, by wrapping bound methods of one object each (undone by `close()`).

    Device time: CUDA events recorded around the call on the current stream (no profiler, no sync until
    `device_seconds`); on the CPU the calls are synchronous, so the host clock is the device's. Host time: the
    wall inside the call (for CUDA work: launching it, plus any wait inside).
    """

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.events, self.host, self.calls, self._wrapped = {}, {}, {}, []
        self.rows: dict = {}  # kind -> the length of each call's first argument (rows of an extend call)
        self.gc = {"seconds": 0.0, "gen0": 0, "gen1": 0, "gen2": 0}  # the garbage collector's pauses meanwhile
        self._gc_t0 = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc["seconds"] += time.perf_counter() - self._gc_t0
            self.gc[f"gen{info['generation']}"] += 1

    def wrap(self, obj, name: str, kind: str, device: bool = True) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            if device and self.cuda:
                begin = torch.cuda.Event(enable_timing=True)
                begin.record()
            out = fn(*args, **kwargs)
            if device and self.cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.events.setdefault(kind, []).append((begin, end))
            self.host[kind] = self.host.get(kind, 0.0) + time.perf_counter() - t0
            self.calls[kind] = self.calls.get(kind, 0) + 1
            self.rows.setdefault(kind, []).append(len(args[0]) if args and hasattr(args[0], "__len__") else None)
            return out
        setattr(obj, name, timed)
        self._wrapped.append((obj, name))

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        for obj, name in self._wrapped:
            delattr(obj, name)  # the instance attribute goes: the class's method is back
        self._wrapped = []

    def per_call(self, kind: str) -> list:
        """[(rows, ms)] of every call of this kind: device ms from its events (CUDA), else the host's."""
        if not self.cuda:
            return [(rows, None) for rows in self.rows.get(kind, [])]
        torch.cuda.synchronize()
        ms = [round(b.elapsed_time(e), 3) for b, e in self.events.get(kind, [])]
        return list(zip(self.rows.get(kind, []), ms))

    def marks(self) -> dict:
        """Where every kind's calls and the collector's pauses stand now, for `between`."""
        return {"gc": self.gc["seconds"], **{k: len(v) for k, v in self.events.items()},
                **({} if self.cuda else {f"host:{k}": v for k, v in self.host.items()})}

    def between(self, start: dict, end: dict, kinds) -> dict:
        """{device_s: per kind, gc_s} of the calls made between two `marks()`."""
        if self.cuda:
            torch.cuda.synchronize()
            spent = {k: sum(b.elapsed_time(e) for b, e in self.events.get(k, [])[start.get(k, 0):end.get(k, 0)]) / 1000
                     for k in kinds}
        else:
            spent = {k: end.get(f"host:{k}", 0.0) - start.get(f"host:{k}", 0.0) for k in kinds}
        return {"device_s": {k: round(v, 4) for k, v in spent.items() if v}, "gc_s": round(end["gc"] - start["gc"], 4)}

    def device_seconds(self, kinds) -> dict:
        if not self.cuda:
            return {k: round(self.host.get(k, 0.0), 4) for k in kinds}
        torch.cuda.synchronize()
        return {k: round(sum(b.elapsed_time(e) for b, e in self.events.get(k, [])) / 1000, 4) for k in kinds}


DEVICE_KINDS = ("decode", "prefill", "extend", "collect", "begin")


def wrap_runner(clock: Clock, runner) -> None:
    for kind in DEVICE_KINDS:
        clock.wrap(runner, kind, kind)
    clock.wrap(runner, "_extend_pass", "extend_pass", device=False)  # passes per extend() call


def measured(fn, clock: Clock, device: str) -> tuple:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    seconds = time.perf_counter() - t0
    spent = clock.device_seconds(DEVICE_KINDS)
    extra = dict(device_s=spent, device_busy=round(sum(spent.values()) / seconds, 3),
                 host_s={k: round(v, 4) for k, v in clock.host.items()}, calls=dict(clock.calls),
                 gc={**clock.gc, "seconds": round(clock.gc["seconds"], 4)})
    clock.close()
    return seconds, out, extra


def median_run(cases: list) -> dict:
    """The run of median wall time among repeats (its breakdown), with every repeat's seconds. Of an even number,
    the faster of the middle two: a slow repeat of the single-turn baseline never flatters the ratios over it."""
    ordered = sorted(cases, key=lambda c: c["seconds"])
    mid = dict(ordered[(len(ordered) - 1) // 2])
    mid["seconds_all"] = [round(c["seconds"], 4) for c in cases]
    return mid


def multi_turn(engine, ids, a, latency_s: float, pool: Workers, jitter: bool = False) -> dict:
    episode_len = a.prompt + a.turns * a.turn_tokens + (a.turns - 1) * a.obs_tokens
    limits = AgentLimits(max_turns=a.turns, max_turn_tokens=a.turn_tokens, max_episode_tokens=episode_len,
                         context_limited=False, step_timeout_s=60.0, on_env_error="stop", workers=len(ids),
                         overlap=True)
    env_kwargs = dict(latency_s=latency_s, obs_tokens=a.obs_tokens, turns=a.turns, jitter=jitter,
                      spread_s=None if a.spread_ms is None else a.spread_ms / 1000)
    runner = EpisodeRunner(EnvironmentFactory(SimulatedTool, env_kwargs), IdsTokenizer(), limits, workers=pool)
    params = SamplingParams(max_new_tokens=a.turn_tokens, temperature=1.0)
    clock = Clock(a.device)
    wrap_runner(clock, engine.runner)
    for name in ("_turn_ended", "_apply", "_answers"):
        clock.wrap(runner, name, name.strip("_"), device=False)

    def once():
        with engine.session(params, slot_len=episode_len, eos_token_ids=[], num_slots=len(ids)) as session:
            clock.wrap(session, "step", "session_step", device=False)
            clock.wrap(session, "_retire", "session_retire", device=False)    # waits for the step before, gathers
            clock.wrap(session, "_wait", "session_wait", device=False)        # of which: the wait (device time)
            clock.wrap(session, "_outputs", "session_outputs", device=False)  # and: ended turns' outputs to the host
            clock.wrap(session, "_prefill", "session_prefill", device=False)  # launches prefills and extends
            return runner.run_session(session, starts(ids))
    seconds, episodes, extra = measured(once, clock, a.device)
    passes = extra["calls"].get("extend_pass", 0)
    per_call = clock.per_call("extend")  # [(rows, device ms)] of each extend call: an outlier shows a slow one
    assert all(e.num_turns == a.turns for e in episodes), [e.finish_reason for e in episodes[:4]]
    sampled = sum(len(s.token_ids) for e in episodes for s in e.segments if s.kind == "model")
    st = engine.last_stats
    return dict(seconds=seconds, sampled_tokens=sampled, tokens_per_s=sampled / seconds, decode_steps=st["steps"],
                slot_occupancy=st["busy_slot_steps"] / max(1, st["steps"] * st["slots"]),
                extend_tokens=st["extend_tokens"], swaps=st["swaps"], extend_passes=passes,
                extend_pass_ms=round(1000 * extra["device_s"]["extend"] / passes, 3) if passes else None,
                extend_calls=per_call, **extra)


def lookahead(a) -> int:
    """Steps ahead that the async stream starts a batch's episodes at --max-staleness (the product's rule)."""
    return async_lookahead(a.max_staleness)


def held(a) -> int:
    """Episodes the async stream holds at once: the batches of the lookahead and the one due."""
    return (lookahead(a) + 1) * a.episodes


def multi_turn_async(engine, a, latency_s: float, pool: Workers, jitter: bool = False,
                     partial_kv: str = "keep") -> dict:
    """The asynchronous stream's rollout (rollout.max_staleness --max-staleness, default 1): (lookahead + 1) x
    episodes in flight (lookahead = max(1, k - 1), config.validate.async_lookahead: 2 x episodes at k <= 2, 3 x at
    k = 3), phases back to back, each ending when the oldest `episodes` episodes are complete (a step's batch) and the
    pace's decode steps are done (turns x turn_tokens / (lookahead + 1), as trainer/agent_stream.py sets it);
    unfinished ones carry on into the next phase (EpisodeRunner.run_phase, as trainer/agent_stream.py drives it; no
    training between phases here, so a tool's call overlaps only decoding). tokens_per_s: the model tokens of the
    completed batches over the timed phases' wall (the trained tokens/s of a run whose update took no time);
    sampled_tokens_per_s: every token sampled in them.
    device_s / device_busy: the engine's calls in the timed phases, as for the lock-step case; host_s["answers"]: the
    host's time collecting the tools' answers; phase_records: each timed phase's wall, decode steps, rows stepped
    per decode step, prefilled and extended tokens, decode graphs captured, cut and parked, its device_s and gc_s
    (collector pauses). Untimed phases come first: one fills the stream, `lookahead` paced ones set its batches a
    phase's turns apart. partial_kv (rollout.partial_kv): keep = one session kept across the phases
    (RolloutEngine.open_session; a phase's end pauses the turns in progress and keeps parked episodes' slots:
    nothing re-prefilled), prefill = a session per phase (the cut turns and the parked episodes re-prefilled next
    phase). kept / reprefill_tokens count them per phase."""
    episode_len = a.prompt + a.turns * a.turn_tokens + (a.turns - 1) * a.obs_tokens
    limits = AgentLimits(max_turns=a.turns, max_turn_tokens=a.turn_tokens, max_episode_tokens=episode_len,
                         context_limited=False, step_timeout_s=60.0, on_env_error="stop", workers=held(a),
                         overlap=True)
    env_kwargs = dict(latency_s=latency_s, obs_tokens=a.obs_tokens, turns=a.turns, jitter=jitter,
                      spread_s=None if a.spread_ms is None else a.spread_ms / 1000)
    runner = EpisodeRunner(EnvironmentFactory(SimulatedTool, env_kwargs), IdsTokenizer(), limits, workers=pool)
    params = SamplingParams(max_new_tokens=a.turn_tokens, temperature=1.0)
    total = a.episodes * (a.async_phases + lookahead(a) + 4)
    pool_ids = prompts(total, a.prompt, engine.model.config.vocab_size)
    in_flight, next_i, batches, sampled, phases, timing = [], 0, [], 0, [], {}
    keep = partial_kv == "keep"
    kept = engine.open_session(params, slot_len=episode_len, eos_token_ids=[], num_slots=held(a)) if keep \
        else None

    def phase(version: int):
        nonlocal next_i, in_flight, sampled
        while len(in_flight) < held(a):
            in_flight += runner.begin_runs(starts(pool_ids[next_i:next_i + 1]), first_index=next_i)
            next_i += 1
        clock = timing.get("clock")
        marks, captured = clock.marks() if clock else None, engine.runner.captures
        t = time.perf_counter()
        with (kept.phase() if keep else engine.session(params, slot_len=episode_len, eos_token_ids=[],
                                                       num_slots=held(a))) as session:
            before = dataclasses.asdict(session.stats)  # a kept session counts every phase: this one's = after - before
            left = runner.run_phase(session, in_flight, version=version, keep=keep,  # the oldest episodes: a batch
                                    enough=lambda: all(r.finish_reason is not None for r in in_flight[:a.episodes])
                                    and (session.stats.steps - before["steps"] >= pace
                                         or all(r.finish_reason for r in in_flight)))
        st = {k: v - before[k] for k, v in dataclasses.asdict(session.stats).items() if k != "extra"}
        sampled += st["new_tokens"]
        rows = round(st["stepped_rows"] / max(1, st["steps"]), 1)
        phases.append(dict(seconds=round(time.perf_counter() - t, 4), decode_steps=st["steps"], rows_per_step=rows,
                           new_tokens=st["new_tokens"], prefill_tokens=st["prefill_tokens"],
                           extend_tokens=st["extend_tokens"], captures=engine.runner.captures - captured, **left,
                           **({"_marks": marks, "_ends": clock.marks()} if clock else {})))
        done, in_flight = in_flight[:a.episodes], in_flight[a.episodes:]
        return done, left

    pace = 0  # the product's pace (trainer/agent_stream.py): a batch's most model tokens over lookahead + 1 phases
    phase(0)  # warm-up: the stream fills up (the first phase has nothing carried over)
    pace = -(-a.turns * a.turn_tokens // (lookahead(a) + 1)) + a.stagger_steps
    for _ in range(lookahead(a)):  # and its batches fall into step, each a phase's turns behind the one before
        phase(0)
    sync(a.device)
    phases.clear()
    clock = Clock(a.device)  # where the timed phases' wall goes: device calls, and the host's waits for the tools
    timing["clock"] = clock
    wrap_runner(clock, engine.runner)
    clock.wrap(runner, "_answers", "answers", device=False)
    t0, sampled = time.perf_counter(), 0
    cut = parked = kept_n = reprefill = 0
    for v in range(1, a.async_phases + 1):
        done, left = phase(v)
        batches.append(done)
        cut, parked = cut + left["cut"], parked + left["released"]
        kept_n, reprefill = kept_n + left["kept"], reprefill + left["reprefill_tokens"]
    sync(a.device)
    seconds = time.perf_counter() - t0
    if kept is not None:
        kept.close()
    spent = clock.device_seconds(DEVICE_KINDS)
    for ph in phases:  # each phase's own device time and collector pauses, to tell a slow phase's cause
        ph.update(clock.between(ph.pop("_marks"), ph.pop("_ends"), DEVICE_KINDS))
    host = {k: round(v, 4) for k, v in clock.host.items() if k == "answers"}
    clock.close()
    assert all(r.finish_reason == "done" for b in batches for r in b), [r.finish_reason for r in batches[0][:4]]
    tokens = sum(len(s.token_ids) for b in batches for r in b for s in r.segments if s.kind == "model")
    carried = sum(len({v for s in r.segments if s.kind == "model" for v in s.versions}) > 1 for b in batches for r in b)
    return dict(seconds=seconds, phases=a.async_phases, max_staleness=a.max_staleness, in_flight=held(a),
                trained_tokens=tokens, tokens_per_s=tokens / seconds,
                sampled_tokens_per_s=sampled / seconds, cut_turns=cut, parked_released=parked, partial_kv=partial_kv,
                kept_sequences=kept_n, reprefill_tokens=reprefill,
                prefill_tokens=sum(ph["prefill_tokens"] for ph in phases),
                episodes_across_phases=carried, device_s=spent, device_busy=round(sum(spent.values()) / seconds, 3),
                host_s=host, phase_records=phases)


def single_turn(engine, ids, a) -> dict:
    params = SamplingParams(max_new_tokens=a.turns * a.turn_tokens, temperature=1.0)
    clock = Clock(a.device)
    wrap_runner(clock, engine.runner)
    seconds, result, extra = measured(
        lambda: engine.generate(ids, params, eos_token_ids=[], pad_token_id=0, ignore_eos=True), clock, a.device)
    sampled = sum(map(len, result.response_ids))
    return dict(seconds=seconds, sampled_tokens=sampled, tokens_per_s=sampled / seconds,
                decode_steps=engine.last_stats["steps"], **extra)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


SWITCH = {"off": False, "on": True, "auto": None}


def capture_buckets(engine, a) -> dict:
    """Every decode bucket's CUDA graph for the async cases' slots (held(a)), captured before they are timed
    (a one-token generate() per bucket). A run captures each bucket the first time one of its steps needs it (the
    step runs eagerly first: 0.3-0.35 s a bucket on an H100 in a phase's device time), which would otherwise land in
    whichever timed phase first stepped that many rows: a run-order effect of the benchmark, not of the stream."""
    if not engine.runner.use_graphs:
        return {"buckets": 0, "captures": 0, "seconds": 0.0}
    many = prompts(held(a), a.prompt, engine.model.config.vocab_size)
    params = SamplingParams(max_new_tokens=2, temperature=1.0)  # the async cases' sampling: the same graphs
    buckets, before = runner_module.decode_buckets(held(a)), engine.runner.captures
    sync(a.device)
    t = time.perf_counter()
    for b in buckets:
        engine.generate(many[:b], params, eos_token_ids=[], pad_token_id=0, ignore_eos=True)
    sync(a.device)
    return {"buckets": len(buckets), "captures": engine.runner.captures - before,
            "seconds": round(time.perf_counter() - t, 3)}


def run_variant(model, a, pool: Workers, common: dict, compile) -> list:
    """One engine with these settings: warm-ups, the single-turn baseline, every latency; its JSON lines."""
    episode_len = a.prompt + a.turns * a.turn_tokens + (a.turns - 1) * a.obs_tokens
    engine = RolloutEngine(model, EngineConfig(max_slots=held(a) if a.async_phases else a.episodes,
                                               max_seq_tokens=episode_len,
                                               compile=SWITCH[compile]))
    engine.wake()
    ids = prompts(a.episodes, a.prompt, model.config.vocab_size)
    common = dict(common, engine_compile=compile)
    lines = []
    with torch.inference_mode():
        single_turn(engine, ids, a)            # warm-up: layout, fused weights, graphs, compile
        multi_turn(engine, ids, a, 0.0, pool)  # and the session's layout, worker threads
        base = median_run([single_turn(engine, ids, a) for _ in range(a.repeats)])
        lines.append(dict(case="single_turn", **common, **base))
        emit(**lines[-1])
        for latency, jitter in [(ms, False) for ms in a.latency_ms] + [(ms, True) for ms in a.jitter_ms]:
            multi_turn(engine, ids, a, latency / 1000, pool, jitter)  # warm-up
            r = median_run([multi_turn(engine, ids, a, latency / 1000, pool, jitter) for _ in range(a.repeats)])
            # lock-step episodes idle the device for every turn's latency; with jitter, the others decode meanwhile
            bound = None if jitter else base["seconds"] / (base["seconds"] + (a.turns - 1) * latency / 1000)
            lines.append(dict(case="multi_turn_jitter" if jitter else "multi_turn", latency_ms=latency, **common, **r,
                              vs_single_turn=r["tokens_per_s"] / base["tokens_per_s"], lockstep_bound=bound))
            emit(**lines[-1])
        cases = [(ms, False) for ms in a.latency_ms] + [(ms, True) for ms in a.jitter_ms] if a.async_phases else []
        if cases:
            lines.append(dict(case="capture", **common, **capture_buckets(engine, a)))
            emit(**lines[-1])
        for (latency, jitter), partial_kv in itertools.product(cases, a.partial_kv):
            multi_turn_async(engine, a, latency / 1000, pool, jitter, partial_kv)  # warm-up
            for order in ("first", "second"):  # twice, apart in time: a run-order effect would show
                r = multi_turn_async(engine, a, latency / 1000, pool, jitter, partial_kv)
                lines.append(dict(case="async_jitter" if jitter else "async", measured=order, latency_ms=latency,
                                  **common, **r, vs_single_turn=r["tokens_per_s"] / base["tokens_per_s"],
                                  sampled_vs_single_turn=r["sampled_tokens_per_s"] / base["tokens_per_s"]))
                emit(**lines[-1])
        if a.profile_extend:
            for record in extend_profile(engine, ids, a):
                emit(**common, **record)
    engine.release()
    return lines


def extend_profile(engine, ids, a) -> list[dict]:
    """One lock-step extend call (every episode's observation after its first turn) under torch.profiler, the
    session driven by hand: is the pass bound by the device (kernels back to back) or by the host (gaps between
    launches)? Its wall, its kernels' device time and the top kernels (profiling.summarize), and the same for the
    prompt prefill of the same episodes for comparison (per token)."""
    from profiling import profile_call

    episode_len = a.prompt + a.turns * a.turn_tokens + (a.turns - 1) * a.obs_tokens
    params = SamplingParams(max_new_tokens=a.turn_tokens, temperature=1.0)
    out = []

    def profiled(kind: str, fn, tokens: int) -> None:
        sync(a.device)
        record = profile_call(fn, a.device)
        out.append(dict(case="extend_profile", part=kind, tokens=tokens,
                        us_per_token=round(record["wall_ms"] * 1e3 / tokens, 3), **record))

    with engine.session(params, slot_len=episode_len, eos_token_ids=[], num_slots=len(ids)) as session:
        for i, prompt in enumerate(ids):
            session.start(i, prompt, a.turn_tokens)
        profiled("prefill", session._prefill, sum(map(len, ids)))
        ended = 0
        while ended < len(ids):
            ended += len(session.step())
        obs = [[(7 * i + j) % 1000 + 1 for j in range(a.obs_tokens)] for i in range(len(ids))]
        for i in range(len(ids)):
            session.extend(i, obs[i], a.turn_tokens)
        profiled("extend", session._prefill, len(ids) * (a.obs_tokens + 1))  # + each turn's last sampled id
        while session.decoding:
            session.step()
    return out


def side_by_side(lines: list) -> dict:
    """Per multi-turn case: each variant's tokens/s and ratio to single turn."""
    table: dict = {}
    for line in lines:
        if line["case"] in ("single_turn", "capture") or line["case"].startswith("async"):
            continue
        name = f"{line['case']}@{line['latency_ms']:g}ms"
        table.setdefault(name, {})[f"compile={line['engine_compile']}"] = dict(
            tokens_per_s=round(line["tokens_per_s"]), vs_single_turn=round(line["vs_single_turn"], 3),
            extend_pass_ms=line["extend_pass_ms"], device_busy=line["device_busy"])
    return dict(table=table)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--episodes", type=int, default=256)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--turn-tokens", type=int, default=64)
    p.add_argument("--obs-tokens", type=int, default=32)
    p.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 50.0, 500.0])
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case; the median is reported")
    p.add_argument("--jitter-ms", type=float, nargs="*", default=[],
                   help="also these mean latencies with each step's drawn uniformly in [mean - spread, mean + spread]")
    p.add_argument("--spread-ms", type=float, default=None,
                   help="the jitter cases' spread (default: the mean itself, [0, 2 x mean]; e.g. 25 for 50 +- 25 ms)")
    p.add_argument("--engine-compile", nargs="+", choices=sorted(SWITCH), default=["auto"],
                   help="EngineConfig.compile of each variant (auto: the engine's rule)")
    p.add_argument("--profile-extend", action="store_true",
                   help="per variant, after the timed cases: one lock-step extend call and the prompt prefill under "
                        "torch.profiler (device time, busy share, top kernels)")
    p.add_argument("--extend-kernel", choices=["on", "off"], default="on",
                   help="runner.EXTEND_KERNEL: extend passes' attention through rollout/extend_kernel.py (Triton) "
                        "or the torch path (a gathered copy of the slots, a [rows, tokens, context] mask)")
    p.add_argument("--async-phases", type=int, default=0,
                   help="also the asynchronous stream's rollout (--max-staleness) per latency: this many timed phases "
                        "of `episodes` completed episodes each, measured twice (0 = off)")
    p.add_argument("--max-staleness", type=int, default=1, help="the async cases' rollout.max_staleness k: "
                   "(max(1, k - 1) + 1) x episodes in flight and that pace, as the product's stream")
    p.add_argument("--stagger-steps", type=int, default=0,
                   help="an experiment, not the product's rule: this many decode steps added to the async pace, so "
                        "that the batches' turn boundaries fall apart (e.g. turn_tokens / 2)")
    p.add_argument("--partial-kv", nargs="+", choices=["auto", "keep", "prefill"], default=["auto"],
                   help="the asynchronous cases' rollout.partial_kv, each in turn on the same engine (A/B: keep "
                        "prefill); auto = what a user gets: keep on CUDA (an engine kept awake), prefill on the CPU")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shape, 8 episodes x 2 turns")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: the host's own costs at a turn boundary (host_s) with a tiny model, e.g. --device cpu "
                        "--shape tiny --episodes 256 (the decode itself is not representative there)")
    a = p.parse_args(argv)
    a.partial_kv = [("keep" if a.device == "cuda" and not a.smoke else "prefill") if m == "auto" else m
                    for m in a.partial_kv]
    runner_module.EXTEND_KERNEL = a.extend_kernel == "on"
    if a.smoke:
        a.device, a.shape, a.episodes, a.turns, a.prompt, a.turn_tokens, a.obs_tokens = "cpu", "tiny", 8, 2, 16, 8, 4
        a.latency_ms, a.repeats, a.jitter_ms = [0.0, 20.0], 1, [20.0]
        torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    with torch.device(a.device):
        model = CausalLM(decoder_config(a.shape)).to(dtype).eval()
    pool = Workers(held(a), name="bench-env")  # the asynchronous case holds (lookahead + 1) x the episodes
    common = dict(shape=a.shape, device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                  episodes=a.episodes, turns=a.turns, prompt=a.prompt, turn_tokens=a.turn_tokens,
                  obs_tokens=a.obs_tokens, repeats=a.repeats, extend_kernel=a.extend_kernel,
                  **({"spread_ms": a.spread_ms} if a.spread_ms is not None else {}))
    lines = []
    for compile in a.engine_compile:
        lines += run_variant(model, a, pool, common, compile)
        gc.collect()
        if a.device == "cuda":
            torch.cuda.empty_cache()
    if len(a.engine_compile) > 1:
        emit(case="variants", **common, **side_by_side(lines))


if __name__ == "__main__":
    main()
