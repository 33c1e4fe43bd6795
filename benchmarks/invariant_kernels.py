"""The bitwise mode's GPU kernels alone (models/invariant_triton.py) at Qwen2 shapes: what each costs against torch's,
and whether each stays exact.

For each model shape, projection (q, k/v, o, gate = up, gate_up, down, lm_head) and row count N, one JSON line per
variant of the invariant matmul, bf16 in and out as invariant.linear calls it:
  torch        F.linear (cuBLAS), the default mode's numbers
  split_off    invariant_triton.SPLIT_K = False: one split, one program per 64 x 64 tile
  split_auto   split-K as the product runs it: k_splits(K, M) splits deep weights only (K >= DEEP_RATIO x M and
               K >= DEEP_MIN_K), every other weight is split_off; the launch chosen by the grid size
  split_splits / split_tiles   the two launches forced (same bits, other speed), when the weight has splits
  min_steps_S, fill_P   split_auto with MIN_SPLIT_STEPS = S or FILL_PROGRAMS = P (other splits, other bits): how
               the product's constants (4, 132) compare on a deep weight
  split_all, split_all_fill_264, split_all_min_steps_8   the depth rule off (DEEP_RATIO = DEEP_MIN_K = 0): a shallow
               or short weight (q, k/v, o, gate) split as a deep one would, to re-check that the rule leaves it whole
(each sweep variant only where it splits the weight otherwise than the product and the variants before it)
with `ms` (CUDA events, after warm-up; each call of a replay takes another copy of the weight, enough copies to
exceed twice the L2 (`weight_copies`), so the weight comes from device memory as in a decode step; --hot: one
weight, L2-resident where it fits), `x_torch` (ms / torch's ms) and the exactness checks: `rows_alone_equal`
(rows 0, N/2 and N-1 each computed in a 1-row call equal the batched rows bit for bit), `equals_reference` (the
first min(N, 64) rows equal a 64-row call's, whichever launch each took) and `max_abs_diff_vs_torch`. Then per N a
`layer` line: one decoder layer's projections (q, k, v, o, gate, up, down: the bitwise engine's calls) summed for
torch, split_off, split_auto (the product's rule; `splits` gives each projection's count under it) and split_all
(every weight split; with the sweep).
Then the attention kernel at decode shapes (one query per sequence at the end of L keys) against torch's SDPA,
and the log-sum-exp over the vocabulary against torch.logsumexp.

--tiles: instead of all that, the tile experiment: for each projection (q, kv, o, gate, gate_up, down) and row count
(TILE_ROWS), each matmul configuration (TILES: BLOCK_M x BLOCK_N x BLOCK_K, warps, stages; the split rule unchanged)
timed against torch and against invariant_tiles.BASE at the same rows, and `bits_equal`: its output rows (the first
N, and N rows from offset TILE_OFFSET) equal bit for bit BASE's output for the same rows computed within one
TILE_REFERENCE-row call (the invariant: a row's bits never depend on the row count or the tile). `picked`: the tile
the product takes for that call here (invariant_triton.tile_for: invariant_tiles.candidate where it agrees).

    python benchmarks/invariant_kernels.py                  # 0.5b and 1.5b on the GPU (well under two minutes)
    python benchmarks/invariant_kernels.py --no-sweep --shapes 0.5b
    python benchmarks/invariant_kernels.py --tiles          # the tile experiment, 0.5b and 1.5b
    TRITON_INTERPRET=1 python benchmarks/invariant_kernels.py --smoke   # CPU, Triton's interpreter: checks the script
    TRITON_INTERPRET=1 python benchmarks/invariant_kernels.py --smoke --tiles
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from phaserl.models import invariant_triton as it  # noqa: E402
from qwen2_shapes import SHAPES  # noqa: E402

ROWS = (1, 8, 32, 64, 256, 512, 4096, 16384)
REFERENCE_ROWS = 64
DIFF_ROWS = 1024      # max |Δ| vs torch over the first rows only (an lm_head output of 16384 rows is 5 GB)
SWEEP = {f"min_steps_{n}": dict(MIN_SPLIT_STEPS=n) for n in (1, 2, 8)}  # other caps on the splits' depth
SWEEP.update({f"fill_{n}": dict(FILL_PROGRAMS=n) for n in (264, 528)})     # other grid targets
EVERY = dict(DEEP_RATIO=0, DEEP_MIN_K=0)  # no depth rule: split_all first, so the layer line finds it on every weight
SWEEP.update(split_all=EVERY, split_all_fill_264=dict(EVERY, FILL_PROGRAMS=264),
             split_all_min_steps_8=dict(EVERY, MIN_SPLIT_STEPS=8))
LAYER_CALLS = {"q": 1, "kv": 2, "o": 1, "gate": 2, "down": 1}  # a bitwise layer's projections (gate and up alike)
LAYER_VARIANTS = ("torch", "split_off", "split_auto", "split_all")  # the layer line's sums (split_all: with the sweep)


def projections(shape: str) -> dict:
    """name -> (M, K, has_bias) of the weight [M, K] (Qwen2: q/k/v carry a bias)."""
    s = SHAPES[shape]
    H, inter, V = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    D = H // s["num_attention_heads"]
    return {"q": (H, H, True), "kv": (s["num_key_value_heads"] * D, H, True), "o": (H, H, False),
            "gate": (inter, H, False), "gate_up": (2 * inter, H, False), "down": (H, inter, False),
            "lm_head": (V, H, False)}


L2_BYTES = 50 << 20   # an H100's L2 cache: the copies a cold timing cycles through hold at least twice this
COLD_MAX = 128        # ... and at most this many copies of one weight


class Cold:
    """Copies of a weight that the timed calls take in turn (`next()`), so each call reads its weight from device
    memory, as a decode step does (every layer's weights pass once per step, far more than the L2 holds). One
    weight timed over and over stays in the L2 when it fits (a 0.5B q projection is 1.6 MB): faster than it ever
    runs in the engine. hot=True (--hot) or off CUDA: the one weight."""

    def __init__(self, w: torch.Tensor, hot: bool = False):
        n = 1 if hot or w.device.type != "cuda" else min(COLD_MAX, max(1, -(-2 * L2_BYTES // w.nbytes)))
        self.items, self.i = [w] + [w.clone() for _ in range(n - 1)], 0

    def next(self) -> torch.Tensor:
        self.i += 1
        return self.items[(self.i - 1) % len(self.items)]


def timed_ms(fn, device, budget_ms: float = 40.0, min_calls: int = 1) -> float:
    """Mean device milliseconds of one fn() call: warmed up (compiles), then replayed from a CUDA graph of several
    calls (at least min_calls: a Cold weight's copies, each taken once a replay), as the engine's decode step replays
    its graph (no Python launch cost in the number)."""
    fn(), fn()
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    calls = max(min_calls, int(min(20, max(1, budget_ms / 4 / max(start.elapsed_time(end), 1e-3)))))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError as e:  # keep the run going: this number then includes the Python launch cost
        print(json.dumps({"warning": f"CUDA graph capture failed ({e}); timed eagerly"}), file=sys.stderr)
        graph = _Eager(fn, calls)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    reps = int(min(50, max(2, budget_ms / max(start.elapsed_time(end), 1e-3))))
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    del graph
    return start.elapsed_time(end) / (reps * calls)


class _Eager:
    """A stand-in for a CUDA graph of `calls` calls of fn."""

    def __init__(self, fn, calls: int):
        self.fn, self.calls = fn, calls

    def replay(self) -> None:
        for _ in range(self.calls):
            self.fn()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


class Settings:
    """invariant_triton's module constants for the duration of a block (split-K off, another MIN_SPLIT_STEPS)."""

    def __init__(self, **values):
        self.values, self.saved = values, {}

    def __enter__(self):
        self.saved = {k: getattr(it, k) for k in self.values}
        for k, v in self.values.items():
            setattr(it, k, v)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            setattr(it, k, v)


def matmul_lines(common: dict, x_all, w, b, rows_list, device, sweep: bool, hot: bool = False):
    """Yield the JSON dicts of one projection: every variant at every row count (timed on Cold copies of w)."""
    M, K = w.shape
    cold = Cold(w, hot)
    n = len(cold.items)
    common = {**common, "weight_copies": n}
    S, KS = it.k_splits(K, M)
    variants = {"split_off": (dict(SPLIT_K=False), "auto"), "split_auto": ({}, "auto")}
    if S > 1:
        variants.update(split_splits=({}, "splits"), split_tiles=({}, "tiles"))
    swept, seen = {}, {(S, KS)}  # the sweep's settings that split this weight otherwise (each once)
    for name, settings in SWEEP.items():
        with Settings(**settings):
            if it.k_splits(K, M) not in seen:
                swept[name] = (settings, "auto")
                seen.add(it.k_splits(K, M))
    references = {}
    for name, (settings, launch) in variants.items():
        with Settings(**settings):
            references[name] = bits(it.matmul(x_all[:REFERENCE_ROWS], w, b, x_all.dtype, launch=launch))
    for N in rows_list:
        x = x_all[:N]  # [N, K]
        torch_ms = timed_ms(lambda: F.linear(x, cold.next(), b), device, min_calls=n)
        yield {**common, "rows": N, "variant": "torch", "ms": torch_ms}
        expected = F.linear(x[:DIFF_ROWS], w, b).float()
        runs = dict(variants)
        if sweep:
            runs.update(swept)
        for name, (settings, launch) in runs.items():
            with Settings(**settings):
                splits, per = it.k_splits(K, M)
                ms = timed_ms(lambda: it.matmul(x, cold.next(), b, x.dtype, launch=launch), device, min_calls=n)
                out = it.matmul(x, w, b, x.dtype, launch=launch)  # [N, M]
                alone = all(torch.equal(bits(it.matmul(x[i:i + 1], w, b, x.dtype, launch=launch)), bits(out[i:i + 1]))
                            for i in sorted({0, N // 2, N - 1}))
                line = {**common, "rows": N, "variant": name, "splits": splits, "split_depth": per, "ms": ms,
                        "x_torch": ms / torch_ms, "rows_alone_equal": alone,
                        "max_abs_diff_vs_torch": float((out[:DIFF_ROWS].float() - expected).abs().max())}
                if name in references:
                    n = min(N, REFERENCE_ROWS)
                    line["equals_reference"] = torch.equal(bits(out[:n]), references[name][:n])
                del out
            yield line


def add_to_layer(layer: dict, ms: dict, calls: int, rows_list, sweep: bool) -> None:
    """Add `calls` times one projection's ms [(rows, variant)] to the layer's sums. split_all is absent where forcing
    splits leaves this weight's splits as the product's (a deep weight): split_auto's number stands for it there."""
    for N in rows_list:
        for v in LAYER_VARIANTS:
            t = ms.get((N, v), ms[(N, "split_auto")] if v == "split_all" and sweep else None)
            if t is not None:
                layer[(N, v)] = layer.get((N, v), 0.0) + calls * t


def attention_lines(common: dict, shape: str, device, dtype, smoke: bool):
    """The invariant attention kernel at decode (n sequences, one query at position L - 1) against SDPA."""
    s = SHAPES[shape]
    Hq, Hkv = s["num_attention_heads"], s["num_key_value_heads"]
    D = s["hidden_size"] // Hq
    for n in ((1, 4) if smoke else (1, 8, 32, 64, 256)):
        for L in ((40,) if smoke else (256, 1024, 4096)):
            g = torch.Generator(device=device).manual_seed(0)
            q = torch.randn(n, 1, Hq, D, generator=g, device=device).to(dtype)  # [n, 1, Hq, D]
            k, v = (torch.randn(n, L, Hkv, D, generator=g, device=device).to(dtype) for _ in range(2))  # [n, L, Hkv, D]
            qpos = torch.full((n, 1), L - 1, device=device, dtype=torch.int64)
            mine = timed_ms(lambda: it.attention(q, qpos, k, v, D ** -0.5, None), device)
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
            try:  # [n, H, T, D]; the key/value heads shared by groups of query heads
                sdpa = timed_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True), device)
            except RuntimeError:
                kr, vr = kt.repeat_interleave(Hq // Hkv, 1), vt.repeat_interleave(Hq // Hkv, 1)
                sdpa = timed_ms(lambda: F.scaled_dot_product_attention(qt, kr, vr), device)
            programs = n * Hq  # grid (n, cdiv(1, BLOCK_Q), Hq): one program per sequence and query head
            yield {**common, "measure": "attention_decode", "sequences": n, "keys": L, "heads": Hq, "kv_heads": Hkv,
                   "head_dim": D, "programs": programs, "invariant_ms": mine, "sdpa_ms": sdpa, "x_sdpa": mine / sdpa}


def logsumexp_lines(common: dict, vocab: int, device, smoke: bool):
    for N in ((1, 3) if smoke else (1, 32, 256, 1024)):
        z = torch.randn(N, vocab, device=device) * 4  # [N, V] float32
        mine = timed_ms(lambda: it.logsumexp(z), device)
        ref = timed_ms(lambda: torch.logsumexp(z, -1), device)
        yield {**common, "measure": "logsumexp", "rows": N, "vocab": vocab, "invariant_ms": mine, "torch_ms": ref,
               "x_torch": mine / ref, "max_abs_diff": float((it.logsumexp(z) - torch.logsumexp(z, -1)).abs().max())}


TILE_ROWS = (1, 8, 32, 64, 256, 2048)
TILE_REFERENCE, TILE_OFFSET = 2048 + 96, 77  # the big call's rows; the offset puts rows at other places in a tile
TILE_PROJECTIONS = ("q", "kv", "o", "gate", "gate_up", "down")
TILES = [it.Tile(*t) for t in ((64, 64, 32, 4, 3), (64, 64, 64, 4, 3), (64, 64, 64, 4, 5), (64, 64, 128, 4, 3),
                               (64, 64, 32, 4, 8), (64, 32, 128, 4, 4), (64, 128, 64, 4, 4), (32, 64, 128, 4, 4),
                               (16, 64, 128, 4, 4), (16, 32, 128, 4, 5), (16, 32, 256, 4, 3), (128, 128, 32, 8, 3),
                               (128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 4),
                               (128, 256, 64, 8, 3))]  # the first: BASE
TILE_BUDGET_MS = 15.0  # timed_ms's budget per measurement (the experiment stays near a minute per shape)


def tile_lines(base: dict, shape: str, device, dtype, rows_list, tiles, hot: bool = False):
    """The few-row tile experiment's lines for one shape (see the module docstring; timed on Cold copies)."""
    product = it.BASE
    for proj, (M, K, has_bias) in projections(shape).items():
        if proj not in TILE_PROJECTIONS:
            continue
        g = torch.Generator(device=device).manual_seed(0)
        w = (torch.randn(M, K, generator=g, device=device) * K ** -0.5).to(dtype)  # [M, K]
        b = (torch.randn(M, generator=g, device=device) * 0.1).to(dtype) if has_bias else None
        big = max(TILE_REFERENCE, max(rows_list) + TILE_OFFSET)
        x_all = torch.randn(big, K, generator=g, device=device).to(dtype)  # [R, K]
        reference = bits(it.matmul(x_all, w, b, dtype, tile=product))  # [R, M]: every row inside one big call
        cold = Cold(w, hot)
        n = len(cold.items)
        common = {**base, "measure": "tile", "proj": proj, "M": M, "K": K, "splits": it.k_splits(K, M)[0],
                  "weight_copies": n}
        for N in rows_list:
            x = x_all[:N]
            torch_ms = timed_ms(lambda: F.linear(x, cold.next(), b), device, TILE_BUDGET_MS, n)
            product_ms = None
            for tile in tiles:
                try:
                    ms = timed_ms(lambda: it.matmul(x, cold.next(), b, dtype, tile=tile), device, TILE_BUDGET_MS, n)
                    first = torch.equal(bits(it.matmul(x, w, b, dtype, tile=tile)), reference[:N])
                    shifted = x_all[TILE_OFFSET:TILE_OFFSET + N]
                    later = torch.equal(bits(it.matmul(shifted, w, b, dtype, tile=tile)),
                                        reference[TILE_OFFSET:TILE_OFFSET + N])
                except Exception as e:  # a configuration this Triton cannot build: say so, go on
                    yield {**common, "rows": N, "tile": list(tile), "error": repr(e)[:300]}
                    continue
                product_ms = ms if tile == product else product_ms
                yield {**common, "rows": N, "tile": list(tile), "base_tile": tile == product,
                       "picked": tile == it.tile_for(N, M, device, dtype, common["splits"]), "ms": ms,
                       "torch_ms": torch_ms, "x_torch": ms / torch_ms,
                       "x_base": None if product_ms is None else ms / product_ms,
                       "bits_equal": first and later, "bits_equal_first_rows": first, "bits_equal_offset_rows": later}
        if device.type == "cuda":
            torch.cuda.empty_cache()


def tiles_main(a, device, dtype, card: str) -> None:
    """--tiles: the experiment's lines, then a summary line per tile (equal everywhere, mean x_base at <= 64
    rows)."""
    began = time.perf_counter()
    rows_list = [1, 8] if a.smoke else a.rows
    tiles = TILES[:2] + [it.Tile(16, 32, 64, 4, 1)] if a.smoke else TILES
    seen = {}
    for shape in a.shapes:
        base = {"bench": "invariant_kernels", "device": card, "shape": shape, "dtype": str(dtype).split(".")[-1]}
        for line in tile_lines(base, shape, device, dtype, rows_list, tiles, a.hot):
            print(json.dumps(line), flush=True)
            s = seen.setdefault(tuple(line["tile"]), {"equal": True, "few": [], "errors": 0})
            if "error" in line:
                s["errors"] += 1
                continue
            s["equal"] &= line["bits_equal"]
            if line["rows"] <= 64 and line["x_base"] is not None:
                s["few"].append(line["x_base"])
    for tile, s in seen.items():
        print(json.dumps({"bench": "invariant_kernels", "measure": "tile_summary", "device": card, "tile": list(tile),
                          "bits_equal_everywhere": s["equal"] and not s["errors"], "errors": s["errors"],
                          "mean_x_base_rows_le_64": sum(s["few"]) / len(s["few"]) if s["few"] else None}))
    print(json.dumps({"bench": "invariant_kernels", "measure": "summary", "seconds": time.perf_counter() - began}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"])
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--no-sweep", action="store_true", help="skip the split constants' sweep lines")
    parser.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1, the tiny shape")
    parser.add_argument("--tiles", action="store_true", help="only the few-row tile experiment (rows: TILE_ROWS)")
    parser.add_argument("--hot", action="store_true", help="time each matmul on one weight, over and over (it stays "
                        "in the L2 where it fits), instead of copies that each call reads from device memory")
    a = parser.parse_args()
    if a.tiles and a.rows == list(ROWS):
        a.rows = list(TILE_ROWS)
    if a.smoke:  # the tiny shape's depths (64, 128) split only without the floor and with 1-step splits
        a.shapes, a.rows = ["tiny"], [1, 8, 70]
        it.DEEP_MIN_K, it.MIN_SPLIT_STEPS = 0, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    if not it.available(device):
        sys.exit("needs Triton on CUDA (or TRITON_INTERPRET=1 with Triton installed for --smoke)")
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter's bf16 dot is unusable
    if a.tiles:
        return tiles_main(a, device, dtype, card)
    began = time.perf_counter()
    checks = {"rows_alone_equal": [], "equals_reference": []}
    for shape in a.shapes:
        base = {"bench": "invariant_kernels", "device": card, "shape": shape, "dtype": str(dtype).split(".")[-1]}
        layer = {}  # (rows, variant) -> ms of one layer's projections
        splits = {proj: it.k_splits(K, M)[0] for proj, (M, K, _) in projections(shape).items() if proj in LAYER_CALLS}
        for proj, (M, K, has_bias) in projections(shape).items():
            g = torch.Generator(device=device).manual_seed(0)
            w = (torch.randn(M, K, generator=g, device=device) * K ** -0.5).to(dtype)  # [M, K]
            b = (torch.randn(M, generator=g, device=device) * 0.1).to(dtype) if has_bias else None
            x_all = torch.randn(max(max(a.rows), REFERENCE_ROWS), K, generator=g, device=device).to(dtype)  # [N, K]
            common = {**base, "measure": "matmul", "proj": proj, "M": M, "K": K}
            ms = {}  # (rows, variant) -> ms of this projection
            for line in matmul_lines(common, x_all, w, b, a.rows, device, not a.no_sweep, a.hot):
                print(json.dumps(line), flush=True)
                for check, seen in checks.items():
                    if check in line:
                        seen.append(line[check])
                ms[(line["rows"], line["variant"])] = line["ms"]
            add_to_layer(layer, ms, LAYER_CALLS.get(proj, 0), a.rows, not a.no_sweep)
            del w, b, x_all
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for N in a.rows:
            times = {v: layer[(N, v)] for v in LAYER_VARIANTS if (N, v) in layer}
            print(json.dumps({**base, "measure": "layer", "rows": N, "splits": splits,
                              **{f"{v}_ms": t for v, t in times.items()},
                              **{f"{v}_x_torch": t / times["torch"] for v, t in times.items() if v != "torch"}}),
                  flush=True)
        for line in attention_lines(base, shape, device, dtype, a.smoke):
            print(json.dumps(line), flush=True)
        for line in logsumexp_lines(base, SHAPES[shape]["vocab_size"], device, a.smoke):
            print(json.dumps(line), flush=True)
    print(json.dumps({"bench": "invariant_kernels", "measure": "summary", "seconds": time.perf_counter() - began,
                      **{f"all_{check}": all(seen) for check, seen in checks.items()},
                      "matmul_checks": len(checks["rows_alone_equal"])}))


if __name__ == "__main__":
    main()
