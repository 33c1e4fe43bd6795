"""DecoderConfig: the architecture of a native decoder (Llama, Qwen2/3, Qwen3.5, Mistral, Gemma 3/4, OLMo 2, Phi-3,
Qwen2/3-MoE), and its Hugging Face config.json form.

This module only describes shapes and hyper-parameters. What differs between families (which norms a layer
has and where, the norm's rounding, the activation, qk-norm, embedding scale, attention scale, sliding
windows, Qwen3.5's linear-attention layers, output gate and partial RoPE) is a field here, filled by the
family's reader in `families.py`; the layer math that reads those fields lives once in `layers.py` (Qwen3.5's
in `hybrid.py` and `linear_attention.py`), used by the training decoder and the rollout engine alike. It reads both
config.json dialects that exist in the wild (transformers 4.x `rope_theta` + `rope_scaling`, transformers
5.x `rope_parameters`) and writes the 4.x dialect, which every transformers version since 4.x still reads.
Building the network lives in `decoder.py`; reading and writing weights in `hf_io.py`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

from phaserl.errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "proportional")
LAYER_NORMS = ("pre", "sandwich", "post")   # norms before the sublayer / before and after it / after it only
NORM_STYLES = ("llama", "olmo2", "gemma")   # weight * x.to(dtype) / (weight * x).to(dtype) / x * (1 + weight)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")  # linear: Gated DeltaNet (Qwen3.5)


# The model types the native decoder implements: families.py reads and writes each one's config.json (and asserts
# that its table covers exactly these); config.py itself knows no family.
MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "ministral", "gemma3_text", "qwen3_moe", "qwen2_moe",
               "gemma4_text", "qwen3_5_text", "phi3", "olmo2")


@dataclass
class DecoderConfig:
    model_type: str                          # one of MODEL_TYPES
    vocab_size: int
    hidden_size: int
    intermediate_size: int                   # gated-MLP inner width
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int                 # < num_attention_heads means grouped-query attention
    head_dim: Optional[int] = None           # None -> hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None      # {"rope_type": "linear"|"dynamic"|"llama3"|"yarn", "factor": ..., ...}
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False             # bias on q/k/v (and on o_proj too, except for qwen2)
    qk_norm: bool = False                    # RMSNorm of q and k before RoPE (Qwen3, Gemma 3, OLMo 2)
    qk_norm_scope: str = "head"              # "head": over each head's D (Qwen3, Gemma 3); "projection": over Hq*D
    layer_norms: str = "pre"                 # see LAYER_NORMS
    norm_style: str = "llama"                # see NORM_STYLES
    hidden_act: str = "silu"                 # gate activation of the gated MLP (SwiGLU / GeGLU)
    embed_scale: Optional[float] = None      # Gemma: token embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: Optional[float] = None  # attention scale = this ** -0.5 (None: head_dim ** -0.5)
    sliding_window: Optional[int] = None     # keys a sliding layer sees, its own token included
    layer_types: Optional[tuple] = None      # per layer "full_attention" | "sliding_attention"; None: all full
    local_rope_theta: Optional[float] = None  # Gemma 3: sliding layers use default RoPE with this theta
    # Gemma 4 (gemma4.py): full-attention layers may have their own head_dim / kv heads, values equal to the
    # keys' projection, values RMS-normed without a weight, a scalar per layer, and soft-capped logits.
    global_head_dim: Optional[int] = None    # head_dim of full-attention layers (None: head_dim)
    global_kv_heads: Optional[int] = None    # num_key_value_heads of full-attention layers (None: the same)
    attention_k_eq_v: bool = False           # full-attention layers have no v_proj: v = k_proj(x)
    v_norm: bool = False                     # values RMS-normed per head, no weight
    layer_scalar: bool = False               # each layer's output times its `layer_scalar` buffer [1]
    final_logit_softcapping: Optional[float] = None  # logits = cap * tanh(logits / cap)
    # Gemma 4 E2B/E4B: a second embedding gives every layer a small input of its own (layers.per_layer_inputs),
    # and the last kv_shared_layers layers attend over the keys/values of an earlier layer (kv_source).
    per_layer_input_size: int = 0            # P of each layer's own input; 0: none
    per_layer_vocab_size: int = 0            # rows of the per-layer embedding table (Gemma 4: the vocabulary)
    kv_shared_layers: int = 0                # the last this many layers keep no keys/values of their own
    double_wide_mlp: bool = False            # those layers' MLPs are 2 x intermediate_size wide
    partial_rotary_factor: float = 1.0       # RoPE rotates the first head_dim * this dims of q and k (Qwen3.5: 0.25)
    attn_output_gate: bool = False           # Qwen3.5: q_proj also yields a gate, attention output * sigmoid(gate)
    linear_attention: Optional["LinearAttentionShape"] = None  # Gated DeltaNet layers' shape (layer_types says which)
    mrope_section: Optional[tuple] = None    # Qwen2.5-VL: rotary frequencies per position axis (t, h, w), mrope.py
    mrope_interleaved: bool = False          # Qwen3-VL: the axes take turns over the frequencies instead of blocks
    bos_token_id: Optional[int] = None
    eos_token_id: Union[int, list, None] = None
    pad_token_id: Optional[int] = None
    # Mixture of experts (Qwen3-MoE; moe.py). num_experts 0: every layer is a dense gated MLP.
    num_experts: int = 0                     # E
    num_experts_per_tok: int = 0             # k, the experts each token is routed to
    moe_intermediate_size: int = 0           # I of each expert's SwiGLU MLP
    norm_topk_prob: bool = False             # renormalize the k kept router probabilities to sum 1
    decoder_sparse_step: int = 1             # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple = ()              # ... and i is not listed here
    router_aux_loss_coef: float = 0.0        # weight of the router's load-balancing loss in training
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a shared expert MLP of this width beside the routed ones

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"DecoderConfig.model_type={self.model_type!r} is not one of {MODEL_TYPES}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                                  f"{self.num_attention_heads}; set head_dim explicitly")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        for name, allowed in (("layer_norms", LAYER_NORMS), ("norm_style", NORM_STYLES),
                              ("hidden_act", ACTIVATIONS), ("qk_norm_scope", ("head", "projection"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"DecoderConfig.{name}={getattr(self, name)!r} is not one of {allowed}")
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if len(self.layer_types) != self.num_hidden_layers or bad:
                raise ConfigError(f"layer_types must list one of {LAYER_TYPES} per layer ({self.num_hidden_layers}); "
                                  f"got {list(self.layer_types)}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ConfigError("layer_types has sliding_attention layers but sliding_window is not set")
        for layer in range(self.num_hidden_layers):
            Hq, Hkv, D = self.heads(layer)
            if Hq % Hkv or D % 2:
                raise ConfigError(f"layer {layer}: num_attention_heads={Hq} must be a multiple of its "
                                  f"{Hkv} key/value heads and its head_dim={D} even (rotary embeddings)")
        if self.rotary_dim % 2 or not 0 < self.partial_rotary_factor <= 1:
            raise ConfigError(f"partial_rotary_factor={self.partial_rotary_factor} with head_dim={self.head_dim} "
                              "must rotate an even number (> 0) of dims")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window={self.sliding_window} must be >= 1 (or null for full attention)")
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0 and self.decoder_sparse_step > 0):
            raise ConfigError(f"MoE config: need 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= num_experts "
                              f"({self.num_experts}), moe_intermediate_size > 0 ({self.moe_intermediate_size}) and "
                              f"decoder_sparse_step > 0 ({self.decoder_sparse_step})")
        if isinstance(self.linear_attention, dict):
            self.linear_attention = LinearAttentionShape(**self.linear_attention)
        if ("linear_attention" in (self.layer_types or ())) != (self.linear_attention is not None):
            raise ConfigError("layer_types has linear_attention layers exactly when linear_attention (their shape) "
                              f"is set; got layer_types={self.layer_types}, linear_attention={self.linear_attention}")
        self._check_kv_sharing()
        if self.mrope_section is not None:
            self.mrope_section = tuple(self.mrope_section)
            if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.rotary_dim // 2:
                raise ConfigError(f"mrope_section={list(self.mrope_section)} must be 3 sections summing to "
                                  f"head_dim / 2 = {self.rotary_dim // 2}")
        if self.rope_scaling is not None:
            self.rope_scaling = normalize_rope_scaling(self.rope_scaling)
            if self.rope_scaling["rope_type"] == "default":
                self.rope_scaling = None

    def _check_kv_sharing(self) -> None:
        n, shared = self.num_hidden_layers, self.kv_shared_layers
        if not 0 <= shared < n:
            raise ConfigError(f"kv_shared_layers={shared} must be in [0, num_hidden_layers={n}): at least the first "
                              "layer computes its own keys and values")
        kinds = {self.layer_kind(i) for i in range(n - shared)}
        missing = sorted({self.layer_kind(i) for i in range(n - shared, n)} - kinds)
        if missing:
            raise ConfigError(f"kv_shared_layers={shared}: the shared layers include {missing} layers but none of "
                              f"the first {n - shared} layers is one, so there are no keys/values to share")
        if self.per_layer_input_size and self.per_layer_vocab_size < 1:
            raise ConfigError(f"per_layer_input_size={self.per_layer_input_size} needs per_layer_vocab_size >= 1")

    def layer_kind(self, layer: int) -> str:
        """layer_types[layer], or "full_attention" where layer_types is None."""
        return "full_attention" if self.layer_types is None else self.layer_types[layer]

    def kv_source(self, layer: int) -> int:
        """The layer whose keys and values `layer` attends over: itself, or for one of the last kv_shared_layers the
        last layer of its kind before them (transformers' Gemma 4 rule)."""
        first = self.num_hidden_layers - self.kv_shared_layers
        if layer < first:
            return layer
        return max(i for i in range(first) if self.layer_kind(i) == self.layer_kind(layer))

    def mlp_width(self, layer: int) -> int:
        """The dense MLP's inner width at `layer` (Gemma 4's double_wide_mlp doubles it in the KV-sharing layers)."""
        wide = self.double_wide_mlp and self.kv_source(layer) != layer
        return self.intermediate_size * (2 if wide else 1)

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each q/k head that RoPE rotates (all of head_dim unless partial rotary)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_linear(self, layer: int) -> bool:
        """True when layer `layer` is a Gated DeltaNet (linear attention) layer: no KV cache, a recurrent state."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    @property
    def hybrid(self) -> bool:
        """True when the layers are hybrid.py's (Qwen3.5: linear attention and/or gated attention)."""
        return self.linear_attention is not None or self.attn_output_gate

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep keys and values of their own (not the linear-attention ones, nor Gemma 4's KV-sharing
        ones)."""
        return sum(not self.is_linear(i) and self.kv_source(i) == i for i in range(self.num_hidden_layers))

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    @property
    def o_proj_bias(self) -> bool:
        # Qwen2 (and Qwen2-MoE) put a bias on q/k/v only; the other families use one `attention_bias` flag for all four.
        return self.attention_bias and self.model_type not in ("qwen2", "qwen2_moe")

    def window(self, layer: int) -> Optional[int]:
        """The sliding window of layer `layer` (keys it sees, its own included), or None for full attention."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def heads(self, layer: int) -> tuple[int, int, int]:
        """(Hq, Hkv, D) of layer `layer`: full-attention layers may differ (Gemma 4's global_head_dim)."""
        full = self.layer_types is None or self.layer_types[layer] == "full_attention"
        return (self.num_attention_heads,
                (self.global_kv_heads or self.num_key_value_heads) if full else self.num_key_value_heads,
                (self.global_head_dim or self.head_dim) if full else self.head_dim)

    def v_from_k(self, layer: int) -> bool:
        """True when layer `layer` has no v_proj and takes the keys' projection as its values (Gemma 4)."""
        return self.attention_k_eq_v and self.window(layer) is None

    def local_rope(self, layer: int) -> bool:
        """True when layer `layer` takes the local (sliding layers') RoPE table instead of the global one."""
        return self.local_rope_theta is not None and self.window(layer) is not None

    def is_moe(self, layer: int) -> bool:
        """True when layer `layer` has a mixture of experts instead of the dense MLP (transformers' rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe(i)]

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    def replace(self, **changes) -> "DecoderConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class LinearAttentionShape:
    """The Gated DeltaNet layers' shape (Qwen3.5's linear_* keys): Hk key heads of Dk, Hv value heads of Dv
    (Hv a multiple of Hk: each key head serves Hv / Hk consecutive value heads), a causal depthwise
    convolution of `conv_kernel` taps over [q; k; v] before the recurrence."""
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    def __post_init__(self):
        if min(self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim, self.conv_kernel) < 1:
            raise ConfigError(f"linear attention shape {self} needs every size >= 1")
        if self.num_value_heads % self.num_key_heads:
            raise ConfigError(f"linear_num_value_heads={self.num_value_heads} is not a multiple of "
                              f"linear_num_key_heads={self.num_key_heads}")

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: [q; k; v] = 2 Hk Dk + Hv Dv."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


def read_rope(params: Optional[dict], d: dict, source: str, default_max_positions: int) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from either config.json dialect: `params` is a rope_parameters dict (5.x) or
    None, then d's rope_theta / rope_scaling (4.x) are read."""
    if isinstance(params, dict) and params:
        if "rope_theta" not in params and "rope_theta" not in d:
            raise ConfigError(f"{source}: rope_parameters has no rope_theta")
        theta = params.get("rope_theta", d.get("rope_theta"))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = 10000.0 if d.get("rope_theta") is None else d["rope_theta"]
        scaling = dict(d["rope_scaling"]) if d.get("rope_scaling") else {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if scaling.get("partial_rotary_factor", 1.0) not in (1, 1.0, None) and rope_type != "proportional":
        raise ConfigError(f"{source}: partial_rotary_factor={scaling['partial_rotary_factor']} is not supported "
                          "natively (model.implementation=transformers runs it exactly)")
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    # transformers fills the pre-training context length from max_position_embeddings when it is absent.
    if rope_type in ("llama3", "yarn") and "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = d.get("max_position_embeddings", default_max_positions)
    try:
        return theta, normalize_rope_scaling(scaling)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def normalize_rope_scaling(scaling: dict) -> dict:
    scaling = dict(scaling)
    rope_type = scaling.pop("type", None) or scaling.get("rope_type")
    scaling["rope_type"] = rope_type
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope_scaling.rope_type={rope_type!r} is not supported (supported: {ROPE_TYPES})")
    needed = {"linear": ["factor"], "dynamic": ["factor"], "default": [],
              "llama3": ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"],
              "yarn": ["factor", "original_max_position_embeddings"], "proportional": []}[rope_type]
    missing = [k for k in needed if scaling.get(k) is None]
    if missing:
        raise ConfigError(f"rope_scaling of type {rope_type!r} is missing {missing}")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0 and rope_type != "proportional":
        raise ConfigError("rope_scaling.partial_rotary_factor != 1 is not supported natively")
    return scaling
