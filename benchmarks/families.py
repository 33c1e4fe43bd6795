"""Native decoder + engine vs the transformers path, for the new families: Gemma-3-1B, Gemma-4-1B, Mistral-7B,
Qwen3-MoE and Qwen3.5 shapes.

Random weights in bf16, one GPU, one JSON line per measurement on stdout:
  rollout_native  phaserl's RolloutEngine (CUDA graphs, Triton decode attention with sliding windows) on
                  phaserl's decoder loaded from the family's transformers-made directory
  rollout_hf      transformers' own `generate` (its dynamic KV cache, sampling) on the same directory,
                  all sequences in one batch; the anchor of the target (native >= 4x HF generate)
  grpo_native / grpo_transformers
                  one whole GRPO step (benchmarks/grpo_step.py --only ours on this script's world) with
                  model.implementation=native / transformers: the same model files, the two paths (the
                  transformers path rolls out with transformers' KV cache through rollout/generate.py);
                  training micro-batches of phaserl's default ppo.micro_batch_tokens (auto since 2026-12-04;
                  16,384 before) unless --micro-batch-tokens says otherwise (before 2026-12-03: 8 sequences,
                  3,072 tokens at the Qwen3.5 shapes, where the eager hybrid layers were host-bound: 2B step
                  30.38 s vs 19.61 s)
  grpo_native_replay  MoE shapes: grpo_native with actor.routing_replay=true
  mismatch_replay MoE shapes: sample with the engine (recording experts), recompute the log-probs with the
                  training forward (packed, as ppo.packing), routing replay off and on: the mismatch/* metrics
                  of each, and how often the training forward picks the rollout's experts without replay
  mismatch        the engine's bf16 log-probs against the trainer's forward on the same tokens, padded and
                  packed: mean/max |diff| and k3 (benchmarks/mismatch.py's measure), on 16 prompts x 4 of the
                  shape's prompt length, 128 new tokens, CUDA graphs; in bf16 also the trainer's own distance from
                  the same weights in float32 (noise/abs_diff_mean) and mismatch_over_noise
  rollout_native_torch_delta
                  Qwen3.5 shapes: rollout_native with the DeltaNet decode update in torch, not the Triton kernel
  delta_rule      Qwen3.5 shapes: one linear layer's rule at a training micro-batch (8 sequences of the run's
                  prompt + new tokens), packed: one of the torch rule's triangular solves alone, the torch
                  chunked rule forward and forward + backward with its solves (torch) and with the blocked
                  inverse instead (torch_blocked, linear_attention.TRIANGULAR), fla's forward and forward +
                  backward where they run here (each timed, or its error); the compiled torch rule; a profile
  train_layers    Qwen3.5 shapes: the model's layers on one packed micro-batch of 8 sequences, forward + backward,
                  eager against the hybrid layers compiled (hybrid.COMPILE_HYBRID: the delta rule and the
                  attention core stay eager), with the eager pass's profile
Shapes (sequences x (prompt + new tokens), EOS ignored, temperature 1):
  gemma3-1b   Gemma 3 1B text: 26 layers, hidden 1152, 4 q / 1 kv heads of 256, sliding 512 on 5 of 6
              layers, vocab 262144; 64 x 8 x (128 + 256)
  gemma4-1b   Gemma 4 text at Gemma 3 1B's size (no such Gemma 4 model exists; the features are the 31B's):
              26 layers, hidden 1152, 4 q / 1 kv heads of 256 on sliding layers (512 on 5 of 6), global layers
              with 1 kv head of 512 (v = k), proportional RoPE 0.25, soft-capping 30, vocab 262144;
              64 x 8 x (128 + 256)
  gemma4-e2b  Gemma 4 E2B-like text (random weights; sizes as we read the released config): 35 layers, hidden 1536,
              8 q / 1 kv heads of 256 (global layers, every 5th: 512), the last 20 layers sharing layer 13's /
              14's keys and values with double-wide MLPs, per-layer inputs of 256, soft-capping 30, vocab 262144;
              64 x 8 x (128 + 256)
  mistral-7b  Mistral 7B: 32 layers, hidden 4096, 32 q / 8 kv heads of 128, sliding window 4096 on every
              layer, vocab 32768; 16 x 8 x (256 + 512)
  qwen3-moe-a3b  Qwen3-30B-A3B's layers (128 experts, top-8, expert width 768, hidden 2048, 32 q / 4 kv heads of
              128, vocab 151936) but 8 of its 48 layers (--layers): 32 x 8 x (256 + 512)
  qwen35-0.8b / qwen35-2b
              Qwen3.5-0.8B/2B-like (random weights; sizes as we read the released configs): 24 layers, 3 of
              every 4 Gated DeltaNet (16 key / 16 value heads of 128, conv 4), the 4th gated attention
              (8 q / 2 kv heads of 256, partial RoPE 0.25), hidden 1024 / 2048, vocab 248320; 64 x 8 x (128 + 256)

    python benchmarks/families.py --shape gemma3-1b --case all
    python benchmarks/families.py --shape mistral-7b --case rollout_native,rollout_hf
    python benchmarks/families.py --shape qwen3-moe-a3b --case all
    python benchmarks/families.py --shape gemma3-1b --case grpo_native,grpo_transformers --grpo-steps 1
    python benchmarks/families.py --shape qwen35-2b --case grpo_transformers --run 8,8,128,256 --grpo-steps 1 \
        --case-timeout 250                      # a slow path inside one device call: the steps it finished
    python benchmarks/families.py --shape qwen35-0.8b --case mismatch,rollout_native,rollout_hf
    python benchmarks/families.py --smoke            # CPU, tiny shapes of every family, a few tokens

Not here: TRL (grpo_step.py compares with it), the Qwen2 reference shape (rollout.py).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import grpo_setup  # noqa: E402
from phaserl.models import load_pretrained  # noqa: E402
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402
from profiling import profile_call  # noqa: E402
from step_probes import json_or_none  # noqa: E402

BENCH = "families"
SHAPES = {
    "gemma3-1b": dict(cls="Gemma3TextConfig", run=(64, 8, 128, 256), config=dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        max_position_embeddings=32768, tie_word_embeddings=True)),
    "mistral-7b": dict(cls="MistralConfig", run=(16, 8, 256, 512), config=dict(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, sliding_window=4096, max_position_embeddings=32768,
        rope_theta=1e6)),
    "qwen3-moe-a3b": dict(cls="Qwen3MoeConfig", run=(32, 8, 256, 512), config=dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=8, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=32768, rope_theta=1e6)),
    "qwen3-moe-tiny": dict(cls="Qwen3MoeConfig", run=(2, 2, 8, 6), config=dict(
        vocab_size=512, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64)),
    "gemma4-1b": dict(cls="Gemma4TextConfig", run=(64, 8, 128, 256), config=dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, global_head_dim=512, num_global_key_value_heads=1,
        attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=512, final_logit_softcapping=30.0,
        max_position_embeddings=32768, tie_word_embeddings=True)),
    "gemma4-e2b": dict(cls="Gemma4TextConfig", run=(64, 8, 128, 256), config=dict(
        vocab_size=262144, hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
        num_key_value_heads=1, head_dim=256, global_head_dim=512, hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=262144, num_kv_shared_layers=20, use_double_wide_mlp=True, sliding_window=512,
        final_logit_softcapping=30.0, max_position_embeddings=32768, tie_word_embeddings=True,
        layer_types=["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(35)])),
    # the 1B shape's global-layer features and E2B's per-layer inputs and key/value sharing (layers 2, 3 read 0, 1)
    "gemma4-tiny": dict(cls="Gemma4TextConfig", run=(2, 2, 8, 6), config=dict(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=512, num_kv_shared_layers=2,
        use_double_wide_mlp=True, sliding_window=4, final_logit_softcapping=30.0, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"] * 2)),
    "qwen35-0.8b": dict(cls="Qwen3_5TextConfig", run=(64, 8, 128, 256), config=dict(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=32768, tie_word_embeddings=True)),
    "qwen35-2b": dict(cls="Qwen3_5TextConfig", run=(64, 8, 128, 256), config=dict(
        vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=32768, tie_word_embeddings=True)),
    "qwen35-tiny": dict(cls="Qwen3_5TextConfig", run=(2, 2, 8, 6), config=dict(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, max_position_embeddings=64)),
    "gemma3-tiny": dict(cls="Gemma3TextConfig", run=(2, 2, 8, 6), config=dict(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8, sliding_window=4, max_position_embeddings=64,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "mistral-tiny": dict(cls="MistralConfig", run=(2, 2, 8, 6), config=dict(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=4, max_position_embeddings=64)),
}
CASES = ("rollout_native", "rollout_hf", "grpo_native", "grpo_transformers", "grpo_native_replay", "mismatch_replay",
         "mismatch", "rollout_native_torch_delta", "delta_rule", "train_layers")
MOE_CASES = ("grpo_native_replay", "mismatch_replay")  # skipped for dense shapes
HYBRID_CASES = ("rollout_native_torch_delta", "delta_rule", "train_layers")  # Qwen3.5 shapes only


PROCESS_T0 = time.perf_counter()  # rollout_hf's started line counts from here


def emit(**record) -> None:
    print(json.dumps({"bench": BENCH, **record}), flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_world(shape: str, root: str, device: str) -> str:
    """model/ (transformers-made, random, bf16), tokenizer/ and train.parquet: grpo_step.py's world layout."""
    import transformers

    if os.path.isfile(os.path.join(root, "train.parquet")):
        return root
    spec = SHAPES[shape]
    tokenizer = grpo_setup.build_tokenizer(spec["config"]["vocab_size"])
    config = getattr(transformers, spec["cls"])(**spec["config"], eos_token_id=tokenizer.eos_token_id,
                                                pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(os.path.join(root, "model"))
    tokenizer.save_pretrained(os.path.join(root, "tokenizer"))
    prompts, _, prompt_len, _ = spec["run"]
    grpo_setup.write_prompt_file(root, grpo_setup.prompt_texts(prompts * 8, prompt_len, config.vocab_size))
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return root


def prompt_ids(shape: str) -> list[list[int]]:
    prompts, n, prompt_len, _ = SHAPES[shape]["run"]
    g = torch.Generator().manual_seed(0)
    unique = torch.randint(2, SHAPES[shape]["config"]["vocab_size"], (prompts, prompt_len), generator=g).tolist()
    return [p for p in unique for _ in range(n)]


RESULTS: dict = {}  # case -> best tokens/s of this process (the compare line)


def rollout_native(shape: str, root: str, device: str, dtype: torch.dtype, repeats: int, case: str = "native") -> None:
    model = load_pretrained(os.path.join(root, "model"), dtype=dtype, device=device, implementation="native").eval()
    new = SHAPES[shape]["run"][3]
    engine = RolloutEngine(model, EngineConfig(max_slots=len(prompt_ids(shape))))
    params = SamplingParams(max_new_tokens=new, temperature=1.0)
    engine.generate(prompt_ids(shape), params, eos_token_ids=[], pad_token_id=0)  # warm-up: graphs, compile
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = engine.generate(prompt_ids(shape), params, eos_token_ids=[], pad_token_id=0)
        sync()
        seconds = time.perf_counter() - t0
        tokens = sum(len(r) for r in out.response_ids)
        pool = engine.pool  # its size: KV bytes per token as allocated, the slots of this run's length that fit
        emit(measure="rollout", case=case, shape=shape, seconds=round(seconds, 3), new_tokens=tokens,
             tokens_per_s=round(tokens / seconds, 1), graphs=engine.last_stats.get("graphs"),
             kv_bytes_per_token=pool.allocated_bytes // max(pool.capacity_tokens, 1),
             kv_pool_gib=round(pool.allocated_bytes / 2**30, 2),
             slots_that_fit=pool.slots_that_fit(engine.last_stats["slot_len"]))
        RESULTS[case] = max(RESULTS.get(case, 0.0), tokens / seconds)


def rollout_hf(shape: str, root: str, device: str, dtype: torch.dtype, repeats: int) -> None:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, "model"), dtype=dtype).to(device)
    model.eval()
    new = SHAPES[shape]["run"][3]
    ids = torch.tensor(prompt_ids(shape), device=device)  # equal lengths: no padding
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:2], **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            # A line before the timed call: a part cut off by its time limit still shows how long generate ran
            # (the part's limit minus process_s), a lower bound on its time.
            emit(measure="rollout_started", case="hf_generate", shape=shape, process_s=round(t0 - PROCESS_T0, 1),
                 sequences=ids.shape[0], new_tokens_each=new)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            sync()
            seconds = time.perf_counter() - t0
            tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
            emit(measure="rollout", case="hf_generate", shape=shape, seconds=round(seconds, 3), new_tokens=tokens,
                 tokens_per_s=round(tokens / seconds, 1))
            RESULTS["hf"] = max(RESULTS.get("hf", 0.0), tokens / seconds)


