"""The memory budget of one RL step on one rank: model shapes turned into bytes, phase by phase.

Both the run's builder (trainer/speed.py, through memory/plan.py's plan) and the doctor (doctor/memory.py,
doctor/probes.py) count with these functions, so the plan a run chooses and the estimate the doctor prints are
the same numbers.

The estimates are deliberately rough (within ~2×): they decide "fits / does not fit / leaves the GPU
idle", not allocator details. Formulas, per rank (b = bytes per parameter element, T = tokens):
  resident state  actor: params + grads + AdamW (two moments in the param dtype) = 4 × b per param; float16
                  params step through float32 masters (master + two moments, 12 bytes: 2 + 2 + 12 = 16 per param;
                  adamw_state_bytes);
                  critic the same; reference and reward model: params only. FULL_SHARD divides all of
                  it by world_size, SHARD_GRAD_OP divides grads and AdamW only, cpu_offload keeps it off
                  the device.
  KV cache        per sequence, what the rollout engine allocates for one slot (rollout/slot_memory.py, from the
                  code that sizes the KV pool, the recurrent state and the route record): the attention layers'
                  K and V × T (each layer its own kv heads × head_dim: Gemma 4's global layers wider than its
                  sliding ones; sliding layers over the whole slot; no KV for Qwen3.5's linear-attention layers)
                  + each linear layer's fixed recurrent state + with actor.routing_replay the MoE layers' int16
                  expert ids × k × T. Models on the
                  transformers path (and shapes built by hand) use the dense rule 2 × layers × kv_heads × head_dim
                  × b × T, which phaserl's engine also gives for a dense decoder.
  rollout         per sequence: KV cache + prefill temporaries (2h + 2I) × b × prompt tokens
                  + two float32 rows of vocabulary logits
  scoring         transformers engine, per sequence: the RM's KV cache + (2h + 2I) × b × max_length;
                  phaserl engine, per token of a micro-batch: (2h + 2I) × b (no KV cache), padded
                  + max_length × (1 + b) for the [b, 1, T, T] boolean mask and SDPA's additive copy
                  (packed with the varlen kernel: no mask; the dense block-diagonal mask of packing
                  without it is not counted)
  update          per token and layer, saved activations: phaserl's dense layers eager in bytes, each tensor in
                  its dtype for the family's norms, qk/v-norms and per-layer widths (activations.py; the
                  transformers path 8h + 4I + 2 × kv_heads × head_dim values), torch.compile'd layers
                  (actor.compile) 6h + 3I + 2 × kv_heads × head_dim (see layer_bytes); a MoE layer's I is
                  top-k × moe_intermediate_size (+ its shared expert)
                  plus 3k × h of gathered inputs and expert outputs and the router's probabilities; × b;
                  Qwen3.5's Gated DeltaNet and gated attention layers in bytes, each tensor they save counted with
                  its own dtype (delta_layer_bytes, gated_attention_layer_bytes: the float32 chunked rule on the
                  CPU, flash-linear-attention's kernels on CUDA where they run), on the transformers path too
                  (activation checkpointing of the first k layers: those keep k × h × b, and the larger of the other
                  layers and one recomputed layer is held at a time; selective: k < layers; with their inputs offloaded
                  to host memory, actor.offload_activations, min(k, OFFLOAD_IN_FLIGHT) × h × b), plus float32
                  logits × 3 for the log-prob projection of up to 1024 tokens at a time.
  kept engine     rollout.engine_keep_awake: its KV pool (engine_max_slots slots of the longest sequence rounded
                  up to 64 tokens, at most engine_memory_fraction of the free memory), the recurrent state and
                  route record of the slots that pool holds (outside the pool's budget) + the weights once more
                  (fused copies, graph temporaries; less a MoE model's routed experts, read in place), through the
                  update; `config/auto.py` turns it on when the update's peak with it stays under 75% of the
                  device (the builder and the doctor both ask it).
Not here: choosing settings from the count (memory/plan.py, config/auto.py), the doctor's per-phase size
suggestions and report (doctor/memory.py, doctor/probes.py), reading the config or loading models.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import ConfigError
from ..models import linear_attention
from ..models.config import DecoderConfig
from ..models.families import config_from_hf
from ..rollout.slot_memory import SlotMemory, slot_memory
from .activations import dense_layer_bytes, dense_layouts, norm_bytes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
HEADROOM = 0.85          # use at most this fraction of the free memory (allocator slack, CUDA context)
LOGPROB_CHUNK = 1024     # tokens per vocabulary-projection chunk (roles/forward.py)
GB = 2**30
OFFLOAD_IN_FLIGHT = 2    # checkpointed layers' inputs on the device at once under actor.offload_activations
                         # (roles/activation_offload.py: copies outstanding each way; the builder passes it there)


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know about a decoder."""

    num_params: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    param_bytes: int  # bytes per parameter element (2 for bf16/fp16, 4 for fp32)
    slot: Optional[SlotMemory] = None  # phaserl's decoder: what one engine slot holds; None: the dense KV rule
    moe: Optional["ExpertShape"] = None  # a mixture-of-experts decoder's routed MLPs (for the update's activations)
    hybrid: Optional["HybridShape"] = None  # Qwen3.5's layers (models/hybrid.py): never compiled, counted per kind
    dense: Optional[tuple] = None  # phaserl's dense layers: activations.dense_layouts (None: the rough dense rule)

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelShape":
        """Read the shape of a loaded model (ours, any transformers causal LM, or a wrapper with `.config`).

        Parameters are counted from the model; the rest comes from whichever config spelling exists
        (Llama's `intermediate_size`, GPT-2's `n_layer`/`n_embd`/`n_inner`, T5-style `d_model`/`d_ff`, a
        multimodal model's text config). A gated-MLP width that no field gives is taken as 4 × hidden (GPT-2's
        rule). Raises UnknownShape, naming the missing field, when the estimate cannot be made."""
        c = model.config
        c = c.get_text_config() if hasattr(c, "get_text_config") else c
        first = next(model.parameters(), None)
        if first is None:
            raise UnknownShape("the model has no parameters")
        hidden = _field(c, "hidden_size", "n_embd", "d_model")
        heads = _field(c, "num_attention_heads", "n_head", "num_heads")
        head_dim = _read(c, "head_dim") or hidden // heads
        output = model.output_weight if hasattr(model, "output_weight") else None
        vocab = getattr(c, "vocab_size", None) or (output.shape[0] if output is not None else None)
        if vocab is None:
            raise UnknownShape(f"{type(c).__name__} has no vocab_size")
        intermediate = _optional_field(c, "intermediate_size", "n_inner", "ffn_dim", "d_ff") or 4 * hidden
        native = isinstance(c, DecoderConfig)  # phaserl's decoder: the engine's own layout, per layer
        hybrid = c if native else _hybrid_twin(c)
        return cls(num_params=sum(p.numel() for p in model.parameters()),
                   num_layers=_field(c, "num_hidden_layers", "n_layer", "num_layers"), hidden_size=hidden,
                   intermediate_size=intermediate,
                   num_kv_heads=_optional_field(c, "num_key_value_heads", "n_kv_heads", "num_kv_heads") or heads,
                   head_dim=head_dim, vocab_size=vocab, param_bytes=first.element_size(),
                   slot=slot_memory(c, first.dtype) if native else None,
                   moe=ExpertShape.of(c, hidden) if native and c.num_experts else None,
                   hybrid=HybridShape.of(hybrid, first.device) if hybrid is not None and hybrid.hybrid else None,
                   dense=dense_layouts(c) if native and not c.hybrid else None)


