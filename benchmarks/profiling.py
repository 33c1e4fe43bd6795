"""Summaries of a torch.profiler run for the benchmarks: device time per kernel group, the top kernels,
host-side waits, and how busy the device was over the wall time of the profiled region.

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ...  # the region, ending with a device sync
    for record in summarize(prof, wall_s): print(json.dumps(record))
"""
from __future__ import annotations

GROUPS = (("flash_attention", ("flash",)), ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas")),
          ("logprob_triton", ("stats_kernel", "grad_kernel")), ("rollout_triton", ("decode_attention", "sample")),
          ("inductor_triton", ("triton",)), ("copy_or_fill", ("copy", "fill", "memset", "cat")))
HOST_WAITS = ("Synchronize", "_local_scalar_dense", "aten::nonzero")


def group(name: str) -> str:
    low = name.lower()
    return next((key for key, words in GROUPS if any(w in low for w in words)), "other")


def summarize(prof, wall_s: float, top: int = 15) -> list[dict]:
    """JSON-ready records: one per kernel group, `top` kernels, and a totals line."""
    kernels = [e for e in prof.key_averages() if str(getattr(e, "device_type", "")).endswith("CUDA")]
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
