"""The rollout engine's functions in the bitwise numerics mode (rollout.bitwise): every attention pass (prefill,
decode, multi-turn extend) and the sampler's log-prob through models/invariant.py, so that a sampled token's
log-prob equals the one the trainer's forward computes, bit for bit.

  cached_attention    the decode step's: write each row's new k/v at its position, attend over its slot
  prefill_attention   torch's scaled_dot_product_attention's signature, for the prefill pass's call
  extend_attention    an extend pass's: write the new tokens' k/v, attend over each row's slot
  sample_tokens       torch_path.sample_tokens' draw, its log-prob from invariant_head.logprobs_of (fast_sample: the
                      Triton sampler's draw where it runs)
  engine_weights      a layer's weights: its projections as the trainer's modules, a LoRA projection as its merged
                      weight (invariant.merged_weight, computed once per call where the trainer computes it per
                      forward: the same bits)
A slot's position p holds the key of the sequence's token at position p, which is exactly the layout
invariant.attention reads (keys past a query's own weigh 0), so no copy into another layout is needed.
Not here: the kernels (models/invariant.py), choosing these functions (runner.layer_fns).

Legend: b decode rows, U prompts of P tokens, C rows x M tokens of an extend pass, Hq/Hkv heads, D head_dim,
S slot_len, ctx context.
"""
from __future__ import annotations

from typing import Optional

import torch

from phaserl.models import invariant, invariant_fused, invariant_head
from phaserl.models.layers import LayerWeights, post_attention, pre_attention, rms_norm
from phaserl.rollout import kernels, sample_kernel, torch_path
from phaserl.rollout.layer_fns import LayerFns

Tensor = torch.Tensor


def cached_attention(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, pos: Tensor,
                     scale: Optional[float] = None, window: Optional[int] = None) -> Tensor:
    """q [b, Hq, D], k/v [b, Hkv, D] at positions pos [b]; keys/values [slots, Hkv, S, D] -> [b, Hq * D]."""
    b = q.shape[0]
    invariant_fused.write_kv(k, v, keys, values, pos)  # one launch where Triton runs (index_put elsewhere)
    out = invariant.attention(q[:, None], pos[:, None], keys[:b].transpose(1, 2), values[:b].transpose(1, 2),
                              scale, window)  # [b, 1, Hq, D]
    return out.reshape(b, -1)


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = True,
                      scale: Optional[float] = None, enable_gqa: bool = True) -> Tensor:
    """q [U, Hq, P, D], k/v [U, Hkv, P, D] (prompts at positions 0..P-1) -> [U, Hq, P, D]. attn_mask: the runner's
    prefill_mask [P, P] of a sliding layer (None: causal); its last row holds min(P, window) keys, and a window of
    P or more sees what causal attention sees, so that count is the window."""
    U, _, P, _ = q.shape
    window = None if attn_mask is None else int(attn_mask[-1].sum())
    qpos = torch.arange(P, device=q.device).expand(U, P)
    out = invariant.attention(q.transpose(1, 2), qpos, k.transpose(1, 2), v.transpose(1, 2), scale, window)
    return out.transpose(1, 2)


def extend_attention(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, slots: Tensor, pos: Tensor,
                     context: int, heads: tuple[int, int, int], scale: Optional[float],
                     window: Optional[int]) -> Tensor:
    """The new k/v [C * M, Hkv, D] into the cache at (slots[r], :, pos[r, j]), then q [C * M, Hq, D] over each row's
    slot below `context` -> [C * M, Hq * D] (padding tokens: garbage, finite, as the default path's)."""
    (C, M), (Hq, Hkv, D) = pos.shape, heads
    keys[slots[:, None], :, pos] = k.view(C, M, Hkv, D)
    values[slots[:, None], :, pos] = v.view(C, M, Hkv, D)
    out = invariant.attention(q.view(C, M, Hq, D), pos, keys[slots, :, :context].transpose(1, 2),
                              values[slots, :, :context].transpose(1, 2), scale, window)  # [C, M, Hq, D]
    return out.reshape(C * M, Hq * D)


def sample_tokens(logits: Tensor, noise: Optional[Tensor], greedy: bool, temperature: float, top_k: int,
                  top_p: float) -> tuple[Tensor, Tensor]:
    """logits [b, V] -> (tokens [b], log-probs [b]): torch_path.sample_tokens' draw; the log-prob under
    log_softmax(logits / T) as the trainer's bitwise head computes it."""
    tokens, _ = torch_path.sample_tokens(logits, noise, greedy, temperature, top_k, top_p)
    return tokens, invariant_head.logprobs_of(invariant_head.scaled(logits, temperature), tokens)


def fast_sample(logits: Tensor, seed: Tensor, keys: Tensor, at: Tensor, greedy: bool,
                temperature: float) -> tuple[Tensor, Tensor]:
    """sample_kernel.sample's draw (no top-k/top-p; where Triton runs), the log-prob as sample_tokens gives it."""
    tokens, _ = sample_kernel.sample(logits, seed, keys, at, greedy, temperature)
    return tokens, invariant_head.logprobs_of(invariant_head.scaled(logits, temperature), tokens)


def engine_weights(layer, previous: Optional[LayerWeights] = None) -> LayerWeights:
    """The decoder layer's LayerWeights for the engine: its projections as modules, except that each LoRA projection
    with its adapter on becomes an invariant.Projection of W + s·BA (invariant.merged_weight), refilled in place into
    `previous`'s tensor where it has one (captured graphs keep their pointers). The base weight is never written."""
    m = layer.weights()
    merged = {}
    for name, module in m._asdict().items():
        if not invariant.is_adapter(module) or not module.adapter_enabled:
            continue
        with torch.no_grad():
            w = invariant.merged_weight(module.weight, module.lora_A, module.lora_B, module.scaling)  # [out, in]
        old = getattr(previous, name, None)
        if isinstance(old, invariant.Projection) and (old.weight.shape, old.weight.dtype) == (w.shape, w.dtype):
            w = old.weight.copy_(w)
        merged[name] = invariant.Projection(w, module.bias)
    return m._replace(**merged)


# The runner's functions in bitwise mode: the layer math dispatches to the invariant kernels itself (layers.py);
# no compile (it may fuse a product into an FMA). Where Triton runs, the draws and their noise are the Triton
# sampler's (`on_device`), the log-probs always invariant_head.logprobs_of's.
FNS = LayerFns(pre_attention, post_attention, rms_norm, cached_attention, sample_tokens, None,
               prefill=prefill_attention)


def on_device(device) -> LayerFns:
    """FNS for a runner on `device`."""
    if kernels.available(device):
        return FNS._replace(fast_sample=fast_sample, noise=sample_kernel.keyed_noise)
    return FNS
