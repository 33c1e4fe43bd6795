"""The doctor's rollout/training mismatch check: sample one small batch, recompute its log-probs, compare.

It builds the actor the run would build (same rollout engine choice, same temperature and filters),
samples `rollout.n` responses for a few training prompts, recomputes the log-prob of every sampled
token with the trainer's forward (the same weights, at the rollout temperature) and reports the
metrics the run logs every step (`algo.mismatch`). Above the thresholds below it warns: the PPO ratio
of the first optimizer step then no longer starts at 1, and a correction (algorithm.rollout_correction)
or a closer engine (rollout.engine=hf, float32) is worth considering. Nothing is trained.
"""
from __future__ import annotations

import torch

from ..algo import mismatch_metrics
from ..data import build_prompt_dataset
from ..roles import HybridActor
from ..roles.forward import batch_logprobs
from ..rollout import EngineConfig, SamplingParams
from ..trainer.rollout_phase import build_rollout_batch
from .checks import Context, check
from .report import OK, WARN, CheckResult

PROBE_PROMPTS = 4
# Same weights, same tokens: beyond these the two sides do not compute the same distribution.
K3_WARN = 1e-3          # mean KL(rollout || train) per token
RATIO_OUT_WARN = 1e-3   # share of tokens with pi_train / pi_rollout outside [0.5, 2]


@check("rollout/training mismatch", needs=("policy", "tokenizer", "train_rows"))
def check_mismatch(ctx: Context) -> CheckResult:
    cfg, tok = ctx.cfg, ctx.tokenizer
    r, d = cfg.rollout, cfg.data
    rows = ctx.train_rows[:PROBE_PROMPTS]
    items = build_prompt_dataset(rows, tok, max_prompt_length=d.max_prompt_length, overlong="truncate_left",
                                 apply_chat_template=d.apply_chat_template).items
    actor = HybridActor(ctx.policy, tok, hybrid_engine_config=cfg.actor.hybrid_engine)
    actor.configure_rollout(r.engine, EngineConfig(max_slots=r.engine_max_slots,
                                                   memory_fraction=r.engine_memory_fraction,
                                                   cuda_graphs=False, compile=False,
                                                   max_seq_tokens=d.max_prompt_length + r.max_new_tokens))
    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
    temperature = r.temperature if r.temperature > 0 else 1.0
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)
    prompts = [list(item.prompt_ids) for item in items for _ in range(r.n)]
    generator = torch.Generator(device=ctx.device).manual_seed(cfg.trainer.seed)
    with actor.rollout_mode():
        result = actor.generate(prompts, params, eos_token_ids=eos, pad_token_id=pad, batch_size=len(prompts),
                                generator=generator)
    batch = build_rollout_batch(items, r.n, result, tokenizer=tok, pad_token_id=pad, group_offset=0,
                                device=ctx.device)
    ctx.policy.eval()
    trainer_logprobs = batch_logprobs(ctx.policy, batch, temperature=temperature,
                                      token_budget=cfg.ppo.forward_micro_batch_tokens, packing=False)
    m = mismatch_metrics(trainer_logprobs, batch.rollout_logprobs, batch.response_mask)
    path = "builtin engine" if actor.engine is not None else "transformers generate"
    tokens = int(batch.response_mask.sum())
    message = (f"{tokens} sampled tokens ({path}, T = {temperature:g}): k3 {m['mismatch/k3']:.2e}, "
               f"|Δ log p| mean {m['mismatch/abs_diff_mean']:.2e} max {m['mismatch/abs_diff_max']:.2e}, "
               f"ratio outside [0.5, 2] {100 * m['mismatch/ratio_out_frac']:.2f}%")
    if m["mismatch/k3"] > K3_WARN or m["mismatch/ratio_out_frac"] > RATIO_OUT_WARN:
        return CheckResult("rollout/training mismatch", WARN, message,
                           fix=f"above k3 {K3_WARN:g} / {100 * RATIO_OUT_WARN:g}% of tokens: set "
                               "algorithm.rollout_correction (tis, icepop, masked_is or seq_mask; docs/concepts.md), "
                               "or compare rollout.engine=hf and model.dtype=float32 to find the side that differs")
    return CheckResult("rollout/training mismatch", OK, message)
