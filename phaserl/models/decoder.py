"""The native decoder (Llama, Qwen2/3, Mistral, Gemma 3/4, OLMo 2, Phi-3): one readable implementation for training.

`CausalLM(cfg)(input_ids, ...)` returns the final-normed hidden states, not logits: callers project to
the vocabulary in chunks (`model.output_weight`) so that a [B, T, V] tensor never has to exist.
Parameter names equal transformers' (`model.layers.0.self_attn.q_proj.weight`, and each family's norm
names), so safetensors files load by name. The modules here only hold parameters and pick the pieces:
each layer runs `layers.pre_attention` -> an attention core (attention.py: SDPA with an explicit boolean
mask, or the varlen kernel for packed rows) -> `layers.post_attention`, the same functions the rollout
engine runs, so training and rollout compute one thing. Sliding layers get their window in the mask or
the kernel; Gemma 3/4's sliding layers get their own RoPE table (Gemma 4's global layers their own head_dim).
Soft-capped logits (Gemma 4's final_logit_softcapping) make `plain_head` False: `logits()` applies the cap
and the roles score tokens through `token_logprobs` (heads.py), never the plain projection.
Gemma 4 E2B/E4B: the per-layer inputs are computed once per forward from the ids and embeddings
(layers.per_layer_inputs), each layer reading its own; a KV-sharing layer takes its source layer's (k, v) as an
input, which the source returned beside its hidden states (explicit, so that module hooks never lose it).
`enable_compile(model)` runs each decoder layer through `torch.compile` (attention stays eager).
Not here: loading weights (hf_io.py), sampling (phaserl/rollout), paged caches.

Legend: B batch, T new tokens, S key slots (cache prefix + T), H hidden, D head_dim,
Hq query heads, Hkv key/value heads, V vocab.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from phaserl.models import hybrid, invariant
from phaserl.models.attention import (  # noqa: F401
    PackedSeqs,
    attend,
    block_diagonal,
    build_attention_mask,
    packed_boundaries,
    use_varlen,
    varlen_takes_windows,
)
from phaserl.models.config import DecoderConfig
from phaserl.models.heads import chunked_token_logprobs, softcap
from phaserl.models.hybrid import HybridLayer
from phaserl.models.layers import (
    LayerWeights,
    embed,
    layer_spec,
    per_layer_inputs,
    post_attention,
    pre_attention,
    rope_tables,
)
from phaserl.models.modules import MLP, RMSNorm  # noqa: F401  (their home; imported from here too)
from phaserl.models.moe import MoEWeights, Route, Routing, SharedExpert, prepare_device
from phaserl.models.mrope import MRotaryEmbedding
from phaserl.models.rope import RotaryEmbedding


@dataclass
class KVCache:
    """Preallocated keys/values for every layer, filled left to right.

    All rows share one write offset (`length`); a row whose prompt was left-padded simply has invalid
    slots at the front, recorded in `key_valid` and excluded by the attention mask.
    """
    keys: list[torch.Tensor]      # per layer [B, Hkv, max_len, D]
    values: list[torch.Tensor]    # per layer [B, Hkv, max_len, D]
    key_valid: torch.Tensor       # [B, max_len] bool: the slot holds a real (non-padding) token
    length: int = 0               # slots [0, length) are filled

    @classmethod
    def allocate(cls, cfg: DecoderConfig, batch_size: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str) -> "KVCache":
        keys, values = [], []
        for i in range(cfg.num_hidden_layers):  # a KV-sharing layer (Gemma 4) holds its source's tensors, unwritten
            shape = (batch_size, cfg.heads(i)[1], max_len, cfg.heads(i)[2])
            own = cfg.kv_source(i) == i
            keys.append(torch.zeros(shape, dtype=dtype, device=device) if own else keys[cfg.kv_source(i)])
            values.append(torch.zeros(shape, dtype=dtype, device=device) if own else values[cfg.kv_source(i)])
        return cls(keys=keys, values=values,
                   key_valid=torch.zeros(batch_size, max_len, dtype=torch.bool, device=device))

    @property
    def max_len(self) -> int:
        return self.key_valid.shape[1]

    def record_tokens(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """Mark the validity of the T tokens about to be written; returns key_valid [B, S] for them."""
        end = self.length + attention_mask.shape[1]
        if end > self.max_len:
            raise ValueError(f"KVCache overflow: {end} slots needed, {self.max_len} allocated")
        self.key_valid[:, self.length:end] = attention_mask.bool()
        return self.key_valid[:, :end]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, Hkv, T, D] at the current offset; return all keys/values so far [B, Hkv, S, D]."""
        end = self.length + k.shape[2]
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens


