"""Log-probabilities (and entropies) of target tokens, from logits or straight from hidden states.

`token_logprobs_from_hidden` fuses the LM head with log_softmax and processes the tokens in chunks:
neither forward nor backward ever holds a float32 [N, V] tensor (for Qwen2 V = 151,936, so 8k
tokens would be 5 GB). Backward recomputes each chunk's logits from the saved hidden states and
weight, the same trade Liger-Kernel's fused linear cross-entropy makes. Everything is computed in
float32 (float64 for float64 inputs) whatever the input dtype. With `fused=True` the per-chunk softmax
statistics and gradient run as two fused kernels that read the chunk's logits in their own dtype (no
float32 [n, V] copies): Triton one-pass kernels on CUDA (logprob_kernels.py), `torch.compile`d ones
elsewhere. Same math, several times less memory traffic, which is what dominates a small model's
step (benchmarks/train_step.py).

Legend: N = flattened tokens, H = hidden size, V = vocabulary size.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from phaserl.algo import logprob_kernels
from phaserl.algo.masked import upcast


def token_logprobs_from_logits(logits: Tensor, targets: Tensor, *, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[target], in float32.

    Args:
        logits: [..., V].
        targets: [...] token ids.

    Returns:
        [...] float32.
    """
    logits = upcast(logits) / temperature
    picked = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # [...]
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature): logsumexp(z) - sum softmax(z) * z, in float32.

    Args:
        logits: [..., V].

    Returns:
        [...] float32.
    """
    logits = upcast(logits) / temperature
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def _chunk_logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    logits = upcast(hidden @ weight.t())  # [n, V] float32, n = chunk length; a fresh tensor
    return logits if temperature == 1.0 else logits.div_(temperature)


def _fused_stats(logits: Tensor, targets: Tensor, temperature: float,
                 with_entropy: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """One chunk's (logprob [n], logsumexp [n], entropy [n] or None) from logits [n, V] (compiled)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # [n, V], never stored
    lse = torch.logsumexp(z, dim=-1)  # [n]
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    ent = lse - (torch.exp(z - lse[:, None]) * z).sum(-1) if with_entropy else None
    return logp, lse, ent


