"""The builder: where the Config dies.  Three functions, each a plain value in and out:

    build_roles(cfg) -> Roles                      load the models the config names, wrap them in roles
    complete_roles(cfg, actor, ...) -> Roles       the same from roles made by hand (the verl-style API)
    build_run(cfg, roles) -> RunSettings           set the roles up for training, resolve everything else

and `config_with_trainer_kwargs`, which turns the verl-style keyword arguments of `RLTrainer`
(checkpoint_path, log_dir, save_interval, keep_checkpoint_num) into checked config overrides.

Below this module nothing reads the config: roles and the loop take explicit arguments. The advantage
estimator, policy loss, KL placement, rollout correction and dynamic sampling are picked here, once. Names in the
config ('tiny', 'auto', dtypes) are resolved by `phaserl.resolve`, shared with the doctor.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import TYPE_CHECKING, Optional, Union

import torch

from ..agents.render import observation_vision
from ..algo import (
    ADVANTAGE_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    bind_policy_loss,
    canonical_kl_estimator,
    rollout_correction,
)
from ..compile_cache import enable_compile_cache
from ..config import Config, Derived, check_context_length, derive, load_config, to_dict
from ..config.auto import SpeedChoices, partial_kv_choice
from ..config.load import with_overrides
from ..config.validate import (
    GROUP_ESTIMATORS,
    async_lookahead,
    critic_enabled,
    policy_loss_range,
    ref_enabled,
    rollout_correction_mode,
)
from ..cuda_allocator import configure_cuda_allocator
from ..data import PromptDataset, build_prompt_dataset, load_prompt_rows
from ..data.images import build_vision_dataset, check_no_images, processor_for
from ..errors import ConfigError
from ..metrics import MetricsLogger
from ..models import CausalLM, invariant, load_pretrained, load_tokenizer
from ..models.qwen_vl import set_vision_trainable
from ..parallel import is_distributed, launch_rank_and_world, rank_and_world
from ..parallel.launch import collective_timeout_s
from ..parallel.rank_split import rank_groups, start_rank_split
from ..resolve import (
    build_reward_sources,
    resolve_compile_cache_dir,
    resolve_data_files,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
    resolve_reward_model_path,
)
from ..rewards import RewardSources, RuleRewards
from ..rm import init_critic
from ..roles import Critic, HybridActor, ReferencePolicy, RewardModelWrapper
from ..roles.actor import PolicyLossSettings
from ..roles.optim import OptimSettings
from ..roles.parallel_settings import FSDPSettings
from ..roles.train_graphs import TrainGraphs
from ..rollout import EngineConfig, SamplingParams
from .advantage_phase import AdvantageSettings, ZeroVarianceMonitor
from .agent_phase import rollout_choice
from .agent_stream import AgentStream
from .dynamic_sampling import DynamicSampling, single_round
from .guard import RuntimeGuard
from .lora_setup import add_lora, lora_reference
from .prompt_stream import PromptStream
from .score_shaping import OverlongShaping, no_shaping
from .settings import Roles, RunSettings
from .speed import choose_speed, compile_watch, packing_choice, train_graphs_choice
from .stream import AsyncStream, SyncStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ..checkpoint import Checkpointer
    from ..config import OptimConfig

log = logging.getLogger("phaserl")

# RLTrainer's verl-style keyword arguments and the config keys they set
TRAINER_KWARGS = {"checkpoint_path": "trainer.checkpoint_path", "log_dir": "trainer.log_dir",
                  "save_interval": "trainer.save_interval", "keep_checkpoint_num": "trainer.keep_checkpoint_num"}


def config_with_trainer_kwargs(cfg: Optional[Config], **kwargs) -> Config:
    """`cfg` (None = the defaults) with RLTrainer's verl-style keyword arguments set on `trainer.*`: checked
    like the same keys in YAML (keep_checkpoint_num=0 is an error), then the whole config validated."""
    cfg = cfg if cfg is not None else load_config(None)
    given = {TRAINER_KWARGS[name]: value for name, value in kwargs.items() if value is not None}
    if not given:
        return cfg
    source = "RLTrainer(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if v is not None) + ")"
    return with_overrides(cfg, given, source=source, world_size=launch_rank_and_world()[1])


# ---- cfg -> roles -------------------------------------------------------------------------------

def is_rollout_rank() -> bool:
    """True on a rank that only generates (rollout.ranks, after build_roles split the launch)."""
    groups = rank_groups()
    return groups is not None and groups.role == "rollout"


def build_roles(cfg: Config) -> Roles:
    """Load the models the config names and wrap them in roles (the reward sources too). With rollout.ranks, the
    ranks split first (the trainer ranks train among themselves), and a rollout rank loads the policy alone."""
    groups = start_rank_split(cfg.rollout.ranks, collective_timeout_s())
    torch.manual_seed(cfg.trainer.seed)
    device, dtype = resolve_device(cfg.trainer.device), resolve_dtype(cfg.model.dtype)
    if device.type == "cuda":  # before the models load: expandable segments unless the user set the allocator
        configure_cuda_allocator()
    model_dir = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(resolve_model_path(cfg.model.tokenizer_path or cfg.model.path))
    load = lambda path: load_pretrained(resolve_model_path(path), dtype=dtype, device=device,  # noqa: E731
                                        trust_remote_code=cfg.model.trust_remote_code,
                                        implementation=cfg.model.implementation,
                                        allow_random_init=cfg.model.allow_random_init)
    policy = load(model_dir)
    set_vision_trainable(policy, cfg.model.vision_trainable)  # a vision-language model's tower: frozen by default
    if getattr(policy, "takes_images", False) and critic_enabled(cfg):
        raise ConfigError("a critic (algorithm.adv_estimator=gae) does not take images yet: its values would not see "
                          "the pictures of a vision-language policy's rows; use a group estimator (grpo, rloo, ...)")
    check_context_length(cfg, policy.config.max_position_embeddings, source=os.path.join(model_dir, "config.json"))
    actor = HybridActor(policy, tokenizer, fsdp_config=cfg.actor.fsdp, hybrid_engine_config=cfg.actor.hybrid_engine)
    add_lora(cfg, actor.model, "actor", model_dir)  # actor.lora (lora_setup.py); the reference may then be its base
    if groups is not None and groups.role == "rollout":  # it only generates (trainer/rollout_worker.py)
        return Roles(actor=actor, critic=None, ref_policy=None, reward=None, tokenizer=tokenizer)
    ref = None
    if ref_enabled(cfg):
        ref = lora_reference(cfg, actor) or ReferencePolicy(load(cfg.ref.path or model_dir), fsdp_config=cfg.ref.fsdp)
    critic = None
    if critic_enabled(cfg):  # critic.init_from: policy | reward_model
        c = cfg.critic
        start = (resolve_model_path(c.path or model_dir) if c.init_from == "policy"
                 else resolve_reward_model_path(c.path or cfg.reward_model.path))
        critic = Critic(init_critic(c.init_from, start, dtype=dtype, device=device, policy_tokenizer=tokenizer,
                                    trust_remote_code=cfg.model.trust_remote_code),
                        fsdp_config=c.fsdp, hybrid_engine_config=c.hybrid_engine)
        add_lora(cfg, critic.model, "critic", start)
    return Roles(actor=actor, critic=critic, ref_policy=ref, reward=build_reward_sources(cfg, device),
                 tokenizer=tokenizer)


def complete_roles(cfg: Config, actor: HybridActor, critic: Optional[Critic] = None,
                   ref_policy: Optional[ReferencePolicy] = None,
                   reward: Union[RewardModelWrapper, RuleRewards, RewardSources, None] = None,
                   tokenizer: Optional["PreTrainedTokenizerBase"] = None) -> Roles:
    """Roles made by hand (the verl-style API), with what they leave out taken from the config: the reward
    sources when `reward` is None, the tokenizer when neither `tokenizer` nor the actor has one (the actor
    keeps the one chosen)."""
    tokenizer = tokenizer or actor.tokenizer or load_tokenizer(
        resolve_model_path(cfg.model.tokenizer_path or cfg.model.path))
    actor.tokenizer = tokenizer
    return Roles(actor=actor, critic=critic, ref_policy=ref_policy,
                 reward=_as_reward_sources(reward, cfg, actor.device), tokenizer=tokenizer)


def _as_reward_sources(reward, cfg: Config, device: torch.device) -> RewardSources:
    """What the verl-style API passes as `reward=`: a RewardModelWrapper, RuleRewards, RewardSources or None."""
    if reward is None:
        return build_reward_sources(cfg, device)
    if isinstance(reward, RewardSources):
        return reward
    if isinstance(reward, RewardModelWrapper):
        return RewardSources(reward_model=reward, reward_model_weight=cfg.reward.reward_model_weight)
    if isinstance(reward, RuleRewards):
        return RewardSources(rules=reward)
    raise TypeError(f"reward= must be a RewardModelWrapper, RuleRewards or RewardSources, got {type(reward).__name__}")


# ---- cfg, roles -> RunSettings ------------------------------------------------------------------

def build_run(cfg: Config, roles: Roles) -> RunSettings:
    """Set the roles up for training (`prepare_roles`), then resolve the rest of the run (`run_settings`): the
    derived arithmetic once, each number taken from it."""
    rank, world = rank_and_world()  # among the trainer ranks when rollout ranks are split off
    derived = derive(cfg, launch_rank_and_world()[1])
    speed = prepare_roles(cfg, roles, derived, world_size=world)
    return run_settings(cfg, roles, derived, speed, rank=rank, world_size=world)


def prepare_roles(cfg: Config, roles: Roles, d: Derived, *, world_size: int) -> SpeedChoices:
    """What each role needs before its first step, from its own section of the config: FSDP2 shards (2+
    ranks), optimizers and losses, the rollout engine, packing, compile, gradient checkpointing. The auto
    speed settings are chosen here for this machine (trainer/speed.py) and returned."""
    actor, critic, ref = roles.actor, roles.critic, roles.ref_policy
    a, alg, r = cfg.actor, cfg.algorithm, cfg.rollout
    set_numerics(r.bitwise, actor.model)  # before the engine is made: it picks its functions by the mode
    if alg.adv_estimator == "gae" and critic is None:
        raise ConfigError("algorithm.adv_estimator=gae needs a critic: pass critic=Critic(...) or set "
                          "critic.enable=true")
    if world_size > 1:  # each role's own FSDP2 settings, before the optimizers take the parameters
        from ..parallel.fsdp import shard_roles

        shard_roles({"actor": actor, "critic": critic, "ref": ref}, actor.device)
    if ref is not None:
        ref.check_separate_from(actor.model)
    if a.sequence_parallel > 1:  # after FSDP: the groups' all-to-alls run inside the sharded layers
        sequence_groups(a.sequence_parallel, actor, ref, r.bitwise)
    speed = choose_speed(cfg, roles, d, world_size=world_size)  # auto compile / keep_awake, before optimizer state
    speed = dataclasses.replace(speed, partial_kv=partial_kv_choice(  # after keep_awake: keep needs it
        r.partial_kv, max_staleness=r.max_staleness, rollout_ranks=r.ranks, keep_awake=speed.engine_keep_awake.value))
    if speed.compiles:  # before the first compile: torch's caches persist in phaserl's cache directory
        enable_compile_cache(resolve_compile_cache_dir())
    total_optim_steps = cfg.trainer.total_steps * d.optimizer_steps_per_rl_step
    actor.setup_training(
        _optim(a.optim, total_optim_steps),
        PolicyLossSettings(loss_fn=policy_loss_fn(a), agg_mode=a.loss_agg_mode, entropy_coef=a.entropy_coef,
                           kl_loss_coef=alg.kl_coef if alg.kl_placement == "loss" and ref else 0.0,
                           kl_estimator=canonical_kl_estimator(alg.kl_estimator), temperature=_temperature(cfg),
                           norm_len=r.max_new_tokens, correction=rollout_correction_fn(cfg)))
    actor.configure_rollout(r.engine, EngineConfig(
        max_slots=r.engine_max_slots, memory_fraction=r.engine_memory_fraction,
        cuda_graphs=r.engine_cuda_graphs, compile=speed.engine_compile.value, keep_awake=speed.engine_keep_awake.value,
        max_seq_tokens=d.sequence_tokens))
    actor.setup_routing(replay=a.routing_replay)
    if critic is not None:
        critic.setup_training(_optim(cfg.critic.optim, total_optim_steps),
                              cliprange_value=cfg.critic.cliprange_value, loss_coef=cfg.critic.loss_coef,
                              agg_mode=a.loss_agg_mode, norm_len=r.max_new_tokens)
    apply_memory_plan(speed, actor, ref)
    set_packing([actor, critic, ref], cfg.ppo.packing)
    actor.keep_head_logits = speed.keep_head_logits.value
    set_compile([actor, ref], speed.actor_compile.value)
    if critic is not None:
        model_gradient_checkpointing(critic.model, cfg.critic.gradient_checkpointing)
        set_compile([critic], speed.critic_compile.value)
    rm = roles.reward.reward_model
    if world_size > 1 and rm is not None:  # forward only, like the reference
        from ..parallel.fsdp import shard_roles

        rm.fsdp = FSDPSettings.from_any(cfg.reward_model.fsdp, role="reward_model")
        shard_roles({"reward_model": rm}, actor.device)
    graphs = train_graphs_choice(cfg.ppo.train_graphs, actor, world_size=world_size)
    actor.train_graphs = TrainGraphs(actor.model, max_seq_tokens=d.sequence_tokens) if graphs.value else None
    return dataclasses.replace(speed, packing=packing_choice(cfg.ppo.packing, actor.packing, actor.device),
                               train_graphs=graphs)



def run_settings(cfg: Config, roles: Roles, d: Derived, speed: SpeedChoices, *, rank: int,
                 world_size: int) -> RunSettings:
    """Everything the loop reads, resolved from the config, the derived arithmetic `d` and the speed settings as
    chosen, by phase (`RunSettings`' groups)."""
    alg, r, t, tokenizer = cfg.algorithm, cfg.rollout, cfg.trainer, roles.tokenizer
    device = roles.actor.device
    # 1. prompts, and 2.-3. the rollout phase and what scores it (single turn, or episodes)
    train_prompts = PromptStream(_prompt_dataset(cfg, cfg.data.train_files, "train", tokenizer, roles.actor.model),
                                 r.prompts_per_step,
                                 seed=t.seed, shuffle=cfg.data.shuffle, rank=rank, world_size=world_size)
    val_prompts = None
    if cfg.data.val_files:
        items = _prompt_dataset(cfg, cfg.data.val_files, "val", tokenizer, roles.actor.model).items
        if cfg.data.val_max_prompts:
            items = items[: cfg.data.val_max_prompts]
        val_prompts = items[rank::world_size]
    context = getattr(roles.actor.model.config, "max_position_embeddings", None) or cfg.agent.max_episode_tokens
    vision = observation_vision(roles.actor.model, min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)
    phases = rollout_choice(cfg, model_context=context, tokenizer=tokenizer, reward=roles.reward,
                            train_prompts=train_prompts, val_prompts=val_prompts, vision=vision)
    # 2. rollout
    eos = _eos_ids(tokenizer, roles.actor.model)
    sampled = r.val_temperature > 0
    rollout = dict(
        n=r.n, val_n=r.val_n,
        sampling=SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                top_k=r.top_k),
        greedy=SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.0),
        val_sampling=SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.val_temperature,
                                    top_p=r.top_p if sampled else 1.0, top_k=r.top_k if sampled else 0),
        temperature=_temperature(cfg), needs_greedy_baseline=alg.adv_estimator == "remax",
        generate_batch_size=r.batch_size, eos_token_ids=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0],
        sampling_generator=torch.Generator(device=device).manual_seed(t.seed * 7919 + rank), ignore_eos=r.ignore_eos)
    # 4.-5. forward-only passes, advantage
    has_ref = roles.ref_policy is not None
    advantage = AdvantageSettings(estimator=ADVANTAGE_ESTIMATORS[alg.adv_estimator], gamma=alg.gamma, lam=alg.lam,
                                  norm_by_std=alg.norm_adv_by_std,
                                  kl_in_reward=alg.kl_placement == "reward" and has_ref,
                                  kl_estimator=canonical_kl_estimator(alg.kl_estimator))
    kl_controller = (AdaptiveKLController(alg.kl_coef, alg.kl_target, alg.kl_horizon) if alg.kl_target is not None
                     else FixedKLController(alg.kl_coef))
    return RunSettings(
        tokenizer=tokenizer, train_prompts=phases.train_prompts, val_prompts=phases.val_prompts, **rollout,
        # 2.-3. one round of rollout + score, or DAPO's dynamic sampling
        sample=DynamicSampling(alg.dynamic_sampling_max_rounds, rollout["pad_token_id"]) if alg.dynamic_sampling
        else single_round,
        rollout_phase=phases.phase, agent=phases.agent, harness=phases.harness,
        stream=rollout_stream(cfg, phases.train_prompts.dataset, prompts_per_rank=d.prompts_per_rank,
                              agent=phases.agent, model=roles.actor.model,
                              partial_kv=speed.partial_kv.value if speed.partial_kv else "prefill"),
        reward=phases.reward,  # 3. score
        shape_scores=(OverlongShaping(r.max_new_tokens, alg.overlong_buffer, alg.overlong_penalty)
                      if alg.overlong_buffer else no_shaping),
        forward_tokens=d.forward_micro_batch_tokens, advantage=advantage, kl_controller=kl_controller,
        zero_variance=ZeroVarianceMonitor(alg.adv_estimator, alg.adv_estimator in GROUP_ESTIMATORS),
        # 6. update
        epochs=cfg.ppo.epochs, mini_batch_per_rank=d.mini_batch_per_rank, responses_per_step=d.responses_per_step,
        train_tokens=speed.micro_batch_tokens.value, guard=RuntimeGuard(t.on_nonfinite),
        # 7. checkpoint, log, the loop
        seed=t.seed, total_steps=t.total_steps, val_before_train=t.val_before_train, val_interval=t.val_interval,
        save_interval=t.save_interval, checkpoint_path=t.checkpoint_path, log_dir=t.log_dir,
        keep_checkpoint_num=t.keep_checkpoint_num,
        metrics_logger=MetricsLogger(t.log_dir, t.loggers, rank=rank, config=to_dict(cfg)),
        checkpointer=build_checkpointer(cfg, rank, world_size), save_on_signal=t.save_on_signal,
        bitwise_check_every=r.bitwise_check_every if r.bitwise else 0,
        show_progress=rank == 0 and "console" in t.loggers,
        speed=speed, compile_watch=compile_watch(speed, roles, rank=rank))


