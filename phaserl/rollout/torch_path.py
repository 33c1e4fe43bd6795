"""The engine's pure-torch attention and sampling: the path on the CPU (and wherever Triton does not run), and
the reference the Triton kernels (kernels.py, extend_kernel.py) are tested against.

  decode_attention  one query per row over its slot (grouped-query heads folded into the matmul)
  extend_attention  M queries per row over its slot, with extend_mask's [C, M, ctx] mask (multi-turn extend pass)
  cached_attention  the decode step's: write the row's new k/v at its position, then decode_attention
  sample_tokens     Gumbel-max sampling with the sampler's log-prob, every filter (top-k, top-p)
Not here: which function a runner calls (runner.layer_fns), the layers around them (models/layers.py).

Legend: b decode rows, C rows x M tokens of an extend pass, Hq/Hkv heads, G = Hq / Hkv, D head_dim, S slot_len,
ctx context, V vocab.
"""
from __future__ import annotations

from typing import Optional

import torch

from phaserl.rollout.sampling import filter_top_k, filter_top_p

Tensor = torch.Tensor


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, hidden: Tensor, scale: Optional[float] = None) -> Tensor:
    """One query per row over its slot: q [b, Hq, D], keys/values [b, Hkv, S, D] -> [b, Hq * D].

    hidden [b, S] is True at positions the row must not see (after its own, or before its window). Grouped-query
    heads are folded into the matmul (q viewed as [b, Hkv, Hq/Hkv, D]), so each key/value byte is read once.
    The softmax runs in float32 inside the kernel whatever the dtype of the scores. scale: None = D ** -0.5.
    """
    b, Hq, D = q.shape
    qg = (q * (D ** -0.5 if scale is None else scale)).view(b, keys.shape[1], Hq // keys.shape[1], D)
    scores = torch.matmul(qg, keys.transpose(-1, -2))  # [b, Hkv, G, S]
    probs = scores.masked_fill(hidden[:, None, None, :], float("-inf")).softmax(dim=-1)
    return torch.matmul(probs, values).reshape(b, Hq * D)  # [b, Hkv, G, D] -> [b, Hq * D]


def extend_attention(q: Tensor, keys: Tensor, values: Tensor, hidden: Tensor, scale: Optional[float] = None) -> Tensor:
    """M queries per row over its slot's keys: q [C, M, Hq, D], keys/values [C, Hkv, ctx, D], hidden [C, M, ctx]
    (True where a query must not look) -> [C * M, Hq * D].

    Grouped-query heads are folded into the matmul like decode_attention's (each key/value byte read once, no
    [C, Hq, ctx, D] expansion): SDPA takes an explicit mask with grouped-query heads only on its math backend,
    which expands K/V to every query head in float32 first.
    """
    C, M, Hq, D = q.shape
    Hkv, G = keys.shape[1], Hq // keys.shape[1]
    qg = (q * (D ** -0.5 if scale is None else scale)).view(C, M, Hkv, G, D).permute(0, 2, 3, 1, 4)  # [C, Hkv, G, M, D]
    scores = torch.matmul(qg.reshape(C, Hkv, G * M, D), keys.transpose(-1, -2)).view(C, Hkv, G, M, -1)
    probs = scores.masked_fill(hidden[:, None, None], float("-inf")).softmax(dim=-1)  # [C, Hkv, G, M, ctx]
    out = torch.matmul(probs.view(C, Hkv, G * M, -1), values).view(C, Hkv, G, M, D)
    return out.permute(0, 3, 1, 2, 4).reshape(C * M, Hq * D)


def extend_mask(pos: Tensor, lengths: Tensor, context: int, window: Optional[int]) -> Tensor:
    """hidden [C, M, ctx] for extend_attention: True where query token j of a row (at pos [C, M], the row's
    first lengths [C] tokens real) must not look: keys after its own position, and for a real token of a sliding
    layer those before its window. Padding tokens see no window: one past the context would see no key at all,
    and its NaN would reach the KV (0 * NaN in a later masked read; fixed on 2026-12-01)."""
    M = pos.shape[1]
    key_pos = torch.arange(context, device=pos.device)[None, None, :]  # [1, 1, ctx]
    hidden = key_pos > pos[:, :, None]
    if window is not None:
        real = (torch.arange(M, device=pos.device) < lengths[:, None])[:, :, None]  # [C, M, 1]
        hidden |= (key_pos <= pos[:, :, None] - window) & real
    return hidden


def cached_attention(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, pos: Tensor,
                     scale: Optional[float] = None, window: Optional[int] = None) -> Tensor:
    """Write the new k/v [b, Hkv, D] at each row's position pos [b], then attend: -> [b, Hq * D].

    The pure-torch twin of kernels.decode_attention (the CPU path): it reads the whole slot, masked; a sliding
    layer sees the `window` positions up to its own.
    """
    b = q.shape[0]
    keys[torch.arange(b, device=q.device), :, pos] = k
    values[torch.arange(b, device=q.device), :, pos] = v
    slot = torch.arange(keys.shape[2], device=q.device)
    hidden = slot > pos[:, None]  # [b, S] after each row's position
    if window is not None:
        hidden = hidden | (slot <= pos[:, None] - window)
    return decode_attention(q, keys[:b], values[:b], hidden, scale)


def sample_tokens(logits: Tensor, noise: Optional[Tensor], greedy: bool, temperature: float, top_k: int,
                  top_p: float) -> tuple[Tensor, Tensor]:
    """logits [b, V] -> (tokens [b], logprobs [b] under log_softmax(logits / T); T = 1 when greedy).

    Sampling is Gumbel-max: argmax(z - log E), E ~ Exp(1) in `noise` [b, V] (the engine's: sampling.keyed_noise),
    draws from softmax(z) without a host sync, so it can live inside a CUDA graph. Filters decide the draw only
    (sampling.py).
    """
    z = logits.float()  # [b, V]
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)  # [b]
    if greedy:
        tokens = z.argmax(dim=-1)
    elif top_k == 0 and top_p >= 1.0:
        tokens = (z - noise.log()).argmax(dim=-1)  # E = 0 gives +inf: that token wins, as it should
    else:  # filtered tokens are -inf, which must stay below every finite score: no infinite noise
        kept = filter_top_p(filter_top_k(z, top_k), top_p)
        tokens = (kept - noise.clamp_min(1e-30).log()).argmax(dim=-1)
    return tokens, z.gather(-1, tokens[:, None]).squeeze(-1) - lse
