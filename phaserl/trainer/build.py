"""The builder: where the Config dies.  Config → models, roles and plain `RunSettings`.

Below this module nothing reads the config; roles and the loop take explicit arguments. The
estimator, policy loss and KL placement are picked here, once, from dicts of functions.
"""
from __future__ import annotations

import copy
import logging
import os
from typing import Optional

import torch

from ..algo import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, AdaptiveKLController, FixedKLController
from ..config import Config, check_context_length, derive, load_config, to_dict
from ..data import build_prompt_dataset, load_prompt_rows
from ..metrics import MetricsLogger
from ..models import load_pretrained, load_tokenizer
from ..parallel import is_distributed
from ..rewards import RuleRewards
from ..rm import resolve_reward_model_path
from ..roles import Critic, HybridActor, ReferencePolicy, RewardModelWrapper
from ..roles.actor import PolicyLossSettings
from ..roles.optim import OptimSettings
from ..roles.parallel_settings import FSDPSettings
from ..rollout import EngineConfig, SamplingParams
from .advantage_phase import AdvantageSettings
from .guard import RuntimeGuard
from .prompt_stream import PromptStream
from .scoring import RewardSources
from .settings import RunSettings

log = logging.getLogger("phaserl")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        from ..errors import ConfigError

        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu")
    if name == "cuda":
        from ..parallel import rank_and_world

        return torch.device("cuda", rank_and_world()[0] % torch.cuda.device_count())
    return torch.device(name)


def resolve_model_path(path: str) -> str:
    """'tiny' names the built-in tiny world's warm-started model."""
    if path == "tiny":
        from ..world import prepare_tiny_world

        return prepare_tiny_world().model_dir
    return path


def resolve_data_files(files: list, split: str) -> list:
    out = []
    for f in files:
        if f == "tiny":
            from ..world import prepare_tiny_world

            world = prepare_tiny_world()
            out.append(world.train_file if split == "train" else world.val_file)
        else:
            out.append(f)
    return out


def build_roles(cfg: Config):
    """Load the models the config names and wrap them in roles.  Returns (actor, critic, ref, reward, tokenizer)."""
    torch.manual_seed(cfg.trainer.seed)
    device, dtype = resolve_device(cfg.trainer.device), DTYPES[cfg.model.dtype]
    derived = derive(cfg, _world_size())
    model_dir = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(resolve_model_path(cfg.model.tokenizer_path or cfg.model.path))
    load = lambda path: load_pretrained(resolve_model_path(path), dtype=dtype, device=device,  # noqa: E731
                                        trust_remote_code=cfg.model.trust_remote_code)
    policy = load(model_dir)
    check_context_length(cfg, policy.config.max_position_embeddings, source=os.path.join(model_dir, "config.json"))
    actor = HybridActor(policy, tokenizer, fsdp_config=cfg.actor.fsdp, hybrid_engine_config=cfg.actor.hybrid_engine)
    ref = ReferencePolicy(load(cfg.ref.path or model_dir), fsdp_config=cfg.ref.fsdp) if derived.ref_enabled else None
    critic = None
    if derived.critic_enabled:
        from ..rm import init_critic, resolve_reward_model_path  # critic.init_from: policy | reward_model

        c = cfg.critic
        start = (resolve_model_path(c.path or model_dir) if c.init_from == "policy"
                 else resolve_reward_model_path(c.path or cfg.reward_model.path))
        critic = Critic(init_critic(c.init_from, start, dtype=dtype, device=device, policy_tokenizer=tokenizer,
                                    trust_remote_code=cfg.model.trust_remote_code),
                        fsdp_config=c.fsdp, hybrid_engine_config=c.hybrid_engine)
    return actor, critic, ref, build_reward_sources(cfg, device), tokenizer


def build_reward_sources(cfg: Config, device) -> RewardSources:
    rules = None
    if cfg.reward.functions:
        rules = RuleRewards([(f.name, f.weight, f.kwargs) for f in cfg.reward.functions])
    rm = None
    if cfg.reward_model.enable:
        rc = cfg.reward_model
        rm = RewardModelWrapper.from_pretrained(
            resolve_reward_model_path(rc.path), tokenizer_path=rc.tokenizer_path, engine=rc.engine,
            apply_chat_template=rc.apply_chat_template, chat_template=rc.chat_template, response_key=rc.response_key,
            max_length=rc.max_length, truncation=rc.truncation, truncation_side=rc.truncation_side,
            batch_size=rc.batch_size, micro_batch_tokens=rc.micro_batch_tokens, packing=rc.packing, device=device)
    return RewardSources(rules=rules, reward_model=rm, reward_model_weight=cfg.reward.reward_model_weight)


