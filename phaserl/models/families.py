"""The native families: what each model_type's config.json means in DecoderConfig's terms, and back.

One `Family` per model_type says what transformers assumes for absent keys and which layer layout the
family has (norm placement and rounding, activation, qk-norm, embedding scale); `config_from_hf` turns a
config.json dict into a DecoderConfig and `config_to_hf` writes it back so that transformers builds the
same network. The layer math those fields select lives in `layers.py`, once for all families.
  llama, qwen2, qwen3   pre-norm SwiGLU (qwen2: q/k/v bias; qwen3: per-head qk-norm); sliding layers as
                        layer_types (or 4.x use_sliding_window + max_window_layers) say
  mistral               Llama with a sliding window on every layer (sliding_window: null = full)
  ministral             Mistral with per-layer layer_types
  gemma3_text           sandwich norms x * (1 + w), GeGLU, sqrt(H) embedding scale, per-head qk-norm,
                        query_pre_attn_scalar, local (sliding, own RoPE theta) / global layers
  gemma4_text           Gemma 3's layout with plain norms, value norm, global layers' own head_dim / kv heads /
                        proportional RoPE / k_eq_v, a layer scalar and soft-capped logits; E2B/E4B's per-layer
                        inputs and key/value sharing between layers (gemma4.py); the multimodal `gemma4`
                        config.json is read as its text_config (gemma4_composite.py)
  olmo2                 norms after attention and MLP only, (w * x) rounding, qk-norm over the projection
  qwen3_moe             Qwen3 with a mixture of experts in place of the MLP (moe.py: top-k softmax routing,
                        stacked experts in memory, one tensor per expert in the files, the router's aux loss
                        as output_router_logits + router_aux_loss_coef say); no sliding window
  qwen2_moe             Qwen2 (q/k/v bias: qkv_bias) with the same experts plus a shared expert MLP, gated by
                        sigmoid(shared_expert_gate · x); no sliding window
  qwen3_5_text          Qwen3.5: Gated DeltaNet (linear_attention) layers between gated full-attention ones
                        (output gate, partial RoPE, per-head (1 + w) qk-norm), (1 + w) norms; the linear_* keys
                        and layer_types (default: every 4th layer full) say the layout. The composite
                        vision-language `qwen3_5` config is refused natively (transformers path)
  phi3                  Llama with fused qkv_proj / gate_up_proj tensors in the checkpoint (split on load,
                        fused again on save: `native_state` / `hf_state`) and an optional sliding window
                        on every layer; partial rotary and longrope (Phi-3.5 / Phi-4-mini, 128k) are refused
Features a family has in transformers but not here (attention soft-capping, bidirectional attention,
partial rotary, mlp_bias) are errors, never silently different logits. Not here: weights (hf_io.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from phaserl.errors import ConfigError
from phaserl.models import gemma4, gemma4_composite
from phaserl.models.config import MODEL_TYPES, DecoderConfig, read_rope
from phaserl.models.moe import file_expert, unstack_experts


@dataclass(frozen=True)
class Family:
    architecture: str                 # the transformers *ForCausalLM class
    classifier: Optional[str]         # the *ForSequenceClassification class (value models)
    defaults: dict                    # transformers' values for absent optional keys
    layout: dict = field(default_factory=dict)  # DecoderConfig fields fixed by the family


_LLAMA_LIKE = {"rms_norm_eps": 1e-6, "attention_bias": False, "rope_theta": 10000.0, "tie_word_embeddings": False}
_QWEN_WINDOW = {"max_position_embeddings": 32768, "sliding_window": 4096, "max_window_layers": 28}
FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "LlamaForSequenceClassification",
                    {**_LLAMA_LIKE, "max_position_embeddings": 2048}),
    "qwen2": Family("Qwen2ForCausalLM", "Qwen2ForSequenceClassification",
                    {**_LLAMA_LIKE, **_QWEN_WINDOW}),
    "qwen3": Family("Qwen3ForCausalLM", "Qwen3ForSequenceClassification",
                    {**_LLAMA_LIKE, **_QWEN_WINDOW, "head_dim": 128}, {"qk_norm": True}),
    "mistral": Family("MistralForCausalLM", "MistralForSequenceClassification",
                      {**_LLAMA_LIKE, "max_position_embeddings": 4096 * 32, "sliding_window": 4096}),
    "ministral": Family("MinistralForCausalLM", "MinistralForSequenceClassification",
                        {**_LLAMA_LIKE, "max_position_embeddings": 4096 * 32, "sliding_window": 4096}),
    "gemma3_text": Family("Gemma3ForCausalLM", "Gemma3TextForSequenceClassification",
                          {**_LLAMA_LIKE, "max_position_embeddings": 131072, "head_dim": 256, "rope_theta": 1e6,
                           "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                           "rope_local_base_freq": 10000.0, "hidden_activation": "gelu_pytorch_tanh"},
                          {"qk_norm": True, "layer_norms": "sandwich", "norm_style": "gemma"}),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification",
                        {**_LLAMA_LIKE, "max_position_embeddings": 32768, "decoder_sparse_step": 1,
                         "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "output_router_logits": False},
                        {"qk_norm": True}),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", "Qwen2MoeForSequenceClassification",
                        {**_LLAMA_LIKE, **_QWEN_WINDOW, "decoder_sparse_step": 1, "norm_topk_prob": False,
                         "router_aux_loss_coef": 0.001, "output_router_logits": False, "qkv_bias": True}),
    "gemma4_text": Family("Gemma4ForCausalLM", None, {**_LLAMA_LIKE, **gemma4.DEFAULTS}, gemma4.LAYOUT),
    "qwen3_5_text": Family("Qwen3_5ForCausalLM", "Qwen3_5TextForSequenceClassification",
                           {**_LLAMA_LIKE, "max_position_embeddings": 32768, "head_dim": 256,
                            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4},
                           {"qk_norm": True, "norm_style": "gemma", "attn_output_gate": True}),
    "phi3": Family("Phi3ForCausalLM", "Phi3ForSequenceClassification",
                   {**_LLAMA_LIKE, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}),
    "olmo2": Family("Olmo2ForCausalLM", "Olmo2ForSequenceClassification",
                    {**_LLAMA_LIKE, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5},
                    {"qk_norm": True, "qk_norm_scope": "projection", "layer_norms": "post", "norm_style": "olmo2"}),
}
NATIVE_MODEL_TYPES = tuple(FAMILIES)
assert set(NATIVE_MODEL_TYPES) == set(MODEL_TYPES), "config.MODEL_TYPES and FAMILIES list different model types"
_GEMMA = ("gemma3_text", "gemma4_text")  # hidden_activation (not hidden_act), Gemma's layer_types pattern
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def config_from_hf(d: dict, *, source: str = "config.json") -> DecoderConfig:
    """DecoderConfig from a config.json dict (see the module docstring for what each family reads); `source`
    names the file in error messages."""
    model_type = d.get("model_type")
    if model_type == "qwen3_5":
        raise ConfigError(f"{source}: model_type='qwen3_5' is the vision-language Qwen3.5 (text weights under "
                          "model.language_model.*); the native decoder reads its text model, model_type qwen3_5_text. "
                          "Save that once with transformers: "
                          "Qwen3_5ForCausalLM.from_pretrained(path).save_pretrained(out) (same logits, no vision "
                          "tower), or keep model.implementation=auto/transformers")
    if model_type == "gemma4":  # hf_io reads its text_config (gemma4_composite.py)
        return config_from_hf(gemma4_composite.text_config(d, source), source=f"{source} (text_config)")
    if model_type not in FAMILIES:
        raise ConfigError(f"{source}: model_type={model_type!r} is not implemented natively "
                          f"(supported: {', '.join(FAMILIES)})")
    missing = [k for k in _REQUIRED_KEYS if k not in d]
    if missing:
        raise ConfigError(f"{source}: missing key(s) {missing} needed to build a {model_type} model")
    family = FAMILIES[model_type]

    def value(key, default=None):  # null in config.json means "transformers' default", like an absent key
        return family.defaults.get(key, default) if d.get(key) is None else d[key]

    _reject_unsupported(d, source, value)
    rope_params = d.get("rope_parameters")
    local_theta = None
    if model_type == "gemma4_text":
        gemma4.reject_unsupported(d, source, value)
        d = {**d, "rope_parameters": gemma4.rope_parameters(d),
             "layer_types": gemma4.last_layer_full(d.get("layer_types"))}
    hybrid = {}
    if model_type in _GEMMA:
        rope_params, local_theta = _gemma3_rope(d, source, value)
    elif model_type == "qwen3_5_text":
        rope_params, hybrid = _qwen35_layout(d, source, value)
    elif isinstance(rope_params, dict) and "full_attention" in rope_params:
        raise ConfigError(f"{source}: per-layer-type rope_parameters are not supported natively for {model_type}")
    rope_theta, rope_scaling = read_rope(rope_params, {**d, "rope_theta": value("rope_theta")}, source,
                                         value("max_position_embeddings"))
    sliding_window, layer_types = _read_layer_types(model_type, d, value, source)
    fields = dict(
        model_type=model_type,
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=value("num_key_value_heads", d["num_attention_heads"]),
        head_dim=value("head_dim"), max_position_embeddings=value("max_position_embeddings"),
        rope_theta=float(rope_theta), rope_scaling=rope_scaling, rms_norm_eps=value("rms_norm_eps"),
        tie_word_embeddings=value("tie_word_embeddings"),
        # Qwen2's q/k/v bias is fixed by its architecture, not read from config.json.
        attention_bias={"qwen2": True, "qwen2_moe": value("qkv_bias")}.get(model_type, value("attention_bias")),
        hidden_act=value("hidden_activation") if model_type in _GEMMA else value("hidden_act", "silu"),
        sliding_window=sliding_window, layer_types=layer_types, local_rope_theta=local_theta,
        bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"), pad_token_id=d.get("pad_token_id"),
        **family.layout)
    if model_type in ("qwen3_moe", "qwen2_moe"):
        fields.update(_read_moe(d, value, source))
    fields.update(hybrid)
    if model_type == "gemma3_text":
        fields.update(embed_scale=math.sqrt(d["hidden_size"]), query_pre_attn_scalar=value("query_pre_attn_scalar"),
                      final_logit_softcapping=d.get("final_logit_softcapping"))
    if model_type == "gemma4_text":
        fields.update(gemma4.fields(d, source, value, layer_types))
    try:
        return DecoderConfig(**fields)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _read_layer_types(model_type: str, d: dict, value, source: str) -> tuple[Optional[int], Optional[tuple]]:
    """(sliding_window, layer_types) with layer_types None when every layer attends fully."""
    n = d["num_hidden_layers"]
    window = value("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        window = window if d.get("use_sliding_window") else None
    types = d.get("layer_types")
    if types is None:
        if window is None:
            types = None
        elif model_type in ("mistral", "ministral", "phi3"):
            types = ["sliding_attention"] * n
        elif model_type in _GEMMA:
            pattern = d.get("sliding_window_pattern") or 6
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        else:  # qwen2/qwen3 4.x: the layers from max_window_layers on slide
            first = value("max_window_layers")
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if types is None or "sliding_attention" not in types:
        return None, None
    if window is None:
        raise ConfigError(f"{source}: layer_types has sliding_attention layers but sliding_window is null")
    return int(window), tuple(types)


def _read_moe(d: dict, value, source: str) -> dict:
    """The DecoderConfig MoE fields of a qwen3_moe config.json (num_experts is num_local_experts in 5.x files)."""
    experts = d.get("num_experts", d.get("num_local_experts"))
    missing = [k for k, v in (("num_experts", experts), ("num_experts_per_tok", d.get("num_experts_per_tok")),
                              ("moe_intermediate_size", d.get("moe_intermediate_size"))) if v is None]
    shared = d.get("shared_expert_intermediate_size") if d["model_type"] == "qwen2_moe" else 0
    if shared is None:
        missing.append("shared_expert_intermediate_size")
    if missing:
        raise ConfigError(f"{source}: missing key(s) {missing} needed to build a {d['model_type']} model")
    if d.get("use_sliding_window"):
        raise ConfigError(f"{source}: use_sliding_window=true is not supported natively for {d['model_type']} "
                          "(model.implementation=transformers runs it)")
    # transformers adds the aux loss only when output_router_logits is set: so does the actor.
    coef = float(value("router_aux_loss_coef")) if value("output_router_logits") else 0.0
    return dict(num_experts=int(experts), num_experts_per_tok=int(d["num_experts_per_tok"]),
                moe_intermediate_size=int(d["moe_intermediate_size"]), norm_topk_prob=bool(value("norm_topk_prob")),
                decoder_sparse_step=int(value("decoder_sparse_step")),
                mlp_only_layers=tuple(d.get("mlp_only_layers") or ()), router_aux_loss_coef=coef,
                shared_expert_intermediate_size=int(shared))


def _gemma3_rope(d: dict, source: str, value) -> tuple[Optional[dict], float]:
    """(rope_parameters of the global layers or None for 4.x keys, the local layers' theta)."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"{source}: rope_parameters.sliding_attention.rope_type={local['rope_type']!r} is "
                              "not supported natively (only 'default')")
        return params["full_attention"], float(local.get("rope_theta", value("rope_local_base_freq")))
    return None, float(value("rope_local_base_freq"))