def _hybrid_twin(config) -> Optional[DecoderConfig]:
    """A transformers-path model with linear-attention layers (Qwen3.5 under model.implementation=transformers): the
    native config of the same shape, so that its Gated DeltaNet and gated attention layers are counted as what they
    save. transformers' torch fallback saves about what phaserl's torch rule does (a 0.8B-like layer, bf16 on the CPU,
    2026-12-04: 238 kB a token against the 269 counted; gated attention 92.5 against 88.1), where the dense rule
    counted ~47 kB: at 64 × 384 tokens the transformers path ran out of an H200's memory at an auto micro-batch the
    dense rule said would fit. None for any other model."""
    if "linear_attention" not in (getattr(config, "layer_types", None) or ()):
        return None
    try:
        twin = config_from_hf(config.to_dict())
    except (ConfigError, KeyError, TypeError, ValueError):  # a model type phaserl does not build: the dense rule
        return None
    return twin if twin.hybrid else None


@dataclass(frozen=True)
class ExpertShape:
    """A MoE decoder's routed MLPs, as the update's activations see them (models/moe.py)."""

    layers: int        # MoE layers (the others are dense gated MLPs)
    top_k: int         # experts per token
    width: int         # moe_intermediate_size, each expert's SwiGLU width
    experts: int       # E, the router's outputs
    shared_width: int  # Qwen2-MoE's shared expert (0: none)
    hidden: int = 0    # h, for the experts' parameter count

    @classmethod
    def of(cls, c: DecoderConfig, hidden: int) -> "ExpertShape":
        return cls(len(c.moe_layers), c.num_experts_per_tok, c.moe_intermediate_size, c.num_experts,
                   c.shared_expert_intermediate_size, hidden)

    @property
    def routed_params(self) -> int:
        """Parameters of the routed experts (gate, up and down of each): the engine reads them in place."""
        return self.layers * self.experts * 3 * self.hidden * self.width