def rollout_stream(cfg: Config, dataset, *, prompts_per_rank: int, agent=None, model=None,
                   partial_kv: str = "prefill"):
    """Phases 1-3's source (trainer/stream.py): the synchronous step, the asynchronous stream (max_staleness >= 1),
    or the groups rollout ranks send (rollout.ranks >= 1, trainer/remote_stream.py). partial_kv: rollout.partial_kv
    as chosen (config/auto.py partial_kv_choice)."""
    r, alg = cfg.rollout, cfg.algorithm
    if r.max_staleness == 0 and not r.ranks:
        return SyncStream()
    refused = [(alg.dynamic_sampling, "algorithm.dynamic_sampling (DAPO's extra rounds)"),
               (alg.adv_estimator == "remax", "algorithm.adv_estimator=remax (its greedy baseline rollout)"),
               (bool(cfg.agent.harness), "agent.harness (an external harness drives its own episodes)"),
               (r.engine == "hf", "rollout.engine=hf (responses continue across updates in the built-in engine)")]
    for on, what in refused:
        if on:
            raise ConfigError(f"rollout.max_staleness={r.max_staleness} (asynchronous rollout) does not run with "
                              f"{what} yet: set rollout.max_staleness=0, or turn that setting off")
    if r.ranks:  # `model`: the actor's, whose weights go to the rollout ranks
        from .remote_stream import remote_stream

        return remote_stream(cfg, dataset, prompts_per_rank=prompts_per_rank, model=model)
    kind, extra = (AgentStream, {"agent": agent}) if cfg.agent.env else (AsyncStream, {})
    # a slot for every sample that may decode at once (the batches due within max(1, k - 1) steps: the stream's
    # lookahead), as far as engine_max_slots and the KV cache allow: the newer groups decode while the oldest ones'
    # tails finish or their episodes wait for tools (with one batch's slots, measured on an H100: agents 0.59 of
    # the single-turn rate, with two batches' 0.79)
    in_flight = (async_lookahead(r.max_staleness) + 1) * prompts_per_rank * r.n
    return kind(max_staleness=r.max_staleness, on_stale=r.on_stale, n=r.n, prompts_per_rank=prompts_per_rank,
                slots=min(in_flight, r.engine_max_slots), noise_seed=cfg.trainer.seed * 7919 + 17,
                dataset=dataset, partial_kv=partial_kv, **extra)


