"""The doctor's rollout/training mismatch check: sample one small batch, recompute its log-probs, compare.

It builds the actor the run would build (same rollout engine choice, same temperature and filters),
samples `rollout.n` responses for a few training prompts, recomputes the log-prob of every sampled
token with the trainer's forward (the same weights, at the rollout temperature) and reports the
metrics the run logs every step (`algo.mismatch`). Above the thresholds below it warns: the PPO ratio
of the first optimizer step then no longer starts at 1, and a correction (algorithm.rollout_correction)
or a closer engine (rollout.engine=hf, float32) is worth considering. Nothing is trained.
"""
from __future__ import annotations

from ..data import build_prompt_dataset
from ..roles import HybridActor
from ..roles.mismatch_probe import measure_mismatch
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
    items = build_prompt_dataset(ctx.train_rows[:PROBE_PROMPTS], tok, max_prompt_length=d.max_prompt_length,
                                 overlong="truncate_left", apply_chat_template=d.apply_chat_template).items
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)
    actor = HybridActor(ctx.policy, tok, hybrid_engine_config=cfg.actor.hybrid_engine)
    m, tokens, path = measure_mismatch(
        actor, [list(item.prompt_ids) for item in items], n=r.n, engine=r.engine, max_new_tokens=r.max_new_tokens,
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, eos_token_ids=eos, pad_token_id=pad,
        token_budget=cfg.ppo.forward_micro_batch_tokens, seed=cfg.trainer.seed, replay=cfg.actor.routing_replay)
    temperature = r.temperature if r.temperature > 0 else 1.0
    replay = ", routing replay" if cfg.actor.routing_replay else ""
    message = (f"{tokens} sampled tokens ({path}{replay}, T = {temperature:g}): k3 {m['mismatch/k3']:.2e}, "
               f"|Δ log p| mean {m['mismatch/abs_diff_mean']:.2e} max {m['mismatch/abs_diff_max']:.2e}, "
               f"ratio outside [0.5, 2] {100 * m['mismatch/ratio_out_frac']:.2f}%")
    if m["mismatch/k3"] > K3_WARN or m["mismatch/ratio_out_frac"] > RATIO_OUT_WARN:
        return CheckResult("rollout/training mismatch", WARN, message,
                           fix=f"above k3 {K3_WARN:g} / {100 * RATIO_OUT_WARN:g}% of tokens: set "
                               "algorithm.rollout_correction (tis, icepop, masked_is or seq_mask; docs/concepts.md), "
                               "or compare rollout.engine=hf and model.dtype=float32 to find the side that differs")
    return CheckResult("rollout/training mismatch", OK, message)