_attend = attend  # what layers call; enable_compile swaps in a compile-disabled wrapper (graph break)


class Attention(nn.Module):
    """The attention's parameters (q/k/v/o projections, optional qk-norms); the math is layers.py's."""

    def __init__(self, cfg: DecoderConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        (Hq, Hkv, D), H = cfg.heads(layer_idx), cfg.hidden_size
        own_kv = cfg.kv_source(layer_idx) == layer_idx  # Gemma 4's KV-sharing layers have no key/value weights
        self.q_proj = nn.Linear(H, Hq * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(H, Hkv * D, bias=cfg.attention_bias) if own_kv else None
        # Gemma 4's attention_k_eq_v layers have no v_proj: their values are the keys' projection.
        own_v = own_kv and not cfg.v_from_k(layer_idx)
        self.v_proj = nn.Linear(H, Hkv * D, bias=cfg.attention_bias) if own_v else None
        self.o_proj = nn.Linear(Hq * D, H, bias=cfg.o_proj_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2)
            per_head = cfg.qk_norm_scope == "head"
            self.q_norm = RMSNorm(D if per_head else Hq * D, cfg.rms_norm_eps, cfg.norm_style)
            self.k_norm = RMSNorm(D if per_head else Hkv * D, cfg.rms_norm_eps, cfg.norm_style) if own_kv else None


class Experts(nn.Module):
    """A MoE layer's experts as stacked weights (transformers 5's names and layout; moe.py has the math)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        E, H, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inter, H))  # [gate; up] of each expert
        self.down_proj = nn.Parameter(torch.empty(E, H, inter))


class SparseMoE(nn.Module):
    """A MoE layer's parameters: the router `gate` [E, H], the stacked `experts`, and Qwen2-MoE's shared expert
    with its sigmoid gate."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def weights(self) -> MoEWeights:
        s = getattr(self, "shared_expert", None)
        shared = (None if s is None
                  else SharedExpert(s.gate_proj, s.up_proj, s.down_proj, self.shared_expert_gate.weight))
        return MoEWeights(self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj, shared)


# Which transformers norm name plays which role (LayerWeights field), per config.LAYER_NORMS.
NORM_NAMES = {
    "pre": {"attn_in": "input_layernorm", "mlp_in": "post_attention_layernorm"},
    "sandwich": {"attn_in": "input_layernorm", "attn_out": "post_attention_layernorm",
                 "mlp_in": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm"},
    "post": {"attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"},
}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int):
        super().__init__()
        self.spec = layer_spec(cfg, layer_idx)
        self.norm_roles = NORM_NAMES[cfg.layer_norms]
        for name in self.norm_roles.values():
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_style))
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = SparseMoE(cfg) if self.spec.moe is not None else MLP(cfg, cfg.mlp_width(layer_idx))
        if cfg.layer_scalar:  # Gemma 4: a checkpoint buffer (not trained) that scales the layer's output
            self.register_buffer("layer_scalar", torch.ones(1))
        # Gemma 4 E2B/E4B: the layer reads keys/values of kv_source (itself unless shared); kv_store: a later layer
        # reads this one's; and the per-layer input's gate [P, H], projection [H, P] and norm.
        self.kv_source = cfg.kv_source(layer_idx)
        self.kv_store = any(cfg.kv_source(j) == layer_idx != j for j in range(cfg.num_hidden_layers))
        if cfg.per_layer_input_size:
            H, P = cfg.hidden_size, cfg.per_layer_input_size
            self.per_layer_input_gate = nn.Linear(H, P, bias=False)
            self.per_layer_projection = nn.Linear(P, H, bias=False)
            self.post_per_layer_input_norm = RMSNorm(H, cfg.rms_norm_eps, cfg.norm_style)
        self.compiled: Optional[str] = None  # enable_compile(): the torch.compile backend of cache-free calls

    @property
    def attn_key(self) -> Optional[int]:
        """Which of DecoderModel.forward's attention inputs the layer reads: the mask (or PackedSeqs) of its window."""
        return self.spec.window

    def weights(self) -> LayerWeights:
        """The layer's parameters for layers.py: projections as modules (so wrappers of them are honoured)."""
        a, m = self.self_attn, self.mlp
        norms = {role: getattr(self, name).weight for role, name in self.norm_roles.items()}
        if isinstance(m, SparseMoE):
            dense = dict(gate=None, up=None, down=None, moe=m.weights())
        else:
            dense = dict(gate=m.gate_proj, up=m.up_proj, down=m.down_proj)
        ple = {}
        if hasattr(self, "per_layer_input_gate"):
            ple = dict(ple_gate=self.per_layer_input_gate, ple_proj=self.per_layer_projection,
                       ple_norm=self.post_per_layer_input_norm.weight)
        return LayerWeights(
            attn_in=norms.get("attn_in"), q=a.q_proj, k=a.k_proj, v=a.v_proj, qkv=None, qkv_bias=None,
            q_norm=a.q_norm.weight if a.qk_norm else None,
            k_norm=getattr(a.k_norm, "weight", None) if a.qk_norm else None,  # none in a KV-sharing layer
            o=a.o_proj, o_bias=None, attn_out=norms.get("attn_out"), mlp_in=norms.get("mlp_in"),
            gate_up=None, mlp_out=norms.get("mlp_out"), layer_scalar=getattr(self, "layer_scalar", None), **dense,
            **ple)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Union[torch.Tensor, PackedSeqs],
                kv_cache: Optional[KVCache] = None, route: Optional[Route] = None,
                per_layer_input: Optional[torch.Tensor] = None, shared_kv: Optional[tuple] = None):
        # The module call (and any FSDP hook on it) stays outside torch.compile; only the math is compiled.
        if self.compiled and kv_cache is None and route is None:
            return _COMPILED_BLOCKS[self.compiled](self, h, cos, sin, attn, None, None, per_layer_input, shared_kv)
        return layer_block(self, h, cos, sin, attn, kv_cache, route, per_layer_input, shared_kv)


