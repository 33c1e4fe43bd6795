"""Critic: the value model.  Forward, backward, step — it never takes part in rollout or resharding."""
from __future__ import annotations

from typing import Optional

import torch

from ..algo import aggregate, clipped_value_loss
from ..batch import TrainBatch
from ..errors import ConfigError
from .checkpointed import CheckpointedRole
from .forward import batch_values, rows_values, split_rows
from .optim import Optimizer, OptimSettings
from .parallel_settings import FSDPSettings, reject_hybrid_config


class Critic(CheckpointedRole):
    """The value role (seed name).  `model` maps (input_ids, position_ids, attention_mask) → values [B, S]."""

    role = "critic"

    def __init__(self, model: torch.nn.Module, *, fsdp_config=None, hybrid_engine_config=None):
        reject_hybrid_config("Critic", hybrid_engine_config)
        self.model = model
        self.fsdp = FSDPSettings.from_any(fsdp_config, role="critic")
        self.optimizer: Optional[Optimizer] = None
        self.cliprange_value = 0.5
        self.loss_coef = 0.5
        self.agg_mode, self.norm_len = "token-mean", None  # the actor's loss_agg_mode (set by setup_training)
        self.packing = False  # ppo.packing: padding-free micro-batches (set by the builder)

    def setup_training(self, optim: OptimSettings, *, cliprange_value: float, loss_coef: float,
                       agg_mode: str = "token-mean", norm_len: Optional[int] = None) -> None:
        """`agg_mode` (actor.loss_agg_mode) aggregates the value loss like the policy loss, as verl's
        critic.loss_agg_mode; `norm_len` is seq-mean-token-sum-norm's constant (rollout.max_new_tokens)."""
        self.optimizer = Optimizer(self.model.parameters(), optim)
        self.cliprange_value = cliprange_value
        self.loss_coef = loss_coef
        self.agg_mode, self.norm_len = agg_mode, norm_len

    def compute_values(self, batch, *, token_budget: int) -> torch.Tensor:
        """Values of the positions predicting each response token.  [B, R]"""
        was_training = self.model.training
        self.model.eval()
        try:
            return batch_values(self.model, batch, token_budget=token_budget, packing=self.packing)
        finally:
            self.model.train(was_training)

    def update_mini_batch(self, mb: TrainBatch, *, token_budget: int, global_tokens: float,
                          global_seqs: float) -> dict:
        if self.optimizer is None:
            raise ConfigError("Critic.setup_training(...) must be called before update (RLTrainer does it)")
        stats = {"critic/vf_loss": 0.0, "critic/vf_clipfrac": 0.0}
        for idx in split_rows(mb.rollout, token_budget, packing=self.packing):
            micro = mb.select(idx)
            values, resp_mask = rows_values(self.model, mb.rollout, idx, packing=self.packing)  # [b, R] each
            R = resp_mask.shape[1]
            mask = micro.rollout.loss_mask[:, :R].float()  # [b, R] sampled tokens only (observations are 0)
            vf_mat, vf_stats = clipped_value_loss(values, micro.old_values[:, :R], micro.returns[:, :R], mask,
                                                  clip_range=self.cliprange_value)
            vf_loss = aggregate(vf_mat, mask, self.agg_mode, global_tokens=global_tokens, global_seqs=global_seqs,
                                max_len=self.norm_len)
            self.optimizer.scaled(self.loss_coef * vf_loss).backward()  # float16: times the loss scale
            stats["critic/vf_loss"] += float(vf_loss.detach())
            stats["critic/vf_clipfrac"] += float(vf_stats["clipfrac"]) * float(mask.sum()) / global_tokens
        stats["critic/grad_norm"] = self.optimizer.step()
        stats["critic/lr"] = self.optimizer.lr
        return stats