def policy_loss_fn(a) -> functools.partial:
    """actor.policy_loss with its hyper-parameters bound (each loss takes the ones it declares)."""
    low, high = policy_loss_range(a)  # verl's clip_ratio_low/high, each loss's meaning (DPPO: per-sign thresholds)
    return bind_policy_loss(a.policy_loss, clip_low=low, clip_high=high, dual_clip_c=a.dual_clip_c,
                            tau_pos=a.sapo_tau_pos, tau_neg=a.sapo_tau_neg, beta=a.dro_beta, delta_low=low,
                            delta_high=high, ratio_cap=a.dppo_ratio_cap)


def rollout_correction_fn(cfg: Config) -> Optional[functools.partial]:
    """algorithm.rollout_correction bound to its cap, or None (off)."""
    mode = rollout_correction_mode(cfg)
    if mode == "none":
        return None
    return functools.partial(rollout_correction, mode=mode, cap=cfg.algorithm.rollout_correction_cap)


def build_checkpointer(cfg: Config, rank: int, world: int) -> "Checkpointer":
    """The trainer's Checkpointer (phaserl.checkpoint) from `trainer.*`."""
    from ..checkpoint import Checkpointer

    t = cfg.trainer
    return Checkpointer(root=t.checkpoint_path, keep=t.keep_checkpoint_num, resume_mode=t.resume,
                        export_hf=t.export_hf, config=cfg, rank=rank, world_size=world,
                        verify_full=t.checkpoint_verify == "full", fallback=t.resume_fallback)


