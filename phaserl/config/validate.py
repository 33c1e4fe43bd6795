"""Cross-field rules of a config, and the batch quantities derived from it.

`validate(cfg, world_size)` checks what no single field can check alone: batch arithmetic across
phases, which roles an algorithm needs, token budgets. It raises one ConfigError that lists every
broken rule with its arithmetic and the fix, and warns (`warnings.warn`) about settings that are
valid but ignored. `derive(cfg, world_size)` resolves the null/"auto" conveniences into a frozen
`Derived` instead of mutating the config. `check_context_length` runs later, once the model's
context size is known. Per-field checks (types, ranges, unknown keys) happen while loading (`load.py`).
Nothing here reads a file: what depends on a model directory (`reward_model.engine = auto` is decided
by the RM's config.json) is passed in by the caller that read it (`derive(..., reward_model_engine=)`).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from phaserl.config.auto import MICRO_BATCH_OFF_CUDA
from phaserl.config.schema import Config
from phaserl.errors import ConfigError

# Estimators whose baseline is built from the other responses to the same prompt.
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_passk", "opo", "gpg")
FORWARD_TOKENS = 32768  # ppo.forward_micro_batch_tokens = null: tokens per forward-only micro-batch, per rank
_RESUME_LOOKALIKES = ("none", "no", "false", "off", "true", "yes", "on", "latest", "last", "always")


@dataclass(frozen=True)
class Derived:
    """Quantities resolved from a validated config and a world size (see `explain` for the formulas)."""

    world_size: int
    prompts_per_rank: int  # prompts each rank generates for, per RL step
    responses_per_step: int  # GLOBAL responses per RL step (prompts_per_step * n)
    responses_per_rank: int
    generate_calls_per_rank: int  # rollout engine calls per rank per RL step
    mini_batch_size: int  # GLOBAL responses per optimizer step (ppo.mini_batch_size, resolved)
    mini_batch_per_rank: int
    num_mini_batches: int
    optimizer_steps_per_rl_step: int  # ppo.epochs * num_mini_batches
    critic_enabled: bool
    ref_enabled: bool
    reward_model_engine: str  # phaserl | transformers | auto (not resolved: the RM directory decides)
    reward_model_inputs_per_call: int  # full-length RM inputs one forward holds for sure (0 when the RM is off)
    reward_model_scoring_calls_per_rank: int  # at most, per RL step (0 when the reward model is off)
    total_responses: int  # over the whole run
    max_sequence_tokens: int  # prompt + response, at most
    sequence_tokens: int  # a micro-batch's or an engine slot's longest sequence (a whole episode in multi-turn runs)
    sequences_per_micro_batch: int  # full-length sequences that fit ppo.micro_batch_tokens
    forward_micro_batch_tokens: int  # ppo.forward_micro_batch_tokens, resolved (auto: FORWARD_TOKENS or one sequence)
    max_grad_accum_steps: int  # micro-batches per optimizer step per rank when every sequence is full length


def _multiples(x: int, m: int) -> str:
    """Nearest multiples of m around x, as a fix suggestion ('28 or 32')."""
    low = x // m * m
    return f"{low} or {low + m}" if low > 0 else str(m)


def _divisors(x: int) -> str:
    """The first few divisors of x, as a fix suggestion."""
    return ", ".join([str(d) for d in range(1, x + 1) if x % d == 0][:8])


def trainer_ranks(cfg: Config, world_size: int) -> int:
    """The ranks that train and so divide the batches: the launch's world size less rollout.ranks (the whole world
    when rollout.ranks = 0, or when the split itself is wrong: _split_errors says so)."""
    k = cfg.rollout.ranks
    return world_size - k if isinstance(world_size, int) and 0 < k < world_size else world_size


def _ranks_name(cfg: Config, world_size: int) -> str:
    """How the batch rules name the ranks they divide by."""
    k = cfg.rollout.ranks
    if isinstance(world_size, int) and 0 < k < world_size:
        return f"the trainer ranks (world_size - rollout.ranks = {world_size} - {k})"
    return "world_size"


def _split_errors(cfg: Config, world_size: int) -> list[str]:
    """rollout.ranks against the launch: rollout ranks of their own need torchrun, and a trainer rank must remain."""
    k = cfg.rollout.ranks
    if k == 0 or not isinstance(world_size, int) or isinstance(world_size, bool):
        return []
    if world_size == 1:
        return [f"rollout.ranks = {k} puts generation on ranks of its own, but this run is one process (no "
                f"torchrun): launch with torchrun --nproc-per-node N, N > {k} (the first N - {k} ranks train, the "
                f"last {k} generate), or set rollout.ranks = 0 (every rank generates and trains)"]
    if k >= world_size:
        return [f"rollout.ranks = {k} leaves no trainer rank: the launch has world_size = {world_size} ranks and the "
                f"last {k} would only generate; set rollout.ranks to at most {world_size - 1}, or launch at least "
                f"{k + 1} ranks"]
    return []


def _batch_errors(cfg: Config, world_size: int, ranks: str = "world_size") -> list[str]:
    """Broken batch arithmetic (prompts -> ranks -> responses -> mini-batches), one message per rule. `ranks` names
    the rank count they divide by (the trainer ranks when rollout.ranks > 0)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        return [f"world_size = {world_size!r}: expected an integer >= 1"]
    ws, P, n = world_size, cfg.rollout.prompts_per_step, cfg.rollout.n
    mbs, nmb, R = cfg.ppo.mini_batch_size, cfg.ppo.num_mini_batches, P * n
    responses = f"rollout.prompts_per_step × rollout.n = {P} × {n} = {R} responses per step"
    errs = []
    if P % ws:
        errs.append(f"rollout.prompts_per_step = {P} is not divisible by {ranks} = {ws} (prompts per rank = "
                    f"{P} / {ws} = {P / ws:g}); use a multiple of {ws}, e.g. {_multiples(P, ws)}")
    if mbs is None and R % nmb:
        errs.append(f"{responses} do not split into ppo.num_mini_batches = {nmb} equal mini-batches "
                    f"({R} / {nmb} = {R / nmb:g}); use a divisor of {R}, e.g. {_divisors(R)}")
    elif mbs is not None and mbs * nmb != R:
        fixes = [f"ppo.mini_batch_size = {R // nmb} ({R} / {nmb})"] if R % nmb == 0 else []
        fixes += [f"ppo.num_mini_batches = {R // mbs} ({R} / {mbs})"] if R % mbs == 0 else []
        fixes += ["ppo.mini_batch_size = null (derived from num_mini_batches)"]
        errs.append(f"ppo.mini_batch_size × ppo.num_mini_batches = {mbs} × {nmb} = {mbs * nmb} responses, but "
                    f"{responses}; every response must be used exactly once per epoch. "
                    f"Set {' or '.join(fixes)}, or change rollout.prompts_per_step / rollout.n")
    resolved = mbs if mbs is not None else R // nmb
    if resolved * nmb == R and resolved % ws:  # only once the mini-batch itself is right
        what = "ppo.mini_batch_size" if mbs is not None else f"ppo.mini_batch_size (derived: {R} / {nmb})"
        errs.append(f"{what} = {resolved} responses per optimizer step (global) is not divisible by {ranks} = "
                    f"{ws} ({resolved} / {ws} = {resolved / ws:g} per rank); use a multiple of {ws}, "
                    f"e.g. {_multiples(resolved, ws)}")
    return errs