def as_reward_sources(reward, cfg: Config, device) -> RewardSources:
    """Accept what the seed API passes as `reward=`: a RewardModelWrapper, RuleRewards, RewardSources or None."""
    if reward is None:
        return build_reward_sources(cfg, device)
    if isinstance(reward, RewardSources):
        return reward
    if isinstance(reward, RewardModelWrapper):
        return RewardSources(reward_model=reward, reward_model_weight=cfg.reward.reward_model_weight)
    if isinstance(reward, RuleRewards):
        return RewardSources(rules=reward)
    raise TypeError(f"reward= must be a RewardModelWrapper, RuleRewards or RewardSources, got {type(reward).__name__}")


def _world_size() -> int:
    from ..parallel import rank_and_world

    return rank_and_world()[1]


def assemble(trainer, cfg, *, reward, tokenizer, trainer_overrides: dict) -> RunSettings:
    """Resolve the config into RunSettings and set up the roles' optimizers (called by RLTrainer)."""
    cfg = copy.deepcopy(cfg) if cfg is not None else load_config(None)
    for key, value in trainer_overrides.items():
        if value is not None:
            setattr(cfg.trainer, key, value)
    rank, world = trainer.rank, trainer.world_size
    d = derive(cfg, world)
    actor = trainer.actor
    device = actor.device
    if world > 1:  # each role's own FSDP2 settings, before the optimizers take the parameters
        from ..parallel.fsdp import shard_roles

        shard_roles({"actor": actor, "critic": trainer.critic, "ref": trainer.ref_policy}, device)
    tokenizer = tokenizer or actor.tokenizer or load_tokenizer(resolve_model_path(cfg.model.tokenizer_path or cfg.model.path))
    actor.tokenizer = tokenizer
    a, alg, r = cfg.actor, cfg.algorithm, cfg.rollout
    total_optim_steps = cfg.trainer.total_steps * d.optimizer_steps_per_rl_step
    temperature = r.temperature if r.temperature > 0 else 1.0
    if trainer.ref_policy is not None:
        trainer.ref_policy.check_separate_from(actor.model)
    actor.setup_training(
        _optim(a.optim, total_optim_steps),
        PolicyLossSettings(loss_fn=POLICY_LOSSES[a.policy_loss], clip_low=a.clip_ratio_low, clip_high=a.clip_ratio_high,
                           dual_clip_c=a.dual_clip_c, agg_mode=a.loss_agg_mode, entropy_coef=a.entropy_coef,
                           kl_loss_coef=alg.kl_coef if alg.kl_placement == "loss" and trainer.ref_policy else 0.0,
                           kl_estimator=alg.kl_estimator, temperature=temperature, norm_len=r.max_new_tokens))
    actor.configure_rollout(r.engine, EngineConfig(
        max_slots=r.engine_max_slots, memory_fraction=r.engine_memory_fraction,
        cuda_graphs=r.engine_cuda_graphs, compile=r.engine_compile, keep_awake=r.engine_keep_awake,
        max_seq_tokens=cfg.data.max_prompt_length + r.max_new_tokens))
    if trainer.critic is not None:
        trainer.critic.setup_training(_optim(cfg.critic.optim, total_optim_steps),
                                      cliprange_value=cfg.critic.cliprange_value, loss_coef=cfg.critic.loss_coef)
    if alg.adv_estimator == "gae" and trainer.critic is None:
        from ..errors import ConfigError

        raise ConfigError("algorithm.adv_estimator=gae needs a critic: pass critic=Critic(...) or set critic.enable=true")
    model_gradient_checkpointing(actor.model, a.gradient_checkpointing)
    set_packing([actor, trainer.critic, trainer.ref_policy], cfg.ppo.packing)
    set_compile([actor, trainer.ref_policy], a.compile)
    if trainer.critic is not None:
        model_gradient_checkpointing(trainer.critic.model, cfg.critic.gradient_checkpointing)
        set_compile([trainer.critic], cfg.critic.compile)
    kl_ctl = (AdaptiveKLController(alg.kl_coef, alg.kl_target, alg.kl_horizon) if alg.kl_target is not None
              else FixedKLController(alg.kl_coef))
    train_ds = _prompt_dataset(cfg, cfg.data.train_files, "train", tokenizer)
    val_items = None
    if cfg.data.val_files:
        items = _prompt_dataset(cfg, cfg.data.val_files, "val", tokenizer).items
        if cfg.data.val_max_prompts:
            items = items[: cfg.data.val_max_prompts]
        val_items = items[rank::world]
    reward_sources = as_reward_sources(reward, cfg, device)
    if world > 1 and reward_sources.reward_model is not None:  # forward only, like the reference
        from ..parallel.fsdp import shard_roles

        reward_sources.reward_model.fsdp = FSDPSettings.from_any(cfg.reward_model.fsdp, role="reward_model")
        shard_roles({"reward_model": reward_sources.reward_model}, device)
    eos = _eos_ids(tokenizer, actor.model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    gen = torch.Generator(device=device).manual_seed(cfg.trainer.seed * 7919 + rank)
    return RunSettings(
        tokenizer=tokenizer,
        train_prompts=PromptStream(train_ds, r.prompts_per_step, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle,
                                   rank=rank, world_size=world),
        val_prompts=val_items, n=r.n, val_n=r.val_n,
        sampling=SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k),
        greedy=SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.0),
        val_sampling=SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.val_temperature,
                                    top_p=r.top_p if r.val_temperature > 0 else 1.0,
                                    top_k=r.top_k if r.val_temperature > 0 else 0),
        temperature=temperature, needs_greedy_baseline=alg.adv_estimator == "remax",
        generate_batch_size=r.batch_size, eos_token_ids=eos, pad_token_id=pad, sampling_generator=gen,
        ignore_eos=r.ignore_eos,
        reward=reward_sources,
        advantage=AdvantageSettings(estimator=ADVANTAGE_ESTIMATORS[alg.adv_estimator], estimator_name=alg.adv_estimator,
                                    gamma=alg.gamma, lam=alg.lam, norm_by_std=alg.norm_adv_by_std,
                                    kl_in_reward=alg.kl_placement == "reward" and trainer.ref_policy is not None,
                                    kl_estimator=alg.kl_estimator),
        kl_controller=kl_ctl, epochs=cfg.ppo.epochs, mini_batch_per_rank=d.mini_batch_per_rank,
        responses_per_step=d.responses_per_step, forward_tokens=cfg.ppo.forward_micro_batch_tokens,
        train_tokens=cfg.ppo.micro_batch_tokens, guard=RuntimeGuard(cfg.trainer.on_nonfinite),
        seed=cfg.trainer.seed, total_steps=cfg.trainer.total_steps, val_before_train=cfg.trainer.val_before_train,
        val_interval=cfg.trainer.val_interval, save_interval=cfg.trainer.save_interval,
        checkpoint_path=cfg.trainer.checkpoint_path, log_dir=cfg.trainer.log_dir,
        keep_checkpoint_num=cfg.trainer.keep_checkpoint_num,
        metrics_logger=MetricsLogger(cfg.trainer.log_dir, cfg.trainer.loggers, rank=rank, config=to_dict(cfg)),
        checkpointer=build_checkpointer(cfg, rank, world),
        show_progress=rank == 0 and "console" in cfg.trainer.loggers,
    )


