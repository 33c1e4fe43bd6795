"""The rollout engine for hybrid models (Qwen3.5): a recurrent state per slot beside the KV pool.

Qwen3.5's Gated DeltaNet layers keep no keys and values; each slot holds, per linear layer, the DeltaNet
state [Hv, Dk, Dv] (float32) and the short conv's last K-1 inputs [C, K-1] (`RecurrentState`). The
full-attention layers use the slot KV pool as every other family does (the pool only has those layers).
`HybridRunner` is ModelRunner with the hybrid layer math (models/hybrid.py, models/linear_attention.py:
the functions the training decoder runs):
  prefill  each distinct prompt from zero state (`continue_sequences` with zeros); its conv/DeltaNet
           state and KV are copied into every slot of the sequences that share it: a refilled slot
           starts over, nothing of the previous sequence survives
  decode   one recurrent step per slot; only running slots change their state (a stopped slot's frozen
           steps must not feed its last token again: `extend` feeds it with the next turn)
  extend   continues each slot's state over the appended tokens (multi-turn)
  move     compaction moves the state with the KV
On CUDA the DeltaNet state update is a Triton kernel (delta_kernel.py: the state read and written once), the
rest of the step torch ops before and after it (decode_inputs / decode_output, through torch.compile with
`compile`), all captured in the graphs; the full-attention layers use the Triton decode attention kernel.
Without Triton (the CPU) the same step runs in torch.
Not here: the math (models/), slots and scheduling (scheduler.py), the KV memory (kv_pool.py).

Legend: b decode rows, U distinct prompts, P longest prompt, C rows extended, M longest extension,
S slot_len, H hidden, Hq/Hkv heads, D head_dim, Hv/Dk/Dv DeltaNet heads and dims, K conv taps.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from phaserl.models.hybrid import gated_output, gated_pre_attention
from phaserl.models.layers import LayerWeights, embed, rms_norm
from phaserl.models.linear_attention import (
    continue_sequences,
    decode_inputs,
    decode_output,
    decode_step_,
    decode_weights,
    recurrent_step_,
)
from phaserl.models.lora import engine_weight
from phaserl.rollout import kernels
from phaserl.rollout.kv_pool import exchange_index, slot_index
from phaserl.rollout.layer_fns import compile_layer_fn
from phaserl.rollout.runner import ModelRunner, prefill_mask

Tensor = torch.Tensor
USE_DELTA_KERNEL = True  # False: the torch DeltaNet step on CUDA too (benchmarks compare the two)


@functools.cache
def compiled_decode_fns() -> tuple:
    """torch.compile'd decode_inputs / decode_output (dynamic shapes: one compile serves every bucket and layer)."""
    return tuple(compile_layer_fn(fn) for fn in (decode_inputs, decode_output))


class RecurrentState:
    """Per linear layer: conv [slots, C, K-1] in the model dtype and delta [slots, Hv, Dk, Dv] in float32."""

    def __init__(self, cfg, num_slots: int, dtype: torch.dtype, device: torch.device):
        self.num_slots = num_slots
        self.conv, self.delta = [], []  # a Qwen3.5 config whose layer_types are all full_attention has none
        if cfg.linear_attention is None:
            return
        conv, delta = self.slot_tensors(cfg, dtype)
        layers = sum(cfg.is_linear(i) for i in range(cfg.num_hidden_layers))
        self.conv = [torch.zeros(num_slots, *conv[0], dtype=conv[1], device=device) for _ in range(layers)]
        self.delta = [torch.zeros(num_slots, *delta[0], dtype=delta[1], device=device) for _ in range(layers)]

    @staticmethod
    def slot_tensors(cfg, dtype: torch.dtype) -> tuple[tuple[tuple, torch.dtype], tuple[tuple, torch.dtype]]:
        """(shape, dtype) of one slot's conv and DeltaNet state in each linear layer. The state stays float32 under
        bf16 weights: it accumulates over every token of the sequence."""
        s = cfg.linear_attention
        return ((s.conv_dim, s.conv_kernel - 1), dtype), ((s.num_value_heads, s.key_head_dim, s.value_head_dim),
                                                          torch.float32)

    @classmethod
    def bytes_per_slot(cls, cfg, dtype: torch.dtype) -> int:
        """What one slot holds over all linear layers, whatever its length (0 without linear layers)."""
        if cfg.linear_attention is None:
            return 0
        layers = sum(cfg.is_linear(i) for i in range(cfg.num_hidden_layers))
        return layers * sum(math.prod(shape) * torch.empty((), dtype=d).element_size()
                            for shape, d in cls.slot_tensors(cfg, dtype))

    def move(self, src: Tensor, dst: Tensor) -> None:
        for t in (*self.conv, *self.delta):
            t[dst] = t[src]