def _rule_errors(cfg: Config) -> list[str]:
    """Broken rules between sections that do not involve the world size."""
    a, r, errs = cfg.algorithm, cfg.rollout, []
    if a.adv_estimator in GROUP_ESTIMATORS and r.n < 2:
        errs.append(f"algorithm.adv_estimator = {a.adv_estimator} needs rollout.n >= 2, got rollout.n = {r.n}: its "
                    "baseline comes from the other responses to the same prompt, and a group of one has none. "
                    "Set rollout.n to 4-16, or use reinforce_plus_plus, remax or gae with n = 1")
    if r.temperature == 0 and a.adv_estimator in GROUP_ESTIMATORS + ("remax",):
        errs.append(f"rollout.temperature = 0 (greedy) with algorithm.adv_estimator = {a.adv_estimator}: every "
                    "response equals its baseline, so all advantages are 0 and nothing is learned; "
                    "set rollout.temperature > 0 (e.g. 1.0)")
    if a.adv_estimator == "gae" and cfg.critic.enable is False:
        errs.append("algorithm.adv_estimator = gae needs value estimates, but critic.enable = false; set "
                    "critic.enable to true (or null), or use a critic-free estimator (grpo, rloo, remax, ...)")
    if cfg.critic.hybrid_engine is not None:
        errs.append("critic.hybrid_engine must be null: only the actor generates, so only the actor switches "
                    "between rollout and training modes; resharding the critic like the actor is how a shared FSDP "
                    "config ends in OOM or 'all_reduce failed' (classic mistake 1). Delete critic.hybrid_engine; "
                    "set the critic's sharding in critic.fsdp and mode switching in actor.hybrid_engine")
    if a.kl_placement != "none" and cfg.ref.enable is False:
        errs.append(f"algorithm.kl_placement = {a.kl_placement} measures the KL to the reference policy, but "
                    "ref.enable = false; set ref.enable to true (or null), or algorithm.kl_placement = none")
    if cfg.actor.routing_replay and r.engine == "hf":
        errs.append("actor.routing_replay = true needs the experts recorded by phaserl's rollout engine, but "
                    "rollout.engine = hf; set rollout.engine = auto (or builtin), or actor.routing_replay = false")
    if cfg.actor.routing_replay and cfg.agent.harness:
        errs.append("actor.routing_replay = true replays the engine's own rollouts and agent.env episodes, where "
                    "every position is fed once; an agent.harness request re-prefills its whole conversation, so the "
                    "experts of a position differ between the completions that fed it and one record per position "
                    "cannot replay them all: set actor.routing_replay = false (or use agent.env)")
    rm = cfg.reward_model
    if not cfg.reward.functions and not rm.enable:
        errs.append("no reward: reward.functions is empty and reward_model.enable = false; add a rule function "
                    "(e.g. reward.functions=[tiny_exact]) or set reward_model.enable = true with reward_model.path")
    if rm.enable and not rm.path:
        errs.append("reward_model.enable = true needs reward_model.path (a Hugging Face sequence-classification "
                    "model directory)")
    for i, fn in enumerate(cfg.reward.functions):
        if not fn.name.strip():
            errs.append(f"reward.functions[{i}].name is empty; give a built-in rule name or 'file.py:function'")
    low = policy_loss_range(cfg.actor)[0]
    if low >= 1 and cfg.actor.policy_loss in ("ppo", "vanilla", "gspo"):
        errs.append(f"actor.clip_ratio_low = {low}: the lower clip bound 1 - clip_ratio_low = 1 - {low} = "
                    f"{1 - low:g} is not positive, so the ratio is never clipped from below; "
                    "expected < 1 (usually 0.2)")
    p, t = cfg.data.max_prompt_length, r.max_new_tokens
    for key in ("micro_batch_tokens", "forward_micro_batch_tokens"):
        budget = getattr(cfg.ppo, key)
        if budget is not None and budget < p + t:  # None: auto, whole sequences by construction
            errs.append(f"ppo.{key} = {budget} cannot hold one full sequence: data.max_prompt_length + "
                        f"rollout.max_new_tokens = {p} + {t} = {p + t} tokens, and a sequence is never split "
                        f"across micro-batches; set ppo.{key} >= {p + t}")
    if r.val_n > 1 and r.val_temperature == 0:
        errs.append(f"rollout.val_n = {r.val_n} with rollout.val_temperature = 0: greedy decoding gives the same "
                    f"response {r.val_n} times, so validation costs {r.val_n}× for nothing; set rollout.val_n = 1, "
                    "or rollout.val_temperature > 0 (e.g. 1.0) to measure mean@k / pass@k")
    for role in ("actor", "critic"):
        betas = getattr(cfg, role).optim.betas
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            errs.append(f"{role}.optim.betas = {betas}: expected two numbers in [0, 1), e.g. [0.9, 0.999]")
    errs += _lora_errors(cfg)
    if not cfg.data.train_files:
        errs.append("data.train_files is empty; give at least one .parquet/.jsonl file (or 'tiny')")
    errs += _agent_errors(cfg)
    resume = cfg.trainer.resume
    word = resume.strip().lower()
    if not word or word in _RESUME_LOOKALIKES or (word in ("auto", "never") and resume != word):
        errs.append(f"trainer.resume = {resume!r}: expected auto (newest complete checkpoint), never, or a "
                    "checkpoint path (write ./name for a directory whose name looks like a keyword)")
    return errs + _algorithm_errors(cfg) + _bitwise_errors(cfg)