def _temperature(cfg: Config) -> float:
    """The temperature log-probs are computed at: the sampling one (greedy sampling counts as 1)."""
    return cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0


def _optim(o: "OptimConfig", total_steps: int) -> OptimSettings:
    return OptimSettings(lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), grad_clip=o.grad_clip,
                         warmup_steps=o.warmup_steps, lr_schedule=o.lr_schedule, total_steps=total_steps)


def _prompt_dataset(cfg: Config, files: list[str], split: str, tokenizer, model=None) -> PromptDataset:
    rows = load_prompt_rows(resolve_data_files(files, split), prompt_key=cfg.data.prompt_key)
    d = cfg.data
    if getattr(model, "takes_images", False):  # a vision-language policy: one processor call per row (docs/vision.md)
        if cfg.rollout.max_staleness:
            raise ConfigError("rollout.max_staleness >= 1 (the asynchronous stream) does not take prompts with images "
                              "yet; set rollout.max_staleness=0 for a vision-language model")
        if cfg.agent.harness:
            raise ConfigError("agent.harness episodes (an OpenAI-compatible endpoint) do not take images yet: a "
                              "vision-language policy runs agent.env episodes or single-turn rows (docs/vision.md)")
        if cfg.agent.env and cfg.rollout.engine == "hf":
            raise ConfigError("agent.env episodes of a vision-language policy run on the built-in engine only (its "
                              "sessions place observation images); set rollout.engine=auto (docs/vision.md)")
        processor = processor_for(model.vision_config, min_pixels=d.min_pixels, max_pixels=d.max_pixels)
        return build_vision_dataset(rows, tokenizer, processor, merge_size=model.vision_config.spatial_merge_size,
                                    max_prompt_length=d.max_prompt_length, overlong=d.overlong_prompts,
                                    apply_chat_template=d.apply_chat_template, image_key=d.image_key)
    check_no_images(rows, d.image_key)
    return build_prompt_dataset(rows, tokenizer, max_prompt_length=cfg.data.max_prompt_length,
                                overlong=cfg.data.overlong_prompts, apply_chat_template=cfg.data.apply_chat_template)


