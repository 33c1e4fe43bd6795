"""HFCausalLM: any transformers causal LM behind CausalLM's interface (the slow path), computing exactly
what the model's own forward computes.

Used by `load_pretrained` for architectures the native decoder does not implement (or when
model.implementation = transformers). It offers the same `forward(...) -> hidden`, `output_weight`, `logits`
and `gradient_checkpointing` as CausalLM, so the trainer's code does not care which one it holds. It has no
KVCache: `generate` decodes with transformers' own cache through `forward_cached`.
Logits: `logits(hidden)` applies the architecture's own head, the projection (+ bias) and whatever
transformers does after it that this module knows (final-logit soft-capping of Gemma 2/3/4, Cohere's
logit_scale, Granite's logits_scaling). `verify_head()` (run at construction) compares that with the
model's own `forward().logits` on a few tokens and raises if they differ, so an architecture with a step
we do not know fails loudly instead of training on wrong log-probs. `plain_head` is False when the head is
more than a projection: the roles then score tokens through `token_logprobs` (chunked, exact) instead of
the fused projection kernels.

Legend: B batch, T tokens, H hidden, V vocab, N scored tokens.
"""
from __future__ import annotations

import copy
import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from phaserl.errors import ConfigError
from phaserl.models.heads import chunked_token_logprobs, softcap

log = logging.getLogger("phaserl")

_PROBE_TOKENS = 6


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class _TransformersModule(nn.Module):
    """What both wrappers do with the transformers model at `self.hf_model`: its activation-checkpointing switch,
    and the backbone's final-normed hidden states for phaserl's (input_ids, position_ids, attention_mask) call."""

    @property
    def gradient_checkpointing(self) -> bool:
        return bool(getattr(self.hf_model, "is_gradient_checkpointing", False))

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, enabled: bool) -> None:
        if enabled:
            self.hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.hf_model.gradient_checkpointing_disable()

    def _hidden(self, backbone: nn.Module, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor],
                attention_mask: Optional[torch.Tensor], kv_cache) -> torch.Tensor:
        """input_ids [B, T] -> backbone's last hidden states [B, T, H]; positions as in CausalLM."""
        if kv_cache is not None:
            raise NotImplementedError(f"{type(self).__name__} (transformers fallback) does not support phaserl's "
                                      "KVCache")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]
        return backbone(input_ids=input_ids, attention_mask=attention_mask.long(), position_ids=position_ids,
                        use_cache=False).last_hidden_state


class HFCausalLM(_TransformersModule):
    def __init__(self, hf_model: nn.Module, *, verify: bool = True):
        super().__init__()
        self.hf_model = hf_model
        self.config = hf_model.config
        text = _text_config(self.config)
        self.softcap = getattr(text, "final_logit_softcapping", None)       # Gemma 2/3/4: cap * tanh(z / cap)
        self.logit_scale = getattr(text, "logit_scale", None)               # Cohere: z * scale
        self.logits_scaling = getattr(text, "logits_scaling", None)         # Granite: z / scaling
        self.plain_head = self.softcap is None and self.logit_scale in (None, 1, 1.0) \
            and self.logits_scaling in (None, 1, 1.0)
        if verify:
            self.verify_head()

    @property
    def _head(self) -> nn.Module:
        return self.hf_model.get_output_embeddings()

    @property
    def output_weight(self) -> torch.Tensor:
        """The vocabulary projection [V, H]."""
        return self._head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V], as the model's own forward computes them."""
        z = F.linear(hidden, self.output_weight, getattr(self._head, "bias", None))
        if self.logit_scale not in (None, 1, 1.0):
            z = z * self.logit_scale
        if self.logits_scaling not in (None, 1, 1.0):
            z = z / self.logits_scaling
        return softcap(z, self.softcap)

    @torch.no_grad()
    def verify_head(self) -> None:
        """Raise ConfigError when log_softmax(logits(forward hidden)) is not the model's own forward().logits'."""
        first = next(self.hf_model.parameters(), None)
        if first is None or first.is_meta:
            return  # nothing to run yet (built on meta, or sharded before its weights arrived)
        vocab = self.output_weight.shape[0]
        ids = (torch.arange(_PROBE_TOKENS, device=first.device) * 7919 % vocab)[None]  # [1, T] fixed tokens
        was_training = self.hf_model.training
        self.hf_model.eval()
        try:
            expected = self.hf_model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)
            got = self.logits(self(ids)).float().log_softmax(-1)
        finally:
            self.hf_model.train(was_training)
        tol = 1e-4 if first.dtype == torch.float32 else 2e-2
        diff = (got - expected).abs().max().item()
        if not diff <= tol:
            raise ConfigError(f"model_type {self.config.model_type!r}: transformers' forward post-processes its "
                              f"logits in a way phaserl's transformers path does not reproduce (log-probs differ by "
                              f"{diff:.3g} on a probe); training on them would be wrong. Please report the "
                              "architecture")

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                       with_entropy: bool = False,
                       chunk_size: int = 1024) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """log softmax(logits(hidden) / temperature)[target]: hidden [N, H], targets [N] -> [N] float32 (and
        entropies [N]); chunked (heads.chunked_token_logprobs), so [N, V] never exists at once."""
        return chunked_token_logprobs(self.logits, hidden, targets, temperature=temperature,
                                      with_entropy=with_entropy, chunk_size=chunk_size)

    def forward_cached(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                       cache=None) -> tuple[torch.Tensor, object]:
        """Incremental forward with transformers' own cache (rollout): input_ids/position_ids [B, T] new
        tokens, attention_mask [B, S] for everything so far -> (hidden [B, T, H], the cache to pass next)."""
        out = self.hf_model.base_model(input_ids=input_ids, attention_mask=attention_mask.long(),
                                       position_ids=position_ids, past_key_values=cache, use_cache=True)
        return out.last_hidden_state, out.past_key_values

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, kv_cache: None = None) -> torch.Tensor:
        """input_ids [B, T] -> final-normed hidden states [B, T, H] (positions as in CausalLM)."""
        return self._hidden(self.hf_model.base_model, input_ids, position_ids, attention_mask, kv_cache)