def layer_block(layer: DecoderLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: Union[torch.Tensor, PackedSeqs], kv_cache: Optional[KVCache] = None,
                route: Optional[Route] = None, per_layer_input: Optional[torch.Tensor] = None,
                shared_kv: Optional[tuple] = None):
    """One decoder layer: h [B, T, H] -> [B, T, H]; cos/sin are layers.rope_tables [B, T, D];
    route: a MoE layer's routing in/out (moe.Route); per_layer_input [B, T, P] (Gemma 4). Gemma 4's key/value
    sharing, explicit in and out (module hooks may copy containers, never the tensors): a KV-sharing layer attends
    with `shared_kv`, its source's (k, v) [B, S, Hkv, D]; a source (kv_store) returns (h, (k, v))."""
    spec, w = layer.spec, layer.weights()
    q, k, v = pre_attention(h, w, spec, cos, sin)  # [B, T, Hq|Hkv, D]
    if spec.kv_shared:
        k, v = shared_kv
    elif kv_cache is not None:
        k, v = kv_cache.update(layer.self_attn.layer_idx, k.transpose(1, 2), v.transpose(1, 2))  # [B, Hkv, S, D]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, S, Hkv, D]
    out = _attend(q, k, v, attn, spec.scale)  # [B, T, Hq, D]
    h = post_attention(h, out.flatten(-2), w, spec, route, per_layer_input)
    return (h, (k, v)) if layer.kv_store else h


_COMPILED_BLOCKS: dict = {}  # backend -> torch.compile(layer_block), made once per process by enable_compile


def enable_compile(model: nn.Module, enabled: bool = True, *, backend: str = "inductor") -> None:
    """Run every DecoderLayer of `model` through one compiled `layer_block` (dynamic shapes, one graph for all
    layers: the layer is an argument, not a constant). Attention runs eager between two graphs, so the
    dense mask and the varlen kernel are the same calls as without compile. Only a flag is stored on the
    layers (deepcopy and state_dict see no wrapper). The KV-cache (rollout) path is never compiled here;
    the rollout engine has its own switch. Tests pass backend="eager" (tracing only, no code generation)."""
    global _attend
    if enabled and backend not in _COMPILED_BLOCKS:
        import torch._dynamo  # noqa: F401  (seconds to import: only when compiling)

        _attend = torch.compiler.disable(attend)
        from ..compile_cache import guard_compiled, specialize_floats  # a corrupt cache: moved aside, cold

        specialize_floats()  # spec.eps a constant: no restarted compiles (compile_cache.py)
        _COMPILED_BLOCKS[backend] = guard_compiled(torch.compile(layer_block, dynamic=True, backend=backend))
    for layer in model.modules():
        if isinstance(layer, DecoderLayer):
            layer.compiled = backend if enabled else None
        elif isinstance(layer, HybridLayer) and hybrid.COMPILE_HYBRID:  # Qwen3.5: off until measured (hybrid.py)
            layer.compiled = backend if enabled else None


