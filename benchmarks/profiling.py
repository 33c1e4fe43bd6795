"""Summaries of a torch.profiler run for the benchmarks: device time per kernel group, the top kernels,
host-side waits, and how busy the device was over the wall time of the profiled region; `by_phase` splits
the kernels by the trainer's phases (the `phase/<name>` ranges RLTrainer.train_step records).

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ...  # the region, ending with a device sync
    for record in summarize(prof, wall_s) + by_phase(prof): print(json.dumps(record))
"""
from __future__ import annotations

GROUPS = (("flash_attention", ("flash",)), ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas")),
          ("logprob_triton", ("stats_kernel", "grad_kernel")), ("rollout_triton", ("decode_attention", "sample")),
          ("inductor_triton", ("triton",)), ("copy_or_fill", ("copy", "fill", "memset", "cat")))
# Counted by op name: `_local_scalar_dense` and `nonzero` also count reads of host tensors, which never wait for
# the GPU (pack_rows plans on CPU masks: ~50 such reads per 0.5B micro-batch, 2026-12-04). The device syncs
# themselves, by call site: benchmarks/sync_points.py (torch.cuda.set_sync_debug_mode).
HOST_WAITS = ("Synchronize", "_local_scalar_dense", "aten::nonzero")
PHASE = "phase/"  # trainer/core.py's record_function ranges (on the host, and mirrored on the device by kineto)


def group(name: str) -> str:
    low = name.lower()
    return next((key for key, words in GROUPS if any(w in low for w in words)), "other")


def summarize(prof, wall_s: float, top: int = 15) -> list[dict]:
    """JSON-ready records: one per kernel group, `top` kernels, and a totals line."""
    kernels = [e for e in prof.key_averages()
               if str(getattr(e, "device_type", "")).endswith("CUDA") and not e.key.startswith(PHASE)]
    total_us = sum(e.self_device_time_total for e in kernels)
    groups: dict = {}
    for e in kernels:
        g = groups.setdefault(group(e.key), [0.0, 0])
        g[0] += e.self_device_time_total
        g[1] += e.count
    out = [dict(group=name, device_ms=us / 1000, share=us / max(total_us, 1e-9), launches=n)
           for name, (us, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])]
    out += [dict(kernel=e.key[:120], device_ms=e.self_device_time_total / 1000, launches=e.count, group=group(e.key))
            for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]]
    waits = {e.key: e.count for e in prof.key_averages() if any(w in e.key for w in HOST_WAITS)}
    out.append(dict(total_device_ms=total_us / 1000, wall_ms=wall_s * 1000,
                    device_busy=total_us / 1e6 / wall_s if wall_s else None, host_waits=waits))
    return out


def by_phase(prof, top: int = 8) -> list[dict]:
    """One record per trainer phase: its device time, kernel launches and `top` kernels, each kernel counted in
    the innermost `phase/<name>` range around its start (the device-side copy of the range where kineto made
    one, else the host range). Without CUDA kernels (a CPU run) the host ops' self time stands in for them."""
    events = list(prof.events())
    on_cuda = [e for e in events if str(e.device_type).endswith("CUDA")]
    ranges = [e for e in (on_cuda or events) if e.name.startswith(PHASE)] or [
        e for e in events if e.name.startswith(PHASE)]
    work = [e for e in on_cuda if not e.name.startswith(PHASE)]
    cost = (lambda e: e.time_range.elapsed_us()) if work else (lambda e: e.self_cpu_time_total)
    if not work:
        work = [e for e in events if not str(e.device_type).endswith("CUDA") and not e.name.startswith(PHASE)]
    spans = sorted(((r.time_range.start, r.time_range.end, r.name[len(PHASE):]) for r in ranges),
                   key=lambda s: s[1] - s[0])  # innermost (shortest) first
    phases: dict = {}
    for e in work:
        start = e.time_range.start
        name = next((n for a, b, n in spans if a <= start <= b), "outside")
        per = phases.setdefault(name, {})
        us, n = per.get(e.name, (0.0, 0))
        per[e.name] = (us + cost(e), n + 1)
    out = []
    for name, per in sorted(phases.items(), key=lambda kv: -sum(us for us, _ in kv[1].values())):
        best = sorted(per.items(), key=lambda kv: -kv[1][0])[:top]
        out.append(dict(phase=name, device_ms=sum(us for us, _ in per.values()) / 1000,
                        launches=sum(n for _, n in per.values()),
                        top=[dict(kernel=k[:100], ms=round(us / 1000, 3), launches=n, group=group(k))
                             for k, (us, n) in best]))
    return out


def idle_gaps(prof, min_gap_us: float = 20.0, top: int = 12) -> dict:
    """Where the device waited for the host: the gaps of at least `min_gap_us` between the kernels (their union
    over the profiled region), each charged to what the host was doing at the gap's middle: the innermost host op
    running then, named by its first phaserl frame when the profiler recorded stacks (`with_stack=True`), else
    by the op. Returns the idle total, the gap count and the `top` places by idle time."""
    import bisect

    events = list(prof.events())
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if str(e.device_type).endswith("CUDA") and not e.name.startswith(PHASE))
    host = sorted((e for e in events if not str(e.device_type).endswith("CUDA")), key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in host]
    gaps, end = [], (kernels[0][1] if kernels else 0.0)
    for a, b in kernels[1:]:
        if a - end >= min_gap_us:
            gaps.append((end, a))
        end = max(end, b)
    places: dict = {}
    for a, b in gaps:
        mid = (a + b) / 2
        label, last = "(no host op)", bisect.bisect_right(starts, mid) - 1  # the last host op started by then
        for i in range(last, max(-1, last - 4000), -1):
            e = host[i]
            if e.time_range.end >= mid:  # the latest-starting op that still runs: the innermost
                frames = [f for f in (getattr(e, "stack", None) or []) if "phaserl/" in f or "benchmarks/" in f]
                label = f"{frames[0]} [{e.name}]" if frames else e.name
                break
        us, n = places.get(label, (0.0, 0))
        places[label] = (us + (b - a), n + 1)
    best = sorted(places.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(idle_ms=round(sum(b - a for a, b in gaps) / 1000, 2), gaps=len(gaps), min_gap_us=min_gap_us,
                places=[dict(where=k[:160], ms=round(us / 1000, 2), gaps=n) for k, (us, n) in best])


def profile_call(fn, device: str, top: int = 8) -> dict:
    """One call of fn under torch.profiler (ending with a device sync): wall_ms, device_ms, device_busy, the
    kernel groups (group, ms, launches) and the top kernels (kernel, launches, ms), from `summarize`; on the CPU
    the kernel lists stay empty (CUDA kernels only)."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    records = summarize(prof, wall, top=top)
    return {"wall_ms": round(wall * 1e3, 2), "device_ms": round(records[-1]["total_device_ms"], 2),
            "device_busy": records[-1]["device_busy"],
            "groups": [(r["group"], round(r["device_ms"], 2), r["launches"]) for r in records if "share" in r],
            "top": [(r["kernel"][:60], r["launches"], round(r["device_ms"], 3)) for r in records if "kernel" in r]}
