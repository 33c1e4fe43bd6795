"""CUDA graphs for the training forward and backward of packed micro-batches (ppo.train_graphs).

The decoder's body (embedding, layers, final norm) of a packed micro-batch runs as two graph replays, one
forward and one backward, instead of ~100 compiled-region calls, their Python and ~2,400 kernel launches.
The host's cost per micro-batch then no longer sets the update's speed, so a small micro-batch (less memory)
runs about as fast as a large one on any host.

Static shapes: a micro-batch of N tokens in b rows is laid into T >= N tokens, its rows as they are and then
the padding as extra sequences of at most `pad_len` <= max_len tokens each (token 0, positions 0, 1, ...), so
the varlen kernel sees only whole sequences no longer than its max_seqlen and no padding token ever attends to
a real one; the cumulative lengths are padded to K + 1 entries with empty sequences. The padding's outputs are never
read, so its gradients are zero and every parameter's gradient is the unpadded one (up to the GEMMs' order of
summation). T and max_len are rounded up (TOKEN_STEP, LENGTH_STEP; max_len from the run's longest sequence when
the builder gives it), K to a power of two: one graph pair per shape met,
captured on first use by torch.cuda.make_graphed_callables (its warm-up iterations compile and tune first);
all of them in one memory pool, which is safe because micro-batches run one after another.
Not here: the LM head and the loss (eager: their shapes follow the response tokens), forward-only passes
(no backward to save), MoE routing, FSDP, hybrid (Qwen3.5) layers, LoRA adapters and activation checkpointing:
`unsupported` says which, and those runs take the eager path.
Legend: N real tokens, T padded tokens, b rows, K padded sequence slots, H hidden.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..models import CausalLM
from ..models.attention import use_varlen, varlen_takes_windows
from ..models.decoder import PackedSeqs
from ..models.lora import has_lora
from ..packing import Packed

log = logging.getLogger("phaserl")

TOKEN_STEP = 1024   # T: the micro-batch's tokens rounded up to this
MIN_SLOTS = 16      # K: rows + padding sequences rounded up to a power of two, at least this (empty slots are cheap)
LENGTH_STEP = 128   # max_len: the run's longest sequence (or this micro-batch's, if longer) rounded up to this
PAD_CHUNK = 512     # the padding's sequences are at most this long (and never longer than max_len): their
                    # attention, wasted work, stays small
MAX_GRAPHS = 16     # graph pairs kept per model; a new shape past this runs eagerly (logged once)


@dataclass(frozen=True)
class PaddedShape:
    tokens: int    # T
    slots: int     # K
    max_len: int   # the varlen kernel's max_seqlen

    @property
    def pad_len(self) -> int:
        """The length of each padding sequence (the last one shorter)."""
        return min(self.max_len, PAD_CHUNK)


def padded_shape(tokens: int, rows: int, longest: int, run_longest: int = 0) -> PaddedShape:
    """The static shape a micro-batch of `tokens` real tokens in `rows` rows (longest `longest`) is laid into.
    run_longest: the longest sequence the run allows (prompt + response): with it max_len is the same for every
    micro-batch, so the shapes a run meets differ in T and K only (fewer captures)."""
    T = -(-tokens // TOKEN_STEP) * TOKEN_STEP
    max_len = -(-max(longest, run_longest, 1) // LENGTH_STEP) * LENGTH_STEP
    pad_seqs = -(-(T - tokens) // min(max_len, PAD_CHUNK))
    K = max(MIN_SLOTS, 1 << (rows + pad_seqs - 1).bit_length())
    return PaddedShape(T, K, max_len)


def padded_inputs(packed: Packed, shape: PaddedShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [1, T], position_ids [1, T], cu_seqlens [K + 1] int32) on the packed batch's device, built there
    without a host sync: the rows as packed, then padding sequences of pad_len tokens (the last one shorter)."""
    N, b, dev = packed.num_tokens, len(packed.rows), packed.input_ids.device
    T, K, L = shape.tokens, shape.slots, shape.pad_len
    pad = T - N
    ids = torch.nn.functional.pad(packed.input_ids, (0, pad))                          # [1, T] padding: token 0
    positions = torch.cat([packed.position_ids, (torch.arange(pad, device=dev) % L)[None]], dim=1)  # [1, T]
    pad_seqs = -(-pad // L)
    ends = (N + L * torch.arange(1, pad_seqs + 1, device=dev)).clamp(max=T).to(torch.int32)  # [pad_seqs]
    rest = torch.full((K - b - pad_seqs,), T, dtype=torch.int32, device=dev)          # empty sequences
    cu = torch.cat([packed.cu_seqlens.to(torch.int32), ends, rest])                    # [K + 1]
    return ids, positions, cu


def unsupported(model) -> str:
    """Why this model's training micro-batches cannot be graphed ('' when they can)."""
    if not isinstance(model, CausalLM):
        return "the model is not phaserl's decoder"
    cfg, dev = model.config, model.output_weight.device
    if cfg.num_experts:
        return "mixture-of-experts layers (routing is decided per token on the host side of the graph)"
    if cfg.linear_attention is not None:
        return "hybrid linear-attention layers (Qwen3.5)"
    if has_lora(model):
        return "LoRA adapters (not measured with graphs yet)"
    if model.model.gradient_checkpointing:
        return "activation checkpointing"
    if dev.type != "cuda":
        return f"{dev.type.upper()}: CUDA graphs need a CUDA device"
    if not use_varlen(dev, model.output_weight.dtype):
        return "packed micro-batches do not take the varlen kernel here (CUDA, bf16/fp16 and a torch that has it)"
    if any(layer.spec.window is not None for layer in model.model.layers) and not varlen_takes_windows():
        return "sliding-window layers without a varlen window argument"
    return ""


def pool_bytes(pool) -> int:
    """Bytes the CUDA caching allocator holds for the private memory pool `pool` (graph_pool_handle()): the
    activations the graphs keep between their forward and backward, held as long as the graphs live. Replays
    allocate nothing, so torch.cuda.max_memory_allocated never sees them."""
    segments = torch.cuda.memory_snapshot()
    return sum(s["total_size"] for s in segments if tuple(s.get("segment_pool_id", ())) == tuple(pool))


class _Body(nn.Module):
    """The decoder body on static packed inputs: what one graph pair captures (max_len is the graph's constant)."""

    def __init__(self, body: nn.Module, max_len: int):
        super().__init__()
        self.body, self.max_len = body, max_len

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        # seq_ids only selects the packed path; the varlen kernel reads the boundaries
        return self.body(input_ids, position_ids=position_ids, seq_ids=position_ids,
                         boundaries=PackedSeqs(cu_seqlens=cu_seqlens, max_len=self.max_len))  # [1, T, H]


class TrainGraphs:
    """The graphed body of one model: `hidden(packed)` -> [1, T, H] hidden states under autograd (the first N
    positions are the packed tokens'), or None when this micro-batch takes the eager path."""

    def __init__(self, model: CausalLM, *, max_seq_tokens: int = 0):
        self.model, self.max_seq_tokens = model, max_seq_tokens  # the run's longest sequence (padded_shape)
        self.graphs: dict = {}
        self.pool = None
        self.pointers: Optional[list[int]] = None
        self.pool_bytes = 0  # what the graphs' memory pool holds (the allocator's allocated bytes leave it out)
        self._warned = False

    def hidden(self, packed: Packed) -> Optional[torch.Tensor]:
        if not torch.is_grad_enabled() or packed.routed_experts is not None:
            return None
        self._check_parameters()
        shape = padded_shape(packed.num_tokens, len(packed.rows), packed.max_len, self.max_seq_tokens)
        graphed = self.graphs.get(shape)
        inputs = padded_inputs(packed, shape)
        if graphed is None:
            if len(self.graphs) >= MAX_GRAPHS:
                if not self._warned:
                    log.warning(f"ppo.train_graphs: {MAX_GRAPHS} micro-batch shapes captured already; new shapes "
                                f"(here {shape}) run without graphs")
                    self._warned = True
                return None
            graphed = self._capture(shape, inputs)
        return graphed(*inputs)

    def _capture(self, shape: PaddedShape, inputs: tuple) -> nn.Module:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        body = _Body(self.model.model, shape.max_len)
        graphed = torch.cuda.make_graphed_callables(body, inputs, allow_unused_input=True, pool=self.pool)
        self.graphs[shape] = graphed
        self.pool_bytes = pool_bytes(self.pool)
        log.info(f"ppo.train_graphs: captured a micro-batch of {shape.tokens} tokens, {shape.slots} sequence slots, "
                 f"sequences up to {shape.max_len} ({len(self.graphs)} shape(s), pool {self.pool_bytes / 2**30:.1f} "
                 "GiB)")
        return graphed

    def _check_parameters(self) -> None:
        """One pass over the body's parameters before a replay.

        Addresses: the graphs read the parameters where they were when captured, so a parameter replaced since (a
        load that swaps tensors instead of copying into them) drops every graph, to be captured again.
        Gradients: every trainable parameter holds a gradient tensor, so that autograd adds the graph's gradients
        into it. Into a parameter without one, autograd may store the returned tensor itself, and that is the
        graph's static buffer, overwritten by the next micro-batch's backward (pytorch#181723)."""
        pointers = []
        for p in self.model.model.parameters():
            pointers.append(p.data_ptr())
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        if pointers != self.pointers:
            if self.graphs:
                log.info("ppo.train_graphs: the model's parameters moved; the graphs are captured again")
            self.graphs, self.pool, self.pointers, self.pool_bytes = {}, None, pointers, 0