def _fused_grad(logits: Tensor, lse: Tensor, targets: Tensor, g_logp: Tensor, g_ent: Optional[Tensor],
                temperature: float) -> Tensor:
    """d loss / d logits [n, V] in the logits' dtype, from the upstream grads [n] (compiled)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # [n, V]
    p = torch.exp(z - lse[:, None])
    onehot = torch.arange(z.shape[1], device=z.device)[None, :] == targets[:, None]  # [n, V], never stored
    grad_z = g_logp[:, None].float() * (onehot.float() - p)
    if g_ent is not None:
        mean_z = (p * z).sum(-1, keepdim=True)  # [n, 1]
        grad_z = grad_z + g_ent[:, None].float() * p * (mean_z - z)
    return (grad_z / temperature).to(logits.dtype)


_FUSED: dict = {}  # (name, backend) -> compiled function, made on first use (torch._dynamo costs seconds)


def _fused(name: str, backend: str):
    if (name, backend) not in _FUSED:
        fn = {"stats": _fused_stats, "grad": _fused_grad}[name]
        _FUSED[name, backend] = torch.compile(fn, dynamic=True, backend=backend)
    return _FUSED[name, backend]


class _ChunkedLinearLogprobs(torch.autograd.Function):
    """logprobs (and entropy) of hidden @ weight.T, chunk by chunk; backward recomputes the logits
    (or, with save_logits, overwrites the ones kept from the forward with their gradient).

    With z = logits / temperature and p = softmax(z):
        d logp_target / dz = onehot(target) - p
        d entropy / dz     = p * (E_p[z] - z)
    and d/dlogits = d/dz / temperature. An output the loss does not use arrives as None in backward
    (grads are not materialised) and its term is skipped: entropy computed for a metric costs no backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy, fused=None, save_logits=False):
        ctx.set_materialize_grads(False)
        n = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        logprobs = torch.empty(n, dtype=dtype, device=hidden.device)  # [N]
        lse = torch.empty_like(logprobs)  # [N] logsumexp(z), saved for backward
        entropy = torch.empty_like(logprobs) if with_entropy else None
        mean_z = torch.empty_like(logprobs) if with_entropy and fused == "triton" else None  # [N] E_p[z]
        kept = []  # [n, V] logits chunks for backward (save_logits)
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            if fused == "triton":
                logits = hidden[start:stop] @ weight.t()  # [n, V] in the weight's dtype
                logp, lse[start:stop], mz = logprob_kernels.row_stats(logits, targets[start:stop], temperature,
                                                                      with_entropy)
                logprobs[start:stop] = logp
                if with_entropy:
                    mean_z[start:stop], entropy[start:stop] = mz, lse[start:stop] - mz
                if save_logits:
                    kept.append(logits)
                continue
            if fused:
                logp, lse_c, ent = _fused("stats", fused)(hidden[start:stop] @ weight.t(), targets[start:stop],
                                                   temperature, with_entropy)
                logprobs[start:stop], lse[start:stop] = logp, lse_c
                if with_entropy:
                    entropy[start:stop] = ent
                continue
            z = _chunk_logits(hidden[start:stop], weight, temperature)  # [n, V]
            lse[start:stop] = torch.logsumexp(z, dim=-1)
            logprobs[start:stop] = z.gather(-1, targets[start:stop, None]).squeeze(-1) - lse[start:stop]
            if with_entropy:
                probs = z.sub(lse[start:stop, None]).exp_()  # [n, V]
                entropy[start:stop] = lse[start:stop] - (probs * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse, mean_z)
        ctx.kept_logits = kept
        ctx.temperature, ctx.chunk_size, ctx.with_entropy, ctx.fused = temperature, chunk_size, with_entropy, fused
        if with_entropy:
            return logprobs, entropy
        return logprobs

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy=None):
        hidden, weight, targets, lse, mean_z = ctx.saved_tensors
        kept, ctx.kept_logits = ctx.kept_logits, []  # each chunk becomes its own gradient, then is dropped
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logprobs is None:  # only the entropy is used
            grad_logprobs = torch.zeros_like(lse)
        if not ctx.with_entropy:
            grad_entropy = None
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        # The weight gradient accumulates in fp32 (fp64 for fp64 inputs), except on the Triton path, where
        # each chunk's matmul adds into it in place in the weight's dtype (fp32 inside the GEMM, one rounding
        # per chunk, like the model's other bf16 gradients): no [V, H] fp32 buffer and no add kernel per chunk.
        acc_dtype = weight.dtype if ctx.fused == "triton" else lse.dtype
        grad_weight = torch.zeros_like(weight, dtype=acc_dtype) if need_weight else None
        for i, start in enumerate(range(0, hidden.shape[0], ctx.chunk_size)):
            stop = min(start + ctx.chunk_size, hidden.shape[0])
            h = hidden[start:stop]  # [n, H]
            g_ent = grad_entropy[start:stop] if grad_entropy is not None else None
            if ctx.fused == "triton":
                if kept:  # the forward's logits; dropped from the list so they die with their gradient
                    logits, kept[i] = kept[i], None
                else:
                    logits = h @ weight.t()  # [n, V]
                grad_logits = logprob_kernels.row_grad_(
                    logits, targets[start:stop], lse[start:stop], None if mean_z is None else mean_z[start:stop],
                    grad_logprobs[start:stop], g_ent, ctx.temperature)  # [n, V], in place
            elif ctx.fused:
                grad_logits = _fused("grad", ctx.fused)(h @ weight.t(), lse[start:stop], targets[start:stop],
                                             grad_logprobs[start:stop], g_ent, ctx.temperature)  # [n, V]
            else:
                g_logp = grad_logprobs[start:stop, None].to(lse.dtype)  # [n, 1]
                z = _chunk_logits(h, weight, ctx.temperature)  # [n, V]
                # grad_z = g_logp * (onehot - p) + g_ent * p * (E_p[z] - z), built in place in z (and p).
                if g_ent is not None:
                    probs = z.sub(lse[start:stop, None]).exp_()  # [n, V]
                    mean_z_c = (probs * z).sum(-1, keepdim=True)  # [n, 1] E_p[z]
                    grad_z = probs.mul_(z.sub_(mean_z_c).mul_(-g_ent[:, None].to(lse.dtype)).sub_(g_logp))
                else:
                    grad_z = z.sub_(lse[start:stop, None]).exp_().mul_(-g_logp)  # z -> p -> -g_logp * p
                grad_z.scatter_add_(-1, targets[start:stop, None], g_logp)
                grad_logits = grad_z.div_(ctx.temperature).to(weight.dtype)  # [n, V]
            if need_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[start:stop])
            if need_weight and acc_dtype == weight.dtype:
                grad_weight.addmm_(grad_logits.t(), h)
            elif need_weight:
                grad_weight += grad_logits.t() @ h  # in-place add promotes, no [V, H] fp32 copy
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def token_logprobs_from_hidden(hidden: Tensor, weight: Tensor, targets: Tensor, *, temperature: float = 1.0,
                               chunk_size: int = 1024, with_entropy: bool = False,
                               fused: bool | str = False, save_logits: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """log softmax(hidden @ weight.T / temperature)[target] without materialising [N, V].

    Gradients with respect to `hidden` and `weight` equal those of the naive
    `token_logprobs_from_logits(hidden @ weight.T, targets)`; memory is O(chunk_size * V) in both
    passes instead of O(N * V), at the price of computing the logits twice.

    Args:
        hidden: [N, H] final hidden states (after the last norm), any float dtype.
        weight: [V, H] LM head (tied embedding or not).
        targets: [N] token ids to score.
        temperature: divides the logits, as the sampler did (rollout and training must agree).
        chunk_size: tokens per chunk. Peak extra memory is about 3 (4 with entropy) float32
            [chunk_size, V] buffers plus a float32 copy of the weight gradient; measured on an H200
            (N=8192, H=896, V=151936, bf16): 2.3 GiB at chunk 1024 vs 18.6 GiB naive, 1.25x the time.
        with_entropy: also return each position's entropy (differentiable, for the entropy bonus).
        fused: run each chunk's softmax statistics and gradient as fused kernels, reading the logits in
            the weight's dtype (no float32 [n, V] copies; same results within float rounding). True =
            the Triton one-pass kernels of logprob_kernels.py where they run (CUDA with Triton, float32
            or lower precision), else torch.compile'd kernels with the inductor backend; "triton" or
            the name of a torch.compile backend picks one. The compiled ones compile on first call.
        save_logits: Triton path only: keep each chunk's [chunk_size, V] logits (weight dtype) from the
            forward and turn them into their gradient in backward instead of recomputing them (one of
            the head's four matmuls saved, for N * V * 2 bytes more memory in bf16).

    Returns:
        (logprobs [N] float32, entropy [N] float32 or None); float64 for float64 inputs.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N, H] and weight [V, H]; "
                         f"got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if temperature <= 0 or chunk_size < 1:
        raise ValueError(f"temperature must be > 0 and chunk_size >= 1, got {temperature} and {chunk_size}")
    kernel = _pick_kernels(fused, hidden)
    if save_logits and kernel != "triton":
        raise ValueError(f"save_logits needs the Triton kernels (fused=True on a CUDA device with Triton); "
                         f"this call runs {kernel or 'unfused'} on {hidden.device}")
    out = _ChunkedLinearLogprobs.apply(hidden, weight, targets.long(), float(temperature), int(chunk_size),
                                       bool(with_entropy), kernel, bool(save_logits))
    if with_entropy:
        return out[0], out[1]
    return out, None


def can_save_logits(fused: bool | str, hidden: Tensor) -> bool:
    """Whether token_logprobs_from_hidden(hidden, ..., fused=fused) runs the Triton kernels, so save_logits=True
    is allowed."""
    return _pick_kernels(fused, hidden) == "triton"


def _pick_kernels(fused: bool | str, hidden: Tensor) -> Optional[str]:
    """None (unfused), "triton", or a torch.compile backend name; see token_logprobs_from_hidden."""
    if not fused:
        return None
    triton_ok = logprob_kernels.available(hidden.device) and hidden.dtype != torch.float64
    if fused == "triton" and not triton_ok:
        raise ValueError(f"fused='triton' needs a CUDA device with Triton and at most float32 inputs; got "
                         f"{hidden.dtype} on {hidden.device} (use fused=True to fall back to torch.compile)")
    if fused is True:
        return "triton" if triton_ok else "inductor"
    return fused
