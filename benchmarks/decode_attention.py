"""The rollout engine's decode attention alone, at the GRPO benchmark shapes: launch settings against the KV bandwidth.

One JSON line per (case, context, setting): device time of one layer's `kernels.decode_attention` (bias + RoPE + KV
write + attention, the fused path's call) inside a CUDA graph, the KV bytes it must read at that context, and the
rate that makes. `rollout/kernels.py`'s split rule (`attention_splits`) and launch constants come from these runs.

    python benchmarks/decode_attention.py                 # the uniform cases, the sweep
    python benchmarks/decode_attention.py --case 1.5b-grpo --splits 1,2,4
    python benchmarks/decode_attention.py --case 0.5b-mixed,1.5b-mixed   # mixed lengths: splits and the bound
    python benchmarks/decode_attention.py --smoke         # CPU, Triton's interpreter, tiny cases: checks the script

Uniform cases (rows, slot length, contexts timed) follow the step benchmarks: `0.5b-ref` is `rollout.py`'s and
`grpo_step.py`'s 0.5B shape (512 rows, 128 + 256), `1.5b-grpo` and `7b-grpo` are `grpo_step.py --shape 1.5b / 7b`
(256 rows of 256 + 1,024; 128 rows of 256 + 512). Every row sits at the same position, as in a fixed-length batch.

Mixed cases are `long_tail.py`'s batch as the asynchronous stream holds it mid-phase: the engine's decode buckets
of 128, 192 and 256 rows (that stream steps ~185 rows on average) in 4,224-token slots (128-token prompt,
responses up to 4,096), each row's context drawn with a fixed seed (MIXES; `-flat`: every row at the draw's mean
context, the same bytes without the long rows, for the rate a split could reach at best). They sweep
forced split counts, `attention_splits`' run bound alone (`keys:N` = max_run_keys N, no row runs) and runs of N keys,
as many as each row needs (`rows:N`: kernels.ROW_RUNS, the default's rule at N = 512) with the kernel's launch, and
add per line: the longest row's context, `chain_keys` (the keys one program of that row walks), `kv_mb` from the
sum of the rows' contexts, and `step_ms` (the layer's time x the model's layers: attention's share of one step).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from phaserl.models.layers import rope_tables  # noqa: E402
from phaserl.rollout import kernels  # noqa: E402
from qwen2_shapes import SHAPES  # noqa: E402

MAX_RUN_KEYS, ROW_RUNS = kernels.MAX_RUN_KEYS, kernels.ROW_RUNS  # the engine's rule, restored after each setting
from rollout import graph_ms  # noqa: E402

# name: (model shape, rows, slot length, contexts); mixed cases: rows are decode buckets, contexts MIXES names
CASES = {
    "0.5b-ref": ("0.5b", 512, 384, (192, 256, 383)),
    "1.5b-ref": ("1.5b", 512, 384, (256,)),
    "1.5b-grpo": ("1.5b", 256, 1280, (384, 768, 1279)),
    "7b-grpo": ("7b", 128, 768, (320, 512, 767)),
    "tiny": ("tiny", 8, 96, (40,)),
    "0.5b-mixed": ("0.5b", (128, 192, 256), 4224, ("mid-phase", "tail-end", "mid-phase-flat")),
    "1.5b-mixed": ("1.5b", (128, 192, 256), 4224, ("mid-phase", "tail-end", "mid-phase-flat")),
    "tiny-mixed": ("tiny", (8,), 96, ("mid-phase", "tail-end")),
}
UNIFORM_SPLITS = "default,1,2,3,4,6,8"
MIXED_SPLITS = "default,1,2,3,4,6,8,12,16,keys:512,keys:1024,keys:2048,rows:512,rows:1024"
PROMPT, LONGEST, FULL_SLOT = 128, 4096, 4224  # long_tail.py's prompt and longest response; MIXES are drawn at this


def draw_length(rng: random.Random) -> int:
    """long_tail.draw_length at its default scale: 90% in [32, 512], 8% in [512, 2048], 2% 4,096."""
    u = rng.random()
    if u < 0.90:
        return rng.randint(32, 512)
    return rng.randint(512, 2048) if u < 0.98 else LONGEST


def mid_phase(rows: int, rng: random.Random) -> list:
    """The stream's steady state: a response of length L is live for L steps, so live rows are drawn with weight
    L (the tail's 2% of samples are ~19% of live rows), each somewhere uniform in its response."""
    contexts = []
    while len(contexts) < rows:
        length = draw_length(rng)
        if rng.random() * LONGEST < length:
            contexts.append(PROMPT + rng.randrange(length))
    return contexts


def tail_end(rows: int, rng: random.Random) -> list:
    """A phase's last steps: a handful of rows near the longest, a fifth in [640, 2176], the rest short."""
    n_tail, n_mid = max(1, rows // 32), rows // 5
    return ([rng.randint(PROMPT + LONGEST - 384, PROMPT + LONGEST - 1) for _ in range(n_tail)]
            + [rng.randint(640, 2176) for _ in range(n_mid)]
            + [rng.randint(160, 640) for _ in range(rows - n_tail - n_mid)])


def mix_contexts(mix: str, rows: int, S: int) -> list:
    """A MIXES draw (seed 0) at 4,224-token slots, scaled to slots of S; `-flat`: every row at the draw's mean."""
    flat = mix.endswith("-flat")
    contexts = MIXES[mix.removesuffix("-flat")](rows, random.Random(0))
    if flat:
        contexts = [round(sum(contexts) / rows)] * rows
    return [min(S - 1, max(1, c * S // FULL_SLOT)) for c in contexts]


MIXES = {"mid-phase": mid_phase, "tail-end": tail_end}
# (block_n, num_warps, num_stages); None: kernels.py's own choice
LAUNCHES = [None, (64, 2, 2), (64, 4, 1), (64, 4, 3), (32, 4, 2), (128, 4, 2), (128, 8, 2)]


def timer_ms(fn) -> float:
    """Device time of one fn() call inside a CUDA graph (rollout.graph_ms); on the CPU (--smoke) one call, 0."""
    if not torch.cuda.is_available():
        fn()  # the interpreter runs the kernel: the script is checked, nothing is timed
        return 0.0
    return graph_ms(fn)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_setting(token: str, rows: int, kv_heads: int, S: int) -> tuple:
    """--splits token -> (splits for decode_attention, its label): default (None: the kernel's own rule), an int
    (forced), keys:N (attention_splits with max_run_keys N), rows:N (the kernel's rule with kernels.ROW_RUNS and
    MAX_RUN_KEYS N: runs of N keys, as many as each row needs; long slots only)."""
    if token == "default" or token.startswith("rows:"):
        return None, token if token != "default" else "default"
    if token.startswith("keys:"):
        bound = int(token[len("keys:"):])
        return kernels.attention_splits(rows, kv_heads, S, bound), f"max_run_keys={bound}"
    return int(token), "forced"


def run_case(name: str, split_tokens: list, device: str) -> None:
    shape, rows, S, contexts = CASES[name]
    mixed = isinstance(contexts[0], str)
    cfg = SHAPES[shape]
    Hq, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg["hidden_size"] // Hq
    slots = max(rows) if mixed else rows
    g = torch.Generator(device=device).manual_seed(0)
    keys, values = (torch.randn(slots, Hkv, S, D, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    qkv = [torch.randn(slots, h, D, device=device, dtype=torch.bfloat16, generator=g) for h in (Hq, Hkv, Hkv)]
    bias = tuple(torch.zeros(t.shape[1] * D, device=device, dtype=torch.bfloat16) for t in qkv)
    angles = torch.arange(S, device=device)[:, None].float() * torch.rand(D // 2, device=device, generator=g)[None]
    emb = torch.cat([angles, angles], dim=-1)
    rope = tuple(t.to(torch.bfloat16) for t in rope_tables(emb.cos(), emb.sin()))
    # (rows, label, [rows] each row's cached keys): mixed cases at every bucket size, uniform ones at theirs
    settings = ([(b, mix, mix_contexts(mix, b, S)) for b in rows for mix in contexts] if mixed
                else [(rows, context, [context] * rows) for context in contexts])
    for b, label, at in settings:
        q, k, v = (t[:b] for t in qkv)
        pos = torch.tensor(at, device=device, dtype=torch.long)
        base = {"case": name, "rows": b, "heads": [Hq, Hkv, D], "slot_len": S, "context": label}
        for token in split_tokens:
            splits, rule = split_setting(token, b, Hkv, S)
            row_runs = token.startswith("rows:")
            kernels.ROW_RUNS = row_runs or (ROW_RUNS and token == "default")  # keys:N and forced counts: no row runs
            kernels.MAX_RUN_KEYS = int(token[5:]) if row_runs else MAX_RUN_KEYS
            for launch in LAUNCHES if not mixed else [None]:
                block_n, warps, stages = launch or (None, None, None)
                if splits is not None and block_n is not None and block_n * splits > 2 * S:
                    continue  # more splits than blocks: nothing new to learn

                def call():
                    return kernels.decode_attention(q, k, v, keys, values, pos, bias=bias, rope=rope, splits=splits,
                                                    block_n=block_n, num_warps=warps, num_stages=stages)
                try:
                    ms = timer_ms(call)
                except Exception as e:  # noqa: BLE001 - a setting the compiler refuses (shared memory) is a result
                    print(json.dumps({**base, "splits": splits, "launch": launch, "error": str(e)[:200]}), flush=True)
                    continue
                bound = kernels.MAX_RUN_KEYS if S >= kernels.LONG_SLOT else None  # the engine's launch
                used = splits or kernels.attention_splits(b, Hkv, S, bound)
                record = {**base, "splits": used, "rule": rule, "default_splits": splits is None, "launch": launch,
                          **rates(ms, at, Hkv, D)}
                if mixed:
                    run = block_n or kernels.ATTENTION_BLOCK_N
                    record.update(longest=max(at), mean_context=round(sum(at) / b),
                                  chain_keys=(cdiv(kernels.MAX_RUN_KEYS, run) * run if kernels.ROW_RUNS and used > 1
                                              and S >= kernels.LONG_SLOT else cdiv(cdiv(max(at), used), run) * run),
                                  step_ms=round(ms * cfg["num_hidden_layers"], 3))
                print(json.dumps(record), flush=True)


def rates(ms: float, contexts: list, kv_heads: int, head_dim: int) -> dict:
    """The layer's time, the cached keys and values it must read (bf16, every row's own context) and the rate."""
    kv_gb = 2 * sum(contexts) * kv_heads * head_dim * 2 / 1e9
    return {"us": round(1e3 * ms, 2), "kv_mb": round(1e3 * kv_gb, 1), "tb_s": round(kv_gb / ms, 3) if ms else None}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="0.5b-ref,1.5b-ref,1.5b-grpo,7b-grpo", help="comma-separated CASES")
    parser.add_argument("--splits", default=None,
                        help=f"comma-separated: default (the kernel's rule), N (forced), keys:N (the rule with "
                             f"max_run_keys N), rows:N (runs of N keys as a row needs); unset: {UNIFORM_SPLITS} ("
                             f"uniform cases), {MIXED_SPLITS} (mixed)")
    parser.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1, the tiny cases")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        global LAUNCHES
        args.case, args.splits, LAUNCHES = "tiny,tiny-mixed", "default,2,keys:32,rows:32", [None, (32, 4, 2)]
    elif device != "cuda":
        sys.exit("decode_attention.py needs CUDA (or --smoke with TRITON_INTERPRET=1)")
    started = time.perf_counter()
    for name in args.case.split(","):
        if name not in CASES:
            sys.exit(f"decode_attention.py: unknown --case {name!r}; known: {', '.join(CASES)}")
        mixed = isinstance(CASES[name][3][0], str)
        tokens = (args.splits or (MIXED_SPLITS if mixed else UNIFORM_SPLITS)).split(",")
        run_case(name, tokens, device)
    print(f"decode_attention.py: {time.perf_counter() - started:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
