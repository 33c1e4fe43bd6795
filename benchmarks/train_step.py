"""Training-step throughput: forward + backward of the actor's loss path, tokens/s and MFU.

One JSON line per measurement on stdout. Reference shape (BENCHMARKS.md): Qwen2-0.5B architecture with random
weights, bf16, 512 rows of 128 prompt + 256 response tokens ("fixed"), and the same rows with long-tail
response lengths ("longtail": most responses short, a few up to 256; prompts 64-128 tokens).
A step = every row once: micro-batches of --micro-tokens tokens, the model's forward, log-probs and
entropies of the response tokens (phaserl.algo.token_logprobs_from_hidden, chunked), a PPO-like loss,
backward (no optimizer step). Variants, on the same batch in the same process:

    padded          our decoder, padded micro-batches (SDPA with a boolean mask)
    packed          our decoder, packed micro-batches (varlen flash attention on CUDA)
    packed_compile  packed + models.decoder.enable_compile (compiled layers and fused log-prob kernels; the head
                    keeps its logits for backward, as the trainer's ppo.keep_head_logits=auto does at these shapes)
    packed_ckpt     packed + activation checkpointing
    padded_compile_ckpt / packed_compile_ckpt: the combinations
    hf              transformers Qwen2ForCausalLM, eager with sdpa attention, padded micro-batches, full
                    [b, S, V] logits then float32 log-softmax and entropy (what a plain HF trainer does)
    breakdown       where a packed step's time goes: the decoder alone (forward + backward of a cheap loss
                    on the hidden states) and the log-prob head alone (eager, inductor-compiled, and the
                    Triton kernels with several chunk sizes / kept logits), same micro-batches
    profile         (not in the default list) one packed_compile step under torch.profiler: device time
                    per kernel group (gemm, flash attention, Triton, ...) and the top kernels

MFU = model FLOPs / seconds / peak. Model FLOPs are phaserl.metrics.FlopModel's (real tokens only:
6 * body params * tokens + 6 * V * H * response tokens + causal attention), the same count for every
variant, so a variant that computes padding or prompt logits gets no credit for it. Each line gives
MFU against the datasheet bf16 peak (989 TFLOP/s for H100/H200: `mfu_spec`) and against the bf16 matmul
rate measured at the start of the run (`mfu_measured`); `mfu_6nd_spec` is the common 6 * all params *
all tokens count, for comparison with numbers quoted that way, and `mfu_6nd_measured` the same count over the
measured matmul rate (HF eager measures ~26% that way: the count the HF anchor of BENCHMARKS.md appears to use).

    python benchmarks/train_step.py                       # everything at the reference shape (CUDA)
    python benchmarks/train_step.py --smoke               # CPU, tiny shapes: checks the script
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import profiling  # noqa: E402
from phaserl.batch import RolloutBatch  # noqa: E402
from phaserl.metrics import PEAK_BF16_FLOPS, FlopModel, device_peak_flops  # noqa: E402
from phaserl.models import CausalLM  # noqa: E402
from phaserl.models.decoder import enable_compile  # noqa: E402
from phaserl.models.families import config_to_hf  # noqa: E402
from phaserl.roles.forward import rows_logprobs, split_rows  # noqa: E402
from qwen2_shapes import SHAPES, decoder_config  # noqa: E402

VARIANTS = ["padded", "packed", "packed_ckpt", "packed_compile", "hf", "breakdown"]


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_batch(kind: str, rows: int, prompt: int, response: int, vocab: int, device, seed: int = 0) -> RolloutBatch:
    """Left-padded prompts [rows, prompt], right-padded responses [rows, response]."""
    g = torch.Generator().manual_seed(seed)
    if kind == "fixed":
        p_len = torch.full((rows,), prompt)
        r_len = torch.full((rows,), response)
    else:  # long tail: log-normal response lengths (median ~ response / 5), clipped to [8, response]
        p_len = torch.randint(prompt // 2, prompt + 1, (rows,), generator=g)
        r_len = (torch.randn(rows, generator=g) * 0.9 + math.log(response / 5)).exp().round().long()
        r_len = r_len.clamp(8, response)
    ids = torch.zeros(rows, prompt + response, dtype=torch.long)
    attn = torch.zeros_like(ids)
    resp = torch.zeros(rows, response, dtype=torch.long)
    for i, (p, r) in enumerate(zip(p_len.tolist(), r_len.tolist())):
        ids[i, prompt - p: prompt + r] = torch.randint(1, vocab, (p + r,), generator=g)
        attn[i, prompt - p: prompt + r] = 1
        resp[i, :r] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return RolloutBatch(input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device),
                        response_mask=resp.to(device), prompt_width=prompt, group_ids=torch.arange(rows),
                        rollout_logprobs=torch.zeros(rows, response, device=device), prompts=[""] * rows,
                        response_texts=[""] * rows, rows=[None] * rows, finish_reasons=["stop"] * rows)


def loss_of(logp: torch.Tensor, ent: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor, tokens: float):
    """A PPO-shaped loss on one micro-batch (ratio against detached log-probs, token mean, entropy bonus)."""
    ratio = torch.exp(logp - logp.detach())  # [b, R]
    return (-(ratio * adv * mask).sum() - 0.001 * (ent * mask).sum()) / tokens


def ours_step(model, batch: RolloutBatch, adv: torch.Tensor, budget: int, packing: bool,
              keep_logits: bool = False) -> float:
    """keep_logits: the head keeps its logits for backward (ppo.keep_head_logits; with the Triton kernels only)."""
    tokens = float(batch.response_mask.sum())
    total = torch.zeros((), device=adv.device)  # summed on the device: no host sync per micro-batch
    for idx in split_rows(batch, budget, packing=packing):
        logp, ent, mask = rows_logprobs(model, batch, idx, packing=packing, temperature=1.0, with_entropy=True,
                                        keep_logits=keep_logits)
        loss = loss_of(logp, ent, mask.float(), adv[idx.to(adv.device, non_blocking=True)][:, : mask.shape[1]],
                       tokens)
        loss.backward()
        total += loss.detach()
    return float(total)


def hf_step(model, batch: RolloutBatch, adv: torch.Tensor, budget: int) -> float:
    from phaserl.batching import split_by_tokens, trim_padding

    tokens = float(batch.response_mask.sum())
    total = 0.0
    for idx in split_by_tokens(batch, budget):
        mb = trim_padding(batch.select(idx))
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                       position_ids=mb.position_ids).logits  # [b, S, V]
        z = logits[:, mb.prompt_width - 1: -1].float()  # [b, R, V]
        lse = torch.logsumexp(z, dim=-1)
        logp = z.gather(-1, mb.response_ids[..., None]).squeeze(-1) - lse
        ent = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
        mask = mb.response_mask.float()
        loss = loss_of(logp, ent, mask, adv[idx][:, : mask.shape[1]], tokens)
        loss.backward()
        total += float(loss.detach())
    return total


def measured_matmul_peak(device) -> float:
    n = 8192 if device.type == "cuda" else 256
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(device)
    start, calls = time.perf_counter(), 10
    for _ in range(calls):
        a @ b
    sync(device)
    return 2 * n**3 * calls / (time.perf_counter() - start)


def build_model(variant: str, args, device):
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if variant == "hf":
        import transformers

        d = config_to_hf(decoder_config(args.shape), "bfloat16" if args.dtype == "bf16" else "float32")
        hf_config = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
        return model.train()
    torch.manual_seed(0)
    with torch.device(device):
        model = CausalLM(decoder_config(args.shape)).to(dtype).train()
    model.gradient_checkpointing = variant.endswith("_ckpt")
    if "compile" in variant:
        enable_compile(model)
    return model


def run_variant(variant: str, args, device, batches: dict, flops: dict, peaks: dict) -> None:
    model = build_model(variant, args, device)
    for kind, batch in batches.items():
        adv = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(1)).to(device)
        packing = variant.startswith("packed")

        def step() -> float:
            model.zero_grad(set_to_none=True)
            if variant == "hf":
                return hf_step(model, batch, adv, args.micro_tokens)
            # compiled: the head keeps its logits, as the trainer's auto ppo.keep_head_logits does at these shapes
            return ours_step(model, batch, adv, args.micro_tokens, packing, keep_logits="compile" in variant)

        t0 = time.perf_counter()
        for _ in range(args.warmup + ("compile" in variant)):  # compiling takes a step of its own
            loss = step()
        sync(device)
        warmup_s = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        for _ in range(args.iters):
            loss = step()
        sync(device)
        seconds = (time.perf_counter() - t0) / args.iters
        real = float(batch.attention_mask.sum())
        record = dict(variant=variant, batch=kind, shape=args.shape, dtype=args.dtype, rows=args.rows,
                      real_tokens=real, response_tokens=float(batch.response_mask.sum()),
                      padded_tokens=float(batch.attention_mask.numel()), micro_tokens=args.micro_tokens,
                      seconds_per_step=seconds, tokens_per_s=real / seconds, loss=loss, warmup_s=warmup_s,
                      peak_memory_gb=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None)
        for name, peak in peaks.items():
            record[f"mfu_{name}"] = flops[kind] / seconds / peak
        record["mfu_6nd_spec"] = flops[f"{kind}_6nd"] / seconds / peaks["spec"] if "spec" in peaks else None
        # 6ND over the measured matmul rate: the count that reproduces BENCHMARKS.md's HF anchor (~26%)
        record["mfu_6nd_measured"] = (flops[f"{kind}_6nd"] / seconds / peaks["measured"]
                                      if "measured" in peaks else None)
        emit(**record)
    model = None  # the step closures hold it too: clearing the shared name frees it for empty_cache
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_breakdown(args, device, batches: dict, flops: dict) -> None:
    """Decoder-only and head-only times of a packed step on the same micro-batches (no compile)."""
    from phaserl.algo import token_logprobs_from_hidden
    from phaserl.packing import pack_rows

    model = build_model("packed", args, device)
    for kind, batch in batches.items():
        packs = [pack_rows(batch, idx) for idx in split_rows(batch, args.micro_tokens, packing=True)]

        def decoder_only():
            for p in packs:
                hidden = model(p.input_ids, position_ids=p.position_ids, seq_ids=p.seq_ids)  # [1, N, H]
                hidden[0, p.predict_index].float().square().mean().backward()

        saved = []
        with torch.no_grad():
            for p in packs:
                hidden = model(p.input_ids, position_ids=p.position_ids, seq_ids=p.seq_ids)
                saved.append(hidden[0, p.predict_index].detach().requires_grad_(True))

        def head_only(fused, chunk=1024, save=False, entropy_in_loss=True):
            for p, h in zip(packs, saved):
                logp, ent = token_logprobs_from_hidden(h, model.output_weight, p.target_ids, with_entropy=True,
                                                       fused=fused, chunk_size=chunk, save_logits=save)
                (logp.sum() + 0.001 * ent.sum() if entropy_in_loss else logp.sum()).backward()

        parts = [("decoder_only", decoder_only), ("head_only", lambda: head_only(False)),
                 ("head_only_inductor", lambda: head_only("inductor"))]
        if device.type == "cuda":  # the Triton one-pass kernels, chunk sizes, kept logits, entropy as a metric
            parts += [("head_only_triton", lambda: head_only("triton")),
                      ("head_only_triton_chunk4096", lambda: head_only("triton", chunk=4096)),
                      ("head_only_triton_save", lambda: head_only("triton", save=True)),
                      ("head_only_triton_save_chunk4096", lambda: head_only("triton", chunk=4096, save=True)),
                      ("head_only_triton_entropy_metric", lambda: head_only("triton", entropy_in_loss=False))]
        for name, fn in parts:
            for _ in range(args.warmup + ("inductor" in name)):
                fn()
            sync(device)
            t0 = time.perf_counter()
            for _ in range(args.iters):
                fn()
            sync(device)
            emit(variant="breakdown", part=name, batch=kind, seconds_per_step=(time.perf_counter() - t0) / args.iters,
                 micro_batches=len(packs))


def run_profile(args, device, batches: dict) -> None:
    """Where the compiled packed step's GPU time goes: one step under torch.profiler, kernels grouped."""
    from torch.profiler import ProfilerActivity, profile

    model = build_model("packed_compile", args, device)
    batch = next(iter(batches.values()))
    adv = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(1)).to(device)
    for _ in range(args.warmup + 1):
        model.zero_grad(set_to_none=True)
        ours_step(model, batch, adv, args.micro_tokens, True, keep_logits=True)
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, with_stack=True) as prof:
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        ours_step(model, batch, adv, args.micro_tokens, True, keep_logits=True)
        sync(device)
        wall = time.perf_counter() - t0
    for record in profiling.summarize(prof, wall, top=25):
        emit(variant="profile", micro_tokens=args.micro_tokens, **record)
    emit(variant="profile", micro_tokens=args.micro_tokens, measure="idle_gaps", **profiling.idle_gaps(prof, top=15))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="0.5b", choices=list(SHAPES))
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--micro-tokens", type=int, default=16384, help="token budget of a micro-batch")
    parser.add_argument("--batches", default="fixed,longtail")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps (compiled variants: one more)")
    parser.add_argument("--iters", type=int, default=2, help="timed steps")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, few rows: checks the script")
    args = parser.parse_args()
    if args.smoke:
        args.shape, args.dtype, args.rows, args.prompt, args.response = "tiny", "fp32", 8, 8, 16
        args.micro_tokens, args.warmup, args.iters = 64, 1, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    cfg = decoder_config(args.shape)
    peaks = {}
    if device.type == "cuda":
        peaks["spec"] = device_peak_flops(device) or PEAK_BF16_FLOPS["H200"]
        peaks["measured"] = measured_matmul_peak(device)
        emit(measurement="peak", device=torch.cuda.get_device_name(device), spec_tflops=peaks["spec"] / 1e12,
             measured_bf16_matmul_tflops=peaks["measured"] / 1e12, torch=torch.__version__)
    with torch.device("meta"):
        flop_model = FlopModel.of(CausalLM(cfg))
        all_params = sum(p.numel() for p in CausalLM(cfg).parameters())
    batches, flops = {}, {}
    for kind in args.batches.split(","):
        b = make_batch(kind, args.rows, args.prompt, args.response, cfg.vocab_size, device)
        batches[kind] = b
        flops[kind] = 3 * flop_model.forward_flops(b.attention_mask.sum(1), float(b.response_mask.sum()))
        flops[f"{kind}_6nd"] = 6.0 * all_params * float(b.attention_mask.sum())
        emit(measurement="batch", batch=kind, rows=args.rows, real_tokens=float(b.attention_mask.sum()),
             response_tokens=float(b.response_mask.sum()), padded_tokens=b.attention_mask.numel(),
             model_tflops_per_step=flops[kind] / 1e12)
    for variant in args.variants.split(","):
        t0 = time.perf_counter()
        try:
            if variant == "breakdown":
                run_breakdown(args, device, batches, flops)
            elif variant == "profile":
                run_profile(args, device, batches)
            else:
                run_variant(variant, args, device, batches, flops, peaks)
        except Exception as exc:  # noqa: BLE001 - report the variant that broke and go on with the others
            emit(variant=variant, status="failed", error=f"{type(exc).__name__}: {exc}"[:2000])
        emit(variant=variant, status="done", wall_s=time.perf_counter() - t0)


if __name__ == "__main__":
    main()
