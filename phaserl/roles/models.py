"""Adapting user-supplied models to the roles' interface (forward → hidden, `output_weight`)."""
from __future__ import annotations

import torch

from ..models import CausalLM


def as_causal_lm(model: torch.nn.Module):
    """Our CausalLM as is; a transformers causal LM wrapped by the slow-path adapter."""
    if isinstance(model, CausalLM) or hasattr(model, "output_weight"):
        return model
    from ..models.hf_fallback import HFCausalLM

    return HFCausalLM(model)