def _bitwise_errors(cfg: Config) -> list[str]:
    """rollout.bitwise against the settings that would run other kernels on one side (models/invariant.py): the
    transformers classes or generate(), compiled code (it may fuse a product and a sum into one rounding), the
    training graphs (padded shapes), LoRA dropout (the merged weight both sides multiply has none)."""
    if not cfg.rollout.bitwise:
        return [] if cfg.rollout.bitwise_check_every == 1 else [
            f"rollout.bitwise_check_every = {cfg.rollout.bitwise_check_every} checks the bitwise mode, which is off: "
            "set rollout.bitwise = true, or leave rollout.bitwise_check_every at 1"]
    why = "rollout.bitwise = true (phaserl's batch-invariant kernels on both sides)"
    refused = [(cfg.model.implementation == "transformers", "model.implementation = transformers",
                "model.implementation = auto or native"),
               (cfg.rollout.engine == "hf", "rollout.engine = hf", "rollout.engine = auto or builtin"),
               (cfg.actor.compile is True, "actor.compile = true", "actor.compile = null (auto) or false"),
               (cfg.critic.compile is True, "critic.compile = true", "critic.compile = null (auto) or false"),
               (cfg.rollout.engine_compile is True, "rollout.engine_compile = true",
                "rollout.engine_compile = null (auto) or false"),
               (cfg.ppo.train_graphs is True, "ppo.train_graphs = true", "ppo.train_graphs = null (auto) or false"),
               *[(getattr(cfg, role).lora.rank > 0 and getattr(cfg, role).lora.dropout > 0,
                  f"{role}.lora.dropout = {getattr(cfg, role).lora.dropout} (no merged weight drops inputs)",
                  f"{role}.lora.dropout = 0") for role in ("actor", "critic")]]
    return [f"{what} does not run with {why}; set {fix}, or rollout.bitwise = false" for on, what, fix in refused if on]