def is_compiled(model: nn.Module) -> Optional[str]:
    """The backend of the first compiled DecoderLayer (or HybridLayer) of `model`, or None."""
    return next((m.compiled for m in model.modules() if isinstance(m, (DecoderLayer, HybridLayer)) and m.compiled),
                None)


class DecoderModel(nn.Module):
    """Embedding, layers and final norm: the `model.` prefix of every parameter name.

    Shared by CausalLM (adds the vocabulary projection) and ValueModel (adds a scalar head).
    """

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        # An explicit weight skips Embedding's own normal_ init (init_weights does it): on the meta device
        # normal_ imports torch._dynamo, seconds of start-up for every model load.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        layer_class = DecoderLayer
        if cfg.hybrid:  # Qwen3.5: Gated DeltaNet and gated attention layers
            layer_class = HybridLayer
        self.layers = nn.ModuleList(layer_class(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_style)
        if cfg.per_layer_input_size:  # Gemma 4 E2B/E4B: layers.per_layer_inputs' table, projection and norm
            LP = cfg.num_hidden_layers * cfg.per_layer_input_size
            self.embed_tokens_per_layer = nn.Embedding(cfg.per_layer_vocab_size, LP,
                                                       _weight=torch.empty(cfg.per_layer_vocab_size, LP))
            self.per_layer_model_projection = nn.Linear(cfg.hidden_size, LP, bias=False)
            self.per_layer_projection_norm = RMSNorm(cfg.per_layer_input_size, cfg.rms_norm_eps, cfg.norm_style)
        self.build_rotary()
        self.checkpoint_layers = 0  # the first k layers recompute their activations in backward (selective when < all)
        self.activation_offload = None  # roles/activation_offload.py: the checkpointed layers' inputs in host memory
        self.sequence_parallel = None  # parallel/ulysses.py: this rank's share of the tokens, attention over all

    @property
    def gradient_checkpointing(self) -> bool:
        """Some layer recomputes its activations in backward; setting it checkpoints all layers or none."""
        return self.checkpoint_layers > 0

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, enabled: bool) -> None:
        self.checkpoint_layers = len(self.layers) if enabled else 0

    def build_rotary(self, device=None) -> None:
        """(Re)make the RoPE tables' frequencies, derived from the config (a meta-built model needs this)."""
        cfg = self.config
        full = cfg if cfg.global_head_dim is None else cfg.replace(head_dim=cfg.global_head_dim)  # Gemma 4
        rotary = RotaryEmbedding if cfg.mrope_section is None else MRotaryEmbedding  # Qwen2.5-VL: M-RoPE
        self.rotary_emb = rotary(full).to(device or "cpu")
        self.rotary_emb_local = None
        if cfg.local_rope_theta is not None:  # Gemma 3's sliding layers: default RoPE, their own theta
            local = cfg.replace(rope_theta=cfg.local_rope_theta, rope_scaling=None)
            self.rotary_emb_local = RotaryEmbedding(local).to(device or "cpu")

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[global, local] layers.rope_tables [B, T, D] (local only for models that have one)."""
        tables = [rope_tables(*self.rotary_emb(position_ids, dtype))]
        if self.rotary_emb_local is not None:
            tables.append(rope_tables(*self.rotary_emb_local(position_ids, dtype)))
        return tables

    def per_layer_inputs(self, ids: torch.Tensor, h: torch.Tensor) -> Optional[torch.Tensor]:
        """Gemma 4's per-layer inputs [..., L, P] for ids [...] embedded as h [..., H]; None for other models."""
        if not self.config.per_layer_input_size:
            return None
        return per_layer_inputs(ids, h, self.embed_tokens_per_layer.weight, self.per_layer_model_projection,
                                self.per_layer_projection_norm.weight, self.config.rms_norm_eps, self.config.norm_style)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None, *, seq_ids: Optional[torch.Tensor] = None,
                boundaries: Optional[PackedSeqs] = None, routing: Optional[Routing] = None,
                embeds: Optional[torch.Tensor] = None, after_layer=None) -> torch.Tensor:
        """input_ids [B, T] -> final-normed hidden states [B, T, H].

        attention_mask [B, T]: 1 = real token, 0 = padding (either side). position_ids [B, T]: when None,
        each real token's position is the number of real tokens before it in its row (cache included).
        With `kv_cache`, the T tokens are appended after the cached prefix and the cache advances by T.
        seq_ids [B, T] (packed rows, phaserl.packing): token i sees token j only when their ids are equal
        (and j <= i); needs explicit position_ids and no cache. boundaries: the same rows as the varlen
        kernel sees them (phaserl.packing.Packed.boundaries), when the caller knows them: saves the host
        sync of working them out from seq_ids. routing (MoE models, moe.Routing): experts to replay
        ([B, T, L, k], -1 = route by the router) and, filled here, the experts and router logits every MoE layer used.
        embeds [B, T, H]: the input embeddings instead of input_ids' (vision-language models: image features in
        place of the placeholders, qwen_vl.py); position_ids may then be M-RoPE's [3, B, T]. after_layer(i, h) -> h:
        runs on each layer's output (Qwen3-VL adds its deepstack features at the image tokens after the first layers).
        """
        if seq_ids is not None and (kv_cache is not None or position_ids is None):
            raise ValueError("DecoderModel.forward(seq_ids=...) packs sequences for a cache-free forward: "
                             "pass each sequence's position_ids and no kv_cache")
        B, T = input_ids.shape
        no_padding = attention_mask is None
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
        start = 0 if kv_cache is None else kv_cache.length
        key_valid = attention_mask.bool() if kv_cache is None else kv_cache.record_tokens(attention_mask)  # [B, S]
        if position_ids is None:
            before = key_valid[:, :start].sum(-1, keepdim=True)  # [B, 1] real tokens already cached
            position_ids = (before + attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]
        if embeds is None:
            embeds = embed(input_ids, self.embed_tokens.weight, self.config.embed_scale)
        h = embeds  # [B, T, H]
        windows = {layer.spec.window for layer in self.layers}
        if invariant.enabled():  # bitwise numerics: tokens laid out by (sequence, position), no mask (invariant.py)
            if kv_cache is not None:
                raise ValueError("the bitwise numerics mode runs cache-free forwards and the rollout engine only")
            base = invariant.Aligned.of(attention_mask, position_ids, seq_ids)
            attn = {w: base.with_window(w) for w in windows}
        elif (seq_ids is not None and no_padding and use_varlen(h.device, h.dtype)
                and (windows == {None} or varlen_takes_windows())):
            base = boundaries if boundaries is not None else packed_boundaries(seq_ids)  # varlen: no mask at all
            attn = {w: dataclasses.replace(base, window=w) for w in windows}
        else:
            attn = {w: build_attention_mask(key_valid, start, T, w) for w in windows}  # [B, 1, T, S] each
            if seq_ids is not None:  # block-diagonal: packed sequences never see each other
                attn = {w: block_diagonal(m, seq_ids) for w, m in attn.items()}
        if self.config.linear_attention is not None:  # linear layers read each sequence's tokens, not a mask
            from phaserl.models.linear_attention import Segments

            attn["linear"] = Segments.of(attention_mask, seq_ids)
        rope = self.rope(position_ids, h.dtype)
        ple = self.per_layer_inputs(input_ids, h)  # [B, T, L, P] or None
        sp = self.sequence_parallel if kv_cache is None else None
        if sp is not None:  # Ulysses: this rank's c tokens through the layers (global positions), attention over all
            h, rope = sp.split(h), [(sp.split(cos), sp.split(sin)) for cos, sin in rope]  # [B, c, H], [B, c, D]
            attn = {w: sp.around(a, attend) for w, a in attn.items()}
        kv_of: dict = {}  # Gemma 4: a source layer -> its (k, v) [B, S, Hkv, D], for the layers sharing them
        moe_layers = 0
        if self.config.num_experts:
            prepare_device(h.device)
        recompute = self.checkpoint_layers if self.training and kv_cache is None else 0
        for i, layer in enumerate(self.layers):
            cos, sin = rope[layer.spec.local_rope]
            a = attn[layer.attn_key]
            route = None
            if routing is not None and layer.spec.moe is not None:
                route, moe_layers = routing.route(moe_layers), moe_layers + 1
            gemma4 = {} if ple is None and not self.config.kv_shared_layers else dict(  # E2B/E4B's extra inputs
                per_layer_input=None if ple is None else ple[:, :, i], shared_kv=kv_of.get(layer.kv_source))
            if i < recompute:
                offload = self.activation_offload.layer(i) if self.activation_offload else contextlib.nullcontext()
                with offload:
                    h = checkpoint(_in_mode(layer, invariant.enabled()), h, cos, sin, a, None, route,
                                   use_reentrant=False, **gemma4)
            else:
                h = layer(h, cos, sin, a, kv_cache, route, **gemma4)
            if getattr(layer, "kv_store", False):  # Gemma 4: later layers attend with this layer's keys/values
                h, kv_of[i] = h
            if after_layer is not None:
                h = after_layer(i, h)
        if kv_cache is not None:
            kv_cache.advance(T)
        return self.norm(h) if sp is None else sp.place(self.norm(h), T)  # [B, T, H] (zeros off this rank's tokens)


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """Random init for models trained from scratch: normal(0, std) weights, zero biases, unit norms
    (a gemma-style norm stores its weight as an offset from 1: zero)."""
    with torch.no_grad():
        for m in module.modules():
            if any(p.is_meta for p in m.parameters(recurse=False)):
                continue  # built on meta to be filled from a checkpoint: nothing to initialize
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, Experts):
                nn.init.normal_(m.gate_up_proj, std=std)
                nn.init.normal_(m.down_proj, std=std)
            elif isinstance(m, RMSNorm):
                (nn.init.zeros_ if m.style == "gemma" else nn.init.ones_)(m.weight)