@dataclass(frozen=True)
class HybridShape:
    """Qwen3.5's layers (models/hybrid.py, models/linear_attention.py), as the update's activations see them."""

    linear_layers: int    # Gated DeltaNet layers; the others are gated full attention
    attention_heads: int  # Hq of the gated attention layers (q_proj yields q and a gate of Hq × head_dim each)
    key_heads: int        # Hk  (the linear fields are 0 where there are no linear layers)
    value_heads: int      # Hv
    key_dim: int          # Dk
    value_dim: int        # Dv
    conv_kernel: int      # K, taps of the short convolution
    chunk: int            # c, tokens per chunk of the delta rule (linear_attention.CHUNK; fla's default too)
    delta_rule: str       # "torch" (the chunked rule in plain torch) or "fla" (flash-linear-attention's kernels)

    @classmethod
    def of(cls, c: DecoderConfig, device: torch.device) -> "HybridShape":
        """The rule is the one training will run where the model sits: fla where linear_attention's own test
        says so (CUDA, fla imports, its probe agrees with our rule), else the torch rule."""
        s = c.linear_attention
        linear = sum(c.is_linear(i) for i in range(c.num_hidden_layers))
        if s is None:
            return cls(0, c.num_attention_heads, 0, 0, 0, 0, 1, linear_attention.CHUNK, "torch")
        fla = linear and linear_attention._fla_usable(device)  # the layer's own test, as its forward asks it
        return cls(linear, c.num_attention_heads, s.num_key_heads, s.num_value_heads, s.key_head_dim,
                   s.value_head_dim, s.conv_kernel, linear_attention.CHUNK, "fla" if fla else "torch")


class UnknownShape(ValueError):
    """The model's config lacks a field the memory estimate needs (the message names it)."""


def _optional_field(config, *names: str):
    return next((v for v in (_read(config, n) for n in names) if isinstance(v, int)), None)


def _read(config, name: str):
    """config.<name>, or None. Where transformers keeps it per layer (`per_layer_attributes`: Gemma 4's head_dim
    and num_key_value_heads; reading it from the config raises), the value of the layer whose KV row is the
    widest (kv heads x head_dim), so that the dense estimate errs on the safe side."""
    if name not in (getattr(config, "per_layer_attributes", None) or ()):
        return getattr(config, name, None)
    widest = max(config.per_layer_config, key=lambda layer: (getattr(layer, "num_key_value_heads", None) or 1)
                 * (getattr(layer, "head_dim", None) or 1))
    return getattr(widest, name, None)


def _field(config, *names: str) -> int:
    found = _optional_field(config, *names)
    if found is None:
        raise UnknownShape(f"{type(config).__name__} has none of {', '.join(names)}")
    return found


