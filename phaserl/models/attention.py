"""The decoder's attention cores: a dense boolean mask through SDPA, or the varlen flash kernel for packed rows.

  masks   `build_attention_mask`: causal by slot index, key-is-not-padding, and for sliding layers the
          window (a query sees the `window` slots up to its own); `block_diagonal` adds packing's
          sequence boundaries. Sliding windows count slots, as transformers' masks do: real tokens of a
          row are contiguous, so a slot distance is a position distance.
  varlen  `torch.nn.attention.varlen` on CUDA in bf16/fp16: boundaries as cumulative lengths, no [T, T]
          mask; sliding layers pass `window_size=(window - 1, 0)`. A torch whose kernel has no window
          argument gets the dense mask instead (logged once), never a full-attention answer. Heads wider
          than the flash kernel takes (256: Gemma 4's global layers) run SDPA per packed sequence.
Not here: the layer math around the core (layers.py), the engine's decode attention (rollout/).

Legend: B batch, T queries, S key slots, Hq/Hkv heads, D head_dim.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F

from phaserl.models.invariant import Aligned

log = logging.getLogger("phaserl")


@dataclass(frozen=True)
class PackedSeqs:
    """Boundaries of packed sequences for the varlen kernel: sequence k is flat tokens [cu[k], cu[k + 1])."""
    cu_seqlens: torch.Tensor  # [n + 1] int32, over the B * T flattened tokens
    max_len: int              # longest sequence
    window: Optional[int] = None  # sliding layers: keys seen, own included (None: causal over the sequence)


def packed_boundaries(seq_ids: torch.Tensor) -> PackedSeqs:
    """seq_ids [B, T] (each sequence a contiguous run of equal ids) -> PackedSeqs over the flattened tokens."""
    B, T = seq_ids.shape
    flat = seq_ids.reshape(-1)  # [B*T]
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::T] = True  # a new row always starts a new sequence
    cu = torch.cat([starts.nonzero().squeeze(1), torch.tensor([B * T], device=flat.device)]).to(torch.int32)
    return PackedSeqs(cu_seqlens=cu, max_len=int((cu[1:] - cu[:-1]).max()))  # one host sync per forward


def _varlen_kernel():
    """(varlen_attn, causal kwargs, native GQA) when this torch has a usable varlen flash API, else None.

    torch 2.10 spells causal `is_causal=True`, 2.11+ `window_size=(-1, 0)`; 2.12 added `enable_gqa`.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        causal = {"is_causal": True}
    elif "window_size" in params:
        causal = {"window_size": (-1, 0)}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params


_VARLEN = _varlen_kernel() if torch.cuda.is_available() else None
# Whether varlen_attn takes `scale=` (Gemma's query_pre_attn_scalar); without it q is scaled beforehand.
_VARLEN_SCALE = _VARLEN is not None and "scale" in inspect.signature(_VARLEN[0]).parameters
USE_VARLEN = True  # False forces the dense block-diagonal mask on CUDA too (debugging, kernel comparisons)
_GQA_PROBED: dict = {}  # device -> whether this torch's varlen kernel takes fewer kv heads as they are
_WARNED: set = set()


def _varlen_takes_gqa(device: torch.device) -> bool:
    """True when varlen_attn accepts k/v with fewer heads than q (torch 2.12+ says so with enable_gqa;
    older ones may pass them straight to the flash kernel, which supports it): probed once on tiny
    tensors, forward and backward against the repeated heads, so a torch that does not is never trusted.

    The first call usually comes from the reference's pass, under torch.inference_mode(): the probe's tensors
    are made after leaving it. Made before (as until 2026-12-04), they were inference tensors the kernel's
    autograd could not save, the probe failed on that, and every packed forward repeated k and v (on the
    H200, 0.5B: 336 copy kernels, 20 ms, in the reference's pass alone)."""
    varlen_attn, causal, native_gqa = _VARLEN
    if native_gqa:
        return True
    if device not in _GQA_PROBED:
        error = None
        try:
            with torch.inference_mode(False), torch.enable_grad():
                g = torch.Generator(device=device).manual_seed(0)
                q, k, v = (torch.randn(8, h, 64, device=device, dtype=torch.bfloat16, generator=g).requires_grad_(True)
                           for h in (4, 2, 2))
                cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
                out = varlen_attn(q, k, v, cu, cu, 5, 5, **causal)
                grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
                ref = varlen_attn(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), cu, cu, 5, 5,
                                  **causal)
                ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
            ok = all(torch.allclose(a.float(), b.float(), atol=1e-2, rtol=1e-2)
                     for a, b in zip((out, *grads), (ref, *ref_grads)))
        except Exception as e:  # noqa: BLE001 - whatever the kernel says about these shapes, the answer is no
            ok, error = False, e
        _GQA_PROBED[device] = ok
        if not ok:
            log.info("the varlen attention kernel does not take fewer kv heads than query heads here (%s): packed "
                     "forwards repeat k and v to every query head", error or "its answer differs from the repeated "
                     "heads'")
    return _GQA_PROBED[device]


VARLEN_MAX_HEAD_DIM = 256  # the flash kernel behind torch's varlen_attn; wider heads take attend_each_sequence