def _qwen35_layout(d: dict, source: str, value) -> tuple[dict, dict]:
    """(rope_parameters without Qwen3.5's extras, DecoderConfig fields of the hybrid layout)."""
    params = dict(d.get("rope_parameters") or {"rope_theta": value("rope_theta")})
    # transformers' Qwen3_5TextConfig defaults partial_rotary_factor to 0.25 when neither place has it.
    partial = params.pop("partial_rotary_factor", d.get("partial_rotary_factor") or 0.25)
    params.pop("mrope_section", None)  # text tokens sit at one position on all three axes: plain RoPE
    params.pop("mrope_interleaved", None)
    if params.get("rope_type", params.get("type", "default")) != "default":
        raise ConfigError(f"{source}: rope_parameters.rope_type={params.get('rope_type')!r} with partial rotary is "
                          "not supported natively (only 'default'; model.implementation=transformers runs it)")
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types is None:
        every = value("full_attention_interval")
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    bad = sorted({t for t in types if t not in ("linear_attention", "full_attention")})
    if bad:
        raise ConfigError(f"{source}: layer_types {bad} are not Qwen3.5 layer types (linear_attention, full_attention)")
    shape = None
    if "linear_attention" in types:
        shape = dict(num_key_heads=value("linear_num_key_heads"), num_value_heads=value("linear_num_value_heads"),
                     key_head_dim=value("linear_key_head_dim"), value_head_dim=value("linear_value_head_dim"),
                     conv_kernel=value("linear_conv_kernel_dim"))
    return params, dict(partial_rotary_factor=float(partial), layer_types=tuple(types), linear_attention=shape)


