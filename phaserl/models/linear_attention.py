"""Gated DeltaNet, Qwen3.5's linear-attention layer: its parameters and its math, for training and the engine.

Instead of attending over keys, the layer keeps one state per value head, S [Dk, Dv], and per token
  x = in_proj_qkv(h) -> causal depthwise conv of K taps -> silu -> q, k [Hk, Dk], v [Hv, Dv]
  q, k L2-normalized, q scaled by Dk ** -0.5; key head j serves value heads j*G .. j*G+G-1 (G = Hv / Hk)
  beta = sigmoid(in_proj_b(h)), g = -exp(A_log) * softplus(in_proj_a(h) + dt_bias)      [Hv] each, g <= 0
  S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q                          (the gated delta rule)
  out = out_proj(w * rms_norm(o) * silu(in_proj_z(h)))            (the norm per value head, then the gate)
Training runs the rule chunk by chunk (`chunk_gated_delta_rule`: inside a chunk the updates are one
triangular solve, the state crosses chunk edges), in float32; the engine steps it token by token
(`recurrent_step_`, in place). Both restate transformers' Qwen3.5 reference (torch_chunk_gated_delta_rule,
torch_recurrent_gated_delta_rule, causal_conv1d_fn/_update), itself the flash-linear-attention math.

Packing: the state and the convolution's memory start empty at every sequence. `Segments` gathers each
sequence of a packed or padded batch into its own row [n, L], so that the conv's zero left padding and
the rule's zero initial state are exactly a fresh sequence; the zeros after a short row's end come after
all its real tokens, so they change none of them (and, with beta = g = 0 there, not the final state either).
Where the flash-linear-attention package (`fla`) imports on CUDA, training hands it the real tokens with
cu_seqlens instead of the torch rule, once a probe has shown it computes our rule: every pass when its forward
and backward do, only the reference's pass (`reference_pass()`) when its backward refuses (the CPU tests try this
with a fake fla; the real one is tried on the GPU: docs/models.md).
Not here: the norms, MLP and residuals around the layer (hybrid.py), the engine's per-slot state
(rollout/recurrent_state.py).

Legend: B batch, T tokens, n sequences, L longest sequence, N real tokens, Hk/Hv key/value heads, Dk/Dv
their dims, C conv channels (2 Hk Dk + Hv Dv), K conv taps, c chunk length.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from phaserl.models.config import DecoderConfig, LinearAttentionShape
from phaserl.models.layers import linear
from phaserl.models.lora import engine_weight

Tensor = torch.Tensor
log = logging.getLogger("phaserl")
CHUNK = 64  # tokens per chunk of the chunked rule (transformers' and fla's default)
# How the chunked rule solves its unit lower triangular systems: "solve" = torch.linalg.solve_triangular
# (cuBLAS batched trsm on CUDA), "blocked" = unit_lower_inverse (batched matmuls only), then two matmuls.
# "solve" until an H200 run of `benchmarks/families.py --case delta_rule` shows which is faster there (on the
# CPU "blocked" is slower: its ~60 small ops per call cost more than LAPACK's solve). The doctor's activation
# count (memory/budget.delta_layer_bytes) is the "solve" rule's.
TRIANGULAR = "solve"
INVERSE_BLOCK = 16  # unit_lower_inverse's diagonal blocks, inverted row by row


class GatedNorm(nn.Module):
    """RMS norm per value head: weight * norm(o) rounded to o's dtype, times silu(z) in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