def _algorithm_errors(cfg: Config) -> list[str]:
    """Rules of the 2026 algorithm keys (losses, corrections, DAPO's sampling and shaping)."""
    a, actor, r, errs = cfg.algorithm, cfg.actor, cfg.rollout, []
    if actor.policy_loss == "cispo" and policy_loss_range(actor)[0] > 1:
        errs.append(f"actor.clip_ratio_low = {actor.clip_ratio_low} with actor.policy_loss = cispo: the weight's lower "
                    "bound 1 - clip_ratio_low would be negative; use a value in [0, 1] (1 = no lower bound)")
    if a.dynamic_sampling and r.n < 2:
        errs.append(f"algorithm.dynamic_sampling = true needs rollout.n >= 2, got {r.n}: a group of one response "
                    "never has reward variance, so no group would ever be kept")
    if a.overlong_buffer > r.max_new_tokens:
        errs.append(f"algorithm.overlong_buffer = {a.overlong_buffer} is longer than rollout.max_new_tokens = "
                    f"{r.max_new_tokens}; use at most the limit (DAPO: a quarter of it) or 0 to turn it off")
    if a.rollout_correction not in ("none", "auto") and a.rollout_correction_cap <= 1:
        errs.append(f"algorithm.rollout_correction_cap = {a.rollout_correction_cap} must be > 1 with "
                    f"algorithm.rollout_correction = {a.rollout_correction} (2.0 is usual for tokens, "
                    "1.01 for seq_mask)")
    return errs


def _agent_errors(cfg: Config) -> list[str]:
    """agent.* against the sizes it shares with single-turn runs (only when agent.env or agent.harness is set)."""
    ag, errs = cfg.agent, []
    if ag.env and ag.harness:
        errs.append(f"agent.env = {ag.env!r} and agent.harness = {ag.harness!r} are both set: an episode comes from "
                    "an environment or from an external harness; set exactly one of them (the other null)")
    errs += _verifiers_errors(ag)
    if not (ag.env or ag.harness):
        return errs
    p, t = cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
    if ag.max_episode_tokens < p + t:
        errs.append(f"agent.max_episode_tokens = {ag.max_episode_tokens} < data.max_prompt_length + "
                    f"rollout.max_new_tokens = {p} + {t}: even the first turn may not fit an episode; set "
                    f"agent.max_episode_tokens >= {p + t} (plus room for the observations and later turns)")
    for key in ("micro_batch_tokens", "forward_micro_batch_tokens"):
        if getattr(cfg.ppo, key) is not None and getattr(cfg.ppo, key) < ag.max_episode_tokens:
            errs.append(f"ppo.{key} = {getattr(cfg.ppo, key)} cannot hold one whole episode of up to "
                        f"agent.max_episode_tokens = {ag.max_episode_tokens} tokens (an episode is never split "
                        f"across micro-batches); set ppo.{key} >= {ag.max_episode_tokens}")
    return errs


