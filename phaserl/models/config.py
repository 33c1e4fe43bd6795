"""DecoderConfig: the architecture of a Llama / Qwen2 / Qwen3 decoder, and its Hugging Face config.json form.

This module only describes shapes and hyper-parameters. It reads both config.json dialects that exist in
the wild (transformers 4.x `rope_theta` + `rope_scaling`, transformers 5.x `rope_parameters`) and writes
the 4.x dialect, which every transformers version since 4.x still reads. Building the network lives in
`decoder.py`; reading and writing weights in `hf_io.py`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

from phaserl.errors import ConfigError

NATIVE_MODEL_TYPES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")

# The transformers class names, written into config.json so AutoModelForCausalLM picks the right class.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# What transformers assumes when an optional key is absent from config.json (per model_type).
_HF_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "attention_bias": False},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "attention_bias": True},
    "qwen3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "attention_bias": False, "head_dim": 128},
}
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass
class DecoderConfig:
    model_type: str                          # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int                   # SwiGLU inner width
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
    qk_norm: bool = False                    # Qwen3: RMSNorm over each head of q and k before RoPE
    bos_token_id: Optional[int] = None
    eos_token_id: Union[int, list, None] = None
    pad_token_id: Optional[int] = None

    def __post_init__(self):
        if self.model_type not in NATIVE_MODEL_TYPES:
            raise ConfigError(f"DecoderConfig.model_type={self.model_type!r} is not one of {NATIVE_MODEL_TYPES}")
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
        if self.rope_scaling is not None:
            self.rope_scaling = _normalize_rope_scaling(self.rope_scaling)
            if self.rope_scaling["rope_type"] == "default":
                self.rope_scaling = None

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    @property
    def o_proj_bias(self) -> bool:
        # Qwen2 puts a bias on q/k/v only; Llama and Qwen3 use one `attention_bias` flag for all four.
        return self.attention_bias and self.model_type != "qwen2"

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    @classmethod
    def from_hf_dict(cls, d: dict, *, source: str = "config.json") -> "DecoderConfig":
        """Read a Hugging Face config dict; `source` names the file in error messages."""
        model_type = d.get("model_type")
        if model_type not in NATIVE_MODEL_TYPES:
            raise ConfigError(f"{source}: model_type={model_type!r} is not implemented natively "
                              f"(supported: {', '.join(NATIVE_MODEL_TYPES)})")
        missing = [k for k in _REQUIRED_KEYS if k not in d]
        if missing:
            raise ConfigError(f"{source}: missing key(s) {missing} needed to build a {model_type} model")
        _reject_unsupported(d, source)
        defaults = _HF_DEFAULTS[model_type]
        rope_theta, rope_scaling = _read_rope(d, source)
        # Keys that are null in config.json mean "use transformers' default", like an absent key.
        def value(key, default):
            return default if d.get(key) is None else d[key]
        try:
            return cls(
                model_type=model_type,
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=d["num_attention_heads"],
                num_key_value_heads=value("num_key_value_heads", d["num_attention_heads"]),
                head_dim=value("head_dim", defaults.get("head_dim")),
                max_position_embeddings=value("max_position_embeddings", defaults["max_position_embeddings"]),
                rope_theta=float(rope_theta),
                rope_scaling=rope_scaling,
                rms_norm_eps=value("rms_norm_eps", defaults["rms_norm_eps"]),
                tie_word_embeddings=value("tie_word_embeddings", False),
                # Qwen2's q/k/v bias is fixed by its architecture, not read from config.json.
                attention_bias=True if model_type == "qwen2" else value("attention_bias", False),
                qk_norm=model_type == "qwen3",
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id"),
                pad_token_id=d.get("pad_token_id"),
            )
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict that transformers' AutoConfig / AutoModelForCausalLM understand."""
        d = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": dtype,   # transformers 4.x
            "dtype": dtype,         # transformers 5.x
            "use_cache": True,
        }
        if self.model_type != "qwen2":
            d["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            d["mlp_bias"] = False
        if self.model_type in ("qwen2", "qwen3"):
            d["use_sliding_window"] = False
        return d

    def replace(self, **changes) -> "DecoderConfig":
        return dataclasses.replace(self, **changes)


def _read_rope(d: dict, source: str) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from either config.json dialect."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params:
        if "rope_theta" not in params and "rope_theta" not in d:
            raise ConfigError(f"{source}: rope_parameters has no rope_theta")
        theta = params.get("rope_theta", d.get("rope_theta"))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = 10000.0 if d.get("rope_theta") is None else d["rope_theta"]
        scaling = dict(d["rope_scaling"]) if d.get("rope_scaling") else {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    # transformers fills the pre-training context length from max_position_embeddings when it is absent.
    if rope_type in ("llama3", "yarn") and "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = d.get("max_position_embeddings",
                                                            _HF_DEFAULTS[d["model_type"]]["max_position_embeddings"])
    try:
        return theta, _normalize_rope_scaling(scaling)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _normalize_rope_scaling(scaling: dict) -> dict:
    scaling = dict(scaling)
    rope_type = scaling.pop("type", None) or scaling.get("rope_type")
    scaling["rope_type"] = rope_type
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope_scaling.rope_type={rope_type!r} is not supported (supported: {ROPE_TYPES})")
    needed = {"linear": ["factor"], "dynamic": ["factor"], "default": [],
              "llama3": ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"],
              "yarn": ["factor", "original_max_position_embeddings"]}[rope_type]
    missing = [k for k in needed if scaling.get(k) is None]
    if missing:
        raise ConfigError(f"rope_scaling of type {rope_type!r} is missing {missing}")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("rope_scaling.partial_rotary_factor != 1 is not supported natively")
    return scaling


def _reject_unsupported(d: dict, source: str) -> None:
    """Features of these families that the native decoder does not implement: fail rather than differ."""
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act={d['hidden_act']!r} is not supported natively (only 'silu')")
    if d.get("mlp_bias"):
        raise ConfigError(f"{source}: mlp_bias=true is not supported natively")
    if d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or []):
        raise ConfigError(f"{source}: sliding-window attention (use_sliding_window / layer_types) is not "
                          "supported natively; set use_sliding_window=false if the model was trained without it")
    if d.get("pretraining_tp", 1) not in (1, None):
        raise ConfigError(f"{source}: pretraining_tp={d['pretraining_tp']} is not supported natively")