def use_varlen(device: torch.device, dtype: torch.dtype) -> bool:
    """Packed forwards take the varlen kernel: CUDA, half precision, and a torch that has it."""
    return USE_VARLEN and _VARLEN is not None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def varlen_takes_windows() -> bool:
    """Whether the varlen kernel can run sliding layers (its causal switch is `window_size`); logs once when not."""
    ok = _VARLEN is not None and "window_size" in _VARLEN[1]
    if not ok and "window" not in _WARNED:
        _WARNED.add("window")
        log.info("this torch's varlen attention has no window_size: packed sliding-window layers use the "
                 "dense block-diagonal mask (O(T^2) memory)")
    return ok


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: Union[torch.Tensor, PackedSeqs],
           scale: Optional[float] = None) -> torch.Tensor:
    """q [B, T, Hq, D], k/v [B, S, Hkv, D] -> [B, T, Hq, D]; `attn` is a boolean mask [B, 1, T, S] or PackedSeqs.
    scale: of the scores (None: D ** -0.5). Any other layout attends through its own `attend`: invariant.Aligned
    (the bitwise mode), parallel.ulysses.SplitAttention (sequence-parallel ranks)."""
    if isinstance(attn, Aligned) or not (torch.is_tensor(attn) or isinstance(attn, PackedSeqs)):
        return attn.attend(q, k, v, scale)
    B, T, Hq, D = q.shape
    groups = Hq // k.shape[2]
    if isinstance(attn, PackedSeqs) and D > VARLEN_MAX_HEAD_DIM:
        return attend_each_sequence(q, k, v, attn, scale)
    if isinstance(attn, PackedSeqs):
        varlen_attn, causal, native_gqa = _VARLEN
        k, v = k.reshape(B * T, -1, D), v.reshape(B * T, -1, D)  # [B*T, Hkv, D]
        extra = dict(causal)
        if attn.window is not None:
            extra["window_size"] = (attn.window - 1, 0)
        if scale is not None and _VARLEN_SCALE:
            extra["scale"] = scale
        elif scale is not None:
            q = q * (scale * D ** 0.5)  # the kernel divides by sqrt(D) itself
        if groups > 1 and native_gqa:
            extra["enable_gqa"] = True
        elif groups > 1 and not _varlen_takes_gqa(q.device):
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [B*T, Hq, D]
        out = varlen_attn(q.reshape(B * T, Hq, D), k, v, attn.cu_seqlens, attn.cu_seqlens, attn.max_len,
                          attn.max_len, **extra)  # [B*T, Hq, D]
        return out.view(B, T, Hq, D)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T|S, D]
    if groups > 1:  # grouped-query attention: each kv head serves `groups` consecutive query heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [B, Hq, S, D]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn, scale=scale).transpose(1, 2)  # [B, T, Hq, D]


@torch.compiler.disable  # one host sync for the boundaries and a loop: kept out of a compiled layer's graph
def attend_each_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedSeqs,
                         scale: Optional[float] = None) -> torch.Tensor:
    """Packed rows without the varlen kernel, for head dims its flash kernel lacks (Gemma 4's global layers:
    512; found on the H200 on 2026-12-01, "FlashAttention forward only supports head dimension at most 256"):
    SDPA over each packed sequence on its own, causal, the window as a mask. Same shapes as `attend`."""
    B, T, Hq, D = q.shape
    groups = Hq // k.shape[2]

    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(B * T, x.shape[2], D).transpose(0, 1)  # [heads, B*T, D]

    q, k, v = heads_first(q), heads_first(k), heads_first(v)
    cu = packed.cu_seqlens.tolist()
    outs = []
    for a, b in zip(cu[:-1], cu[1:]):
        qs, ks, vs = q[None, :, a:b], k[None, :, a:b], v[None, :, a:b]  # [1, heads, L, D]
        if groups > 1:
            ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)  # [1, Hq, L, D]
        mask = None
        if packed.window is not None and b - a > packed.window:
            pos = torch.arange(b - a, device=q.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - packed.window)  # [L, L]
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None,
                                                   scale=scale)[0])  # [Hq, L, D]
    return torch.cat(outs, dim=1).transpose(0, 1).reshape(B, T, Hq, D)


def build_attention_mask(key_valid: torch.Tensor, start: int, num_queries: int,
                         window: Optional[int] = None) -> torch.Tensor:
    """Boolean mask [B, 1, T, S], True = may attend: causal by slot index, the key is not padding, and within
    `window` slots of the query when set.

    Query i sits in slot start + i. Every query may also see its own slot: a padding query would
    otherwise have no visible key, and softmax over nothing is NaN. Padding outputs are garbage
    by design (finite), and no real token ever sees a padding key.
    """
    num_slots = key_valid.shape[1]
    query_slot = torch.arange(start, start + num_queries, device=key_valid.device)[:, None]  # [T, 1]
    key_slot = torch.arange(num_slots, device=key_valid.device)[None, :]  # [1, S]
    visible = key_slot <= query_slot  # [T, S]
    if window is not None:
        visible = visible & (key_slot > query_slot - window)
    mask = (visible[None] & key_valid[:, None, :]) | (key_slot == query_slot)[None]  # [B, T, S]
    return mask[:, None]


def block_diagonal(mask: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """mask [B, 1, T, T] & (same sequence): packed sequences never see each other."""
    return mask & (seq_ids[:, :, None] == seq_ids[:, None, :])[:, None]
