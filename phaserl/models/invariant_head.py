"""The bitwise mode's vocabulary head: the sampler's log-prob of a drawn token and the trainer's log-prob of the same
token from its hidden state, bit for bit (invariant.py's rules: fixed-order sums, the exact matmul), the trainer's
in chunks of HEAD_CHUNK tokens with the default kernels' gradient.

Legend: N tokens, H hidden, V vocabulary, n a chunk's tokens.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from phaserl.models import invariant_triton
from phaserl.models.invariant import linear, tree_sum

Tensor = torch.Tensor


def logsumexp(z: Tensor) -> Tensor:
    """log sum exp over the last dim [..., V] -> [...]: max, then a tree sum of exp(z - max)."""
    if invariant_triton.available(z.device) and z.dtype != torch.float64:
        return invariant_triton.logsumexp(z)
    top = z.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return torch.log(tree_sum(torch.exp(z - top))) + top[..., 0]


def scaled(logits: Tensor, temperature: float) -> Tensor:
    """z = logits in float32 / T: the engine's sampler and the trainer's head start from this."""
    z = logits.float()
    return z if temperature == 1.0 else z / temperature


def logprobs_of(z: Tensor, targets: Tensor) -> Tensor:
    """log softmax(z)[target]: z [N, V] float32 (`scaled`), targets [N] -> [N]."""
    return z.gather(-1, targets[:, None].long()).squeeze(-1) - logsumexp(z)


HEAD_CHUNK = 1024  # tokens per head chunk: a [chunk, V] float32 block exists at a time, never [N, V]


def _head_logits(h: Tensor, w: Tensor, cap: Optional[float], temperature: float, exact: bool) -> Tensor:
    """z = softcap(h @ w.T) / T in float32 [n, V], the logits rounded to w's dtype first (as the engine's)."""
    from phaserl.models.heads import softcap

    logits = linear(h, w) if exact else F.linear(h, w)
    return scaled(softcap(logits, cap), temperature)


class _Head(torch.autograd.Function):
    """Chunked head: forward the exact log-probs (and the default entropy), backward the default kernels'
    gradient, each chunk's logits recomputed."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, cap, with_entropy):
        ctx.set_materialize_grads(False)
        logp = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # [N]
        entropy = torch.empty_like(logp) if with_entropy else None
        for a in range(0, hidden.shape[0], HEAD_CHUNK):
            z = _head_logits(hidden[a:a + HEAD_CHUNK], weight, cap, temperature, exact=True)  # [n, V]
            logp[a:a + HEAD_CHUNK] = logprobs_of(z, targets[a:a + HEAD_CHUNK])
            if with_entropy:
                entropy[a:a + HEAD_CHUNK] = torch.logsumexp(z, -1) - (z.softmax(-1) * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.cap, ctx.with_entropy = temperature, cap, with_entropy
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        hidden, weight, targets = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        for a in range(0, hidden.shape[0], HEAD_CHUNK):
            h = hidden[a:a + HEAD_CHUNK].detach().requires_grad_(need_h)
            w = weight.detach().requires_grad_(need_w)
            with torch.enable_grad():
                z = _head_logits(h, w, ctx.cap, ctx.temperature, exact=False)  # [n, V]
                lse = torch.logsumexp(z, -1)
                outs = [z.gather(-1, targets[a:a + HEAD_CHUNK, None].long()).squeeze(-1) - lse]
                grads = [grad_logp[a:a + HEAD_CHUNK] if grad_logp is not None else torch.zeros_like(lse)]
                if ctx.with_entropy and grad_entropy is not None:
                    outs.append(lse - (z.softmax(-1) * z).sum(-1))
                    grads.append(grad_entropy[a:a + HEAD_CHUNK])
                wanted = [t for t, need in ((h, need_h), (w, need_w)) if need]
                got = torch.autograd.grad(outs, wanted, grads)
            got = list(got)
            if need_h:
                grad_h[a:a + HEAD_CHUNK] = got.pop(0)
            if need_w:
                grad_w += got.pop(0)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def token_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, temperature: float = 1.0,
                   cap: Optional[float] = None, with_entropy: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """The trainer's head in bitwise mode: log softmax(softcap(hidden @ weight.T) / T)[target], hidden [N, H],
    targets [N] -> ([N] float32, entropy [N] float32 or None), the engine's sampler's numbers exactly, HEAD_CHUNK
    tokens at a time. The entropy (a loss term, not compared) and the backward take the default kernels."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        out = _Head.apply(hidden, weight, targets, float(temperature), cap, bool(with_entropy))
        return (out[0], out[1]) if with_entropy else (out, None)
    with torch.no_grad():
        out = _Head.forward(_NoCtx(), hidden, weight, targets, float(temperature), cap, bool(with_entropy))
    return (out[0], out[1]) if with_entropy else (out, None)


class _NoCtx:
    """A stand-in for autograd's ctx when _Head's forward runs without a graph."""

    def set_materialize_grads(self, value: bool) -> None:
        pass

    def save_for_backward(self, *tensors) -> None:
        pass