def _verifiers_errors(ag) -> list[str]:
    """agent.harness = verifiers and agent.verifiers.* go together."""
    v, errs = ag.verifiers, []
    if ag.harness == "verifiers" and not v.env:
        errs.append("agent.harness = verifiers needs agent.verifiers.env: the environment's installed module (e.g. "
                    "my_env) or its file ('path/to/env.py'), with its settings in agent.verifiers.kwargs")
    if ag.harness != "verifiers" and (v.env or v.kwargs or v.eval_kwargs is not None):
        errs.append(f"agent.verifiers.* is set but agent.harness = {ag.harness!r}: set agent.harness = verifiers to "
                    "train on that environment, or delete agent.verifiers")
    return errs


def _lora_errors(cfg: Config) -> list[str]:
    """actor.lora / critic.lora (names are checked per item by the schema's choices): some target, a nonzero alpha."""
    errs = []
    for role in ("actor", "critic"):
        lora = getattr(cfg, role).lora
        if lora.rank == 0:
            continue
        if not lora.target_modules:
            errs.append(f"{role}.lora.target_modules is empty: name the projections that get adapters, e.g. "
                        "[q_proj, v_proj] or [all-linear]")
        if lora.alpha == 0:
            errs.append(f"{role}.lora.alpha = 0 scales every adapter update by alpha / rank = 0: nothing would be "
                        f"learned; set {role}.lora.alpha (commonly 2 x rank, e.g. {2 * lora.rank})")
    return errs


def _memory_errors(cfg: Config, world_size: int) -> list[str]:
    """The memory plan's keys set by hand (docs/memory.md): one way to say how many layers recompute, and the
    single-process measures not asked of several ranks."""
    a, errs = cfg.actor, []
    if a.gradient_checkpointing and a.checkpoint_layers is not None:
        errs.append(f"actor.gradient_checkpointing = true and actor.checkpoint_layers = {a.checkpoint_layers} both say "
                    "how many layers recompute their activations: keep actor.checkpoint_layers (true means all of "
                    "them) and delete actor.gradient_checkpointing")
    if a.offload_activations and a.checkpoint_layers == 0:
        errs.append("actor.offload_activations = true and actor.checkpoint_layers = 0: offloading moves the "
                    "checkpointed layers' inputs to host memory, and no layer is checkpointed; set "
                    "actor.checkpoint_layers (or leave it at auto), or actor.offload_activations = false")
    k = a.sequence_parallel
    if k > 1 and isinstance(world_size, int) and (world_size % k or cfg.rollout.ranks):
        errs.append(f"actor.sequence_parallel = {k} on {world_size} rank(s)"
                    + (f" with rollout.ranks = {cfg.rollout.ranks}: sequence-parallel groups are for colocated "
                       "runs; set rollout.ranks = 0" if cfg.rollout.ranks else
                       f": the ranks form groups of {k}, so it must divide the world size; use 1 (off) or a divisor "
                       f"of {world_size}"))
    if world_size > 1 and a.optimizer_offload:
        errs.append(f"actor.optimizer_offload = true on {world_size} ranks: the CPU step is for one process; with "
                    "several, actor.fsdp.sharding_strategy = FULL_SHARD spreads AdamW's moments over the ranks")
    if a.optimizer_offload and cfg.model.dtype == "float16" and not a.lora.rank:
        errs.append("actor.optimizer_offload = true with model.dtype = float16: AdamW steps float32 master copies of "
                    "float16 weights on the device, and the CPU step does not run on them; set "
                    "actor.optimizer_offload = false (or leave it at auto), or use model.dtype = bfloat16")
    if world_size > 1 and cfg.ref.stream_weights:
        errs.append(f"ref.stream_weights = true on {world_size} ranks: streaming is for one process; with several, "
                    "set ref.fsdp.cpu_offload = true (each rank keeps its shard on the CPU)")
    return errs