class DecoderWrapper(nn.Module):
    """A module whose decoder stack is `self.model`: exposes its activation-checkpointing switch."""

    @property
    def gradient_checkpointing(self) -> bool:
        return self.model.gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, enabled: bool) -> None:
        self.model.gradient_checkpointing = enabled

    @property
    def compiled(self) -> Optional[str]:
        """The torch.compile backend the decoder layers run through (enable_compile), or None."""
        return is_compiled(self.model)


class CausalLM(DecoderWrapper):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        # True when logits are exactly hidden @ output_weight.T (the roles' fused log-prob path relies on it).
        self.plain_head = cfg.final_logit_softcapping is None
        self.model = DecoderModel(cfg)
        # Tied models have no lm_head at all, like the checkpoints transformers writes for them.
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        init_weights(self)

    @property
    def output_weight(self) -> torch.Tensor:
        """The vocabulary projection [V, H]: lm_head.weight, or the embedding when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V], in the parameter dtype (soft-capped where the config says)."""
        return softcap(F.linear(hidden, self.output_weight), self.config.final_logit_softcapping)

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                       with_entropy: bool = False, chunk_size: int = 1024):
        """log softmax(logits(hidden) / temperature)[targets], chunked: the roles' path when not plain_head."""
        return chunked_token_logprobs(self.logits, hidden, targets, temperature=temperature,
                                      with_entropy=with_entropy, chunk_size=chunk_size)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None, *, seq_ids: Optional[torch.Tensor] = None,
                boundaries: Optional[PackedSeqs] = None, routing: Optional[Routing] = None) -> torch.Tensor:
        """input_ids [B, T] -> hidden [B, T, H]; see DecoderModel.forward for the arguments."""
        return self.model(input_ids, position_ids, attention_mask, kv_cache, seq_ids=seq_ids, boundaries=boundaries,
                          routing=routing)


def _in_mode(layer: nn.Module, bitwise: bool):
    """The layer run in the numerics mode of its forward whenever it is called: a checkpointed layer's recompute runs
    in the backward, after the bitwise mode's training forward has left the default kernels' block (roles/forward.py),
    and must save what the forward saved."""
    def run(*args, **kwargs):
        with invariant.bitwise(bitwise):
            return layer(*args, **kwargs)
    return run
