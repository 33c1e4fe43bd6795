"""Ulysses sequence parallelism: k ranks share one micro-batch's sequences, each holding 1/k of every sequence's tokens
through the decoder layers; attention still sees every token.

Every rank of a sequence-parallel group runs the same micro-batch (the same rows). The decoder embeds the whole
sequence, builds the masks and RoPE tables for it (positions are the global ones), and keeps only this rank's
contiguous slice of c = ceil(T / k) tokens (the last rank's slice is zero-padded when k does not divide T). Around
attention, `SplitAttention.attend`:

  q [B, c, Hq, D], k/v [B, c, Hkv, D]    this rank's tokens, every head
    -> all-to-all (sequence split -> head split)
  q [B, T, Hq/k, D], k/v [B, T, Hkv r/k, D]   every token, this rank's heads
    -> the attention core on whole sequences (the mask or varlen boundaries the decoder built for all T tokens)
    -> all-to-all back (head split -> sequence split)
  out [B, c, Hq, D]

Rank j takes query heads [j Hq/k, (j + 1) Hq/k). Grouped-query attention: query head q reads kv head q // g
(g = Hq / Hkv). When k does not divide Hkv, each kv head is repeated r = k / gcd(Hkv, k) times before the all-to-all
(r = 1 when k divides Hkv), so that Hkv r is a multiple of k and rank j's query heads find theirs: r divides g
whenever k divides Hq. So the one rule on heads is that k divides every layer's query heads (`check_heads`).

The last hidden states come back full size [B, T, H] with this rank's tokens filled and zeros elsewhere (`place`):
the log-prob head then runs on this rank's tokens only (`owned`), and `combine` sums the per-token results over the
group (forward: an all-reduce; backward: the identity, since every rank then computes the same loss from the same
summed values), so every rank holds the single-process log-probs. Each rank's parameter gradients are its tokens'
share: summed over the group (as the data-parallel reduction sums over ranks) they are the single-process
gradients. `members` hands every rank each member's micro-batch, which roles/forward.group_rows runs in turn: each
rank keeps its own rows and the group still runs one micro-batch at a time.

Cost: per layer, four all-to-alls forward (q, k, v, out) and four backward, each moving (k - 1)/k of the tensor
(q and out: c x Hq x D values per token row, k and v: c x Hkv r x D), against attention's O(T^2) work on 1/k of
the heads. Not here: which ranks form a group (trainer/build.py), the rollout engine (it decodes per rank,
unchanged), layers other than attention and a gated MLP (linear attention, mixture-of-experts routing, Gemma 4's
per-layer inputs and shared keys/values, vision inputs: `check_model` refuses them), the bitwise numerics mode.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..errors import ConfigError


def kv_repeat(kv_heads: int, k: int) -> int:
    """How many times each kv head is repeated before the all-to-all: the fewest r with k dividing kv_heads x r."""
    return k // math.gcd(kv_heads, k)


def check_heads(heads: list[tuple[int, int]], k: int, key: str = "actor.sequence_parallel") -> None:
    """Every layer's (query heads, kv heads) can be split over k ranks: k divides the query heads. ConfigError
    naming the key and the values that would work otherwise."""
    for i, (hq, hkv) in enumerate(heads):
        if hq % k:
            fits = [d for d in range(2, hq + 1) if hq % d == 0]
            raise ConfigError(f"{key} = {k}: layer {i} has {hq} query heads, which do not split over {k} ranks "
                              f"(each rank takes Hq / k heads); use a value that divides {hq}: "
                              f"{', '.join(map(str, fits)) or 'none (1: off)'}")
        assert (hq // hkv) % kv_repeat(hkv, k) == 0  # r divides the group size whenever k divides Hq


def check_world(k: int, world_size: int, key: str = "actor.sequence_parallel") -> None:
    """k ranks per group, a whole number of groups."""
    if k < 1 or world_size % k:
        raise ConfigError(f"{key} = {k} on {world_size} rank(s): the ranks form groups of {key} ranks, so it must "
                          f"divide the world size ({world_size}); use 1 (off) or a divisor of {world_size}")


def check_model(config, k: int, key: str = "actor.sequence_parallel") -> None:
    """The decoder's layers are ones the split covers (attention + a dense MLP) and its heads split over k ranks
    (phaserl's DecoderConfig): ConfigError otherwise."""
    unsupported = [what for what, present in (
        ("linear-attention layers (Qwen3.5)", getattr(config, "linear_attention", None) is not None),
        ("mixture-of-experts layers", bool(getattr(config, "num_experts", 0))),
        ("Gemma 4's per-layer inputs", bool(getattr(config, "per_layer_input_size", 0))),
        ("Gemma 4's shared keys/values", bool(getattr(config, "kv_shared_layers", 0))),
        ("image inputs (a vision-language model)", getattr(config, "mrope_section", None) is not None)) if present]
    if unsupported:
        raise ConfigError(f"{key} > 1 splits attention and dense layers over ranks; this model has "
                          f"{' and '.join(unsupported)}: set {key} = 1")
    check_heads([config.heads(i)[:2] for i in range(config.num_hidden_layers)], k, key)


class SequenceParallel:
    """This rank's place in a group of k ranks that share every sequence (`group`: a torch.distributed group,
    None = the default group; k = 1: one process, every method the identity)."""

    def __init__(self, group=None, k: Optional[int] = None, rank: Optional[int] = None):
        self.group = group
        self.k = k if k is not None else dist.get_world_size(group)
        self.rank = rank if rank is not None else (dist.get_rank(group) if self.k > 1 else 0)

    def chunk(self, T: int) -> int:
        """Tokens per rank: c = ceil(T / k)."""
        return -(-T // self.k)

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of `x` along `dim` (T long): [.., c, ..], zero-padded past T."""
        T, c = x.shape[dim], self.chunk(x.shape[dim])
        part = x.narrow(dim, min(T, self.rank * c), max(0, min(c, T - self.rank * c)))
        if part.shape[dim] == c:
            return part
        pad = list(x.shape)
        pad[dim] = c - part.shape[dim]
        return torch.cat([part, x.new_zeros(pad)], dim=dim)

    def owned(self, T: int, device=None) -> torch.Tensor:
        """Which of T positions this rank holds.  [T] bool"""
        c = self.chunk(T)
        pos = torch.arange(T, device=device)
        return (pos >= self.rank * c) & (pos < (self.rank + 1) * c)

    def place(self, local: torch.Tensor, T: int) -> torch.Tensor:
        """local [B, c, ...] -> [B, T, ...]: this rank's tokens in place, zeros elsewhere (gradients flow to own
        tokens only)."""
        c = local.shape[1]
        start, n = self.rank * c, max(0, min(c, T - self.rank * c))
        before = local.new_zeros((local.shape[0], min(start, T)) + tuple(local.shape[2:]))
        after = local.new_zeros((local.shape[0], T - min(start, T) - n) + tuple(local.shape[2:]))
        return torch.cat([before, local[:, :n], after], dim=1)

    def combine(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token values of which each rank filled its own (zeros elsewhere) -> the whole, on every rank."""
        return _SumOverGroup.apply(x, self.group) if self.k > 1 else x

    def members(self, own) -> list:
        """Every group member's `own` (a dataclass of tensors, lists and nested dataclasses: a micro-batch's rows),
        in rank order, on this rank's device; `own` itself at this rank's place. The group then runs each member's
        rows in turn, in the same order on every rank."""
        if self.k == 1:
            return [own]
        device = next((t.device for t in _tensors(own)), torch.device("cpu"))
        gathered = [None] * self.k
        dist.all_gather_object(gathered, _map_tensors(own, lambda t: t.detach().cpu()), group=self.group)
        return [own if j == self.rank else _map_tensors(m, lambda t: t.to(device)) for j, m in enumerate(gathered)]

    def around(self, attn, attend: Callable) -> "SplitAttention":
        """The attention input the decoder built for all T tokens, attended through the group's all-to-alls."""
        return SplitAttention(self, attn, attend)


class SplitAttention:
    """An attention core input (mask or varlen boundaries, for the whole sequence) whose `attend` takes this rank's
    tokens of every head and returns the same, attending over every token (attention.attend calls it)."""

    def __init__(self, sp: SequenceParallel, inner, attend: Callable):
        self.sp, self.inner, self.core = sp, inner, attend

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None):
        sp = self.sp
        c = q.shape[1]
        r = kv_repeat(k.shape[2], sp.k)
        if r > 1:  # fewer kv heads than the split needs: each repeated, in order, so query head groups still match
            k, v = k.repeat_interleave(r, dim=2), v.repeat_interleave(r, dim=2)  # [B, c, Hkv r, D]
        T = _full_length(self.inner, c * sp.k)
        q, k, v = (_SeqToHeads.apply(x, sp.group, sp.k)[:, :T] for x in (q, k, v))  # [B, T, H/k, D]
        out = self.core(q, k, v, self.inner, scale)                                  # [B, T, Hq/k, D]
        if out.shape[1] < c * sp.k:
            out = torch.cat([out, out.new_zeros((out.shape[0], c * sp.k - T) + tuple(out.shape[2:]))], dim=1)
        return _HeadsToSeq.apply(out, sp.group, sp.k)  # [B, c, Hq, D]