def _warnings(cfg: Config, world_size: int) -> list[str]:
    """Settings that are valid but will be ignored or wasted."""
    a, out = cfg.algorithm, []
    if cfg.rollout.ranks and cfg.actor.hybrid_engine.offload_optimizer:
        out.append(f"actor.hybrid_engine.offload_optimizer = true is ignored with rollout.ranks = {cfg.rollout.ranks}: "
                   "the trainer ranks never switch the actor to rollout mode (the rollout ranks generate), so its "
                   "optimizer state stays where it is; delete the key")
    if (cfg.rollout.engine_keep_awake and world_size > 1 and cfg.actor.fsdp.sharding_strategy != "NO_SHARD"
            and not cfg.rollout.ranks):  # rollout ranks keep their own unsharded copy: nothing moves there
        out.append(f"rollout.engine_keep_awake = true with actor.fsdp.sharding_strategy = "
                   f"{cfg.actor.fsdp.sharding_strategy} on {world_size} ranks: the weights gathered for each "
                   "rollout land at new addresses, so the engine re-captures its graphs every step anyway while "
                   "its KV cache stays taken through the update; set rollout.engine_keep_awake = false")
    r = cfg.rollout
    if r.partial_kv != "auto" and (r.max_staleness == 0 or r.ranks):
        why = "max_staleness = 0: no response continues across an update" if r.max_staleness == 0 else \
            f"ranks = {r.ranks}: the rollout ranks re-prefill what they continue"
        out.append(f"rollout.partial_kv = {r.partial_kv} is ignored with rollout.{why}; delete the key")
    if cfg.critic.enable is True and a.adv_estimator != "gae":
        out.append(f"critic.enable = true but algorithm.adv_estimator = {a.adv_estimator} does not use values: the "
                   "critic is trained every step and its values are ignored; set critic.enable = null")
    if cfg.ref.enable is True and a.kl_placement == "none":
        out.append("ref.enable = true but algorithm.kl_placement = none: the reference forward runs every step "
                   "and its log-probs are unused; set ref.enable = null")
    critic_on = cfg.critic.enable is True or (cfg.critic.enable is None and a.adv_estimator == "gae")
    ref_on = cfg.ref.enable is True or (cfg.ref.enable is None and a.kl_placement != "none")
    for section, on, why in (("critic", critic_on, f"algorithm.adv_estimator = {a.adv_estimator} trains no critic"),
                             ("ref", ref_on, "algorithm.kl_placement = none keeps no reference policy")):
        changed = _changed_keys(getattr(cfg, section), section, skip=("enable",))
        if changed and not on:
            out.append(f"{', '.join(changed)} {'is' if len(changed) == 1 else 'are'} ignored: {why}"
                       f"{'' if getattr(cfg, section).enable is None else f' ({section}.enable = false)'}; "
                       "delete them, or choose an algorithm that uses them")
    actor = cfg.actor
    if actor.policy_loss == "gspo" and (actor.dual_clip_c is not None or actor.loss_agg_mode != "seq-mean-token-mean"):
        out.append(f"actor.policy_loss = gspo with actor.loss_agg_mode = {actor.loss_agg_mode} and actor.dual_clip_c = "
                   f"{actor.dual_clip_c}: the GSPO paper (and verl) use seq-mean-token-mean and no dual clip; set "
                   "them as examples/gspo.yaml does, or keep these on purpose")
    if actor.policy_loss in ("sapo", "gmpo", "geo_mean") and actor.loss_agg_mode != "seq-mean-token-mean":
        out.append(f"actor.policy_loss = {actor.policy_loss} with actor.loss_agg_mode = {actor.loss_agg_mode}: its "
                   "paper (and verl, whatever the mode) averages over responses, i.e. seq-mean-token-mean")
    rm, L = cfg.reward_model, cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if rm.path and not rm.enable:
        out.append(f"reward_model.path = {rm.path!r} is ignored because reward_model.enable = false")
    if cfg.reward.workers and not cfg.reward.functions:
        out.append(f"reward.workers = {cfg.reward.workers} is ignored because reward.functions is empty (the workers "
                   "run rule functions; the reward model scores in the main process)")
    if rm.enable and not rm.truncation and rm.max_length < L:
        out.append(f"reward_model.max_length = {rm.max_length} < data.max_prompt_length + rollout.max_new_tokens "
                   f"= {L} with reward_model.truncation = false: long responses will fail to score")
    return out


