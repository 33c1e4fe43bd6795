"""The rollout engine's decode attention alone, at the GRPO benchmark shapes: launch settings against the KV bandwidth.

One JSON line per (case, context, setting): device time of one layer's `kernels.decode_attention` (bias + RoPE + KV
write + attention, the fused path's call) inside a CUDA graph, the KV bytes it must read at that context, and the
rate that makes. `rollout/kernels.py`'s split rule (`attention_splits`) and launch constants come from these runs.

    python benchmarks/decode_attention.py                 # every case, the sweep
    python benchmarks/decode_attention.py --case 1.5b-grpo --splits 1,2,4
    python benchmarks/decode_attention.py --smoke         # CPU, Triton's interpreter, a tiny case: checks the script

Cases (rows, slot length, contexts timed) follow the step benchmarks: `0.5b-ref` is `rollout.py`'s and
`grpo_step.py`'s 0.5B shape (512 rows, 128 + 256), `1.5b-grpo` and `7b-grpo` are `grpo_step.py --shape 1.5b / 7b`
(256 rows of 256 + 1,024; 128 rows of 256 + 512). Every row sits at the same position, as in a fixed-length batch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from phaserl.models.layers import rope_tables  # noqa: E402
from phaserl.rollout import kernels  # noqa: E402
from qwen2_shapes import SHAPES  # noqa: E402
from rollout import graph_ms  # noqa: E402

CASES = {  # name: (model shape, rows, slot length, contexts)
    "0.5b-ref": ("0.5b", 512, 384, (192, 256, 383)),
    "1.5b-ref": ("1.5b", 512, 384, (256,)),
    "1.5b-grpo": ("1.5b", 256, 1280, (384, 768, 1279)),
    "7b-grpo": ("7b", 128, 768, (320, 512, 767)),
    "tiny": ("tiny", 8, 96, (40,)),
}
# (block_n, num_warps, num_stages); None: kernels.py's own choice
LAUNCHES = [None, (64, 2, 2), (64, 4, 1), (64, 4, 3), (32, 4, 2), (128, 4, 2), (128, 8, 2)]


def timer_ms(fn) -> float:
    """Device time of one fn() call inside a CUDA graph (rollout.graph_ms); on the CPU (--smoke) one call, 0."""
    if not torch.cuda.is_available():
        fn()  # the interpreter runs the kernel: the script is checked, nothing is timed
        return 0.0
    return graph_ms(fn)


def run_case(name: str, split_list: list, device: str) -> None:
    shape, rows, S, contexts = CASES[name]
    cfg = SHAPES[shape]
    Hq, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg["hidden_size"] // Hq
    g = torch.Generator(device=device).manual_seed(0)
    keys, values = (torch.randn(rows, Hkv, S, D, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    q, k, v = (torch.randn(rows, h, D, device=device, dtype=torch.bfloat16, generator=g) for h in (Hq, Hkv, Hkv))
    bias = tuple(torch.zeros(t.shape[1] * D, device=device, dtype=torch.bfloat16) for t in (q, k, v))
    angles = torch.arange(S, device=device)[:, None].float() * torch.rand(D // 2, device=device, generator=g)[None]
    emb = torch.cat([angles, angles], dim=-1)
    rope = tuple(t.to(torch.bfloat16) for t in rope_tables(emb.cos(), emb.sin()))
    default = kernels.attention_splits(rows, Hkv, S)
    for context in contexts:
        pos = torch.full((rows,), context, device=device, dtype=torch.long)
        kv_gb = 2 * rows * Hkv * context * D * 2 / 1e9  # the cached keys and values this step must read
        for splits in split_list:
            for launch in LAUNCHES:
                block_n, warps, stages = launch or (None, None, None)
                if splits is not None and block_n is not None and block_n * splits > 2 * S:
                    continue  # more splits than blocks: nothing new to learn

                def call():
                    return kernels.decode_attention(q, k, v, keys, values, pos, bias=bias, rope=rope, splits=splits,
                                                    block_n=block_n, num_warps=warps, num_stages=stages)
                try:
                    ms = timer_ms(call)
                except Exception as e:  # noqa: BLE001 - a setting the compiler refuses (shared memory) is a result
                    print(json.dumps({"case": name, "context": context, "splits": splits, "launch": launch,
                                      "error": str(e)[:200]}), flush=True)
                    continue
                print(json.dumps({"case": name, "rows": rows, "heads": [Hq, Hkv, D], "slot_len": S,
                                  "context": context, "splits": splits or default, "default_splits": splits is None,
                                  "launch": launch, "us": round(1e3 * ms, 2), "kv_mb": round(1e3 * kv_gb, 1),
                                  "tb_s": round(kv_gb / ms, 3) if ms else None}), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="0.5b-ref,1.5b-ref,1.5b-grpo,7b-grpo", help="comma-separated CASES")
    parser.add_argument("--splits", default="default,1,2,3,4,6,8", help="comma-separated; default: the kernel's rule")
    parser.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1, the tiny case")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        global LAUNCHES
        args.case, args.splits, LAUNCHES = "tiny", "default,2", [None, (32, 4, 2)]
    elif device != "cuda":
        sys.exit("decode_attention.py needs CUDA (or --smoke with TRITON_INTERPRET=1)")
    split_list = [None if s == "default" else int(s) for s in args.splits.split(",")]
    for name in args.case.split(","):
        run_case(name, split_list, device)


if __name__ == "__main__":
    main()