@dataclass(frozen=True)
class RoleMemory:
    """Bytes one rank holds for one role between phases."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def adamw_state_bytes(weight_bytes: int, dtype=None) -> int:
    """AdamW's state for `weight_bytes` of trained weights of `dtype` (a torch.dtype or its name): two moments in
    the weights' own dtype, 2 x weight_bytes; float16 weights step through float32 masters (roles/loss_scale.py),
    a master and two moments of 4 bytes for each 2-byte weight, 6 x weight_bytes. The run's count
    (trainer/speed.py) and the doctor's (role_memory) both come here."""
    return (6 if str(dtype).removeprefix("torch.") == "float16" else 2) * weight_bytes


def role_memory(num_params: int, param_bytes: int, *, trainable: bool, strategy: str, world_size: int,
                cpu_offload: bool, dtype=None) -> RoleMemory:
    """Device bytes per rank for one role's parameters, gradients and AdamW state (`dtype`: the trained
    weights', for adamw_state_bytes)."""
    if cpu_offload:
        return RoleMemory(0, 0, 0)
    params = num_params * param_bytes
    grads, optimizer = (params, adamw_state_bytes(params, dtype)) if trainable else (0, 0)
    if strategy == "FULL_SHARD":
        return RoleMemory(params // world_size, grads // world_size, optimizer // world_size)
    if strategy == "SHARD_GRAD_OP":
        return RoleMemory(params, grads // world_size, optimizer // world_size)
    return RoleMemory(params, grads, optimizer)


def kv_cache_bytes_per_sequence(shape: ModelShape, tokens: int, *, routes: bool = False) -> int:
    """What one sequence of `tokens` holds in the rollout engine: phaserl's decoder, one engine slot
    (SlotMemory: KV of the attention layers, the linear layers' recurrent state, with `routes` the routing-replay
    record); otherwise the dense rule 2 (K and V) × layers × kv_heads × head_dim × bytes × tokens."""
    if shape.slot is not None:
        return shape.slot.slot_bytes(tokens, routes=routes)
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * shape.param_bytes * tokens


def rollout_bytes_per_sequence(shape: ModelShape, *, prompt_tokens: int, sequence_tokens: int,
                               routes: bool = False) -> int:
    """One sequence in the rollout phase: its KV cache, the prefill's temporaries and two float32 logit rows."""
    prefill = (2 * shape.hidden_size + 2 * shape.intermediate_size) * shape.param_bytes * prompt_tokens
    return kv_cache_bytes_per_sequence(shape, sequence_tokens, routes=routes) + prefill + 2 * shape.vocab_size * 4


def scoring_bytes_per_sequence(rm: ModelShape, max_length: int) -> int:
    """Transformers engine: one padded row's KV cache and forward temporaries."""
    forward = (2 * rm.hidden_size + 2 * rm.intermediate_size) * rm.param_bytes * max_length
    return kv_cache_bytes_per_sequence(rm, max_length) + forward


def scoring_bytes_per_token(rm: ModelShape, max_length: int, packed: bool) -> int:
    """Phaserl engine: forward temporaries per token of a micro-batch (no KV cache); padded rows add
    their attention mask, max_length booleans and as many additive values per token."""
    forward = (2 * rm.hidden_size + 2 * rm.intermediate_size) * rm.param_bytes
    return forward if packed else forward + max_length * (1 + rm.param_bytes)


def train_bytes_per_token(shape: ModelShape, gradient_checkpointing: bool, compiled: bool = False,
                          sequence_tokens: Optional[int] = None, *, checkpoint_layers: Optional[int] = None,
                          offload_activations: bool = False) -> int:
    """Activations saved for backward, per token of a micro-batch (of whole sequences of `sequence_tokens`; None:
    long ones, see delta_layer_bytes): the sum over layer_bytes' kinds; a layer recomputed in backward (activation
    checkpointing) keeps only its input (h × b). `checkpoint_layers`: how many layers are recomputed (selective
    checkpointing; None: all of them with gradient_checkpointing, none without). The decoder recomputes its first k
    layers, which the backward reaches last: by then the other layers' activations are freed, so the peak is the k
    inputs plus the larger of the L - k kept layers and one recomputed layer (the largest). Where layers differ,
    the kept ones are counted as the largest (the count errs on the safe side). `offload_activations`: the k inputs
    live in host memory, at most OFFLOAD_IN_FLIGHT of them on the device at once. Qwen3.5's linear layers also keep,
    once per forward, where each sequence's tokens sit (linear_attention.Segments: an int64 index and a bool
    mask)."""
    kinds = layer_bytes(shape, compiled, sequence_tokens)
    shared = SEGMENTS_BYTES if shape.hybrid and shape.hybrid.linear_layers else 0
    L = shape.num_layers
    k = checkpointed_layers(L, gradient_checkpointing, checkpoint_layers)
    if k == 0:
        return math.ceil(sum(count * each for count, each in kinds.values()) + shared)
    per_layer = sorted((each for count, each in kinds.values() for _ in range(count)), reverse=True)  # [L]
    kept = sum(per_layer[:L - k])
    inputs = min(k, OFFLOAD_IN_FLIGHT) if offload_activations else k
    return math.ceil(inputs * shape.hidden_size * shape.param_bytes + max(kept, per_layer[0]) + shared)


def checkpointed_layers(num_layers: int, gradient_checkpointing: bool, checkpoint_layers: Optional[int]) -> int:
    """Layers recomputed in backward: `checkpoint_layers` (capped at the model's), else all or none."""
    if checkpoint_layers is not None:
        return max(0, min(checkpoint_layers, num_layers))
    return num_layers if gradient_checkpointing else 0


SEGMENTS_BYTES = 8 + 1  # per token: Segments.index (int64) and .real (bool), shared by every linear layer


def layer_bytes(shape: ModelShape, compiled: bool = False,
                sequence_tokens: Optional[int] = None) -> dict[str, tuple[int, float]]:
    """Each kind of layer the model has -> (how many, bytes each saves for backward per token).

    Kinds: "dense" (attention + gated MLP, DecoderLayer; "dense sliding_attention" and "dense full_attention" where
    those layers differ, as Gemma 4's do), "moe", "linear_attention" (Qwen3.5's Gated DeltaNet) and
    "gated_attention" (Qwen3.5's full attention).
    Dense, eager, phaserl's decoder: activations.dense_layer_bytes, each tensor in its own dtype for the family's
    norms, qk/v-norms and widths (measured per family, float32 and bf16). Models on the transformers path (and
    shapes built by hand; not Qwen3.5's layer kinds, see _hybrid_twin): the rough dense rule 8h + 4I + 2 ×
    kv_heads × head_dim values × b (what our Llama layer saves in float32 with Hq × D = h, less its two norm
    statistics; bf16 norms keep float32 copies beyond it).
    Compiled (actor.compile), every family: torch.compile's partitioner recomputes the norms' float32 copies and
    silu(gate) in backward, so a layer keeps 6h + 3I + 2 × kv_heads × head_dim values × b (its input and normed
    input, q, the attention output, the residual after attention and its normed copy; gate, up and their product;
    k and v: benchmarks/saved_activations.py counts them at a Qwen2 shape; not re-derived for the Gemma, OLMo 2 or
    qk-norm layouts, which compile may save differently). The eager count for compiled layers was 1.33× too much
    at the 0.5B shape and made `rollout.engine_keep_awake=auto` see 24.3 GiB where the H200 measured a 20.86 GiB
    peak (BENCHMARKS.md, "Fast by default"); the compiled count gives 20.6 GiB there.
    MoE layers (Qwen3-MoE) run eager in training whenever routing is recorded (aux loss, replay): the rough dense
    rule with I = top-k × moe_intermediate_size (+ a shared expert's width), plus per token its k gathered inputs,
    the k expert outputs and their unsorted copy (3k × h), the router's float32 probabilities (2E values of b = 2
    bytes) and its int64 expert ids (4k): what models/moe.py's grouped and loop mixtures both save (counted on the
    CPU). Both Qwen3.5 kinds are in bytes (delta_layer_bytes, gated_attention_layer_bytes); enable_compile compiles
    DecoderLayer only, never hybrid.py's layers, so `compiled` changes nothing there."""
    b, h, kv = shape.param_bytes, shape.hidden_size, 2 * shape.num_kv_heads * shape.head_dim
    if shape.hybrid:
        linear = shape.hybrid.linear_layers
        kinds = {"linear_attention": (linear, delta_layer_bytes(shape, sequence_tokens)),
                 "gated_attention": (shape.num_layers - linear, float(gated_attention_layer_bytes(shape)))}
        return {kind: v for kind, v in kinds.items() if v[0]}
    moe_layers = shape.moe.layers if shape.moe else 0
    if shape.dense is not None and not compiled:
        kinds = {kind: (n, float(dense_layer_bytes(layout, b))) for kind, layout, n in shape.dense}
    else:
        dense = (6 * h + 3 * shape.intermediate_size if compiled else 8 * h + 4 * shape.intermediate_size) + kv
        kinds = {"dense": (shape.num_layers - moe_layers, float(dense * b))}
    if shape.moe:
        m = shape.moe
        experts = 4 * (m.top_k * m.width + m.shared_width) + 3 * m.top_k * h + 2 * m.experts + 4 * m.top_k
        kinds["moe"] = (m.layers, float((8 * h + experts + kv) * b))
    return {kind: v for kind, v in kinds.items() if v[0]}


def _around_mixer(shape: ModelShape) -> int:
    """What a Qwen3.5 layer saves around its token mixer, per token: two (1 + w) norms read by projections
    (activations.norm_bytes: each its float32 input copy, its float32 normed copy (4h each), its statistic (4) and
    its output in b), and the MLP's gate, up, silu(gate) and their product (4I × b). The output projection's input
    is the mixer's."""
    b, h = shape.param_bytes, shape.hidden_size
    return 2 * norm_bytes(h, 1, "gemma", b, read=True) + 4 * b * shape.intermediate_size


def delta_layer_bytes(shape: ModelShape, sequence_tokens: Optional[int] = None) -> float:
    """Bytes a Gated DeltaNet layer (models/linear_attention.py) saves for backward per token, b the param dtype's,
    every float32 tensor 4 (C = 2 Hk Dk + Hv Dv conv channels, K taps, c chunk, S sequence_tokens):
      around        norms and MLP as _around_mixer
      conv          its input and its silu's input, C × b each; the conv output is K - 1 longer per sequence
      rule inputs   q and k l2-normed in float32 (the copy and its statistic: 4 Hk (Dk + 1) each), sigmoid(beta)
                    in b and softplus's float32 input and output (b Hv + 8 Hv)
      output        the index of the real tokens (int64: 8); the gated norm's float32 copies of o, its normed
                    value, silu(z) and z (12 Hv Dv), its statistic (4 Hv), o rounded to b and weighted (2 b Hv Dv);
                    out_proj's input (b Hv Dv)
      torch rule    chunk_gated_delta_rule, all float32, per token of the chunk-padded sequence (S rounded up to c):
                    five c × c matrices (decay, k kᵀ, the triangular system, q kᵀ, the scores: 5 Hv c), eight Dk-wide
                    tensors (k, q, k beta, the solved w, and the copies matmul makes of k beta, q and twice kᵀ:
                    8 Hv Dk), three Dv-wide (v, the solved u, the corrected u of each chunk: 3 Hv Dv) and four
                    gates (beta, twice e^cum, e^(cum_c - cum): 4 Hv): 4 Hv (5c + 8 Dk + 3 Dv + 4); per chunk the
                    state entering it, 4 Hv Dk Dv (at Qwen3.5-0.8B's shape, Hv 16 and Dk = Dv = 128, 16 KB per
                    token); and per chunk but one the chunk's copies of q e^cum and of k e^(cum_c - cum) that matmul
                    reads the state with and writes it with (8 Hv Dk × c: the first chunk's state is zero, so its q
                    is not kept, and the last chunk's write makes only the final state, which nothing reads).
      fla rule      flash-linear-attention's chunk_gated_delta_rule (fla-core 0.6.0, its Triton kernels: read from
                    ChunkGatedDeltaRuleFunction's save_for_backward, not measured: no GPU here), over the real
                    tokens (varlen, no padding): q, k, v and beta as _fla_chunk passes them (bf16), g's chunk-local
                    cumsum (float32) and the solved (I + A)^-1 blocks A [c] (bf16): Hv (4 Dk + 2 Dv + 6 + 2c). It
                    saves no per-chunk state (backward recomputes them, a transient of one layer) and none of the
                    c × c matrices. fla's FlashQLA backend (the separate flash-qla package, Hopper, Dk = Dv = 128)
                    saves other things: not counted.
    Measured on the CPU (tests/test_doctor_hybrid_memory.py: the tensors saved_tensors_hooks sees that are still
    held when the forward returns), packed micro-batches of several sequences, within 0.5% at tiny shapes and at
    the 0.8B shape. Left out: what is per layer rather than per token (the c × c causal mask, the norms' (1 + w),
    exp(A_log)), each chunk's decay of the state (4 Hv) and, with fla, its cu_seqlens and chunk indices (bytes per
    chunk). A micro-batch of one sequence keeps the first and last chunks' copies too (matmul reads them as views
    of the whole tensor): 8 Hv Dk × c more per sequence, 1% at the 0.8B shape. S None: long sequences of whole
    chunks. Micro-batches of unequal sequences gather every sequence into a row as long as the longest (Segments):
    those rows are what these tensors hold, more than the real tokens."""
    hy, b = shape.hybrid, shape.param_bytes
    Hk, Hv, Dk, Dv, K, c = hy.key_heads, hy.value_heads, hy.key_dim, hy.value_dim, hy.conv_kernel, hy.chunk
    C = 2 * Hk * Dk + Hv * Dv
    S = sequence_tokens
    m = 0 if S is None else math.ceil(S / c)  # chunks per sequence
    per_sequence = 0.0 if S is None else 1 / S  # a per-sequence term's share of each token
    chunks = 1 / c if S is None else m / S  # chunks per token
    padded = 1.0 if S is None else m * c / S  # chunk-padded tokens per token
    kept_copies = 1.0 if S is None else (m - 1) * c / S  # tokens of the chunks but one, per token
    conv = 2 * b * C + b * C * (K - 1) * per_sequence
    rule_inputs = 8 * Hk * (Dk + 1) + b * Hv + 8 * Hv
    output = 8 + 12 * Hv * Dv + 4 * Hv + 2 * b * Hv * Dv + b * Hv * Dv
    if hy.delta_rule == "fla":
        rule = Hv * (4 * Dk + 2 * Dv + 6 + 2 * c)
    else:
        rule = (padded * 4 * Hv * (5 * c + 8 * Dk + 3 * Dv + 4) + chunks * 4 * Hv * Dk * Dv
                + kept_copies * 8 * Hv * Dk)
    return _around_mixer(shape) + conv + rule_inputs + rule + output


def gated_attention_layer_bytes(shape: ModelShape) -> int:
    """Bytes a Qwen3.5 gated attention layer (models/hybrid.py) saves for backward per token (Hq, Hkv heads of D):
    norms and MLP as _around_mixer; the per-head q and k norms, each a float32 copy, a float32 normed copy and
    the statistic: 4 (2 Hq D + Hq) + 4 (2 Hkv D + Hkv); what the packed flash kernel keeps, q after RoPE, k, v
    and the output (b (2 Hq D + 2 Hkv D); its float32 log-sum-exp, 4 Hq, left out as for dense layers); sigmoid(gate)
    and the gated output, o_proj's input (2 b Hq D). In float32 the norm's copy of q is the q_proj output itself,
    gate rows included: 4 Hq D more. Measured on the CPU with a stand-in saving what the flash kernel saves
    (tests/test_doctor_hybrid_memory.py). Not counted: on the CPU, SDPA with the padded batch's mask also keeps k and v
    repeated to Hq heads, its log-sum-exp and a float32 copy of the [T, T] mask (4T bytes per token); on CUDA, a
    varlen kernel without native GQA (attention._varlen_takes_gqa) keeps k and v repeated."""
    b, D = shape.param_bytes, shape.head_dim
    Hq, Hkv = shape.hybrid.attention_heads, shape.num_kv_heads
    norms = 4 * (2 * Hq * D + Hq) + 4 * (2 * Hkv * D + Hkv) + (4 * Hq * D if b >= 4 else 0)
    return _around_mixer(shape) + norms + b * (2 * Hq * D + 2 * Hkv * D) + 2 * b * Hq * D


def kept_engine_bytes(shape: ModelShape, slots: int, slot_tokens: int, *, kv_limit: Optional[int] = None,
                      routes: bool = False) -> int:
    """What a kept rollout engine (rollout.engine_keep_awake) holds through the update: its KV pool, `slots`
    slots of `slot_tokens` (rollout.engine_max_slots of the rounded-up longest sequence: what the pool
    allocates) but at most `kv_limit` bytes (rollout.engine_memory_fraction of the free memory); the recurrent
    state and (`routes`: routing replay) the route record of the slots that pool holds, allocated beside it; plus
    its fused weight copies and graph temporaries, counted as the weights once more (the copies alone are about
    half of a 0.5B model's weights; the rest covers the graphs) less a MoE model's routed experts, which the engine
    reads in place (runner.fused_weights copies none of them: most of a MoE model's weights)."""
    slot = shape.slot or SlotMemory(kv_cache_bytes_per_sequence(shape, 1), 0, 0)
    kv_slot = slot.kv_per_token * slot_tokens
    pool = slots * kv_slot if kv_limit is None else min(slots * kv_slot, kv_limit)
    held = slots if kv_slot == 0 else min(slots, pool // kv_slot)  # the pool caps the slots of a layout
    beside = held * (slot.slot_bytes(slot_tokens, routes=routes) - kv_slot)
    copied = shape.num_params - (shape.moe.routed_params if shape.moe else 0)
    return pool + beside + copied * shape.param_bytes


def update_peak_bytes(shape: ModelShape, *, resident: int, grads: int, micro_batch_tokens: int,
                      gradient_checkpointing: bool, compiled: bool = False, sequence_tokens: Optional[int] = None,
                      checkpoint_layers: Optional[int] = None, offload_activations: bool = False) -> int:
    """The update's peak on one rank: the resident roles, the actor's gradients, one micro-batch's saved
    activations (whole sequences of `sequence_tokens`, see train_bytes_per_token) and its log-prob chunk."""
    tokens = micro_batch_tokens
    per_token = train_bytes_per_token(shape, gradient_checkpointing, compiled, sequence_tokens,
                                      checkpoint_layers=checkpoint_layers, offload_activations=offload_activations)
    return resident + grads + tokens * per_token + logprob_chunk_bytes(shape, tokens)


def logprob_chunk_bytes(shape: ModelShape, tokens: int) -> int:
    """The chunked vocabulary projection: logits, log-softmax and their gradient in float32."""
    return 3 * min(tokens, LOGPROB_CHUNK) * shape.vocab_size * 4


def kept_logits_bytes(shape: ModelShape, response_tokens: int) -> int:
    """ppo.keep_head_logits: a micro-batch's response-token logits kept from forward to backward, in the head's
    dtype (roles/forward.py, algo.token_logprobs_from_hidden's save_logits)."""
    return response_tokens * shape.vocab_size * shape.param_bytes


def response_tokens_of(micro_batch_tokens: int, sequence_tokens: int, prompt_tokens: int) -> int:
    """The response tokens (the ones the head projects) of a micro-batch of whole sequences: all but the prompt."""
    return micro_batch_tokens * max(0, sequence_tokens - prompt_tokens) // max(1, sequence_tokens)


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of the device: CUDA free memory, or the RAM the OS says is available."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", GB), ("MB", 2**20), ("KB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{int(n)} B"
