"""Gemma 4 text (`gemma4_text`) in DecoderConfig's terms: what its config.json means, and back.

The native layout is Gemma 4's dense text decoder as transformers (5.17 .. 5.25) computes it:
  - sandwich norms with plain `(w * x)` rounding (norm_style "olmo2"), per-head q/k norms, and values
    RMS-normed per head without a weight (v_norm);
  - attention scale 1 (the q/k norms set the scale), GeGLU (gelu-tanh), embeddings times sqrt(H), tied head;
  - local (sliding, default RoPE with its own theta) and global (full attention) layers; global layers may
    have their own head_dim (`global_head_dim`) and key/value heads (`num_global_key_value_heads` with
    `attention_k_eq_v`, or a `per_layer_config` that says so), take "proportional" RoPE (only the first
    partial_rotary_factor of each head's frequencies rotate) and, with attention_k_eq_v, no v_proj: their
    values are the keys' projection before the key norm;
  - a `layer_scalar` buffer per layer that scales its output, and final-logit soft-capping;
  - E2B/E4B's per-layer inputs (hidden_size_per_layer_input > 0): a second embedding table and a projection
    of the token embeddings give every layer a small input of its own, which the layer gates into its
    residual stream (layers.per_layer_inputs / add_per_layer_input);
  - E2B/E4B's key/value sharing (num_kv_shared_layers > 0): the last layers compute queries only and attend
    over the keys/values of the last earlier layer of their kind (DecoderConfig.kv_source); they hold no
    key/value weights and the engine's KV pool keeps no cache for them. With use_double_wide_mlp their MLPs are
    twice as wide. Key/value tensors that a checkpoint still holds for those layers are skipped on load, as
    transformers skips them.
Refused with a ConfigError that names the key and the exact fallback (model.implementation=transformers):
the mixture-of-experts block (enable_moe_block: 26B-A4B), bidirectional attention, and per_layer_config overrides
other than the global layers' head_dim / key-value heads. A config whose every layer shares keys/values (an
assistant model that reads another model's) is refused as no causal LM.
Not here: the layer math (layers.py), weights (hf_io.py), the multimodal `gemma4` directory read as its text model
(gemma4_composite.py).
"""
from __future__ import annotations

import math
import re
from typing import Any, Optional

from phaserl.errors import ConfigError

FALLBACK = "model.implementation=transformers runs it exactly"
# transformers' Gemma4TextConfig values for absent keys that change the network.
DEFAULTS = {"max_position_embeddings": 131072, "head_dim": 256, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
            "attention_bias": False, "sliding_window": 512, "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144, "num_kv_shared_layers": 0,
            "use_double_wide_mlp": False, "global_head_dim": 512,
            "rope_local_base_freq": 10000.0, "rope_theta": 1e6}
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
LAYOUT = {"qk_norm": True, "layer_norms": "sandwich", "norm_style": "olmo2", "v_norm": True, "layer_scalar": True}


def reject_unsupported(d: dict, source: str, value) -> None:
    """The parts of Gemma 4 the native decoder does not implement: an error naming all of them, never
    different logits."""
    if value("num_kv_shared_layers") >= d["num_hidden_layers"]:
        raise ConfigError(f"{source}: num_kv_shared_layers={d['num_kv_shared_layers']} of {d['num_hidden_layers']} "
                          "layers: every layer reads another model's keys and values (an assistant model for "
                          "speculative decoding), not a causal LM that runs on its own")
    parts = []
    if d.get("enable_moe_block"):
        parts.append("enable_moe_block=true (the mixture-of-experts block, Gemma 4 26B-A4B)")
    if parts:
        raise ConfigError(f"{source}: {'; '.join(parts)}: not implemented natively; {FALLBACK}")