def mismatch(shape: str, root: str, device: str, dtype: torch.dtype, smoke: bool) -> None:
    from mismatch import measure

    model = load_pretrained(os.path.join(root, "model"), dtype=dtype, device=device, implementation="native").eval()
    prompt_len = SHAPES[shape]["run"][2]
    prompts = [p[:prompt_len] for p in prompt_ids(shape)[::SHAPES[shape]["run"][1]]][:2 if smoke else 16]
    params = SamplingParams(max_new_tokens=6 if smoke else 128, temperature=1.0)
    path = "engine" if device == "cpu" else "engine_graphs"
    reference = copy.deepcopy(model).float() if dtype != torch.float32 else None  # the same weights, float32
    for packing in (False, True):
        m = measure(model, path, prompts, 2 if smoke else 4, params, torch.device(device), packing, reference)
        emit(measure="mismatch", shape=shape, dtype=str(dtype), path=path, packing=packing,
             **{k: round(float(v), 6) for k, v in m.items()})


def mismatch_replay(shape: str, root: str, device: str, dtype: torch.dtype) -> None:
    from phaserl.algo import mismatch_metrics
    from phaserl.batch import layout_routes
    from phaserl.models import moe
    from phaserl.roles.forward import batch_logprobs, rows_logprobs, split_rows
    from phaserl.roles.mismatch_probe import _batch

    model = load_pretrained(os.path.join(root, "model"), dtype=dtype, device=device, implementation="native").eval()
    prompts = prompt_ids(shape)
    engine = RolloutEngine(model, EngineConfig(max_slots=len(prompts), record_routes=True))
    out = engine.generate(prompts, SamplingParams(max_new_tokens=SHAPES[shape]["run"][3], temperature=1.0),
                          eos_token_ids=[], pad_token_id=0, generator=torch.Generator(device=device).manual_seed(0))
    batch = _batch(prompts, out.response_ids, out.logprobs, 0, device)
    P, R = batch.prompt_width, batch.response_mask.shape[1]
    batch.routed_experts = layout_routes(list(map(len, prompts)), out.routes, P, R)
    engine.release()
    budget = 16384
    for replay in (False, True):
        trainer = batch_logprobs(model, batch, temperature=1.0, token_budget=budget, packing=True, replay=replay)
        emit(measure="mismatch", case="replay_on" if replay else "replay_off", shape=shape,
             tokens=int(batch.response_mask.sum()),
             **{k.removeprefix("mismatch/"): round(v, 6) for k, v in
                mismatch_metrics(trainer, batch.rollout_logprobs, batch.response_mask).items()})
    same, total = 0, 0  # (token, layer) pairs whose k experts the training forward picks as the rollout did
    saved, batch.routed_experts = batch.routed_experts, None
    with torch.no_grad():
        for idx in split_rows(batch, budget, packing=True):
            routing = moe.Routing()
            rows_logprobs(model, batch, idx, packing=True, temperature=1.0, with_entropy=False, routing=routing)
            real = batch.attention_mask[idx.to(device)].bool()
            recorded = saved[idx.to(device)][real].long()  # [N, L, k]
            fed = recorded[:, 0, 0] >= 0
            used = routing.experts()[fed].sort(-1).values
            same += int((used == recorded[fed].sort(-1).values).all(-1).sum())
            total += used.shape[0] * used.shape[1]
    emit(measure="routing_agreement", shape=shape, same_experts_frac=round(same / max(total, 1), 4))