def gated_norm(o: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """o, z [..., Dv] -> [..., Dv] in o's dtype."""
    x = o.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # as transformers writes it (F.rms_norm rounds apart)
    return ((weight * x.to(o.dtype)) * F.silu(z.float())).to(o.dtype)


class GatedDeltaNet(nn.Module):
    """The layer's parameters, named as transformers names them (`linear_attn.in_proj_qkv.weight`, ...)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        s, H = cfg.linear_attention, cfg.hidden_size
        self.shape, self.eps = s, cfg.rms_norm_eps
        self.in_proj_qkv = nn.Linear(H, s.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(H, s.num_value_heads * s.value_head_dim, bias=False)
        self.in_proj_b = nn.Linear(H, s.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(H, s.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=False,
                                padding=s.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(s.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_value_heads))  # A = 1; checkpoints carry the trained values
        self.norm = GatedNorm(s.value_head_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(s.num_value_heads * s.value_head_dim, H, bias=False)

    def forward(self, x: Tensor, seg: "Segments") -> Tensor:
        """x [B, T, H] (the normed residual stream) -> [B, T, Hv * Dv] before out_proj; padding tokens get 0."""
        B, T, _ = x.shape
        s = self.shape
        flat = x.reshape(B * T, -1)
        qkv = linear(flat, self.in_proj_qkv)[seg.index]  # [n, L, C]: each sequence from its own start
        a, b = linear(flat, self.in_proj_a)[seg.index], linear(flat, self.in_proj_b)[seg.index]  # [n, L, Hv]
        mixed = F.silu(F.conv1d(qkv.transpose(1, 2), self.conv1d.weight, padding=s.conv_kernel - 1,
                                groups=s.conv_dim)[..., :qkv.shape[1]]).transpose(1, 2)  # [n, L, C]
        q, k, v, g, beta = rule_inputs(mixed, a, b, s, self.A_log, self.dt_bias)
        out = delta_rule_tokens(q, k, v, g, beta, seg, B * T, x.dtype)  # [B * T, Hv, Dv]
        z = linear(flat, self.in_proj_z).view(B * T, s.num_value_heads, s.value_head_dim)
        return gated_norm(out, z, self.norm.weight, self.eps).view(B, T, -1)


# The chunk loop (or fla's kernels) and the gather of the real tokens (a data-dependent shape) run eagerly between
# a compiled layer's pieces (hybrid.COMPILE_HYBRID): compiled whole, the rule's backward was slower on the H200.
@torch.compiler.disable
def delta_rule_tokens(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, seg: "Segments", rows: int,
                      dtype: torch.dtype) -> Tensor:
    """The gated delta rule over every sequence of `seg` (q, k [n, L, Hv, Dk], v [n, L, Hv, Dv], g, beta [n, L, Hv]),
    laid back out on the batch's flat tokens: -> [rows, Hv, Dv] in `dtype`, zeros at padding tokens."""
    if _fla_usable(q.device, grad=torch.is_grad_enabled()):
        o = _fla_chunk(q, k, v, g, beta, seg)  # [N, Hv, Dv] of the real tokens
    else:
        o = chunk_gated_delta_rule(q, k, v, g, beta)[0][seg.real]  # [N, Hv, Dv]
    out = o.new_zeros(rows, *o.shape[1:], dtype=dtype)
    out[seg.index[seg.real]] = o.to(dtype)
    return out


@dataclass(frozen=True)
class Segments:
    """Where the sequences of a [B, T] batch sit: token j of sequence i is flat token index[i, j] of the B * T."""
    index: Tensor       # [n, L] long; past a sequence's end it repeats flat token 0 (masked by `real`)
    real: Tensor        # [n, L] bool
    cu_seqlens: Tensor  # [n + 1] int32 over the real tokens taken in order (index[real])

    @classmethod
    def of(cls, valid: Tensor, seq_ids: Optional[Tensor] = None) -> "Segments":
        """valid [B, T] (1 = real token), seq_ids [B, T] (packed rows: a run of equal ids is one sequence; None:
        one sequence per row). A sequence is a maximal run of real tokens of one row with one id."""
        B, T = valid.shape
        device = valid.device
        real = valid.reshape(-1).bool()  # [B*T]
        ids = torch.zeros(B * T, dtype=torch.long, device=device) if seq_ids is None else seq_ids.reshape(-1)
        same_as_previous = torch.zeros_like(real)
        same_as_previous[1:] = real[:-1] & (ids[1:] == ids[:-1])
        same_as_previous[::T] = False  # a row never continues the previous one
        starts = real & ~same_as_previous
        where = real.nonzero().squeeze(1)  # [N] flat positions of the real tokens, in order
        seq = starts[where].long().cumsum(0) - 1  # [N] the sequence of each
        n = int(seq[-1]) + 1 if len(seq) else 0
        lengths = torch.bincount(seq, minlength=n)  # [n]
        cu = torch.zeros(n + 1, dtype=torch.long, device=device)
        cu[1:] = lengths.cumsum(0)
        L = int(lengths.max()) if n else 0
        offset = torch.arange(len(where), device=device) - cu[seq]  # [N] position inside its sequence
        index = torch.zeros(n, L, dtype=torch.long, device=device)
        index[seq, offset] = where
        mask = torch.zeros(n, L, dtype=torch.bool, device=device)
        mask[seq, offset] = True
        return cls(index, mask, cu.to(torch.int32))


def rule_inputs(mixed: Tensor, a: Tensor, b: Tensor, s: LinearAttentionShape, A_log: Tensor,
                dt_bias: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """After the conv: mixed [..., C], a, b [..., Hv] -> q, k [..., Hv, Dk] (L2-normed, q scaled, one per value
    head), v [..., Hv, Dv], g, beta [..., Hv]; all float32."""
    Hk, Dk = s.num_key_heads, s.key_head_dim
    q, k, v = mixed.split([Hk * Dk, Hk * Dk, s.num_value_heads * s.value_head_dim], dim=-1)
    groups = s.num_value_heads // Hk
    # Contiguous first: the norm's sum then runs in transformers' order (float32 parity to the last bit).
    q, k = (_l2norm(t.unflatten(-1, (Hk, Dk)).float().contiguous()).repeat_interleave(groups, dim=-2) for t in (q, k))
    v = v.unflatten(-1, (s.num_value_heads, s.value_head_dim)).float().contiguous()
    beta = b.sigmoid().float()  # rounded in the model dtype first, as transformers does
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return q * Dk ** -0.5, k, v, g, beta


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           initial_state: Optional[Tensor] = None, chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """The gated delta rule over whole sequences, chunk by chunk (float32):
    q, k [n, L, Hv, Dk], v [n, L, Hv, Dv], g, beta [n, L, Hv], initial_state [n, Hv, Dk, Dv] or None (zeros)
    -> (o [n, L, Hv, Dv], final state [n, Hv, Dk, Dv]).

    Inside a chunk, with cum = cumsum(g) and decay[i, j] = exp(cum_i - cum_j) (j <= i), the token updates
    u_i = beta_i (v_i - S_{i-1}^T k_i) satisfy (I + strict_lower(beta k k^T * decay)) u = beta v - (beta k e^cum) S_0:
    one triangular solve per chunk instead of c sequential steps. Then o = (q e^cum) S_0 + (q k^T * decay) u and
    S_c = e^{cum_c} S_0 + (k e^{cum_c - cum})^T u.
    """
    n, L, H, Dk = k.shape
    Dv = v.shape[-1]
    pad = (-L) % chunk  # zeros at the end: beta = 0 there, so they write nothing
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(1, 2).unflatten(2, (-1, chunk)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, 0, 0, pad)).transpose(1, 2).unflatten(2, (-1, chunk)) for t in (g, beta))
    # q, k [n, H, m, c, Dk], v [n, H, m, c, Dv], g, beta [n, H, m, c]
    cum = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [n, H, m, c, c]
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its diagonal is ignored: unitriangular
    if TRIANGULAR == "blocked":
        inverse = unit_lower_inverse(system)  # [n, H, m, c, c]
        u, w = inverse @ (v * beta[..., None]), inverse @ (k_beta * cum.exp()[..., None])
    else:
        u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # [n, H, m, c, c]
    q_read = q * cum.exp()[..., None]
    k_write = k * (cum[..., -1:] - cum).exp()[..., None]
    state = q.new_zeros(n, H, Dk, Dv) if initial_state is None else initial_state.float()
    outs = []
    for i in range(q.shape[2]):
        u_i = u[:, :, i] - w[:, :, i] @ state  # [n, H, c, Dv]
        outs.append(q_read[:, :, i] @ state + scores[:, :, i] @ u_i)
        state = state * cum[:, :, i, -1, None, None].exp() + k_write[:, :, i].transpose(-1, -2) @ u_i
    o = torch.stack(outs, dim=2).flatten(2, 3)[:, :, :L].transpose(1, 2)  # [n, L, H, Dv]
    return o, state