def _reject_unsupported(d: dict, source: str, value) -> None:
    """Features of these families that the native decoder does not implement: fail rather than differ."""
    act_key = "hidden_activation" if d.get("model_type") in _GEMMA else "hidden_act"
    act = value(act_key, "silu")
    allowed = ("gelu_pytorch_tanh",) if d.get("model_type") in _GEMMA else ("silu",)
    if act not in allowed:
        raise ConfigError(f"{source}: {act_key}={act!r} is not supported natively (only {allowed})")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if d.get(key) is not None and not (key == "final_logit_softcapping" and d.get("model_type") in _GEMMA):
            raise ConfigError(f"{source}: {key}={d[key]} is not implemented natively; the transformers path "
                              "computes it exactly (model.implementation=transformers)")
    # Gemma 4's "vision" makes image tokens attend both ways, in the multimodal model only: text stays causal.
    if d.get("use_bidirectional_attention") and not (d.get("model_type") == "gemma4_text"
                                                     and d["use_bidirectional_attention"] == "vision"):
        raise ConfigError(f"{source}: use_bidirectional_attention={d['use_bidirectional_attention']!r} is not a causal "
                          "LM")
    if d.get("mlp_bias"):
        raise ConfigError(f"{source}: mlp_bias=true is not supported natively")
    if d.get("pretraining_tp", 1) not in (1, None):
        raise ConfigError(f"{source}: pretraining_tp={d['pretraining_tp']} is not supported natively")
    if d.get("partial_rotary_factor", 1.0) not in (1, 1.0, None) and d.get("model_type") != "qwen3_5_text":
        raise ConfigError(f"{source}: partial_rotary_factor={d['partial_rotary_factor']} is not supported natively")