def build_checkpointer(cfg: Config, rank: int, world: int):
    """The trainer's Checkpointer (phaserl.checkpoint) from `trainer.*`."""
    from ..checkpoint import Checkpointer

    t = cfg.trainer
    return Checkpointer(root=t.checkpoint_path, keep=t.keep_checkpoint_num, resume_mode=t.resume,
                        export_hf=t.export_hf, config=cfg, rank=rank, world_size=world)


def _optim(o, total_steps: int) -> OptimSettings:
    return OptimSettings(lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), grad_clip=o.grad_clip,
                         warmup_steps=o.warmup_steps, lr_schedule=o.lr_schedule, total_steps=total_steps)


def _prompt_dataset(cfg: Config, files: list, split: str, tokenizer):
    rows = load_prompt_rows(resolve_data_files(files, split), prompt_key=cfg.data.prompt_key)
    return build_prompt_dataset(rows, tokenizer, max_prompt_length=cfg.data.max_prompt_length,
                                overlong=cfg.data.overlong_prompts, apply_chat_template=cfg.data.apply_chat_template)


def _eos_ids(tokenizer, model) -> list:
    ids = []
    cfg_eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    for value in (tokenizer.eos_token_id, cfg_eos):
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if v is not None and v not in ids:
                ids.append(int(v))
    if not ids:
        from ..errors import ConfigError

        raise ConfigError("neither the tokenizer nor the model config defines an EOS token; responses would never stop")
    return ids


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
    """actor.compile / critic.compile: torch.compile the decoder layers of each role whose model is ours."""
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


def model_gradient_checkpointing(model, enabled: bool) -> None:
    if hasattr(model, "gradient_checkpointing"):
        model.gradient_checkpointing = enabled