def _changed_keys(section, prefix: str, skip: tuple = (), default=None) -> list[str]:
    """Dotted keys of `section` (a config dataclass) whose values differ from its class's defaults."""
    import dataclasses

    default, out = type(section)() if default is None else default, []
    for f in dataclasses.fields(section):
        if f.name in skip:
            continue
        mine, base = getattr(section, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(mine) and dataclasses.is_dataclass(base) and type(mine) is type(base):
            out += _changed_keys(mine, f"{prefix}.{f.name}", default=base)  # the parent's default (critic lr)
        elif mine != base:
            out.append(f"{prefix}.{f.name}")
    return out


def _raise(errs: list[str], source: str) -> None:
    if len(errs) == 1:
        raise ConfigError(f"{source}: {errs[0]}")
    if errs:
        raise ConfigError(f"{source}: {len(errs)} problems:\n" + "\n".join(f"  - {e}" for e in errs))


def validate(cfg: Config, world_size: int = 1, *, source: str = "config") -> None:
    """Raise one ConfigError listing every broken cross-field rule; warn about ignored settings."""
    batch = _batch_errors(cfg, trainer_ranks(cfg, world_size), _ranks_name(cfg, world_size))
    _raise(_split_errors(cfg, world_size) + batch + _rule_errors(cfg) + _memory_errors(cfg, world_size), source)
    for message in _warnings(cfg, world_size):
        warnings.warn(f"{source}: {message}", stacklevel=2)


def reward_model_inputs_per_call(cfg: Config, engine: str) -> int:
    """Full-length inputs (reward_model.max_length tokens) one reward-model forward holds on `engine`.

    transformers: reward_model.batch_size rows. phaserl: floor(micro_batch_tokens / max_length), at least 1
    (a longer input is scored alone); the token-budget grouping closes a micro-batch only when the next
    input would overflow it, so every micro-batch but the last holds at least this many inputs, whatever
    their lengths. auto (the directory not read): the smaller of the two, a bound for either engine.
    """
    rm = cfg.reward_model
    per_call = {"transformers": rm.batch_size, "phaserl": max(1, rm.micro_batch_tokens // rm.max_length)}
    if engine == "auto":
        return min(per_call.values())
    return per_call[engine]


def sequence_tokens(cfg: Config) -> int:
    """The longest sequence a micro-batch or an engine slot must hold: a whole episode in multi-turn runs
    (agent.env or agent.harness), else prompt + response."""
    if cfg.agent.env or cfg.agent.harness:
        return cfg.agent.max_episode_tokens
    return cfg.data.max_prompt_length + cfg.rollout.max_new_tokens


def forward_micro_batch_tokens(cfg: Config) -> int:
    """ppo.forward_micro_batch_tokens, or when null FORWARD_TOKENS, raised to one whole sequence when a sequence is
    longer (long responses: a forward-only pass keeps no activations, one sequence per micro-batch is the floor)."""
    asked = cfg.ppo.forward_micro_batch_tokens
    return asked if asked is not None else max(FORWARD_TOKENS, sequence_tokens(cfg))


def critic_enabled(cfg: Config) -> bool:
    """critic.enable, or when null whether the advantage estimator needs values (gae)."""
    return cfg.critic.enable if cfg.critic.enable is not None else cfg.algorithm.adv_estimator == "gae"


def ref_enabled(cfg: Config) -> bool:
    """ref.enable, or when null whether a KL term is placed anywhere."""
    return cfg.ref.enable if cfg.ref.enable is not None else cfg.algorithm.kl_placement != "none"


def policy_loss_range(actor) -> tuple[float, float]:
    """(low, high) of actor.policy_loss, as verl reads clip_ratio_low/high for each loss: PPO/GSPO/CISPO/GMPO's
    clip range (null = 0.2), DPPO's thresholds where A <= 0 and where A > 0 (null = actor.dppo_delta, whose
    own null is the paper's 0.15 for dppo_tv, 0.05 for dppo_kl)."""
    both = 0.2
    if actor.policy_loss in ("dppo_tv", "dppo_kl"):
        both = actor.dppo_delta if actor.dppo_delta is not None else (0.05 if actor.policy_loss == "dppo_kl" else 0.15)
    return (actor.clip_ratio_low if actor.clip_ratio_low is not None else both,
            actor.clip_ratio_high if actor.clip_ratio_high is not None else both)


def train_micro_batch_tokens(cfg: Config) -> int:
    """ppo.micro_batch_tokens as configured, or when auto the value off CUDA (at least one whole sequence): the
    builder decides auto on the machine (config/auto.micro_batch_rule), and its start-of-run block says what."""
    if cfg.ppo.micro_batch_tokens is not None:
        return cfg.ppo.micro_batch_tokens
    return max(MICRO_BATCH_OFF_CUDA, sequence_tokens(cfg))


def derive(cfg: Config, world_size: int = 1, *, reward_model_engine: str | None = None) -> Derived:
    """The resolved batch arithmetic and role switches of `cfg` on `world_size` ranks (config untouched).

    With rollout.ranks = k > 0 the batches divide over the world_size - k trainer ranks, and Derived.world_size
    is that count. `reward_model_engine` ('phaserl' or 'transformers') is the engine a caller resolved from the RM
    directory; None takes reward_model.engine as configured, where 'auto' stays unresolved.
    """
    _raise(_split_errors(cfg, world_size) + _batch_errors(cfg, trainer_ranks(cfg, world_size),
                                                          _ranks_name(cfg, world_size)), "config")
    world_size = trainer_ranks(cfg, world_size)
    engine = reward_model_engine or cfg.reward_model.engine
    if engine not in ("auto", "phaserl", "transformers"):
        raise ValueError(f"derive: reward_model_engine={reward_model_engine!r}; expected phaserl, transformers, "
                         "auto or None")
    r, ppo, rm = cfg.rollout, cfg.ppo, cfg.reward_model
    prompts_per_rank = r.prompts_per_step // world_size
    responses_per_step = r.prompts_per_step * r.n
    responses_per_rank = prompts_per_rank * r.n
    mini_batch_size = ppo.mini_batch_size
    if mini_batch_size is None:
        mini_batch_size = responses_per_step // ppo.num_mini_batches
    mini_batch_per_rank = mini_batch_size // world_size
    max_sequence_tokens = cfg.data.max_prompt_length + r.max_new_tokens
    # validate() guarantees one full sequence fits; max() keeps derive total on unvalidated configs
    sequences_per_micro_batch = max(1, train_micro_batch_tokens(cfg) // max_sequence_tokens)
    rm_per_call = reward_model_inputs_per_call(cfg, engine) if rm.enable else 0
    return Derived(
        world_size=world_size,
        prompts_per_rank=prompts_per_rank,
        responses_per_step=responses_per_step,
        responses_per_rank=responses_per_rank,
        generate_calls_per_rank=math.ceil(prompts_per_rank / r.batch_size),
        mini_batch_size=mini_batch_size,
        mini_batch_per_rank=mini_batch_per_rank,
        num_mini_batches=ppo.num_mini_batches,
        optimizer_steps_per_rl_step=ppo.epochs * ppo.num_mini_batches,
        critic_enabled=critic_enabled(cfg),
        ref_enabled=ref_enabled(cfg),
        reward_model_engine=engine,
        reward_model_inputs_per_call=rm_per_call,
        reward_model_scoring_calls_per_rank=math.ceil(responses_per_rank / rm_per_call) if rm.enable else 0,
        total_responses=cfg.trainer.total_steps * responses_per_step,
        max_sequence_tokens=max_sequence_tokens,
        sequence_tokens=sequence_tokens(cfg),
        sequences_per_micro_batch=sequences_per_micro_batch,
        forward_micro_batch_tokens=forward_micro_batch_tokens(cfg),
        max_grad_accum_steps=math.ceil(mini_batch_per_rank / sequences_per_micro_batch),
    )


def check_context_length(cfg: Config, max_position_embeddings: int, source: str) -> None:
    """Fail when the longest prompt + response does not fit the model's context (`source` names the model)."""
    p, t = cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
    if p + t <= max_position_embeddings:
        return
    fix = (f"e.g. rollout.max_new_tokens = {max_position_embeddings - p}" if p < max_position_embeddings
           else f"e.g. data.max_prompt_length = {max_position_embeddings // 2} and rollout.max_new_tokens = "
                f"{max_position_embeddings - max_position_embeddings // 2}")
    raise ConfigError(f"data.max_prompt_length + rollout.max_new_tokens = {p} + {t} = {p + t} tokens, but the model "
                      f"({source}) has max_position_embeddings = {max_position_embeddings}; lower them so the sum is "
                      f"at most {max_position_embeddings} ({fix})")


def rollout_correction_mode(cfg) -> str:
    """algorithm.rollout_correction as it runs: auto is `tis` when the rollout is asynchronous (its tokens were
    sampled by older weights: each weighed by proximal / behaviour, truncated at the cap), else none. TIS, not
    decoupled PPO's masking: on the tiny worlds (6 seeds, docs/async.md) masking the tokens past the cap lost up to
    0.17 of held-out score at k = 2, truncating them lost at most 0.01."""
    mode = cfg.algorithm.rollout_correction
    if mode == "auto":
        return "tis" if cfg.rollout.max_staleness > 0 else "none"
    return mode


def async_lookahead(max_staleness: int) -> int:
    """Steps before its batch is due that an asynchronous rollout starts a response: max(1, k - 1) (trainer/stream.py
    says why: starting all k + 1 batches at once trains on staler tokens than the work needs)."""
    return max(1, max_staleness - 1)