def config_to_hf(cfg: DecoderConfig, dtype: str = "float32") -> dict[str, Any]:
    """A config.json dict from which transformers (AutoConfig, AutoModelForCausalLM) builds the network `cfg`
    describes."""
    t = cfg.model_type
    d = {
        "architectures": [FAMILIES[t].architecture],
        "model_type": t,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else dict(cfg.rope_scaling),
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": dtype,   # transformers 4.x
        "dtype": dtype,         # transformers 5.x
        "use_cache": True,
    }
    sliding = cfg.layer_types is not None
    if t != "qwen2":
        d["attention_bias"] = cfg.attention_bias
    if t == "llama":
        d["mlp_bias"] = False
    if t == "gemma3_text":
        d.update(hidden_activation=cfg.hidden_act, query_pre_attn_scalar=cfg.query_pre_attn_scalar,
                 rope_local_base_freq=cfg.local_rope_theta, final_logit_softcapping=cfg.final_logit_softcapping,
                 attn_logit_softcapping=None)
    elif t == "gemma4_text":  # rope_parameters per layer type instead of rope_theta / rope_scaling
        d.update(gemma4.hf_fields(cfg))
        del d["rope_theta"], d["rope_scaling"]
    else:
        d["hidden_act"] = cfg.hidden_act
    if t == "qwen2_moe":
        d.update(qkv_bias=cfg.attention_bias, shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    if t in ("qwen3_moe", "qwen2_moe"):
        d.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                 moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                 decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
                 output_router_logits=cfg.router_aux_loss_coef > 0,
                 router_aux_loss_coef=cfg.router_aux_loss_coef or 0.001, use_sliding_window=False)
    if t in ("qwen2", "qwen3"):
        d["use_sliding_window"] = sliding
        d["max_window_layers"] = cfg.num_hidden_layers
    if t in ("mistral", "phi3") and sliding and set(cfg.layer_types) != {"sliding_attention"}:
        raise ConfigError(f"a {t} config slides on every layer or none; use model_type ministral for a mix")
    d["sliding_window"] = cfg.sliding_window if sliding else None
    if t == "gemma4_text" and not sliding:  # transformers' Gemma4TextConfig wants an int; no layer uses it
        d["sliding_window"] = gemma4.DEFAULTS["sliding_window"]
    if t == "phi3":
        d.update(resid_pdrop=0.0, embd_pdrop=0.0, original_max_position_embeddings=cfg.max_position_embeddings)
    if t == "qwen3_5_text":
        d.pop("rope_scaling")
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta"),
                                "partial_rotary_factor": cfg.partial_rotary_factor}
        s = cfg.linear_attention
        if s is not None:
            d.update(linear_num_key_heads=s.num_key_heads, linear_num_value_heads=s.num_value_heads,
                     linear_key_head_dim=s.key_head_dim, linear_value_head_dim=s.value_head_dim,
                     linear_conv_kernel_dim=s.conv_kernel)
    if t not in ("mistral", "phi3", "gemma4_text"):
        d["layer_types"] = list(cfg.layer_types) if sliding else ["full_attention"] * cfg.num_hidden_layers
    return d


