"""HybridActor: the policy, switching between rollout mode and training mode.

The actor is the only role that switches. Rollout mode: eval(), optimizer state optionally moved to
the CPU, the rollout engine's KV cache allocated by the engine. Training mode: the cache is gone,
optimizer state is back. Every switch's duration and memory go to the step's metrics (hybrid/*); the console
shows the first `[HybridEngine]` line each way, then changes and summaries (switch_log.py).
The update is phase 6 of the RL step (docs/concepts.md): epochs × mini-batches, micro-batches by token
budget, losses normalized by the mini-batch's global token / sequence counts so the split never changes
the gradient.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from ..algo import TRAIN_KL_ESTIMATOR, aggregate, kl_penalty, mismatch_sums
from ..batch import TrainBatch
from ..errors import ConfigError
from ..models import CausalLM
from ..models.moe import Routing
from ..parallel import gather_full_params, mark_memory, rank_and_world, reshard_params
from ..rollout import EngineConfig, GenerationResult, RolloutEngine, SamplingParams, generate
from .checkpointed import CheckpointedRole
from .forward import batch_logprobs, exact_values, group_rows, rows_logprobs, split_rows
from .models import as_causal_lm
from .optim import Optimizer, OptimSettings
from .parallel_settings import FSDPSettings, HybridSettings, device_memory_gb
from .switch_log import SwitchLog
from .train_graphs import TrainGraphs

log = logging.getLogger("phaserl")


@dataclass(frozen=True)
class PolicyLossSettings:
    loss_fn: Callable                 # algo.bind_policy_loss(name, ...): fn(logp, old, adv, mask) -> (loss, stats)
    agg_mode: str
    entropy_coef: float
    kl_loss_coef: float               # 0 unless algorithm.kl_placement == "loss"
    kl_estimator: str
    temperature: float                # the rollout temperature: log-probs are of the sampled distribution
    norm_len: int                     # seq-mean-token-sum-norm's constant length (rollout.max_new_tokens)
    # algo.rollout_correction bound to its mode and cap, or None: a detached per-token weight on the policy loss
    correction: Optional[Callable] = None


class HybridActor(CheckpointedRole):
    """The policy role (seed name).  `model` is our CausalLM or any transformers causal LM."""

    role = "actor"

    def __init__(self, model, tokenizer=None, *, fsdp_config=None, hybrid_engine_config=None):
        self.model = as_causal_lm(model)
        self.tokenizer = tokenizer
        self.fsdp = FSDPSettings.from_any(fsdp_config, role="actor")
        self.hybrid = HybridSettings.from_any(hybrid_engine_config)
        self.optimizer: Optional[Optimizer] = None
        self.loss: Optional[PolicyLossSettings] = None
        self.mode = "training"
        self.last_switch: dict = {}
        self.switch_log = SwitchLog()  # rank 0's switches: console lines and the step's hybrid/* metrics
        self.engine: Optional[RolloutEngine] = None  # fast rollout for our CausalLM, made on first rollout
        self.engine_kind = "auto"                     # auto | builtin | hf (rollout.engine)
        self.engine_config: Optional[EngineConfig] = None
        self.packing = False  # ppo.packing: padding-free micro-batches (set by the builder)
        self.keep_head_logits = False  # ppo.keep_head_logits: the head's logits kept for backward (set by the builder)
        self.train_graphs: Optional[TrainGraphs] = None  # ppo.train_graphs: micro-batches as CUDA graphs (builder)
        self.routing_replay = False  # MoE: training forwards use the rollout's experts (setup_routing)
        self.router_aux = (0.0, 0)   # MoE: (router_aux_loss_coef, top_k); coefficient 0 = no aux loss

    @property
    def device(self) -> torch.device:
        return self.model.output_weight.device

    def setup_training(self, optim: OptimSettings, loss: PolicyLossSettings) -> None:
        self.optimizer = Optimizer(self.model.parameters(), optim)
        self.loss = loss

    def setup_routing(self, *, replay: bool) -> None:
        """MoE actors (models/moe.py): routing replay (the engine, made at the first rollout, records the experts of
        every position and the training forwards use them; actor.routing_replay) and the router's aux loss, as the
        model's config says."""
        native_moe = isinstance(self.model, CausalLM) and self.model.config.num_experts > 0
        if replay and not native_moe:
            raise ConfigError(f"actor.routing_replay=true needs a mixture-of-experts model on phaserl's decoder "
                              f"(model_type qwen3_moe); this actor is {type(self.model).__name__} "
                              f"({getattr(getattr(self.model, 'config', None), 'model_type', '?')})")
        self.routing_replay = replay
        if native_moe:
            self.router_aux = (self.model.config.router_aux_loss_coef, self.model.config.num_experts_per_tok)

    # ----- mode switching ---------------------------------------------------------------------
    @contextmanager
    def rollout_mode(self):
        """Training → rollout on entry, rollout → training on exit, each switch logged."""
        self._switch("rollout")
        try:
            yield self
        finally:
            self._switch("training")

    def _switch(self, target: str) -> None:
        source = self.mode
        if source == target:
            return
        mark_memory(f"switch to {target} starts")  # the memory timeline, when one is recorded
        t0, before = time.perf_counter(), device_memory_gb(self.device)
        if target == "rollout":
            self.model.eval()
            if self.hybrid.offload_optimizer and self.optimizer is not None and self.device.type == "cuda":
                self.optimizer.offload_state("cpu")
            gather_full_params(self.model)  # FSDP shards -> full weights the engine reads (no-op unsharded)
        else:
            kv_bytes = -self.engine.sleep() if self.engine is not None else 0  # before empty_cache: really freed
            reshard_params(self.model)  # full weights -> FSDP shards (no-op unsharded)
            self.model.train()
            if self.hybrid.offload_optimizer and self.optimizer is not None and self.device.type == "cuda":
                self.optimizer.offload_state(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            kept = self.engine is not None and self.engine.kept_awake
            if not kept:  # a kept engine allocates and frees nothing: PyTorch's cached blocks serve the next phase
                torch.cuda.empty_cache()
        if target == "rollout":  # after empty_cache, so the KV cache is sized from truly free memory
            self._ensure_engine()
            kv_bytes = self.engine.wake() if self.engine is not None else 0
        self.mode = target
        mark_memory(f"switch to {target} done")
        after = device_memory_gb(self.device)
        seconds = time.perf_counter() - t0
        self.last_switch = {"to": target, "seconds": seconds, "memory_before_gb": before, "memory_after_gb": after,
                            "kv_cache_gb": kv_bytes / 2**30}
        if rank_and_world()[0] == 0:
            mem = "n/a on cpu" if before is None else f"{before:.2f} GB -> {after:.2f} GB allocated"
            kept = self.engine is not None and self.engine.kept_awake
            mem += (f", KV cache kept {self.engine.pool.allocated_bytes / 2**30:.2f} GB" if kept and kv_bytes == 0
                    else f", KV cache {'allocated' if kv_bytes >= 0 else 'freed'} {abs(kv_bytes) / 2**30:.2f} GB")
            # every switch goes to the step's metrics; the console gets the first each way, then changes and
            # a summary now and then (switch_log.py)
            line = self.switch_log.record(source, target, seconds=seconds, memory_after_gb=after,
                                          kv_cache_gb=kv_bytes / 2**30, detail=f"memory {mem}")
            if line and self.hybrid.enable_rollout_optimization_switch:
                log.info(line)

    # ----- rollout ----------------------------------------------------------------------------
    def generate(self, prompts: list, params: SamplingParams, *, eos_token_ids: list, pad_token_id: int,
                 batch_size: int, generator: Optional[torch.Generator] = None,
                 images: Optional[list] = None) -> GenerationResult:
        if self.mode != "rollout" and self.hybrid.enable_rollout_optimization_switch:
            raise RuntimeError("HybridActor.generate called in training mode: wrap it in `with actor.rollout_mode():`")
        self._ensure_engine()
        if self.engine is not None:  # our CausalLM: the fast engine; batch_size = sequences decoded together
            return self.engine.generate(prompts, params, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                                        batch_size=batch_size, generator=generator, images=images)
        if images is not None:
            raise ConfigError("prompts with images run on the builtin rollout engine only: set rollout.engine=auto")
        return generate(self.model, prompts, params, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                        batch_size=batch_size, generator=generator)

    def decode_session(self, params: SamplingParams, *, slot_len: int, eos_token_ids: list, num_slots: int,
                       generator: Optional[torch.Generator] = None, keep: bool = False):
        """A multi-turn DecodeSession of the engine (a context manager: rollout/session.py), or None when the
        model runs on the transformers fallback (the caller then re-prefills every turn through generate).
        keep: a session that outlives this rollout phase (RolloutEngine.open_session: the object itself, each phase
        run inside `with session.phase():`); only an engine kept awake keeps its slots through training."""
        if self.mode != "rollout" and self.hybrid.enable_rollout_optimization_switch:
            raise RuntimeError("HybridActor.decode_session called in training mode: wrap it in "
                               "`with actor.rollout_mode():`")
        self._ensure_engine()
        if self.engine is None:
            return None
        if keep:
            if not self.engine.config.keep_awake:
                raise ConfigError("a decode session kept across training needs the engine kept awake "
                                  "(rollout.engine_keep_awake=true), or rollout.partial_kv=prefill")
            return self.engine.open_session(params, slot_len=slot_len, eos_token_ids=eos_token_ids,
                                            num_slots=num_slots, generator=generator)
        return self.engine.session(params, slot_len=slot_len, eos_token_ids=eos_token_ids, num_slots=num_slots,
                                   generator=generator)

    def configure_rollout(self, kind: str, engine_config: Optional[EngineConfig] = None) -> None:
        """rollout.engine: `builtin` (our engine; an error for models it cannot run), `hf` (plain
        generate), `auto` (the engine when the model supports it)."""
        if kind == "builtin" and not RolloutEngine.supports(self.model):
            raise ConfigError(f"rollout.engine=builtin, but the builtin engine runs only phaserl's native "
                              f"decoder (docs/models.md) and this actor's model is {type(self.model).__name__}; use "
                              "rollout.engine=auto or hf")
        if kind == "hf" and isinstance(self.model, CausalLM) and self.model.config.linear_attention is not None:
            raise ConfigError("rollout.engine=hf, but Qwen3.5 on phaserl's decoder decodes only with the builtin "
                              "engine (its recurrent state lives there; the plain KV-cache path holds none): use "
                              "rollout.engine=auto, or model.implementation=transformers to run the model through "
                              "transformers' classes and generate")
        self.engine_kind, self.engine_config = kind, engine_config

    def _ensure_engine(self) -> None:
        if self.engine is None and self.engine_kind != "hf" and RolloutEngine.supports(self.model):
            config = self.engine_config or EngineConfig()
            if self.routing_replay:  # the engine records each position's experts for the training forwards
                config = replace(config, record_routes=True)
            self.engine = RolloutEngine(self.model, config)

    # ----- forward-only -----------------------------------------------------------------------
    def compute_logprobs(self, batch, *, token_budget: int) -> torch.Tensor:
        """Old log-probs of the responses.  [B, R]"""
        was_training = self.model.training
        self.model.eval()
        try:
            return batch_logprobs(self.model, batch, temperature=self.loss.temperature, token_budget=token_budget,
                                  packing=self.packing, replay=self.routing_replay)
        finally:
            self.model.train(was_training)

    # ----- update -----------------------------------------------------------------------------
    def update_mini_batch(self, mb: TrainBatch, *, token_budget: int, global_tokens: float,
                          global_seqs: float, engine_values: bool = False) -> dict:
        """One optimizer step on mini-batch `mb` (this rank's share).  Returns summed stats.
        engine_values (the bitwise mode between its checks, rollout.bitwise_check_every; on-policy only): the loss
        takes the engine's log-probs of the sampled tokens as the values (the exact kernels' bits, which the checks
        compare), so only the default forward runs, and no mismatch is measured."""
        if self.optimizer is None:
            raise ConfigError("HybridActor.setup_training(...) must be called before update (RLTrainer does it)")
        on_policy = mb.old_logprobs is None  # the trainer skipped the old log-prob pass (one optimizer step)
        engine_values = engine_values and on_policy
        aux_coef = self.router_aux[0]
        names = ["actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac", "actor/ppo_kl"]
        if on_policy and mb.ref_logprobs is not None:
            names.append("train/kl")  # what the skipped pass would have given: token mean to the reference
        if on_policy and not engine_values:  # no pre-update log-probs of the trainer's: the mismatch is measured here
            names += ["mismatch/k3", "mismatch/abs_diff_mean", "mismatch/ratio_out_frac", "mismatch/abs_diff_max"]
        if self.loss.correction is not None:
            names += ["mismatch/correction_rejected_frac", "mismatch/correction_weight_mean"]
        if aux_coef > 0:
            names.append("actor/router_aux_loss")
        stats = StepStats(names, self.device)
        for idx in split_rows(mb.rollout, token_budget, packing=self.packing):
            for rows, index, own in group_rows(self.model, mb, idx):  # sequence-parallel: each member's in turn
                loss = self.micro_batch_loss(rows, index, stats if own else StepStats(names, self.device),
                                             on_policy=on_policy, global_tokens=global_tokens, global_seqs=global_seqs,
                                             engine_values=engine_values)
                self.optimizer.scaled(loss).backward()  # float16 weights: times the loss scale (roles/loss_scale.py)
        stats = stats.read()
        stats["actor/grad_norm"] = self.optimizer.step()
        stats["actor/lr"] = self.optimizer.lr
        stats.update(self.optimizer.scale_stats("actor"))
        return stats

    def micro_batch_loss(self, mb: TrainBatch, idx, stats: "StepStats", *, on_policy: bool, global_tokens: float,
                         global_seqs: float, engine_values: bool = False) -> torch.Tensor:
        """The loss of micro-batch `idx` of `mb`, normalized by the mini-batch's global counts so the split never
        changes the gradient; its stats are added to `stats` (detached, as shares of the mini-batch)."""
        s, (aux_coef, top_k) = self.loss, self.router_aux
        # s.norm_len: a constant, so Dr.GRPO's normalization is the same in every mini-batch and rank
        norm = dict(global_tokens=global_tokens, global_seqs=global_seqs, max_len=s.norm_len)
        micro = mb.select(idx)
        routing = Routing() if aux_coef > 0 or (self.routing_replay and mb.rollout.routed_experts is not None) else None
        logp, ent, resp_mask = rows_logprobs(self.model, mb.rollout, idx, packing=self.packing,
                                             temperature=s.temperature, with_entropy=True, routing=routing,
                                             keep_logits=self.keep_head_logits, graphs=self.train_graphs,
                                             exact=not engine_values)  # [b, R] each
        R = resp_mask.shape[1]
        mask = micro.rollout.loss_mask[:, :R].float()  # [b, R] sampled tokens only (observations are 0)
        rollout_logp = micro.rollout.rollout_logprobs[:, :R]              # [b, R] the sampler's
        if engine_values:  # the bitwise mode's values are the engine's; the graph is the default forward's
            logp = exact_values(logp, torch.where(mask.bool(), rollout_logp, logp.detach()))
        old = logp.detach() if on_policy else micro.old_logprobs[:, :R]  # on-policy: ratio exactly 1
        pg_mat, pg_stats = s.loss_fn(logp, old, micro.advantages[:, :R], mask)  # [b, R]
        if s.correction is not None:  # rollout/training mismatch: weight each token's loss (0 = rejected)
            weights, fix = s.correction(old, rollout_logp, mask)          # [b, R] detached
            pg_mat = pg_mat * weights
            stats.add({"mismatch/correction_rejected_frac": fix["rejected"] / global_tokens,
                       "mismatch/correction_weight_mean": fix["weight"] / global_tokens})
        pg_loss = aggregate(pg_mat, mask, s.agg_mode, **norm)
        loss = pg_loss
        if s.entropy_coef:  # the bonus follows the loss's aggregation mode, as verl
            loss = loss - s.entropy_coef * aggregate(ent, mask, s.agg_mode, **norm)
        if s.kl_loss_coef > 0:
            kl_loss = aggregate(kl_penalty(logp, micro.ref_logprobs[:, :R], s.kl_estimator), mask, s.agg_mode, **norm)
            loss = loss + s.kl_loss_coef * kl_loss
            stats.add({"actor/kl_loss": kl_loss.detach()})
        if aux_coef > 0:  # the router's load balancing, over this micro-batch's tokens, weighted by its share
            aux = routing.aux_loss(top_k) * (mask.sum() / global_tokens)
            loss = loss + aux_coef * aux
            stats.add({"actor/router_aux_loss": aux.detach()})
        if "train/kl" in stats:
            kl = kl_penalty(logp.detach(), micro.ref_logprobs[:, :R], TRAIN_KL_ESTIMATOR)  # [b, R]
            stats.add({"train/kl": (kl * mask).sum() / global_tokens})
        if "mismatch/k3" in stats:
            sums = mismatch_sums(old, rollout_logp, mask)
            stats.add({"mismatch/k3": sums["k3"] / global_tokens,
                       "mismatch/abs_diff_mean": sums["abs_diff"] / global_tokens,
                       "mismatch/ratio_out_frac": sums["ratio_out"] / global_tokens})
            stats.maximum("mismatch/abs_diff_max", sums["abs_diff_max"])
        share = mask.sum() / global_tokens
        # The logged entropy is the token mean whatever the mode, so runs with different modes compare.
        stats.add({"actor/pg_loss": pg_loss.detach(), "actor/entropy": (ent.detach() * mask).sum() / global_tokens,
                   "actor/pg_clipfrac": pg_stats["clipfrac"] * share, "actor/ppo_kl": pg_stats["approx_kl"] * share})
        return loss


class StepStats:
    """An optimizer step's stats, summed over its micro-batches on the device and read once at the end: a
    float() per micro-batch would stop the host from queueing the next micro-batch while the GPU works. Every
    named stat is reported, 0 when nothing added to it."""

    def __init__(self, names: list, device: torch.device):
        zero = torch.zeros((), dtype=torch.float32, device=device)
        self._values = dict.fromkeys(names, zero)

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def add(self, values: dict) -> None:
        for name, value in values.items():
            self._values[name] = self._values[name] + value  # out of place: the stats share one zero to start

    def maximum(self, name: str, value: torch.Tensor) -> None:
        self._values[name] = torch.maximum(self._values[name], value)

    def read(self) -> dict:
        return {name: float(value) for name, value in self._values.items()}