def global_heads(d: dict, source: str, value, layer_types: Optional[tuple]) -> tuple[int, Optional[int]]:
    """(head_dim, key/value heads or None = unchanged) of the full-attention layers."""
    n = d["num_hidden_layers"]
    full = [i for i in range(n) if layer_types is None or layer_types[i] == "full_attention"]
    overrides = d.get("per_layer_config")
    if overrides is None:  # what transformers derives from global_head_dim / num_global_key_value_heads
        kv = d.get("num_global_key_value_heads") if d.get("attention_k_eq_v") else None
        return int(value("global_head_dim")), kv
    per_layer = {int(k): v for k, v in overrides.items()}
    wanted = [per_layer.get(i) for i in full]
    unusual = sorted(set(per_layer) - set(full)) or [i for i in full if per_layer.get(i) != wanted[0]]
    keys = {k for v in per_layer.values() for k in v} - {"head_dim", "num_key_value_heads"}
    if unusual or keys or not wanted:
        raise ConfigError(f"{source}: per_layer_config overrides layers {unusual} / keys {sorted(keys)}; the native "
                          f"decoder takes one head_dim / num_key_value_heads for all full-attention layers; {FALLBACK}")
    kv = wanted[0].get("num_key_value_heads")
    return int(wanted[0].get("head_dim", value("head_dim"))), None if kv == value("num_key_value_heads") else kv


def last_layer_full(layer_types: Optional[list]) -> Optional[list]:
    """transformers makes Gemma 4's last layer full attention whatever layer_types says (with a warning)."""
    if layer_types:
        layer_types = [*layer_types[:-1], "full_attention"]
    return layer_types


def fields(d: dict, source: str, value, layer_types: Optional[tuple]) -> dict[str, Any]:
    """DecoderConfig fields beyond the common ones (families.config_from_hf fills those)."""
    head_dim, kv_heads = global_heads(d, source, value, layer_types)
    per_layer = int(value("hidden_size_per_layer_input") or 0)
    return dict(embed_scale=math.sqrt(d["hidden_size"]), query_pre_attn_scalar=1.0,  # attention scale 1
                global_head_dim=head_dim, global_kv_heads=kv_heads, attention_k_eq_v=bool(d.get("attention_k_eq_v")),
                final_logit_softcapping=d.get("final_logit_softcapping"), per_layer_input_size=per_layer,
                per_layer_vocab_size=int(value("vocab_size_per_layer_input")) if per_layer else 0,
                kv_shared_layers=int(value("num_kv_shared_layers") or 0),
                double_wide_mlp=bool(value("use_double_wide_mlp")))


_KV_WEIGHT = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.(weight|bias)$")


def unused_tensor(cfg, name: str) -> bool:
    """True for a checkpoint's key/value tensor of a KV-sharing layer: such layers never compute keys or values
    (transformers skips these tensors on load too), so the native model has no place for them."""
    match = _KV_WEIGHT.match(name) if cfg.kv_shared_layers else None
    return match is not None and cfg.kv_source(int(match.group(1))) != int(match.group(1))


def rope_parameters(d: dict) -> dict:
    return d.get("rope_parameters") or DEFAULT_ROPE


def hf_fields(cfg) -> dict[str, Any]:
    """The Gemma 4 keys of config.json for `cfg` (families.config_to_hf writes the common ones)."""
    n = cfg.num_hidden_layers
    full_rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})}
    layer_types = list(cfg.layer_types) if cfg.layer_types else ["full_attention"] * n
    _, kv, head_dim = cfg.heads(layer_types.index("full_attention"))
    return {
        "hidden_activation": cfg.hidden_act, "final_logit_softcapping": cfg.final_logit_softcapping,
        "attention_k_eq_v": cfg.attention_k_eq_v, "hidden_size_per_layer_input": cfg.per_layer_input_size,
        "vocab_size_per_layer_input": cfg.per_layer_vocab_size or cfg.vocab_size,
        "num_kv_shared_layers": cfg.kv_shared_layers, "use_double_wide_mlp": cfg.double_wide_mlp,
        "enable_moe_block": False, "use_bidirectional_attention": None,
        "global_head_dim": head_dim,
        # Read by transformers instead of global_head_dim / num_global_key_value_heads: says exactly which layers.
        "per_layer_config": {str(i): {"head_dim": head_dim, "num_key_value_heads": kv}
                             for i, t in enumerate(layer_types) if t == "full_attention"},
        "rope_parameters": {"full_attention": full_rope,
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": cfg.local_rope_theta or cfg.rope_theta}},
        "layer_types": layer_types,
    }