def _map_tensors(obj, fn):
    """`obj` with fn applied to every tensor field (dataclasses, recursively; other values as they are)."""
    if torch.is_tensor(obj):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changed = {f.name: _map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changed)
    return obj


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))


def _full_length(inner, padded: int) -> int:
    """The sequence length T the attention input was built for (a mask [B, 1, T, S] or varlen boundaries)."""
    if torch.is_tensor(inner):
        return inner.shape[-2]
    cu = getattr(inner, "cu_seqlens", None)
    return int(cu[-1]) if cu is not None else padded


def _seq_to_heads(x: torch.Tensor, group, k: int) -> torch.Tensor:
    """[B, c, H, D] (this rank's tokens) -> [B, k c, H/k, D] (every rank's tokens, this rank's heads)."""
    B, c, H, D = x.shape
    send = x.reshape(B, c, k, H // k, D).permute(2, 0, 1, 3, 4).contiguous()  # [k, B, c, H/k, D]: to rank j
    recv = torch.empty_like(send)                                              # [k, B, c, H/k, D]: from rank j
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(B, k * c, H // k, D)


def _heads_to_seq(x: torch.Tensor, group, k: int) -> torch.Tensor:
    """[B, k c, H/k, D] -> [B, c, H, D]: the inverse of _seq_to_heads."""
    B, kc, h, D = x.shape
    c = kc // k
    send = x.reshape(B, k, c, h, D).permute(1, 0, 2, 3, 4).contiguous()  # [k, B, c, H/k, D]: rank j's tokens
    recv = torch.empty_like(send)                                        # [k, B, c, H/k, D]: head group j
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(B, c, k * h, D)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, k):
        ctx.group, ctx.k = group, k
        return _seq_to_heads(x, group, k)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.group, ctx.k), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, k):
        ctx.group, ctx.k = group, k
        return _heads_to_seq(x, group, k)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.group, ctx.k), None, None


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over the group. Backward: the identity (every rank computes the same loss from the sum, so
    the gradient of its own part is the loss's gradient there, unreduced)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None