def _eos_ids(tokenizer, model: torch.nn.Module) -> list[int]:
    ids = []
    cfg_eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    for value in (tokenizer.eos_token_id, cfg_eos):
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if v is not None and v not in ids:
                ids.append(int(v))
    if not ids:
        raise ConfigError("neither the tokenizer nor the model config defines an EOS token; responses would never stop")
    return ids


def set_numerics(bitwise: bool, model: torch.nn.Module) -> None:
    """rollout.bitwise: the kernels of this process (models/invariant.py), chosen once per run; an actor whose model
    the batch-invariant kernels do not cover is a ConfigError that names the key."""
    if bitwise:
        cfg = getattr(model, "config", None)
        why = ("is not phaserl's decoder" if not isinstance(model, CausalLM) else
               "has mixture-of-experts layers" if cfg.num_experts else
               "has Qwen3.5's linear-attention layers" if cfg.linear_attention is not None else "")
        if why:
            raise ConfigError(f"rollout.bitwise = true covers the dense native families (docs/numerics.md); this "
                              f"actor ({getattr(cfg, 'model_type', type(model).__name__)}) {why}: set "
                              "rollout.bitwise = false")
    invariant.enable(bitwise)


def set_packing(roles: list, setting: Optional[bool]) -> None:
    """ppo.packing on each role whose model is our decoder; any other stays padded. `None` (auto) packs
    where the varlen kernel runs: on the CPU (or in float32) the packed path needs a dense [T, T] block
    mask, measured 5x slower than padding on the tiny world's quickstart."""
    from ..models.decoder import use_varlen
    from ..roles.forward import supports_packing

    for role in roles:
        if role is None:
            continue
        first = next(role.model.parameters())
        fsdp_dtype = role.fsdp.param_dtype if is_distributed() else None  # FSDP2's compute dtype, when sharded
        compute_dtype = getattr(torch, fsdp_dtype) if fsdp_dtype else first.dtype
        enabled = use_varlen(first.device, compute_dtype) if setting is None else setting
        role.packing = enabled and supports_packing(role.model)
        if setting and not role.packing:
            log.info(f"ppo.packing=true does not apply to the {role.role}: its model "
                     f"({type(role.model).__name__}) is not phaserl's decoder, so it runs padded micro-batches")


