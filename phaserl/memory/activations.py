"""What one eager layer of phaserl's dense decoder saves for backward, per token, in bytes, for every family it
runs (Llama, Qwen2/3, Mistral/Ministral, Phi-3, Gemma 3, Gemma 4, OLMo 2): the update's activation count
(budget.layer_bytes calls dense_layer_bytes once per distinct layer layout).

The count follows the code of models/layers.py tensor by tensor, each in its own dtype (b = bytes of the compute
dtype, 4 for float32 tensors; n a normed width, r the rows it is normed over):
  norm (rms_norm)   its input as float32 (`x.float()`: a copy in bf16; in float32 the input itself, which is then
                    not counted twice where another op saves it too), the float32 statistic (4r), and what the
                    weight is applied to: llama style `weight * norm(x).to(dtype)` the rounded normed value (b n),
                    gemma `(1 + w)` and olmo2 `(w * ·)` styles the float32 normed value (4n); plus its output (b n)
                    where a projection reads it (the norms before attention and the MLP), not where it is added to
                    the residual (the norms after them: sandwich and post layouts).
  layer norms       pre (Llama, Qwen, Mistral, Phi-3): before attention and MLP. sandwich (Gemma 3/4): those two
                    and the output norms of attention and MLP. post (OLMo 2): the output norms only, so q/k/v and
                    gate/up read the residual itself (b h, twice).
  qk-norm           per head (Qwen3, Gemma 3/4; r = Hq and Hkv) or over the projection (OLMo 2; r = 1): a norm of
                    the projection output whose output only RoPE reads (RoPE saves nothing but its tables).
  v-norm            Gemma 4's weightless value norm: input and statistic; its output is the attention's v. In
                    float32 a k_eq_v layer's input is the key projection the k norm already saves.
  attention core    q and k after RoPE, v, the output (o_proj's input): b (2 Hq D + 2 Hkv D), what the varlen flash
                    kernel saves (its float32 log-sum-exp, 4 Hq, is left out, as in budget.py).
  MLP               gate, act(gate), up and their product: 4 b I (SwiGLU and GeGLU alike; I the layer's own width:
                    Gemma 4's double-wide MLPs twice intermediate_size).
Measured: tests/test_doctor_activations.py runs tiny random models of each family forward (and backward) on the
CPU in float32 and bfloat16 under saved_tensors_hooks (benchmarks/saved_activations.py's helpers, attention as the
flash-like stand-in) and finds these counts exact per layer kind and for the whole stack, but for the per-layer
constants below; `saved_activations.py --family` the same at the Gemma-3/4-1B and Mistral-7B layer shapes.
Derived, not measured here: bf16 on CUDA (the same ops; F.rms_norm's fused CUDA kernel saves the same input and
statistic: benchmarks/saved_activations.py --family on the H200 is its check).
Left out: per-layer constants (the gemma norms' 1 + w, Gemma 4's layer scalar), the embedding (its ids and sqrt(h)
scale are saved once per forward, not per layer), Gemma 4 E2B/E4B's per-layer input step (a gate of P values, its
activation and product, a projection back to h and its norm) and their KV-sharing layers (counted as if they
computed and saved keys and values of their own; they save their source's), Gemma 4's global layers on CUDA
(head_dim 512 > the flash kernel's 256: attention.attend_each_sequence runs SDPA per sequence, which also keeps k
and v repeated to Hq heads and each sequence's output), the MoE and Qwen3.5 layers (budget.py counts those), and
torch.compile'd layers (budget.layer_bytes keeps its own count for those: the partitioner recomputes the norms'
copies).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..models.config import DecoderConfig


@dataclass(frozen=True)
class LayerLayout:
    """What a dense DecoderLayer saves depends on (one per distinct layer of a model)."""

    hidden: int          # h
    intermediate: int    # I
    heads: tuple         # (Hq, Hkv, D)
    layer_norms: str     # config.LAYER_NORMS: pre | sandwich | post
    norm_style: str      # config.NORM_STYLES: llama | olmo2 | gemma
    qk_norm: str         # "" | "head" | "projection"
    v_norm: bool         # Gemma 4's weightless value norm
    v_from_k: bool       # Gemma 4's k_eq_v layers: v is the key projection

    @classmethod
    def of(cls, cfg: DecoderConfig, layer: int) -> "LayerLayout":
        return cls(cfg.hidden_size, cfg.mlp_width(layer), cfg.heads(layer), cfg.layer_norms, cfg.norm_style,
                   cfg.qk_norm_scope if cfg.qk_norm else "", cfg.v_norm, cfg.v_from_k(layer))


def dense_layouts(cfg: DecoderConfig) -> tuple:
    """((kind, layout, how many layers), ...) over the dense (not MoE, not hybrid) layers of `cfg`, in layer order of
    first appearance; kind is "dense" when every dense layer has one layout, else "dense " + the layer type."""
    seen: dict = {}
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_moe(i):
            layout = LayerLayout.of(cfg, i)
            seen.setdefault(layout, [dense_kind(cfg, i), 0])[1] += 1
    if len(seen) == 1:
        return tuple(("dense", layout, n) for layout, (_, n) in seen.items())
    return tuple((kind, layout, n) for layout, (kind, n) in seen.items())


def dense_kind(cfg: DecoderConfig, layer: int) -> str:
    """The kind budget.layer_bytes names dense layer `layer` under when the model's dense layers differ."""
    return "dense " + (cfg.layer_types[layer] if cfg.layer_types else "full_attention")


def norm_bytes(n: int, rows: int, style: Optional[str], b: int, *, read: bool, input_saved: bool = False) -> int:
    """One rms_norm (layers.rms_norm) over `n` values per token in `rows` rows: its float32 input (0 when in float32
    it is a tensor another op already saves: `input_saved`), the statistic, what the weight meets, and its output
    when a projection reads it (`read`). style None: no weight (its output is counted where it is used)."""
    kept_input = 0 if (b == 4 and input_saved) else 4 * n
    weighted = 0 if style is None else (b * n if style == "llama" else 4 * n)
    return kept_input + 4 * rows + weighted + (b * n if read else 0)


def dense_layer_bytes(layout: LayerLayout, b: int) -> int:
    """Bytes one eager dense layer saves for backward per token, b the compute dtype's (see the module doc)."""
    h, inter, (Hq, Hkv, D), style = layout.hidden, layout.intermediate, layout.heads, layout.norm_style
    q, kv = Hq * D, Hkv * D
    norms = {"pre": 2 * norm_bytes(h, 1, style, b, read=True),
             "sandwich": 2 * norm_bytes(h, 1, style, b, read=True) + 2 * norm_bytes(h, 1, style, b, read=False),
             "post": 2 * norm_bytes(h, 1, style, b, read=False) + 2 * b * h}[layout.layer_norms]
    qk = 0
    if layout.qk_norm:
        per_head = layout.qk_norm == "head"
        qk = (norm_bytes(q, Hq if per_head else 1, style, b, read=False)
              + norm_bytes(kv, Hkv if per_head else 1, style, b, read=False))
    # v_from_k comes with v_norm (Gemma 4 only): attention's v is then the norm's output, never the raw keys
    v = norm_bytes(kv, Hkv, None, b, read=False, input_saved=layout.v_from_k and bool(layout.qk_norm)) \
        if layout.v_norm else 0
    attention = b * (2 * q + 2 * kv)
    return norms + qk + v + attention + 4 * b * inter