def unit_lower_inverse(a: Tensor, block: int = INVERSE_BLOCK) -> Tensor:
    """(I + strict_lower(a))^-1 for a [..., c, c] (its diagonal and upper part ignored), with batched matmuls:
    each diagonal block of `block` rows by forward substitution (row i from the rows above it, all blocks at
    once), then blocks merged pairwise, [[X1, 0], [-X2 L21 X1, X2]], until one block spans c. Substitution and
    the merge are the stable ways (as fla's solve_tril); a product of powers of the strict part would cancel
    catastrophically when keys are alike. c must be `block` times a power of two."""
    c = a.shape[-1]
    nb = c // block
    assert nb * block == c and nb & (nb - 1) == 0, f"chunk {c} is not {block} x a power of two"
    strict = a.tril(-1)
    diag = torch.stack([strict[..., j * block:(j + 1) * block, j * block:(j + 1) * block] for j in range(nb)],
                       dim=-3)  # [..., nb, block, block]
    eye = torch.eye(block, dtype=a.dtype, device=a.device)
    rows = [eye[0].expand(*diag.shape[:-2], block)]  # row 0 of each inverse block: e_0
    for i in range(1, block):  # row i = e_i - L[i, :i] @ X[:i]
        above = torch.stack(rows, dim=-2)  # [..., nb, i, block]
        rows.append(eye[i] - (diag[..., i:i + 1, :i] @ above).squeeze(-2))
    inverse = list(torch.stack(rows, dim=-2).unbind(-3))  # nb x [..., block, block]
    size = block
    while len(inverse) > 1:  # merge neighbours: X of [[T1, 0], [L21, T2]] from X1, X2
        merged = []
        for j in range(0, len(inverse), 2):
            top, x1, x2 = j * size, inverse[j], inverse[j + 1]
            l21 = strict[..., top + size:top + 2 * size, top:top + size]
            lower = -(x2 @ l21 @ x1)
            merged.append(torch.cat([torch.cat([x1, torch.zeros_like(x1)], dim=-1),
                                     torch.cat([lower, x2], dim=-1)], dim=-2))
        inverse, size = merged, 2 * size
    return inverse[0]