# Checkpoint tensors that hold several of ours, concatenated along dim 0 (Phi-3): suffix -> our suffixes.
_FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                        "self_attn.v_proj.weight"),
          "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}


def _fused_sizes(cfg: DecoderConfig, suffix: str) -> list[int]:
    if suffix.startswith("self_attn"):
        D = cfg.head_dim
        return [cfg.num_attention_heads * D, cfg.num_key_value_heads * D, cfg.num_key_value_heads * D]
    return [cfg.intermediate_size, cfg.intermediate_size]


def fused_projections(cfg: DecoderConfig) -> list[tuple[str, tuple, list]]:
    """(the checkpoint's module, our modules it fuses, their output sizes) per fused projection of the family, by
    module suffix (e.g. ("self_attn.qkv_proj", ("self_attn.q_proj", ...), [Hq D, Hkv D, Hkv D])); [] for families
    that fuse none. PEFT adapter export (lora.peft_adapter_files) writes our adapters in that layout."""
    if cfg.model_type != "phi3":
        return []
    strip = lambda name: name.removesuffix(".weight")  # noqa: E731
    return [(strip(fused), tuple(map(strip, parts)), _fused_sizes(cfg, fused)) for fused, parts in _FUSED.items()]


def _fused_suffix(name: str) -> Optional[str]:
    return next((s for s in _FUSED if name.endswith("." + s)), None)


