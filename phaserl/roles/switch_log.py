"""The actor's mode switches: which ones reach the console, and what every one leaves in metrics.jsonl.

A run switches twice a step (and twice more per validation), so one console line per switch buried the step
lines (2 of every 3 lines of the CPU quickstart). The console shows the first switch each way with
the seed's message (`[HybridEngine] Switching actor from training to rollout mode (...)`, which users grep
for), then a switch only when its cost changes (memory after it, or its KV cache, by more than
`MEMORY_STEP_GB`; its time by more than 2x and 50 ms), and a summary line every `SUMMARY_EVERY` switches
each way. Every switch's time and memory are kept for the step's metrics (`hybrid/*`, docs/metrics.md).
Not here: the switch itself (HybridActor._switch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

SUMMARY_EVERY = 50     # switches each way between two summary lines
MEMORY_STEP_GB = 0.1   # a change in memory after the switch, or in its KV cache, worth a line
TIME_FACTOR, TIME_STEP_S = 2.0, 0.05  # a change in its time worth a line: both over 2x and over 50 ms


@dataclass
class _Direction:
    count: int = 0
    seconds: float = 0.0           # since the last summary line
    slowest: float = 0.0           # since the last summary line
    shown: Optional[tuple] = None  # (seconds, memory after GB or None, KV GB) of the last switch shown


@dataclass
class SwitchLog:
    directions: dict = field(default_factory=dict)  # target mode -> _Direction
    pending: list = field(default_factory=list)     # every switch since the last `drain`

    def record(self, source: str, target: str, *, seconds: float, memory_after_gb: Optional[float],
               kv_cache_gb: float, detail: str) -> Optional[str]:
        """Keep the switch for the metrics; the console line to print for it, or None. `detail` is the seed
        line's parenthesis without the time ("memory ..., KV cache ...")."""
        self.pending.append({"to": target, "seconds": seconds, "memory_after_gb": memory_after_gb,
                             "kv_cache_gb": kv_cache_gb})
        d = self.directions.setdefault(target, _Direction())
        d.count, d.seconds, d.slowest = d.count + 1, d.seconds + seconds, max(d.slowest, seconds)
        line = f"[HybridEngine] Switching actor from {source} to {target} mode ({seconds * 1000:.1f} ms, {detail})"
        if d.shown is None:
            d.shown = (seconds, memory_after_gb, kv_cache_gb)
            return (line + f"; later switches {'to ' + target}: a line when their cost changes and a summary every "
                    f"{SUMMARY_EVERY}, each in metrics.jsonl (hybrid/*)")
        if _changed(d.shown, (seconds, memory_after_gb, kv_cache_gb)):
            d.shown = (seconds, memory_after_gb, kv_cache_gb)
            return line + " (its cost changed)"
        if d.count % SUMMARY_EVERY == 0:
            summary = (f"[HybridEngine] Switching actor from {source} to {target} mode: {d.count} switches so far; "
                       f"the last {SUMMARY_EVERY} took {d.seconds / SUMMARY_EVERY * 1000:.1f} ms on average, "
                       f"{d.slowest * 1000:.1f} ms at most; this one: {detail}")
            d.seconds = d.slowest = 0.0
            return summary
        return None

    def drain(self) -> dict:
        """The switches since the last call as metrics (docs/metrics.md, `hybrid/`), then forgets them."""
        switches, self.pending = self.pending, []
        if not switches:
            return {}
        out = {"hybrid/switches": float(len(switches))}
        for target in ("rollout", "training"):
            these = [s for s in switches if s["to"] == target]
            if not these:
                continue
            out[f"hybrid/to_{target}_s"] = sum(s["seconds"] for s in these)
            memory = [s["memory_after_gb"] for s in these if s["memory_after_gb"] is not None]
            if memory:  # a CUDA device: memory allocated after the switch, the step's largest
                out[f"hybrid/memory_after_{target}_switch_gb"] = max(memory)
        kv = [s["kv_cache_gb"] for s in switches if s["to"] == "rollout"]
        if kv:
            out["hybrid/kv_cache_gb"] = max(kv)
        return out


def _changed(shown: tuple, now: tuple) -> bool:
    (t0, m0, kv0), (t1, m1, kv1) = shown, now
    slower = max(t0, t1) > TIME_FACTOR * min(t0, t1) and abs(t1 - t0) > TIME_STEP_S
    memory = m0 is not None and m1 is not None and abs(m1 - m0) > MEMORY_STEP_GB
    return slower or memory or abs(kv1 - kv0) > MEMORY_STEP_GB