class HFValueModel(_TransformersModule):
    """A value model on the transformers path (the PPO critic; a reward model being trained): a transformers
    model's backbone (its `base_model`: the decoder without the vocabulary head) and a scalar head `score`.
    `from_causal_lm` starts the head at zero, like ValueModel, so that the first advantages come from the rewards
    alone; `from_classifier` takes a trained *ForSequenceClassification's (a reward model's) backbone and head.
    Padded batches only (no packing), like HFCausalLM. `to_sequence_classifier()` gives transformers' own
    *ForSequenceClassification with these weights (export). The backbone sits at `hf_model`, where LoRA's peft
    path looks for it. `config` is the model's, with one label (a causal LM's config says 2)."""

    def __init__(self, config, backbone: nn.Module, score: nn.Linear):
        super().__init__()
        self.config = copy.deepcopy(config)
        self.config.num_labels = 1
        self.hf_model, self.score = backbone, score

    @classmethod
    def from_causal_lm(cls, lm: HFCausalLM) -> "HFValueModel":
        w = lm.output_weight  # [V, H]: the backbone's width, dtype and device
        score = nn.Linear(w.shape[1], 1, bias=False, dtype=w.dtype, device=w.device)
        nn.init.zeros_(score.weight)
        return cls(lm.config, lm.hf_model.base_model, score)

    @classmethod
    def from_classifier(cls, classifier: nn.Module) -> "HFValueModel":
        score = getattr(classifier, "score", None)
        if not isinstance(score, nn.Linear) or score.out_features != 1:
            raise ConfigError(f"{type(classifier).__name__}: a value model needs a one-output `score` head "
                              "(num_labels=1), as transformers' *ForSequenceClassification classes have")
        return cls(classifier.config, classifier.base_model, score)

    def get_input_embeddings(self) -> nn.Module:
        return self.hf_model.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, kv_cache: None = None) -> torch.Tensor:
        """input_ids [B, T] -> values [B, T] float32 (one per token: the value of the prefix ending there)."""
        hidden = self._hidden(self.hf_model, input_ids, position_ids, attention_mask, kv_cache)  # [B, T, H]
        return self.score(hidden).squeeze(-1).float()  # [B, T]

    def to_sequence_classifier(self) -> nn.Module:
        """transformers' AutoModelForSequenceClassification (num_labels=1) holding this backbone and head."""
        from transformers import AutoModelForSequenceClassification

        config = type(self.config).from_dict(self.config.to_dict())  # one label (see __init__)
        try:
            with torch.device("meta"):
                classifier = AutoModelForSequenceClassification.from_config(config)
        except ValueError as exc:  # transformers has no such class for this model_type
            raise ConfigError(f"transformers has no *ForSequenceClassification class for model_type "
                              f"{self.config.model_type!r}, so a value model of it cannot be exported as a Hugging "
                              "Face directory (the run's own checkpoints still save and resume the critic)") from exc
        prefix = classifier.base_model_prefix
        state = {f"{prefix}.{k}": v for k, v in self.hf_model.state_dict().items()}
        state["score.weight"] = self.score.weight.detach()
        missing, unexpected = classifier.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise ConfigError(f"model_type {self.config.model_type!r}: transformers' sequence classifier does not "
                              f"take this critic's weights (missing {missing[:4]}, unexpected {unexpected[:4]}); "
                              "the run's own checkpoints still save and resume the critic")
        return classifier.eval()


def value_model_of(backbone: nn.Module) -> nn.Module:
    """A critic started from `backbone`: ValueModel for our decoder, HFValueModel on the transformers path."""
    from phaserl.models.value import ValueModel

    return HFValueModel.from_causal_lm(backbone) if isinstance(backbone, HFCausalLM) else ValueModel(backbone)
