"""HFCausalLM: any transformers causal LM behind CausalLM's interface (the slow path).

Used by `load_pretrained` for architectures the native decoder does not implement. It offers the same
`forward(...) -> hidden`, `output_weight`, `logits` and `gradient_checkpointing` as CausalLM, so the
trainer's log-prob code does not care which one it holds. It has no KVCache: `generate` recomputes the
full forward every step for it. Logits are `hidden @ output_weight.T (+ bias)`; architectures that
post-process logits (soft-capping, logit scaling) are flagged with a warning because their log-probs
would differ from transformers' own.

Legend: B batch, T tokens, H hidden, V vocab.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("phaserl")

# config attributes that mean "the logits are not a plain projection of the last hidden state"
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


class HFCausalLM(nn.Module):
    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf_model = hf_model
        self.config = hf_model.config
        present = [a for a in _LOGIT_POSTPROCESSING if getattr(self.config, a, None) not in (None, 1, 1.0)]
        if present:
            log.warning("model_type %s post-processes its logits (%s); phaserl's logits skip that step, so "
                        "log-probs differ from transformers' own", self.config.model_type, ", ".join(present))

    @property
    def _head(self) -> nn.Module:
        return self.hf_model.get_output_embeddings()

    @property
    def output_weight(self) -> torch.Tensor:
        """The vocabulary projection [V, H]."""
        return self._head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V]."""
        return F.linear(hidden, self.output_weight, getattr(self._head, "bias", None))

    @property
    def gradient_checkpointing(self) -> bool:
        return bool(getattr(self.hf_model, "is_gradient_checkpointing", False))

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, enabled: bool) -> None:
        if enabled:
            self.hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.hf_model.gradient_checkpointing_disable()

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, kv_cache: None = None) -> torch.Tensor:
        """input_ids [B, T] -> final-normed hidden states [B, T, H] (positions as in CausalLM)."""
        if kv_cache is not None:
            raise NotImplementedError("HFCausalLM (transformers fallback) does not support phaserl's KVCache")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]
        out = self.hf_model.base_model(input_ids=input_ids, attention_mask=attention_mask.long(),
                                       position_ids=position_ids, use_cache=False)
        return out.last_hidden_state  # [B, T, H]
