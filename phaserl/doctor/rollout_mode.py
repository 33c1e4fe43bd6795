"""The doctor's "rollout mode" line: synchronous or asynchronous (rollout.max_staleness), the bound, the correction.

It reports what the run will do (trainer/stream.py: which stream, how many groups in flight, what happens to a
sample past the bound, which off-policy correction weighs the update) and warns where the settings make
staleness costly: a large bound at a large learning rate (the policy moves further between sampling and
training than the measured runs of docs/async.md), or the asynchronous stream with the correction turned off.
"""
from __future__ import annotations

from ..config.validate import async_lookahead, rollout_correction_mode
from .checks import Context, check
from .report import OK, WARN, CheckResult

# k x lr above which the update trains on tokens from policies that moved "far": the tiny world's parity runs
# (docs/async.md) used k <= 2; the 2026 peers' defaults are k <= 4 at lr <= 2e-6 (AReaL, prime-rl)
DRIFT_WARN = 1e-5


@check("rollout mode")
def check_rollout_mode(ctx: Context) -> CheckResult:
    cfg = ctx.cfg
    r, lr, k = cfg.rollout, cfg.actor.optim.lr, cfg.rollout.max_staleness
    mode = rollout_correction_mode(cfg)
    if k == 0:
        correction = "" if mode == "none" else f"; algorithm.rollout_correction={mode} weighs the update"
        return CheckResult("rollout mode", OK, "synchronous: every response of a step is sampled by the weights it "
                                               f"trains (rollout.max_staleness=0){correction}")
    per_rank = r.prompts_per_step // max(ctx.world_size, 1)
    kind = "agent episodes" if cfg.agent.env else "responses"
    ahead = async_lookahead(k)
    detail = (f"asynchronous: a batch may hold tokens up to {k} policy version(s) old; up to {per_rank * (k + 1)} "
              f"groups per rank in flight, those due within {ahead} step(s) decoding ({kind} cut at a batch "
              "continue after the update); a sample past the bound "
              f"is {'started over' if r.on_stale == 'restart' else 'dropped with its group'} (rollout.on_stale="
              f"{r.on_stale}); correction: {mode}; {_partial_kv(r)}")
    warnings = []
    if mode == "none":
        warnings.append("algorithm.rollout_correction=none: the update treats tokens of older policies as its own "
                        "(set auto, tis or decoupled)")
    if k >= 2 and k * lr > DRIFT_WARN:
        warnings.append(f"rollout.max_staleness={k} at actor.optim.lr={lr:g}: tokens up to {k} updates old at this "
                        f"learning rate (k x lr = {k * lr:.2g} > {DRIFT_WARN:g}); learning parity with the synchronous "
                        "step was measured at k <= 2; k = 3 / 4 lost 0.03 / 0.05 of held-out score at lr 1e-3 and "
                        "none at 3e-4 (docs/async.md): lower k or the learning rate")
    if r.partial_kv == "keep" and r.engine_keep_awake is False and not r.ranks:
        warnings.append("rollout.partial_kv=keep needs the engine kept awake, and rollout.engine_keep_awake=false: "
                        "the run refuses to start; set engine_keep_awake=true or partial_kv=auto")
    if warnings:
        return CheckResult("rollout mode", WARN, detail, fix="; ".join(warnings))
    return CheckResult("rollout mode", OK, detail)


def _partial_kv(r) -> str:
    """What a response still decoding at an update keeps (rollout.partial_kv; config/auto.py partial_kv_choice). With
    engine_keep_awake auto the run decides it (the memory line's count): both outcomes are named."""
    if r.ranks:
        return "partial rollouts re-prefilled on the rollout ranks"
    kept = {True: "keep", False: "prefill", None: None}[r.engine_keep_awake]
    if r.partial_kv == "prefill" or (r.partial_kv == "auto" and kept == "prefill"):
        return f"partial rollouts re-prefilled after each update (rollout.partial_kv={r.partial_kv} -> prefill)"
    if r.partial_kv == "keep" or kept == "keep":
        return (f"partial rollouts keep their slots and KV through training (rollout.partial_kv={r.partial_kv} -> "
                "keep)")
    return ("partial rollouts keep their KV when the engine is kept awake, else are re-prefilled "
            "(rollout.partial_kv=auto, rollout.engine_keep_awake=auto: see the memory check)")