# Vision-language checkpoints in transformers 5's composite layout (Qwen3-VL; read for Qwen2.5-VL too): the language
# model under model.language_model., the tower under model.visual.; ours are model. and visual. (qwen_vl.py).
_VL_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def vl_name(cfg: DecoderConfig, name: str) -> str:
    """Our name of a vision-language checkpoint tensor (itself for every other family)."""
    if cfg.mrope_section is not None:
        for theirs, ours in _VL_PREFIXES:
            if name.startswith(theirs):
                return ours + name[len(theirs):]
    return name


def vl_file_name(name: str) -> str:
    """The composite-layout name of one of our tensors (Qwen3-VL's files)."""
    for theirs, ours in _VL_PREFIXES:
        if name.startswith(ours):
            return theirs + name[len(ours):]
    return name


def native_names(cfg: DecoderConfig, name: str) -> list[str]:
    """The names of our tensors that checkpoint tensor `name` holds (itself, unless the family fuses it)."""
    expert = file_expert(name) if cfg.num_experts else None
    if expert is not None:  # one file tensor per expert: it fills a slice of our stacked parameter
        return [expert[0]]
    if cfg.model_type == "gemma4_text":  # the multimodal directory's text under model.language_model.; no towers
        name = gemma4_composite.text_name(name)
        if name is None:
            return []
    if gemma4.unused_tensor(cfg, name):  # a KV-sharing layer's key/value weights: none of ours
        return []
    suffix = _fused_suffix(name) if cfg.model_type == "phi3" else None
    if suffix is None:
        return [vl_name(cfg, name)]
    return [name[: -len(suffix)] + part for part in _FUSED[suffix]]


def native_state(cfg: DecoderConfig, name: str, tensor) -> dict:
    """Checkpoint tensor -> {our name: tensor}, split along dim 0 where the family fuses."""
    names = native_names(cfg, name)
    if len(names) == 1:
        return {names[0]: tensor}
    sizes = _fused_sizes(cfg, _fused_suffix(name))
    if tensor.shape[0] != sum(sizes):
        raise ConfigError(f"tensor {name!r} has {tensor.shape[0]} rows, config.json implies {sum(sizes)}")
    return dict(zip(names, tensor.split(sizes, dim=0)))


def hf_state(cfg: DecoderConfig, state: dict) -> dict:
    """Our state dict -> the checkpoint layout of the family (fused tensors for Phi-3, one per expert for MoE)."""
    if cfg.mrope_interleaved:  # Qwen3-VL's files: transformers 5's composite names
        return {vl_file_name(name): tensor for name, tensor in state.items()}
    if cfg.num_experts:
        return unstack_experts(state)
    if cfg.model_type != "phi3":
        return state
    out = {}
    for name, tensor in state.items():
        fused = next(((f, parts) for f, parts in _FUSED.items() if name.endswith("." + parts[0])), None)
        if fused is not None:
            prefix = name[: -len(fused[1][0])]
            out[prefix + fused[0]] = torch.cat([state[prefix + part] for part in fused[1]]).contiguous()
        elif not any(name.endswith("." + part) for parts in _FUSED.values() for part in parts[1:]):
            out[name] = tensor
    return out