def set_compile(roles: list, enabled: bool) -> None:
    """actor.compile / critic.compile as chosen (trainer/speed.py): torch.compile the decoder layers of each
    role whose model is ours."""
    from ..models.decoder import enable_compile
    from ..roles.forward import supports_packing

    for role in roles:
        if role is None or not enabled:
            continue
        if supports_packing(role.model):
            enable_compile(role.model)
        else:
            log.warning(f"{role.role}: compile=true is ignored: its model ({type(role.model).__name__}) is not "
                        "phaserl's decoder")


def model_gradient_checkpointing(model: torch.nn.Module, enabled: bool) -> None:
    if hasattr(model, "gradient_checkpointing"):
        model.gradient_checkpointing = enabled


def sequence_groups(k: int, actor, ref, bitwise: bool) -> None:
    """actor.sequence_parallel: ranks 0..k-1, k..2k-1, ... form groups; the actor's and the reference's decoders
    spread each micro-batch's tokens over the group (parallel/ulysses.py). Every rank makes every group (a
    collective)."""
    import torch.distributed as dist

    from ..parallel.ulysses import SequenceParallel, check_model

    decoder = getattr(actor.model, "model", None)
    if not hasattr(decoder, "sequence_parallel"):
        raise ConfigError(f"actor.sequence_parallel = {k} runs on phaserl's decoder only; this actor's model is "
                          f"{type(actor.model).__name__}: set actor.sequence_parallel = 1")
    if bitwise:
        raise ConfigError(f"actor.sequence_parallel = {k} and rollout.bitwise = true: the bitwise mode's kernels "
                          "see whole sequences on one rank; set actor.sequence_parallel = 1")
    check_model(decoder.config, k)
    rank, world = rank_and_world()
    groups = [dist.new_group(list(range(g, g + k))) for g in range(0, world, k)]
    sp = SequenceParallel(groups[rank // k], k, rank % k)
    for model in (actor.model, getattr(ref, "model", None)):
        if hasattr(getattr(model, "model", None), "sequence_parallel"):
            model.model.sequence_parallel = sp


def apply_memory_plan(speed: SpeedChoices, actor, ref) -> None:
    """The memory plan's measures (memory/plan.py, as trainer/speed.py chose them): the actor's first k layers
    recompute their activations (all or none on the transformers path) and, offloaded, keep their inputs in host
    memory, its AdamW steps on the CPU, the reference's layers stay in CPU memory between passes."""
    layers = speed.checkpoint_layers.value
    decoder = getattr(actor.model, "model", None)
    if hasattr(decoder, "checkpoint_layers"):
        decoder.checkpoint_layers = layers
    else:
        model_gradient_checkpointing(actor.model, layers > 0)
    if speed.optimizer_offload.value:
        actor.optimizer.offload_step()
    offload = speed.offload_activations
    if offload is not None and offload.value and layers and hasattr(decoder, "activation_offload"):
        from ..memory.budget import OFFLOAD_IN_FLIGHT
        from ..roles.activation_offload import ActivationOffload

        decoder.activation_offload = ActivationOffload(actor.device, in_flight=OFFLOAD_IN_FLIGHT)
    elif offload is not None and offload.asked:
        log.warning(f"actor.offload_activations=true moves nothing: {offload.why}")
    if speed.stream_reference.value and ref is not None:
        ref.stream_weights(actor.device)
