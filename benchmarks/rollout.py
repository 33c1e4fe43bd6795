"""Rollout throughput: phaserl's RolloutEngine vs Hugging Face generate, and the roofline of the shape.

One JSON line per measurement on stdout. Reference shape (BENCHMARKS.md): Qwen2-0.5B architecture with
random weights, bf16, 64 prompts x 8 samples = 512 sequences, prompt 128 tokens, 256 new tokens with
EOS ignored (fixed lengths), temperature 1.

    python benchmarks/rollout.py --case all --budget 540      # the default --plan, each in its own process
    python benchmarks/rollout.py --case ours --shape 0.5b [--compile] [--no-fused] [--profile [--sweep]]
    python benchmarks/rollout.py --case ours --shape 1.5b --workload grpo [--split-programs 2048]   # grpo_step's rows
    python benchmarks/rollout.py --case roofline|hf|hf_static|varlen|longtail|longtail_hf|profile --shape 0.5b

--no-fused decodes through layers.py's torch functions instead of rollout/fused.py's kernels (the comparison).

`--case all` runs each --plan entry in its own process under a time limit and reports one that fails.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from phaserl.algo import token_logprobs_from_hidden  # noqa: E402
from phaserl.models import CausalLM, DecoderConfig  # noqa: E402
from phaserl.models.families import config_to_hf  # noqa: E402
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402
from phaserl.rollout import fused as rollout_fused  # noqa: E402
from phaserl.rollout import kernels as rollout_kernels  # noqa: E402
from phaserl.rollout import runner as rollout_runner  # noqa: E402
from phaserl.rollout import sample_kernel as rollout_sampler  # noqa: E402
from phaserl.rollout.torch_path import decode_attention  # noqa: E402
from qwen2_shapes import SHAPES, decoder_config  # noqa: E402

PROMPTS, SAMPLES, PROMPT_LEN, NEW_TOKENS = 64, 8, 128, 256
GRPO_WORKLOADS = {"0.5b": (64, 128, 256), "1.5b": (32, 256, 1024), "7b": (16, 256, 512), "tiny": (4, 16, 16)}
DEVICE = "cuda"


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def our_model(shape: str) -> CausalLM:
    with torch.device(DEVICE):
        return CausalLM(decoder_config(shape)).to(torch.bfloat16).eval()


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    unique = torch.randint(0, 4000, (PROMPTS, PROMPT_LEN), generator=g).tolist()
    return [p for p in unique for _ in range(SAMPLES)]


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0


def per_call_ms(fn, calls: int = 100) -> float:
    fn()  # warm-up: kernel selection and workspaces stay out of the number
    return 1e3 * timed(lambda: [fn() for _ in range(calls)]) / calls


# ----- roofline -----------------------------------------------------------------------------------
def measure_ceilings() -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul rate in FLOP/s), on random data."""
    size = (2 << 30) if DEVICE == "cuda" else (1 << 24)
    x = torch.randint(0, 255, (size,), dtype=torch.uint8, device=DEVICE)
    y = torch.empty_like(x)
    n = 8192 if DEVICE == "cuda" else 256
    a, b = (torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    return 2e3 * size / per_call_ms(lambda: y.copy_(x), 20), 2e3 * n**3 / per_call_ms(lambda: a @ b, 10)


def step_cost(cfg: DecoderConfig, batch: int, context: float) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode step over `batch` rows attending to `context` keys on average, bf16."""
    H, L, V, D = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.head_dim
    attn = H * D * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)  # q, o, k, v
    layer_params = L * (attn + 3 * H * cfg.intermediate_size)
    matmul_params = layer_params + V * H  # + the LM head (the embedding lookup reads one row per token)
    kv_bytes_per_token = 2 * L * cfg.num_key_value_heads * D * 2
    bytes_ = 2 * matmul_params + batch * context * kv_bytes_per_token
    flops = 2 * batch * matmul_params + 4 * batch * context * cfg.num_attention_heads * D * L
    return bytes_, flops


def case_roofline(args) -> None:
    bandwidth, rate = measure_ceilings()
    emit(case="ceilings", copy_bandwidth_tb_s=bandwidth / 1e12, bf16_matmul_tflop_s=rate / 1e12)
    batch = PROMPTS * SAMPLES
    for shape in ("0.5b", "1.5b", "7b"):
        cfg = decoder_config(shape)
        for what, context in (("ideal", PROMPT_LEN + NEW_TOKENS / 2), ("full_slot", PROMPT_LEN + NEW_TOKENS)):
            bytes_, flops = step_cost(cfg, batch, context)
            floor = max(bytes_ / bandwidth, flops / rate)
            emit(case="roofline", shape=shape, kv_read=what, batch=batch, step_gb=bytes_ / 1e9,
                 step_tflop=flops / 1e12, memory_ms=1e3 * bytes_ / bandwidth, compute_ms=1e3 * flops / rate,
                 bound_tokens_per_s=batch / floor)


# ----- our engine ---------------------------------------------------------------------------------
def logprob_parity(model: CausalLM, ps: list[list[int]], result, rows: int = 16) -> dict:
    """Engine log-probs vs the trainer's (one full forward + token_logprobs_from_hidden) on `rows` sequences."""
    diffs = []
    with torch.no_grad():
        for prompt, tokens, logprobs in list(zip(ps, result.response_ids, result.logprobs))[:rows]:
            hidden = model(torch.tensor([prompt + tokens], device=DEVICE))[0]
            trainer = token_logprobs_from_hidden(hidden[len(prompt) - 1:-1], model.output_weight,
                                                 torch.tensor(tokens, device=DEVICE))[0]
            diffs.append((trainer.cpu() - torch.tensor(logprobs)).abs())
    d = torch.cat(diffs)
    return dict(mean_abs_diff=float(d.mean()), max_abs_diff=float(d.max()), tokens=d.numel())


def rollout(engine: RolloutEngine, ps: list[list[int]], params: SamplingParams, **kwargs):
    """The benchmarked call: EOS ignored, so every response has its full (or capped) length."""
    return lambda: engine.generate(ps, params, eos_token_ids=[], pad_token_id=0, ignore_eos=True, **kwargs)


def sleep_wake(engine: RolloutEngine, run, steady_s: float, args) -> None:
    """The hybrid switch's cost: free the KV cache and graphs, allocate again, generate (recaptures)."""
    freed, wake_s = engine.sleep(), timed(engine.wake)
    emit(case="sleep_wake", shape=args.shape, compile=args.compile, freed_gb=freed / 2**30, wake_s=wake_s,
         first_generate_after_wake_s=timed(run), steady_generate_s=steady_s)


def case_ours(args) -> None:
    model = our_model(args.shape)
    engine = RolloutEngine(model, EngineConfig(max_slots=512, compile=args.compile))
    ps, params = prompts(), SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)
    run = rollout(engine, ps, params)
    warmup = timed(run)  # allocates the pool, captures graphs (and compiles)
    runs = [timed(run) for _ in range(3)]
    result = run()
    tokens = sum(map(len, result.response_ids))
    assert tokens == len(ps) * NEW_TOKENS, tokens
    with torch.inference_mode():  # the full-batch step alone (all slots idle now: the same work as a busy step)
        step_ms = per_call_ms(lambda: engine.runner.decode(len(ps)), 50)
    best = min(runs)
    emit(case="ours", shape=args.shape, workload=args.workload, split_programs=rollout_kernels.SPLIT_PROGRAMS,
         prompt_len=PROMPT_LEN, compile=args.compile, fused=rollout_runner.FUSED_DECODE,
         fused_layers=sum(engine.runner.fused), sequences=len(ps), new_tokens=tokens,
         tokens_per_s=tokens / best, seconds=best, runs_s=runs, warmup_s=warmup, steps=engine.last_stats["steps"],
         decode_step_ms=step_ms, decode_only_tokens_per_s=len(ps) / step_ms * 1e3,
         outside_decode_s=best - engine.last_stats["steps"] * step_ms / 1e3,
         kv_pool_gb=engine.pool.allocated_bytes / 2**30, graphs=engine.last_stats["graphs"],
         begin_s=engine.last_stats["begin_seconds"], peak_allocated_gb=peak_gb())
    sleep_wake(engine, run, best, args)
    if args.shape in ("0.5b", "tiny"):
        emit(case="logprob_parity", shape=args.shape, compile=args.compile, **logprob_parity(model, ps, result))
    if args.profile:
        profile_step(model, engine, len(ps), args)