def delta_rule(shape: str, device: str, smoke: bool) -> None:
    """The Gated DeltaNet rule alone, as one training micro-batch of the shape calls it (see the module doc)."""
    from phaserl.models import linear_attention as la

    c = SHAPES[shape]["config"]
    _, _, prompt_len, new = SHAPES[shape]["run"]
    H, Dk, Dv = c["linear_num_value_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]
    n, L = (2, 16) if smoke else (8, prompt_len + new)
    g = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(n * L, H, Dk, device=device, generator=g), dim=-1)
            for _ in range(2))
    v = torch.randn(n * L, H, Dv, device=device, generator=g)
    decay = -0.1 * torch.rand(n * L, H, device=device, generator=g)
    beta = torch.rand(n * L, H, device=device, generator=g)
    seg = la.Segments.of(torch.ones(1, n * L, device=device), (torch.arange(n * L, device=device) // L)[None])

    def torch_rule(x):
        return la.chunk_gated_delta_rule(*(t[seg.index] for t in (q, k)), x[seg.index], decay[seg.index],
                                         beta[seg.index])[0][seg.real]

    def fla_rule(x):
        return la._fla_chunk(*(t[seg.index] for t in (q, k)), x[seg.index], decay[seg.index], beta[seg.index], seg)

    # the torch rule's two triangular solves per chunk, alone (cuBLAS batched trsm: is it most of the rule?)
    chunks = n * H * -(-L // la.CHUNK)
    system = torch.randn(chunks, la.CHUNK, la.CHUNK, device=device, generator=g).tril(-1) * 0.1
    rhs = torch.randn(chunks, la.CHUNK, Dv, device=device, generator=g)
    for _ in range(2):
        start = time.perf_counter()
        for _ in range(3):
            torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        if device == "cuda":
            torch.cuda.synchronize()
    emit(measure="delta_rule", shape=shape, rule="solve_triangular alone", matrices=chunks, size=la.CHUNK,
         rhs=Dv, ms=round((time.perf_counter() - start) / 3 * 1e3, 3))
    compiled = torch.compile(la.chunk_gated_delta_rule)  # is the rule host-bound? (one fused program per shape)

    def compiled_rule(x):
        return compiled(*(t[seg.index] for t in (q, k)), x[seg.index], decay[seg.index], beta[seg.index])[0][seg.real]

    for name, rule, triangular in (("torch", torch_rule, "solve"), ("torch_blocked", torch_rule, "blocked"),
                                   ("torch_compiled", compiled_rule, "solve"), ("fla", fla_rule, "solve")):
        la.TRIANGULAR = triangular  # the torch rule's triangular systems: trsm, or linear_attention.unit_lower_inverse
        for backward in (False, True):
            def once():
                x = v.clone().requires_grad_(backward)
                with torch.set_grad_enabled(backward):
                    o = rule(x)
                    if backward:
                        o.square().sum().backward()
            try:
                once()
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(3):
                    once()
                if device == "cuda":
                    torch.cuda.synchronize()
                emit(measure="delta_rule", shape=shape, rule=name, backward=backward, tokens=n * L,
                     ms=round((time.perf_counter() - start) / 3 * 1e3, 2))
                if name == "torch" and backward:
                    emit(measure="delta_rule_profile", shape=shape, rule=name, backward=backward,
                         **profile_call(once, device))
            except Exception as e:  # noqa: BLE001 - fla refuses some GPUs / Triton versions: say which, go on
                emit(measure="delta_rule", shape=shape, rule=name, backward=backward, error=str(e)[:300])


def train_layers(shape: str, root: str, device: str, dtype: torch.dtype, smoke: bool) -> None:
    """The whole model's layers (no LM head) on one packed training micro-batch (8 sequences of prompt + new tokens,
    as the GRPO cases' micro-batch), forward + backward: eager, then with the hybrid layers compiled
    (hybrid.COMPILE_HYBRID; inductor on CUDA, dynamo's eager backend on the CPU smoke), each timed after a warm-up,
    the compile's own time, the largest output difference, and a profile of the eager pass."""
    from phaserl.models import decoder, hybrid

    _, _, prompt_len, new = SHAPES[shape]["run"]
    n, L = (2, 16) if smoke else (8, prompt_len + new)
    model = load_pretrained(os.path.join(root, "model"), dtype=dtype, device=device, implementation="native")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, n * L), generator=g).to(device)
    positions = torch.arange(L, device=device).repeat(n)[None]
    seq_ids = torch.arange(n, device=device).repeat_interleave(L)[None]

    def once():
        model.zero_grad(set_to_none=True)
        hidden = model(ids, position_ids=positions, seq_ids=seq_ids)
        hidden.float().square().mean().backward()
        return hidden.detach()

    def timed(repeats: int = 3) -> float:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            once()
        sync()
        return (time.perf_counter() - start) / repeats * 1e3

    eager_out = once()
    eager_ms = timed()
    emit(measure="train_layers", shape=shape, variant="eager", tokens=n * L, ms=round(eager_ms, 2),
         profile=profile_call(once, device))
    hybrid.COMPILE_HYBRID = True
    try:
        decoder.enable_compile(model, backend="inductor" if device == "cuda" else "eager")
        start = time.perf_counter()
        out = once()  # the compile
        first_s = time.perf_counter() - start
        compiled_ms = timed()
        emit(measure="train_layers", shape=shape, variant="hybrid_compiled", tokens=n * L, ms=round(compiled_ms, 2),
             first_call_s=round(first_s, 1), speedup=round(eager_ms / compiled_ms, 3),
             max_abs_diff=float((out.float() - eager_out.float()).abs().max()))
    except Exception as e:  # noqa: BLE001 - a compile that fails here is the finding: say it, go on
        emit(measure="train_layers", shape=shape, variant="hybrid_compiled", error=str(e)[:400])
    finally:
        hybrid.COMPILE_HYBRID = False
        decoder.enable_compile(model, enabled=False)


def grpo(shape: str, root: str, implementation: str, smoke: bool, steps: int, extra: tuple = (),
         micro_batch_tokens: Optional[int] = None, timeout: Optional[float] = None) -> None:
    """One grpo_step.py process (`--only ours`) on this shape's world: its summary as a `grpo_step` line. With
    `timeout`, a process still running then is stopped and the steps it finished are emitted (`grpo_partial`)."""
    prompts, n, prompt_len, new = SHAPES[shape]["run"]
    argv = [sys.executable, os.path.join(HERE, "grpo_step.py"), "--only", "ours", "--world", root,
            "--prompts", str(prompts), "--n", str(n), "--prompt-len", str(prompt_len), "--new-tokens", str(new),
            "--ours-set", f"model.implementation={implementation}",
            "--log-dir", os.path.join(root, f"logs-{implementation}{'-extra' if extra else ''}")]
    if not smoke:  # phaserl train's own (auto) unless asked; the smoke keeps grpo_step --tiny's own micro-batch
        argv += ["--ours-set", f"ppo.micro_batch_tokens={micro_batch_tokens or 'auto'}"]
    for setting in extra:
        argv += ["--ours-set", setting]
    # The KV pool sized for every sequence of the step (grpo_step's default fraction is sized for 0.5B).
    argv += ["--tiny", "--steps", "1", "--warmup", "0"] if smoke else ["--steps", str(steps), "--warmup", "1",
                                                                        "--kv-fraction", "0.25"]
    case = f"grpo_{implementation}"
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # what finished before the limit is still a measurement
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        steps_done = [r for r in map(json_or_none, out.splitlines()) if r and r.get("measure") in ("build", "step")]
        emit(measure="grpo_partial", case=case, shape=shape, timeout_s=timeout, lines=steps_done)
        emit(measure="error", case=case, shape=shape, error=f"stopped after {timeout:g} s (--case-timeout)")
        return
    records = list(filter(None, map(json_or_none, proc.stdout.splitlines())))
    chosen = next((r.get("speed") for r in records if r.get("measure") == "build"), None)  # the auto settings' lines
    for record in records:
        if record.get("measure") == "summary":
            emit(measure="grpo_step", case=implementation + "".join(f" {s}" for s in extra), shape=shape,
                 s_per_step=record["s_per_step_median"],
                 tokens_per_s=record["tokens_per_s"], peak=record["timed_peak"],
                 timing_s=record.get("timing_s_median"), speed=chosen)
    if proc.returncode != 0:
        emit(measure="error", case=case, shape=shape, returncode=proc.returncode,
             stderr=proc.stderr[-2000:])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="gemma3-1b", choices=list(SHAPES))
    p.add_argument("--case", default="all", help=f"'all' or a comma-separated subset of {CASES}")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--world", default=None, help="reuse a world directory made before (same shape)")
    p.add_argument("--grpo-steps", type=int, default=2, help="timed GRPO steps per path (after one warm-up step)")
    p.add_argument("--smoke", action="store_true", help="CPU, every tiny shape, every case")
    p.add_argument("--layers", type=int, default=None, help="override the shape's num_hidden_layers")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="grpo cases: ppo.micro_batch_tokens (default: phaserl's own, auto)")
    p.add_argument("--case-timeout", type=float, default=None, help="grpo cases: stop a GRPO process after this "
                   "many seconds and report the steps it finished (the transformers path of a large shape can take "
                   "longer than a device call has)")
    p.add_argument("--run", default=None, metavar="PROMPTS,N,PROMPT_LEN,NEW", help="override the shape's run")
    a = p.parse_args(argv)
    cases = CASES if a.case == "all" else tuple(a.case.split(","))
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; choose from {CASES}")
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cpu":
        torch.set_num_threads(1)
    if a.layers is not None:
        SHAPES[a.shape]["config"]["num_hidden_layers"] = a.layers
    if a.run is not None:
        SHAPES[a.shape]["run"] = tuple(int(x) for x in a.run.split(","))
    for shape in (("gemma3-tiny", "gemma4-tiny", "mistral-tiny", "qwen3-moe-tiny", "qwen35-tiny") if a.smoke
                  else (a.shape,)):
        root = make_world(shape, a.world or tempfile.mkdtemp(prefix=f"families_{shape}_"), device)
        emit(measure="world", shape=shape, dir=root, device=device, run=SHAPES[shape]["run"])
        for case in cases:
            if case in MOE_CASES and "num_experts" not in SHAPES[shape]["config"]:
                continue
            if case in HYBRID_CASES and SHAPES[shape]["cls"] != "Qwen3_5TextConfig":
                continue
            if case == "mismatch_replay":
                mismatch_replay(shape, root, device, dtype)
            elif case == "grpo_native_replay":
                grpo(shape, root, "native", a.smoke, a.grpo_steps, ("actor.routing_replay=true",), a.micro_batch_tokens)
            elif case == "rollout_native":
                rollout_native(shape, root, device, dtype, 1 if a.smoke else a.repeats)
            elif case == "rollout_hf":
                rollout_hf(shape, root, device, dtype, 1 if a.smoke else a.repeats)
            elif case == "mismatch":
                mismatch(shape, root, device, dtype, a.smoke)
            elif case == "delta_rule":
                delta_rule(shape, device, a.smoke)
            elif case == "train_layers":
                train_layers(shape, root, device, dtype, a.smoke)
            elif case == "rollout_native_torch_delta":
                from phaserl.rollout import recurrent_state

                recurrent_state.USE_DELTA_KERNEL = False
                rollout_native(shape, root, device, dtype, 1 if a.smoke else a.repeats, case="native_torch_delta")
                recurrent_state.USE_DELTA_KERNEL = True
            else:
                grpo(shape, root, case.removeprefix("grpo_"), a.smoke, a.grpo_steps,
                     micro_batch_tokens=a.micro_batch_tokens, timeout=a.case_timeout)
        if "native" in RESULTS and "hf" in RESULTS:
            speedup = RESULTS["native"] / RESULTS["hf"]
            emit(measure="compare", shape=shape, native_tokens_per_s=round(RESULTS["native"], 1),
                 hf_tokens_per_s=round(RESULTS["hf"], 1), speedup=round(speedup, 2), target_4x=speedup >= 4)
        RESULTS.clear()


if __name__ == "__main__":
    main()
