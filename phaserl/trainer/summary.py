"""The start-of-run summary: what this run trains, on what, with which sizes per phase and speed settings.

`run_summary(trainer)` reads only what the builder already resolved (the roles and `RunSettings`), so it
states what the run will really do (e.g. `ppo.packing: auto` shown as the choice made on this device), not
what the YAML asked for. Rank 0 prints it once, at the start of `fit()`. It changes nothing.
"""
from __future__ import annotations

from .. import cuda_allocator
from ..algo import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from ..roles.forward import supports_packing


def _params(model) -> str:
    count = sum(p.numel() for p in model.parameters())  # FSDP2 shards report the full size through DTensor
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"


def _model_line(role, name: str) -> str:
    model = role.model
    first = next(model.parameters())
    kind = "phaserl decoder" if supports_packing(model) else f"transformers {type(model).__name__}"
    model_type = getattr(getattr(model, "config", None), "model_type", "?")
    return f"{name} {model_type} ({kind}), {_params(model)} parameters, {str(first.dtype).removeprefix('torch.')}"


def _on_off(flag) -> str:
    return "on" if flag else "off"


def run_summary(trainer) -> str:
    """Several lines of plain text; `trainer` is a built RLTrainer (before or after resume)."""
    run, actor = trainer.run, trainer.actor
    world = trainer.world_size
    per_rank = run.responses_per_step // max(run.n, 1) // world
    train_prompts = len(run.train_prompts.dataset)
    val = ("no validation" if run.val_prompts is None else
           f"{len(run.val_prompts)} held-out prompts" + (" on this rank" if world > 1 else ""))
    models = [_model_line(actor, "policy")]
    if trainer.ref_policy is not None:
        models.append("frozen reference " + _model_line(trainer.ref_policy, "").lstrip())
    if trainer.critic is not None:
        models.append(_model_line(trainer.critic, "critic"))
    rewards = []
    rules = getattr(run.reward, "rules", None)  # a multi-turn run scores with its environment's rewards instead
    if not hasattr(run.reward, "rules"):
        rewards.append("the environment's rewards (agent.*)")
    if rules is not None:
        rewards += [f"{r.name} (weight {r.weight:g})" for r in rules.rewards]
    rm = getattr(run.reward, "reward_model", None)
    if rm is not None:
        unit = (f"≤ {rm.micro_batch_tokens} tokens per forward" if rm.engine == "phaserl"
                else f"≤ {rm.batch_size} sequences per call")
        rewards.append(f"reward model (weight {run.reward.reward_model_weight:g}, {unit})")
    adv, loss = run.advantage, actor.loss
    ctl = run.kl_controller
    coef = (f"coef {ctl.value:g}, adaptive: target {ctl.target:g}, horizon {ctl.horizon} responses"
            if hasattr(ctl, "target") else f"coef {ctl.value:g}")
    kl = ("KL off" if trainer.ref_policy is None else
          f"KL {adv.kl_estimator} in the reward ({coef})" if adv.kl_in_reward else
          f"KL {loss.kl_estimator} in the loss ({coef})")
    mini_steps = run.responses_per_step // (run.mini_batch_per_rank * world)
    reused = run.reuse_update_logprobs and run.epochs == 1 and mini_steps == 1 and not adv.kl_in_reward
    engine = actor.engine_kind if actor.engine_kind != "auto" else (
        "builtin engine" if _engine_supported(actor) else "transformers generate")
    lines = [
        f"device     {actor.device}, {world} rank(s)",
        "model      " + "; ".join(models) + f"; tokenizer {getattr(run.tokenizer, 'name_or_path', '') or '?'}",
        f"data       {train_prompts} training prompts ({train_prompts / (per_rank * world):.1f} steps per epoch), "
        f"{val}",
        f"algorithm  {_name(ADVANTAGE_ESTIMATORS, adv.estimator)} advantages, "
        f"{_name(POLICY_LOSSES, loss.loss_fn)} policy loss ({loss.agg_mode}), {kl}; "
        f"reward: {', '.join(rewards)}",
        f"rollout    {per_rank * world} prompts × {run.n} = {run.responses_per_step} responses per step "
        f"({per_rank} prompts per rank, ≤ {run.generate_batch_size} per generate call), ≤ "
        f"{run.sampling.max_new_tokens} new tokens, temperature {run.sampling.temperature:g}",
        f"forward    ≤ {run.forward_tokens} tokens per micro-batch (old log-probs: "
        f"{'reused from the update' if reused else 'own pass'})" + _bitwise_checks(run, reused),
        f"update     {run.epochs} epoch(s) × {mini_steps} optimizer step(s) of {run.mini_batch_per_rank * world} "
        f"responses, ≤ {run.train_tokens} tokens per micro-batch",
        f"speed      rollout: {engine}; micro-batches: {'packed' if actor.packing else 'padded'}; gradient "
        f"checkpointing: {_on_off(getattr(actor.model, 'gradient_checkpointing', False))}; compile: "
        f"{_on_off(_compiled(actor.model))}; optimizer offload in rollout: {_on_off(actor.hybrid.offload_optimizer)}",
        *_speed_lines(run.speed),
        *([f"memory     {run.speed.memory_plan}"] if run.speed is not None and run.speed.memory_plan else []),
        *([f"memory     CUDA allocator: {cuda_allocator.ACTIVE}"]
          if cuda_allocator.ACTIVE and actor.device.type == "cuda" else []),
        f"run        {run.total_steps} steps; validation "
        f"{f'every {run.val_interval} steps' if run.val_interval else 'at the end'}; checkpoints "
        f"{f'every {run.save_interval} steps' if run.save_interval else 'at the end'} in {run.checkpoint_path}; "
        f"logs in {run.log_dir}",
    ]
    return "phaserl: run summary\n" + "\n".join("  " + line for line in lines)


def _speed_lines(speed) -> list[str]:
    """The auto-able speed settings as chosen for this machine, one per line, with why (trainer/speed.py)."""
    if speed is None:
        return []
    return [("auto       " if i == 0 else " " * 11) + c.line() for i, c in enumerate(speed.all())]


def _name(table: dict, fn) -> str:
    """The config name under which `fn` was chosen (algorithm.adv_estimator, actor.policy_loss)."""
    fn = getattr(fn, "func", fn)  # a loss bound to its settings (functools.partial) names its function
    return next((name for name, candidate in table.items() if candidate is fn), getattr(fn, "__name__", repr(fn)))


def _engine_supported(actor) -> bool:
    from ..rollout import RolloutEngine

    return RolloutEngine.supports(actor.model)


def _compiled(model) -> bool:
    return any(getattr(m, "compiled", None) for m in model.modules())


def _bitwise_checks(run, reused: bool) -> str:
    """The bitwise mode's checks (rollout.bitwise_check_every), or nothing outside that mode."""
    every = run.bitwise_check_every
    if not every:
        return ""
    if every == 1 or not reused or run.stream.max_staleness:
        return "; bitwise: the update's exact log-probs checked every step"
    return (f"; bitwise: the update's exact log-probs checked every {every} steps, the engine's taken between "
            "(rollout.bitwise_check_every)")