def case_varlen(args) -> None:
    """Log-normal lengths (median 128, cap 1024), 1024 sequences in 256 slots: refill vs static batching."""
    model = our_model(args.shape)
    ps, cap = [p for p in prompts() for _ in range(2)], 4 * NEW_TOKENS  # 1024 sequences
    noise = torch.randn(len(ps), generator=torch.Generator().manual_seed(1))
    lengths = (NEW_TOKENS // 2 * noise.exp()).clamp(16, cap).long().tolist()
    params = SamplingParams(max_new_tokens=cap, temperature=1.0)
    for refill in (True, False):
        engine = RolloutEngine(model, EngineConfig(max_slots=256, refill=refill, compile=args.compile))
        run = rollout(engine, ps, params, max_new_tokens=lengths)
        warmup = timed(run)
        seconds = timed(run)
        emit(case="varlen", shape=args.shape, compile=args.compile, refill=refill, sequences=len(ps), slots=256,
             new_tokens=sum(lengths), mean_len=sum(lengths) / len(lengths), max_len=max(lengths),
             tokens_per_s=sum(lengths) / seconds, seconds=seconds, steps=engine.last_stats["steps"],
             warmup_s=warmup)
        engine.sleep()


def longtail_lengths(n: int, cap: int, seed: int = 2) -> list[int]:
    """Most rows stop early (cap/16 + Exp(mean cap/8) tokens: 16 + 32 at 256), 1 row in 20 runs to the cap."""
    g = torch.Generator().manual_seed(seed)
    lengths = (cap // 16 + torch.empty(n).exponential_(generator=g) * cap / 8).clamp(max=cap).long()
    lengths[torch.randperm(n, generator=g)[: n // 20]] = cap
    return lengths.tolist()


def case_longtail(args) -> None:
    """512 sequences with long-tail lengths in 512 slots: shrinking buckets (compaction) vs a fixed batch, and
    2048 such sequences through 512 slots with refill vs static batching. Tokens/s count real tokens only."""
    model = our_model(args.shape)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)
    base = prompts()  # 512 sequences (64 prompts x 8)
    for copies, mode in ((1, "shrinking_buckets"), (1, "fixed_batch"), (4, "refill"), (4, "static")):
        ps = [p for p in base for _ in range(copies)]
        lengths = longtail_lengths(len(ps), NEW_TOKENS)
        engine = RolloutEngine(model, EngineConfig(max_slots=len(base), refill=mode != "static", compile=args.compile))
        if mode == "fixed_batch":  # every step runs the full batch until the longest row is done
            engine._compact = lambda scheduler: None
        run = rollout(engine, ps, params, max_new_tokens=lengths)
        warmup = timed(run)
        seconds = min(timed(run) for _ in range(2))
        emit(case="longtail", shape=args.shape, mode=mode, sequences=len(ps), slots=len(base), new_tokens=sum(lengths),
             mean_len=sum(lengths) / len(lengths), max_len=max(lengths), tokens_per_s=sum(lengths) / seconds,
             seconds=seconds, steps=engine.last_stats["steps"], graphs=engine.last_stats["graphs"], warmup_s=warmup)
        engine.sleep()


def case_longtail_hf(args) -> None:
    """Hugging Face generate on case_longtail's 512-row distribution: a batch runs until its longest row is
    done (EOS cannot be placed in a random model, so it runs to the cap); tokens/s count the real tokens."""
    lengths = longtail_lengths(PROMPTS * SAMPLES, NEW_TOKENS)
    seconds, warmup, version = hf_seconds(args, static=False)
    emit(case="longtail_hf", shape=args.shape, sequences=len(lengths), new_tokens=sum(lengths),
         tokens_per_s=sum(lengths) / seconds, seconds=seconds, warmup_s=warmup, version=version)


# ----- where a decode step's time goes -------------------------------------------------------------
def case_profile(args) -> None:
    """Kernel times of a full-batch decode step (eager: the graph replays the same kernels), attention vs SDPA."""
    model = our_model(args.shape)
    engine = RolloutEngine(model, EngineConfig(max_slots=512, compile=args.compile))
    ps, params = prompts(), SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)
    run = rollout(engine, ps, params)
    run()
    sleep_wake(engine, run, timed(run), args)
    profile_step(model, engine, len(ps), args)


def profile_step(model: CausalLM, engine: RolloutEngine, b: int, args) -> None:
    """After a generate call: kernel times of one b-row step, one layer's attention, one sampling draw.

    The step is timed with every row at the run's mean context (prompt + half the new tokens): after the call the
    rows sit at their last position, where attention reads 1.5x the keys of the average step (the sixteenth
    session's profile, 0.82 ms of attention a step, was taken there)."""
    runner = engine.runner
    with torch.inference_mode():
        pos = runner.state.pos[:b].clone()
        runner.state.pos[:b] = PROMPT_LEN + NEW_TOKENS // 2  # finished rows step there and stay: timing only
        step_ms, eager_ms = per_call_ms(lambda: runner.decode(b), 50), per_call_ms(lambda: runner._decode_step(b), 10)
        gpu = DEVICE == "cuda"
        with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                runner._decode_step(b)
            sync()
        runner.state.pos[:b] = pos
    attr = "self_device_time_total" if gpu else "self_cpu_time_total"
    kernels = sorted(((e.key[:70], round(getattr(e, attr) / 5e3, 4), e.count // 5) for e in prof.key_averages()),
                     key=lambda k: -k[1])  # (name, ms per step, calls per step)
    emit(case="profile", shape=args.shape, compile=args.compile, context=PROMPT_LEN + NEW_TOKENS // 2,
         graph_step_ms=step_ms, eager_step_ms=eager_ms, kernel_ms_per_step=sum(k[1] for k in kernels),
         top_kernels_ms_per_step=kernels[:22])
    keys, values = runner.keys[0], runner.values[0]
    cfg = model.config
    q = torch.randn(b, cfg.num_attention_heads, cfg.head_dim, device=DEVICE, dtype=keys.dtype)
    k, v = (torch.randn(b, cfg.num_key_value_heads, cfg.head_dim, device=DEVICE, dtype=keys.dtype) for _ in range(2))
    pos = torch.randint(PROMPT_LEN, PROMPT_LEN + NEW_TOKENS, (b,), device=DEVICE)  # the average decode step
    hidden = runner.positions > pos[:, None]  # [b, S]
    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, q[:, :, None], keys[:b], values[:b],
                             attn_mask=~hidden[:, None, None, :], enable_gqa=True)
    times, timer = {}, (graph_ms if DEVICE == "cuda" else per_call_ms)  # device time, launch cost out
    with torch.inference_mode():
        times["matmul_whole_slot_ms"] = timer(lambda: decode_attention(q, keys[:b], values[:b], hidden))
        times["sdpa_masked_gqa_ms"] = timer(sdpa)
        if rollout_kernels.available(keys.device):
            times["triton_used_context_ms"] = timer(
                lambda: rollout_kernels.decode_attention(q, k, v, keys, values, pos))
            times["triton_bias_rope_split_ms"] = timer(lambda: fused_attention(q, k, v, keys, values, pos, runner))
    slot_gb = 2 * b * keys[0].numel() * keys.element_size() / 1e9
    used_gb = slot_gb * float(pos.float().mean() + 1) / keys.shape[2]
    emit(case="attention_one_layer", shape=args.shape, kv_slot_gb=slot_gb, kv_used_gb=used_gb, **times,
         layers=cfg.num_hidden_layers)
    logits = torch.randn(b, cfg.vocab_size, device=DEVICE, dtype=keys.dtype)
    with torch.inference_mode():
        slots, at = runner.state.key[:b], pos  # the decode step's keyed noise: (seed, slot key, position)
        times = {"torch_gumbel_ms": timer(lambda: runner.fns.sample(
            logits, torch.empty_like(logits, dtype=torch.float32).exponential_(), False, 1.0, 0, 1.0)),
            "torch_keyed_noise_ms": timer(lambda: runner.fns.noise(runner.seed, slots, at, cfg.vocab_size))}
        if rollout_kernels.available(keys.device):
            times["triton_fused_ms"] = timer(lambda: rollout_sampler.sample(logits, runner.seed, slots, at, False, 1.0))
            times["triton_fused_greedy_ms"] = timer(
                lambda: rollout_sampler.sample(logits, runner.seed, slots, at, True, 1.0))
    emit(case="sampling", shape=args.shape, rows=b, vocab=cfg.vocab_size, logits_gb=logits.numel() * 2 / 1e9, **times)
    if DEVICE == "cuda":
        gemm_times(runner, b, args)
        if any(runner.fused):
            variant_steps(runner, b, args)
    if args.sweep and rollout_kernels.available(keys.device):
        sweep_kernels(q, k, v, keys, values, pos, logits, (runner.seed, runner.state.key[:b], pos), args, runner)


def variant_steps(runner, b: int, args) -> None:
    """The graph step with each fused.RESIDUAL_IN_GEMM setting and the capture's cost with each
    runner.LEAN_CAPTURE setting (re-captured each time), the defaults restored after."""
    defaults = rollout_fused.RESIDUAL_IN_GEMM, rollout_runner.LEAN_CAPTURE
    with torch.inference_mode():
        for residual, lean in ((False, True), (True, True), (False, False)):
            rollout_fused.RESIDUAL_IN_GEMM, rollout_runner.LEAN_CAPTURE = residual, lean
            runner.graphs, runner.graph_pool = {}, None  # a fresh pool: the old one dies with its graphs
            capture_s = timed(lambda: runner.decode(b))  # the eager step, then its capture
            emit(case="variant", shape=args.shape, residual_in_gemm=residual, lean_capture=lean,
                 first_step_with_capture_s=capture_s, graph_step_ms=per_call_ms(lambda: runner.decode(b), 50))
    rollout_fused.RESIDUAL_IN_GEMM, rollout_runner.LEAN_CAPTURE = defaults
    runner.graphs, runner.graph_pool = {}, None


def gemm_times(runner, b: int, args) -> None:
    """The decode step's GEMMs at b rows, each alone in a graph: with the bias / residual in cuBLAS's epilogue
    (what the step runs) and without (the add left to a neighbouring kernel), against the matmul rate."""
    w, x = runner.weights[0], torch.randn(b, runner.cfg.hidden_size, device=DEVICE, dtype=torch.bfloat16)
    mid = torch.randn(b, w.down.shape[1], device=DEVICE, dtype=torch.bfloat16)
    attn = torch.randn(b, w.o.shape[1], device=DEVICE, dtype=torch.bfloat16)
    F = torch.nn.functional
    cases = {"qkv": (lambda: F.linear(x, w.qkv), w.qkv),
             "o_residual": (lambda: torch.addmm(x, attn, w.o.t()), w.o), "o": (lambda: F.linear(attn, w.o), w.o),
             "gate_up": (lambda: F.linear(x, w.gate_up), w.gate_up),
             "down_residual": (lambda: torch.addmm(x, mid, w.down.t()), w.down),
             "down": (lambda: F.linear(mid, w.down), w.down),
             "lm_head": (lambda: F.linear(x, runner.model.output_weight), runner.model.output_weight)}
    if w.qkv_bias is not None:
        cases["qkv_bias"] = (lambda: F.linear(x, w.qkv, w.qkv_bias), w.qkv)
    with torch.inference_mode():
        for name, (fn, weight) in cases.items():
            ms = graph_ms(fn)
            emit(case="gemm", shape=args.shape, name=name, rows=b, out_in=list(weight.shape), us=1e3 * ms,
                 tflop_s=2 * b * weight.numel() / ms / 1e9)


def graph_ms(fn, calls: int = 20, replays: int = 10) -> float:
    """Device time of one fn() call: `calls` launches captured in one CUDA graph, so launch cost stays out."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up: Triton compiles this configuration
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    return 1e3 * timed(lambda: [graph.replay() for _ in range(replays)]) / (calls * replays)


def fused_attention(q, k, v, keys, values, pos, runner, **launch):
    """The fused path's attention call: q/k/v + bias, RoPE at pos, KV write, split-K (bias: zeros here)."""
    bias = tuple(torch.zeros(t.shape[1] * t.shape[2], device=t.device, dtype=t.dtype) for t in (q, k, v))
    return rollout_kernels.decode_attention(q, k, v, keys, values, pos, bias=bias, rope=runner.rope[0], **launch)


def sweep_kernels(q, k, v, keys, values, pos, logits, seed, args, runner) -> None:
    """Launch settings of the Triton kernels, timed inside CUDA graphs (kernels.py's constants come from here)."""
    with torch.inference_mode():
        # splits None: kernels.py's choice (one split at 512 rows; a few for a 64-row bucket); benchmarks/
        # decode_attention.py sweeps the GRPO shapes
        for rows, block_n, splits, warps, stages in [
                (512, 64, None, 4, 2), (512, 64, None, 4, 1), (512, 64, None, 4, 3), (512, 128, None, 4, 2),
                (512, 128, None, 8, 2), (512, 128, None, 4, 1), (512, 32, None, 4, 2), (512, 64, None, 2, 2),
                (512, 32, None, 2, 2), (512, 64, 3, 4, 2), (64, 64, None, 4, 2), (64, 64, 1, 4, 2),
                (64, 64, 6, 4, 2),
                # one stage: half the shared memory per program, so all 1,024 programs of 512 rows can be resident
                # at once (two stages: ~7 per SM by shared memory, a second wave of ~100 programs)
                (512, 32, None, 4, 1), (512, 64, None, 2, 1), (512, 128, None, 8, 1), (512, 256, None, 8, 1),
                (512, 256, None, 4, 1), (512, 64, 2, 4, 1), (512, 128, 3, 4, 1), (512, 32, None, 2, 1)]:
            ms = graph_ms(lambda: fused_attention(q[:rows], k[:rows], v[:rows], keys, values, pos[:rows], runner,
                                                  block_n=block_n, splits=splits, num_warps=warps,
                                                  num_stages=stages))
            emit(case="sweep_attention", shape=args.shape, rows=rows, block_n=block_n, splits=splits, num_warps=warps,
                 num_stages=stages, ms=ms)
        for block, warps in ((2048, 4), (4096, 4), (4096, 8)):
            rollout_sampler.SAMPLE_BLOCK, rollout_sampler.SAMPLE_WARPS = block, warps
            emit(case="sweep_sampling", shape=args.shape, block=block, num_warps=warps,
                 ms=graph_ms(lambda: rollout_sampler.sample(logits, *seed, False, 1.0)))


# ----- Hugging Face -------------------------------------------------------------------------------
def case_hf(args, static: bool = False) -> None:
    seconds, warmup, version, new, rows = hf_seconds(args, static, shape_too=True)
    emit(case="hf_static_compile" if static else "hf", shape=args.shape, sequences=rows, new_tokens=new,
         tokens_per_s=new / seconds, seconds=seconds, warmup_s=warmup, peak_allocated_gb=peak_gb())


def hf_seconds(args, static: bool, shape_too: bool = False):
    """(seconds, warm-up seconds, transformers version[, new tokens, rows]) of one timed generate() at the shape."""
    import transformers

    d = config_to_hf(decoder_config(args.shape), "bfloat16")
    hf_config = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device(DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16,
                                                              attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4000, (PROMPTS, PROMPT_LEN), generator=g).to(DEVICE)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  num_return_sequences=SAMPLES, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                  pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"  # generate() compiles the decode forward for it
    name = "hf_static_compile" if static else "hf"
    with torch.inference_mode():
        warmup = timed(lambda: model.generate(ids, **kwargs))  # the same shapes: compiles once if static
        emit(case=name, shape=args.shape, status="warm", warmup_s=warmup, version=transformers.__version__)
        out = []
        seconds = timed(lambda: out.append(model.generate(ids, **kwargs)))
    new = (out[0].shape[1] - PROMPT_LEN) * out[0].shape[0]
    if shape_too:
        return seconds, warmup, transformers.__version__, new, out[0].shape[0]
    return seconds, warmup, transformers.__version__


# ----- driver -------------------------------------------------------------------------------------
DEFAULT_PLAN = ("roofline,ours-0.5b,hf-0.5b,ours-0.5b-compile,hf_static-0.5b,varlen-0.5b,longtail-0.5b,ours-1.5b,"
                "ours-7b")
LIMITS = {"roofline": 60, "ours": 90, "hf": 90, "hf_static": 200, "varlen": 120, "profile": 90, "longtail": 120,
          "longtail_hf": 90}  # s, x2 compiled


def case_all(args) -> None:
    """Run the --plan entries (case-shape[-compile][-profile]) in order, each in its own process and time limit.

    -profile (case ours) also profiles a decode step; with --sweep, the Triton launch settings too.
    """
    deadline = time.time() + args.budget
    for entry in args.plan.split(","):
        case, shape, *flag = entry.split("-") + (["0.5b"] if "-" not in entry else [])
        compile, profile_it = "compile" in flag, "profile" in flag
        limit = min(LIMITS[case] * (2 if compile else 1), deadline - time.time())
        if limit < 20:
            emit(case=case, shape=shape, compile=compile, status="skipped: benchmark budget spent")
            continue
        cmd = [sys.executable, __file__, "--case", case, "--shape", "tiny" if args.smoke else shape]
        cmd += (["--compile"] if compile else []) + (["--smoke"] if args.smoke else [])
        cmd += ["--profile"] if (args.profile or profile_it) and case == "ours" else []
        cmd += ["--sweep"] if args.sweep else []
        cmd += ["--no-fused"] if args.no_fused else []
        try:
            subprocess.run(cmd, timeout=limit, check=True)
        except subprocess.TimeoutExpired:
            emit(case=case, shape=shape, compile=compile, status=f"timed out after {limit:.0f} s")
        except subprocess.CalledProcessError as e:
            emit(case=case, shape=shape, compile=compile, status=f"failed with exit code {e.returncode}")


CASES = {"roofline": case_roofline, "ours": case_ours, "hf": case_hf, "hf_static": lambda a: case_hf(a, static=True),
         "varlen": case_varlen, "longtail": case_longtail, "longtail_hf": case_longtail_hf, "profile": case_profile}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", default="all", choices=["all", *CASES])
    parser.add_argument("--shape", default="0.5b", choices=list(SHAPES))
    parser.add_argument("--compile", action="store_true", help="torch.compile the engine's layer functions")
    parser.add_argument("--budget", type=float, default=540, help="seconds for --case all")
    parser.add_argument("--plan", default=DEFAULT_PLAN, help="for --case all: comma-separated case-shape[-compile]")
    parser.add_argument("--profile", action="store_true", help="--case ours: also profile a decode step")
    parser.add_argument("--no-fused", action="store_true", help="decode through layers.py's torch functions")
    parser.add_argument("--sweep", action="store_true", help="with the profile: sweep the Triton launch settings")
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny shape, few tokens: checks the script")
    parser.add_argument("--workload", choices=["reference", "grpo"], default="reference",
                        help="reference: 64 x 8, 128 + 256 at every shape; grpo: grpo_step.py's rows and lengths "
                             "for --shape (1.5b: 32 x 8, 256 + 1024; 7b: 16 x 8, 256 + 512)")
    parser.add_argument("--split-programs", type=int, default=None,
                        help="kernels.SPLIT_PROGRAMS for this run (decode attention's split rule)")
    args = parser.parse_args()
    global DEVICE, PROMPTS, PROMPT_LEN, NEW_TOKENS
    if args.workload == "grpo":
        PROMPTS, PROMPT_LEN, NEW_TOKENS = GRPO_WORKLOADS[args.shape]
    if args.split_programs:
        rollout_kernels.SPLIT_PROGRAMS = args.split_programs
    if args.smoke:
        DEVICE, PROMPTS, NEW_TOKENS = "cpu", 4, 16
    rollout_runner.FUSED_DECODE = not args.no_fused
    torch.manual_seed(0)
    (case_all if args.case == "all" else CASES[args.case])(args)


if __name__ == "__main__":
    main()