def hybrid_weights(layer, previous: Optional[LayerWeights] = None) -> LayerWeights:
    """The layer's tensors for the engine: o/out_proj, gate, up, down as the tensors the compiled post_attention
    multiplies (with LoRA adapters the merged engine copies, lora.engine_weight); q/k/v stay the modules (called
    eagerly: their LoRA wrappers act unmerged, their biases apply). No fused [q; k; v] copies yet."""
    m, p = layer.weights(), previous
    return m._replace(o=engine_weight(m.o, p and p.o), o_bias=m.o.bias, gate=engine_weight(m.gate, p and p.gate),
                      up=engine_weight(m.up, p and p.up), down=engine_weight(m.down, p and p.down))


class HybridRunner(ModelRunner):
    engine_weights = staticmethod(hybrid_weights)

    def __init__(self, model, pool, *, compile: bool, **kwargs):
        super().__init__(model, pool, compile=compile, **kwargs)
        layers = model.model.layers
        self.layer_modules = list(layers)
        kv, rec = iter(range(len(layers))), iter(range(len(layers)))
        # per layer: ("linear", index into RecurrentState) or ("attention", index into the KV pool's layers)
        self.slots_of = [("linear", next(rec)) if layer.linear else ("attention", next(kv)) for layer in layers]
        self.recurrent: Optional[RecurrentState] = None
        self.linear_weights: list = []  # per layer: linear_attention.DecodeWeights (None for attention layers)
        self.decode_fns = compiled_decode_fns() if compile else (decode_inputs, decode_output)
        self.delta_step = recurrent_step_  # the DeltaNet state update of a decode step; Triton where it runs
        if USE_DELTA_KERNEL and kernels.available(self.device):
            from phaserl.rollout.delta_kernel import delta_step_

            self.delta_step = delta_step_

    def release(self) -> None:
        super().release()
        self.recurrent, self.linear_weights = None, []

    def refresh_weights(self) -> None:
        """ModelRunner.refresh_weights, and the linear layers' decode tensors (merged LoRA copies refilled in place)
        and post_attention's view of the attention weights: what begin() refills, for an open session."""
        super().refresh_weights()
        if self.weights is None:
            return
        with torch.inference_mode():
            self.post_weights = [w._replace(q=None, k=None, v=None) for w in self.weights]
            self.linear_weights = [decode_weights(m.linear_attn, old) if m.linear else None
                                   for m, old in zip(self.layer_modules, self.linear_weights)]

    def begin(self, num_slots, slot_len, max_new, params, stop_ids) -> None:
        graphs, self.use_graphs = self.use_graphs, False  # capture only once the recurrent state exists
        try:
            super().begin(num_slots, slot_len, max_new, params, stop_ids)
        finally:
            self.use_graphs = graphs
        if self.recurrent is None or self.recurrent.num_slots != self.layout[0]:
            self.graphs = {}  # graphs point at the state they were captured with
            self.recurrent = RecurrentState(self.cfg, self.layout[0], self.model.output_weight.dtype, self.device)
        # What post_attention (compiled on CUDA) sees: tensors only, so one compiled graph serves every layer.
        self.post_weights = [w._replace(q=None, k=None, v=None) for w in self.weights]
        # A linear layer's decode tensors (with LoRA on its in_proj_*, merged copies refilled in place)
        previous = self.linear_weights or [None] * len(self.layer_modules)
        self.linear_weights = [decode_weights(m.linear_attn, old) if m.linear else None
                               for m, old in zip(self.layer_modules, previous)]
        capture_all = getattr(self, "_capture_all", None)  # a runner that captures lazily has none: decode() will
        if self.use_graphs and capture_all is not None:
            capture_all()

    def _layers(self):
        """(module, kind, its index in the KV pool or RecurrentState, weights, post weights, spec) per layer."""
        for module, (kind, j), w, post, spec in zip(self.layer_modules, self.slots_of, self.weights,
                                                     self.post_weights, self.specs):
            yield module, kind, j, w, post, spec

    # ----- prefill --------------------------------------------------------------------------------
    def _prefill_pass(self, groups) -> None:
        Hq, Hkv, D = self.heads
        U, P, lengths, group_of, slots, caps, rope, h, _ = self._prefill_inputs(groups)  # rope: [U * P, R] each
        R = self.recurrent
        for module, kind, j, w, post, spec in self._layers():
            if kind == "linear":
                x = rms_norm(h, w.attn_in, spec.eps, spec.norm_style).view(U, P, -1)
                conv0 = R.conv[j].new_zeros(U, *R.conv[j].shape[1:])
                out, conv, delta = continue_sequences(module.linear_attn, x, lengths, conv0, None)
                R.conv[j][slots], R.delta[j][slots] = conv[group_of], delta[group_of]  # a fresh state per sequence
                h = self.fns.post(h, out.view(U * P, -1), post, spec)
                continue
            q, k, v, gate = gated_pre_attention(h, w, spec, *rope[spec.local_rope])
            k, v = k.view(U, P, Hkv, D).transpose(1, 2), v.view(U, P, Hkv, D).transpose(1, 2)  # [U, Hkv, P, D]
            self.keys[j][slots, :, :P], self.values[j][slots, :, :P] = k[group_of], v[group_of]
            mask = prefill_mask(P, spec.window, self.device)
            attn = F.scaled_dot_product_attention(q.view(U, P, Hq, D).transpose(1, 2), k, v, attn_mask=mask,
                                                  is_causal=mask is None, scale=spec.scale, enable_gqa=True)
            h = gated_output(h, attn.transpose(1, 2).reshape(U * P, Hq * D), gate, post, spec)
        last = h.view(U, P, -1)[torch.arange(U, device=self.device), lengths - 1]  # [U, H]
        tokens, logprobs = self._sample(self.fns.norm(last, self.model.model.norm.weight, *self.final_norm)
                                        [group_of], slots, lengths[group_of] - 1)
        self.state.start(slots, tokens, logprobs, lengths[group_of], caps)

    # ----- extend (multi-turn) --------------------------------------------------------------------
    # ModelRunner._extend_pass (the eager pass: exact shapes) feeds this.
    def _extend_forward(self, ids: Tensor, starts: Tensor, lengths: Tensor, slots: Tensor, caps: Tensor,
                        context: int) -> None:
        """ModelRunner._extend_forward for the hybrid layers. A linear layer's slot state goes on from the row's
        last real token."""
        (C, M), S = ids.shape, self.layout[1]
        pos = (starts[:, None] + torch.arange(M, device=self.device)).clamp(max=S - 1)  # [C, M]
        masks: dict = {}  # ModelRunner._extend_attention's masks (the torch path only; Qwen3.5 has no window)
        flat = pos.view(-1)
        rope = [(cos[flat], sin[flat]) for cos, sin in self.rope]  # [C * M, R] each
        h = embed(ids.view(-1), self.model.model.embed_tokens.weight, self.cfg.embed_scale)  # [C * M, H]
        R = self.recurrent
        for module, kind, j, w, post, spec in self._layers():
            if kind == "linear":
                x = rms_norm(h, w.attn_in, spec.eps, spec.norm_style).view(C, M, -1)
                out, conv, delta = continue_sequences(module.linear_attn, x, lengths, R.conv[j][slots],
                                                      R.delta[j][slots])  # the slot's state goes on
                R.conv[j][slots], R.delta[j][slots] = conv, delta
                h = self.fns.post(h, out.view(C * M, -1), post, spec)
                continue
            q, k, v, gate = gated_pre_attention(h, w, spec, *rope[spec.local_rope])
            attn = self._extend_attention(q, k, v, self.keys[j], self.values[j], slots, pos, lengths, context,
                                          self.heads, spec.scale, spec.window, masks)  # [C * M, Hq * D]
            h = gated_output(h, attn, gate, post, spec)
        last = h.view(C, M, -1)[torch.arange(C, device=self.device), lengths - 1]
        ends = starts + lengths
        tokens, logprobs = self._sample(self.fns.norm(last, self.model.model.norm.weight, *self.final_norm), slots,
                                        ends - 1)
        self.state.start(slots, tokens, logprobs, ends, caps)

    # ----- decode ---------------------------------------------------------------------------------
    def _decode_step(self, b: int) -> None:
        st, R = self.state, self.recurrent
        tokens, pos = st.tokens[:b], st.pos[:b]
        running = ~st.finished[:b]  # [b] only these feed their token into the recurrent state
        rope = [(cos[pos], sin[pos]) for cos, sin in self.rope]  # [b, R] each
        h = embed(tokens, self.model.model.embed_tokens.weight, self.cfg.embed_scale)  # [b, H]
        for layer, (module, kind, j, w, post, spec) in enumerate(self._layers()):
            if kind == "linear":
                x = rms_norm(h, w.attn_in, spec.eps, spec.norm_style)
                out = decode_step_(module.linear_attn, x, R.conv[j][:b], R.delta[j][:b], running,
                                   self.delta_step, self.decode_fns, self.linear_weights[layer])  # states in place
                h = self.fns.post(h, out, post, spec)
                continue
            q, k, v, gate = gated_pre_attention(h, w, spec, *rope[spec.local_rope])
            attn = self.fns.attend(q, k, v, self.keys[j], self.values[j], pos, spec.scale, spec.window)
            h = gated_output(h, attn, gate, post, spec)
        st.record(b, *self._sample(self.fns.norm(h, self.model.model.norm.weight, *self.final_norm), None, pos))

    def move(self, moves: list[tuple[int, int]]) -> None:
        super().move(moves)
        src, dst = slot_index(self.device, moves).T
        self.recurrent.move(src, dst)

    def swap_slots(self, pairs: list[tuple[int, int]], chunk: int = 16) -> None:
        """ModelRunner.swap_slots, and the pairs' recurrent states exchanged with their KV (a parked sequence resumes
        from its own state in its new slot)."""
        super().swap_slots(pairs, chunk)
        self.recurrent.move(*exchange_index(pairs, chunk, self.device))  # the right side is gathered first: an exchange
