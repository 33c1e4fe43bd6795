"""The doctor's rollout/training mismatch check: sample one small batch, recompute its log-probs, compare.

It builds the actor the run would build (same rollout engine choice, same temperature and filters),
samples `rollout.n` responses for a few training prompts, recomputes the log-prob of every sampled
token with the trainer's forward (the same weights, at the rollout temperature) and reports the
metrics the run logs every step (`algo.mismatch`). Above the thresholds below it warns: the PPO ratio
of the first optimizer step then no longer starts at 1, and a correction (algorithm.rollout_correction)
or a closer engine (rollout.engine=hf, float32) is worth considering. Nothing is trained.

With bf16/fp16 weights it also measures the model's own precision noise (roles/mismatch_probe.py: the
trainer against a float32 copy of the same weights) and says which kind of mismatch it sees: one within a
few times that noise is rounding (the two paths compute the same function); one far beyond it is a
difference between the paths, worth finding whatever its size.
"""
from __future__ import annotations

from ..config.validate import forward_micro_batch_tokens
from ..data import build_prompt_dataset
from ..data.images import build_vision_dataset, processor_for
from ..memory.budget import free_memory_bytes
from ..models import invariant
from ..roles import HybridActor
from ..roles.mismatch_probe import measure_mismatch
from .checks import Context, check
from .report import OK, WARN, CheckResult

PROBE_PROMPTS = 4
# Same weights, same tokens: beyond these the two sides do not compute the same distribution.
K3_WARN = 1e-3          # mean KL(rollout || train) per token
RATIO_OUT_WARN = 1e-3   # share of tokens with pi_train / pi_rollout outside [0.5, 2]
NOISE_WARN = 3.0        # mismatch beyond this many times the precision noise: the paths differ
NOISE_FLOOR = 1e-3      # ... once the mean |Δ log p| is at least this (below it, both are negligible)


@check("rollout/training mismatch", needs=("policy", "tokenizer", "train_rows"))
def check_mismatch(ctx: Context) -> CheckResult:
    cfg, tok = ctx.cfg, ctx.tokenizer
    r, d = cfg.rollout, cfg.data
    rows = ctx.train_rows[:PROBE_PROMPTS]
    if getattr(ctx.policy, "takes_images", False):  # a vision-language policy: the rows with their pixels
        processor = processor_for(ctx.policy.vision_config, min_pixels=d.min_pixels, max_pixels=d.max_pixels)
        items = build_vision_dataset(rows, tok, processor, merge_size=ctx.policy.vision_config.spatial_merge_size,
                                     max_prompt_length=10**9, overlong="error",
                                     apply_chat_template=d.apply_chat_template, image_key=d.image_key).items
    else:
        items = build_prompt_dataset(rows, tok, max_prompt_length=d.max_prompt_length, overlong="truncate_left",
                                     apply_chat_template=d.apply_chat_template).items
    images = [item.images for item in items]
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)
    actor = HybridActor(ctx.policy, tok, hybrid_engine_config=cfg.actor.hybrid_engine)
    with invariant.bitwise(r.bitwise):  # the kernels the run will compute with (rollout.bitwise)
        probe = measure_mismatch(
            actor, [list(item.prompt_ids) for item in items], n=r.n, engine=r.engine,
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            eos_token_ids=eos, pad_token_id=pad,
            token_budget=forward_micro_batch_tokens(cfg), seed=cfg.trainer.seed, replay=cfg.actor.routing_replay,
            free_bytes=free_memory_bytes(actor.device),
            images=images if any(im is not None for im in images) else None)
    m, temperature = probe.metrics, r.temperature if r.temperature > 0 else 1.0
    if r.bitwise:
        return _bitwise_result(cfg, m, probe.tokens)
    replay = ", routing replay" if cfg.actor.routing_replay else ""
    diff = m["mismatch/abs_diff_mean"]
    message = (f"{probe.tokens} sampled tokens ({probe.path}{replay}, T = {temperature:g}): k3 {m['mismatch/k3']:.2e}, "
               f"|Δ log p| mean {diff:.2e} max {m['mismatch/abs_diff_max']:.2e}, "
               f"ratio outside [0.5, 2] {100 * m['mismatch/ratio_out_frac']:.2f}%; numerics: default kernels "
               "(rollout.bitwise = true makes the two sides equal bit for bit)")
    details = ((f"precision noise: the trainer is {probe.noise:.2e} (mean |Δ log p|) from the same weights in "
                f"float32; the mismatch is {diff / max(probe.noise, 1e-12):.1f}× that",) if probe.noise is not None
               else (f"precision noise not measured: {probe.noise_note}",) if probe.noise_note else ())
    beyond = probe.noise is not None and diff >= NOISE_FLOOR and diff > NOISE_WARN * probe.noise
    if beyond:
        return CheckResult("rollout/training mismatch", WARN, message + f"; {diff / probe.noise:.1f}× the model's "
                           "own precision noise: the rollout and training paths do not compute the same thing",
                           fix="compare rollout.engine=hf (and model.dtype=float32) to find the side that differs; "
                               "a correction (algorithm.rollout_correction) only hides it", details=details)
    if m["mismatch/k3"] > K3_WARN or m["mismatch/ratio_out_frac"] > RATIO_OUT_WARN:
        rounding = probe.noise is not None and diff <= NOISE_WARN * probe.noise
        within = " (within the model's precision noise: rounding, not a path difference)" if rounding else ""
        return CheckResult("rollout/training mismatch", WARN, message + within,
                           fix=f"above k3 {K3_WARN:g} / {100 * RATIO_OUT_WARN:g}% of tokens: set "
                               "algorithm.rollout_correction (tis, icepop, masked_is or seq_mask; docs/concepts.md), "
                               "or compare rollout.engine=hf and model.dtype=float32 to find the side that differs",
                           details=details)
    return CheckResult("rollout/training mismatch", OK, message, details=details)


def _bitwise_result(cfg, m: dict, tokens: int) -> CheckResult:
    """rollout.bitwise: the numerics mode says the two sides are equal bit for bit; the probe checks it."""
    correction = cfg.algorithm.rollout_correction
    noop = (f"; algorithm.rollout_correction = {correction} is a no-op here (every token's weight is 1)"
            if correction not in ("none", "auto") else "")
    if m["mismatch/abs_diff_max"] == 0.0:
        return CheckResult("rollout/training mismatch", OK, f"numerics: bitwise (rollout.bitwise): the trainer's "
                           f"log-probs of {tokens} sampled tokens equal the sampler's bit for bit, mismatch 0.0; "
                           f"rollout corrections are no-ops{noop}{_checks(cfg)}")
    return CheckResult("rollout/training mismatch", WARN, f"numerics: bitwise (rollout.bitwise), yet the trainer's "
                       f"log-probs differ from the sampler's (max |Δ log p| {m['mismatch/abs_diff_max']:.2e} over "
                       f"{tokens} tokens): some kernel on one side is not the batch-invariant one",
                       fix="report it with this config; meanwhile rollout.bitwise = false and a correction "
                           "(algorithm.rollout_correction) keep training")


def _checks(cfg) -> str:
    """How often the run itself checks it (rollout.bitwise_check_every)."""
    every = cfg.rollout.bitwise_check_every
    return "" if every == 1 else (f"; the run recomputes the exact log-probs every {every} steps and takes the "
                                  "engine's between (rollout.bitwise_check_every)")
