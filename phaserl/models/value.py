"""ValueModel: a decoder backbone with a scalar head, the critic of PPO (and the shape of a reward model).

Parameter names follow transformers' `*ForSequenceClassification` (`model.*`, `score.weight`), so a saved
critic loads in `AutoModelForSequenceClassification` with num_labels=1. The backbone's vocabulary
projection is dropped: a critic never needs it. Not here: saving/loading (hf_io.py).

Legend: B batch, T tokens, H hidden.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from phaserl.models.decoder import CausalLM, DecoderWrapper, KVCache, PackedSeqs


class ValueModel(DecoderWrapper):
    def __init__(self, backbone: CausalLM):
        super().__init__()
        self.config = backbone.config
        self.model = backbone.model  # shares the decoder weights; backbone.lm_head is not kept
        # The head in the backbone's dtype and on its device: made with torch's defaults (float32, CPU) it stayed on
        # the CPU of a CUDA critic and broke FSDP's one-dtype rule for a bf16 one (H200, 1 and 2 ranks, 2026-12-04).
        embed = self.model.embed_tokens.weight  # [V, H]
        self.score = nn.Linear(self.config.hidden_size, 1, bias=False, dtype=embed.dtype, device=embed.device)
        # Zero init: every value starts at 0, so the first advantages are driven by rewards alone.
        nn.init.zeros_(self.score.weight)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None, *, seq_ids: Optional[torch.Tensor] = None,
                boundaries: Optional[PackedSeqs] = None) -> torch.Tensor:
        """input_ids [B, T] -> values [B, T] float32 (one per token: the value of the prefix ending there).

        seq_ids [B, T], boundaries: packed sequences (see DecoderModel.forward)."""
        hidden = self.model(input_ids, position_ids, attention_mask, kv_cache, seq_ids=seq_ids,
                            boundaries=boundaries)  # [B, T, H]
        return self.score(hidden).squeeze(-1).float()  # [B, T]