def recurrent_step_(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
    """One token per row, the state updated in place: q, k [b, Hv, Dk], v [b, Hv, Dv], g, beta [b, Hv],
    state [b, Hv, Dk, Dv] (float32, contiguous) -> o [b, Hv, Dv]. A row with g = beta = 0 keeps its state.

    k^T (e^g S) = e^g (k^T S): the state is read once for it, then decayed and updated in place (baddbmm adds
    the outer product k u^T without a temporary of the state's size), then read once more for the output."""
    b, H, Dk, Dv = state.shape
    flat = state.view(b * H, Dk, Dv)
    decay = g.exp()  # [b, Hv]
    predicted = torch.bmm(k.reshape(b * H, 1, Dk), flat).view(b, H, Dv)  # k^T S before the decay
    update = (v - decay[..., None] * predicted) * beta[..., None]  # [b, Hv, Dv]: beta (v - (e^g S)^T k)
    state.mul_(decay[..., None, None])
    flat.baddbmm_(k.reshape(b * H, Dk, 1), update.reshape(b * H, 1, Dv))
    return torch.bmm(q.reshape(b * H, 1, Dk), flat).view(b, H, Dv)


def conv_with_state(x: Tensor, conv_state: Tensor, weight: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """The short conv continuing from a state: x [n, L, C] (real tokens first), conv_state [n, C, K-1] (the
    K-1 inputs before x), weight [C, 1, K], lengths [n] -> (silu(conv) [n, L, C], the new state [n, C, K-1]:
    the last K-1 inputs up to each row's length)."""
    K = weight.shape[-1]
    full = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [n, C, K-1+L]
    y = F.silu(F.conv1d(full, weight, groups=x.shape[-1]))  # [n, C, L]
    take = (lengths[:, None] + torch.arange(K - 1, device=x.device))[:, None, :].expand(-1, x.shape[-1], -1)
    return y.transpose(1, 2), full.gather(2, take)


def conv_step(x: Tensor, conv_state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """One token per row: x [b, C], conv_state [b, C, K-1] -> (silu(conv) [b, C], the new state)."""
    window = torch.cat([conv_state.to(x.dtype), x[:, :, None]], dim=-1)  # [b, C, K]
    # Accumulated in float32, as the conv kernels of the prefill and of training do.
    y = (window.float() * weight[:, 0].float()).sum(-1).to(x.dtype)
    return F.silu(y), window[:, :, 1:]


def continue_sequences(m: GatedDeltaNet, x: Tensor, lengths: Tensor, conv_state: Tensor,
                       state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The engine's prefill / extend: x [n, L, H] (normed, real tokens first, row i has lengths[i]), continuing
    from conv_state [n, C, K-1] and state [n, Hv, Dk, Dv] -> (out [n, L, Hv * Dv] before out_proj, the conv
    state and the recurrent state after each row's last real token). Zeros for both states = a fresh sequence."""
    s = m.shape
    real = (torch.arange(x.shape[1], device=x.device) < lengths[:, None])[..., None]  # [n, L, 1]
    mixed, conv_state = conv_with_state(linear(x, m.in_proj_qkv), conv_state, m.conv1d.weight, lengths)
    q, k, v, g, beta = rule_inputs(mixed, linear(x, m.in_proj_a), linear(x, m.in_proj_b), s, m.A_log, m.dt_bias)
    o, state = chunk_gated_delta_rule(q, k, v, g * real, beta * real, state)  # padding: no decay, no write
    z = linear(x, m.in_proj_z).unflatten(-1, (s.num_value_heads, s.value_head_dim))
    return gated_norm(o.to(x.dtype), z, m.norm.weight, m.eps).flatten(-2), conv_state, state


class DecodeWeights(NamedTuple):
    """One linear layer's tensors for the decode step (plain tensors: compiled code sees no modules)."""
    qkv: Tensor      # [C, H]
    a: Tensor        # [Hv, H]
    b: Tensor        # [Hv, H]
    z: Tensor        # [Hv Dv, H]
    conv: Tensor     # [C, 1, K]
    A_log: Tensor    # [Hv]
    dt_bias: Tensor  # [Hv]
    norm: Tensor     # [Dv]


def decode_weights(m: GatedDeltaNet, previous: Optional[DecodeWeights] = None) -> DecodeWeights:
    """The layer's tensors, read in place; a projection with LoRA adapters gives its merged engine copy instead
    (lora.engine_weight: refilled in place into `previous`'s buffer, so captured graphs keep their pointers)."""
    p = previous
    return DecodeWeights(engine_weight(m.in_proj_qkv, p and p.qkv), engine_weight(m.in_proj_a, p and p.a),
                         engine_weight(m.in_proj_b, p and p.b), engine_weight(m.in_proj_z, p and p.z),
                         m.conv1d.weight, m.A_log, m.dt_bias, m.norm.weight)


def decode_inputs(x: Tensor, conv_state: Tensor, w: DecodeWeights, running: Tensor,
                  s: LinearAttentionShape) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Before the state update (pure): x [b, H], conv_state [b, C, K-1], running [b] -> q, k [b, Hv, Dk],
    v [b, Hv, Dv], g, beta [b, Hv] (0 where not running: the state stays), the next conv state [b, C, K-1]."""
    mixed, conv = conv_step(F.linear(x, w.qkv), conv_state, w.conv)
    q, k, v, g, beta = rule_inputs(mixed, F.linear(x, w.a), F.linear(x, w.b), s, w.A_log, w.dt_bias)
    keep = running[:, None]
    return q, k, v, g * keep, beta * keep, torch.where(running[:, None, None], conv, conv_state)


def decode_output(o: Tensor, x: Tensor, w: DecodeWeights, s: LinearAttentionShape, eps: float) -> Tensor:
    """After the state update (pure): o [b, Hv, Dv] (float32), x [b, H] -> [b, Hv * Dv] before out_proj."""
    z = F.linear(x, w.z).unflatten(-1, (s.num_value_heads, s.value_head_dim))
    return gated_norm(o.to(x.dtype), z, w.norm, eps).flatten(-2)


def decode_step_(m: GatedDeltaNet, x: Tensor, conv_state: Tensor, state: Tensor, running: Tensor,
                 step=None, fns=(decode_inputs, decode_output), weights: Optional[DecodeWeights] = None) -> Tensor:
    """One token per row, both states updated in place where `running` [b] is True (the others keep theirs):
    x [b, H] (normed), conv_state [b, C, K-1], state [b, Hv, Dk, Dv] (float32) -> out [b, Hv * Dv] before out_proj.
    step: the rule's one-token update (recurrent_step_, or the engine's Triton twin with the same contract);
    fns: decode_inputs / decode_output, or the engine's compiled twins. weights: decode_weights(m), kept by the
    caller (the engine builds them once per call: with LoRA they are merged copies)."""
    inputs, output = fns
    w = decode_weights(m) if weights is None else weights
    q, k, v, g, beta, conv = inputs(x, conv_state, w, running, m.shape)
    conv_state.copy_(conv)
    o = (step or recurrent_step_)(q, k, v, g, beta, state)
    return output(o, x, w, m.shape, m.eps)


@functools.cache
def _fla_rule():
    """fla's chunk_gated_delta_rule where the package imports (it needs Triton and CUDA), else None."""
    if importlib.util.find_spec("fla") is None:
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as rule
    except Exception:  # noqa: BLE001 - an fla that does not import here is an fla we do not use
        return None
    return rule


USE_FLA = True  # False forces the torch rule on CUDA too (comparisons, debugging)
FLA_DEVICES = ("cuda",)  # where fla's kernels run (Triton); the CPU tests add "cpu" to try the choice with a fake fla
_FLA_PROBED: dict = {}  # device -> (forward, backward): what of fla's rule, as _fla_chunk calls it, agrees with ours


def _fla_usable(device: torch.device, grad: bool = True) -> bool:
    """fla on CUDA, once it has shown on a tiny packed batch that it computes our rule (forward and backward). An
    fla whose forward agrees but whose backward refuses (fla-core 0.6.0 on Hopper with Triton < 3.7.1, fla #640)
    serves the reference's pass only (inside `reference_pass()`, without gradients): the old log-probs and the
    update keep one rule, the torch rule, so the PPO ratio compares like with like."""
    status = fla_status(device) if USE_FLA else None
    if status is None:
        return False
    forward, backward = status
    return backward or (forward and not grad and _REFERENCE_PASS[0])


def fla_status(device: torch.device) -> Optional[tuple[bool, bool]]:
    """(forward, backward): what of flash-linear-attention's rule agrees with ours where the model sits (_fla_probe,
    once per device); None where fla would not run at all (not CUDA, or fla does not import)."""
    if device.type not in FLA_DEVICES or _fla_rule() is None:
        return None
    if device not in _FLA_PROBED:
        _FLA_PROBED[device] = _fla_probe(device)
    return _FLA_PROBED[device]


_REFERENCE_PASS = [False]  # inside reference_pass()


@contextlib.contextmanager
def reference_pass():
    """The frozen reference's forward (roles/reference.py): its log-probs enter only the KL term, so a rule whose
    forward agrees with ours to bf16 rounding may compute them even where its backward cannot run."""
    before, _REFERENCE_PASS[0] = _REFERENCE_PASS[0], True
    try:
        yield
    finally:
        _REFERENCE_PASS[0] = before


@torch.inference_mode(False)  # the first probe may come from the reference's pass: see the docstring
def _fla_probe(device: torch.device) -> tuple[bool, bool]:
    """(forward, backward): whether fla's rule, called as _fla_chunk calls it, gives our rule's answer on two packed
    sequences, and whether its backward runs too. An fla whose API or numerics differ here is never trusted
    (logged), the torch rule runs. Its tensors are made outside inference_mode: under it autograd could not save
    them, and a working backward would look refused."""
    g = torch.Generator(device=device).manual_seed(0)
    n, H, Dk, Dv = 40, 2, 16, 16
    q, k = (F.normalize(torch.randn(n, H, Dk, device=device, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(n, H, Dv, device=device, generator=g)
    decay, beta = -torch.rand(n, H, device=device, generator=g), torch.rand(n, H, device=device, generator=g)
    seg = Segments.of(torch.ones(1, n, device=device), (torch.arange(n, device=device) >= 17)[None].long())
    q, k, decay, beta = (t[seg.index] for t in (q, k, decay, beta))  # [2, 23, ...]: each sequence its own row
    want = chunk_gated_delta_rule(q, k, v[seg.index], decay, beta)[0][seg.real]  # [n, H, Dv]
    try:
        with torch.no_grad():
            got = _fla_chunk(q, k, v[seg.index], decay, beta, seg)
    except Exception as e:  # noqa: BLE001 - whatever fla says about these inputs, the answer is no
        log.warning("flash-linear-attention's chunk_gated_delta_rule failed here (%s): the torch rule runs", e)
        return False, False
    if not bool(((got - want).abs().max() <= 3e-2 * want.abs().max()).item()):
        log.warning("flash-linear-attention's chunk_gated_delta_rule disagrees with ours here: the torch rule runs")
        return False, False
    try:
        with torch.enable_grad():
            v = v.clone().requires_grad_(True)
            torch.autograd.grad(_fla_chunk(q, k, v[seg.index], decay, beta, seg).square().sum(), v)
    except Exception as e:  # noqa: BLE001 - a backward that refuses here: its forward is still ours
        log.warning("flash-linear-attention's chunk_gated_delta_rule has no backward here (%s): the reference's "
                    "pass uses it, the old log-probs and the update run the torch rule", e)
        return True, False
    log.info("Gated DeltaNet training layers use flash-linear-attention's chunk_gated_delta_rule")
    return True, True


def _fla_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, seg: Segments) -> Tensor:
    """The real tokens of every sequence as one varlen batch through fla: -> o [N, Hv, Dv] (float32)."""
    r = seg.real
    # q is already normed and scaled (scale=1 below); fla wants its inputs in one dtype, bf16 for speed.
    dtype = torch.bfloat16
    q, k, v, beta = (t[r][None].to(dtype) for t in (q, k, v, beta))  # [1, N, ...]
    o, _ = _fla_rule()(q, k, v, g[r][None], beta, scale=1.0, cu_seqlens=seg.cu_seqlens.long(),
                       use_qk_l2norm_in_kernel=False)
    return o[0].float()
