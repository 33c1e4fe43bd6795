"""What one decoder layer saves for backward, per token, eager and torch.compile'd, against the doctor's count
(doctor/memory.train_bytes_per_token): the numbers behind the update's activation estimate and
`rollout.engine_keep_awake=auto`.

One layer of phaserl's decoder (a Qwen2 shape from qwen2_shapes.py, random weights, the compute dtype) runs forward
on T tokens under `torch.autograd.graph.saved_tensors_hooks`; the bytes of every distinct storage it saves are
summed, less the parameters and the RoPE tables (shared by all layers). The attention core is a stand-in that
saves what the varlen flash kernel saves (q, k, v and the output; its log-sum-exp is a few bytes per token), so
the CPU measures what the GPU's packed update keeps. One JSON line per variant:

    python benchmarks/saved_activations.py --shape 0.5b --tokens 4096          # on the H200 (bf16)
    python benchmarks/saved_activations.py --family qwen35-0.8b --tokens 1024  # each layer kind, eager
    python benchmarks/saved_activations.py --smoke                              # tiny shape, CPU

Measured on the CPU (torch 2.13, bf16, inductor C++, `--smoke`; 2026-12-01): a compiled layer saves 6h + 3I + 2 Hkv D
values per token (its input and normed input, q, the attention output, the residual after attention and its normed
copy, k and v, gate, up and their product; the doctor's compiled count within 0.5%: the norm statistics), an eager
one 10h + 4I + 2 Hkv D (each norm's float32 input copy, normed and weighted outputs too; the doctor counts 8h).
`--family` takes a benchmarks/families.py shape (its first layers: one of each kind) and measures each layer kind
eagerly (the packed training path of hybrid and MoE layers is eager). At qwen35-0.8b on the CPU (torch rule, 512
tokens): a Gated DeltaNet layer saves 271 KB per token, a gated attention layer 94 KB; the doctor counts 47 KB.
Not here: the log-prob head, the optimizer, peak memory of a real step (benchmarks/train_step.py, grpo_step.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qwen2_shapes import decoder_config  # noqa: E402
from phaserl.doctor.memory import ModelShape, train_bytes_per_token  # noqa: E402
from phaserl.models import CausalLM  # noqa: E402
from phaserl.models import decoder  # noqa: E402


class FlashLike(torch.autograd.Function):
    """Causal attention that saves q, k, v and its output, as flash attention does (no [T, T] probabilities)."""

    @staticmethod
    def forward(ctx, q, k, v):  # [1, T, heads, D] each
        with torch.no_grad():
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=True).transpose(1, 2).contiguous()
        ctx.save_for_backward(q, k, v, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _ = ctx.saved_tensors
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=True).transpose(1, 2)
            return torch.autograd.grad(out, (q, k, v), grad)


def flash_like(q, k, v, attn, scale):
    return FlashLike.apply(q, k, v)


def saved_bytes(model: CausalLM, tokens: int, device: torch.device, layer: int = 0) -> int:
    """Bytes layer `layer` saves for backward on one row of `tokens` tokens (parameters and RoPE tables left out)."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    h = model.model.embed_tokens(ids).detach().requires_grad_(True)  # [1, T, H]
    block = model.model.layers[layer]
    cos, sin = model.model.rope(torch.arange(tokens, device=device)[None], h.dtype)[block.spec.local_rope]
    attn = None
    if getattr(block, "linear", False):  # Qwen3.5's Gated DeltaNet layers read the row as one sequence
        from phaserl.models.linear_attention import Segments

        attn = Segments.of(torch.ones(1, tokens, dtype=torch.long, device=device))
    skip = {t.untyped_storage().data_ptr() for t in (cos, sin, *model.parameters())}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(h, cos, sin, attn)
    del out
    return sum(seen.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="0.5b", help="a qwen2_shapes.py shape")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dtype", default=None, help="bfloat16 (default on CUDA) or float32")
    p.add_argument("--variants", default="eager,compiled")
    p.add_argument("--family", default=None, help="a benchmarks/families.py shape: each of its layer kinds, eager")
    p.add_argument("--smoke", action="store_true", help="tiny shape, 256 tokens (CPU)")
    a = p.parse_args()
    if a.smoke:
        a.shape, a.tokens = "tiny", 256
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype or "bfloat16")
    if a.family:
        return family_layers(a.family, a.tokens, device, dtype)
    cfg = decoder_config(a.shape).replace(num_hidden_layers=1)
    torch.manual_seed(0)
    with torch.device(device):
        model = CausalLM(cfg).to(dtype).train()
    shape = ModelShape.of(model)
    for variant in a.variants.split(","):
        decoder._COMPILED_BLOCKS.clear()
        decoder.enable_compile(model, enabled=variant == "compiled")
        decoder._attend = torch.compiler.disable(flash_like)  # after enable_compile, which sets its own wrapper
        start = time.perf_counter()
        saved_bytes(model, a.tokens, device)  # the compile (and its warm-up) happens here
        measured = saved_bytes(model, a.tokens, device) / a.tokens
        predicted = train_bytes_per_token(shape, False, compiled=variant == "compiled")
        print(json.dumps({"bench": "saved_activations", "shape": a.shape, "device": device.type, "dtype": str(dtype),
                          "variant": variant, "tokens": a.tokens, "saved_bytes_per_token_layer": measured,
                          "doctor_bytes_per_token_layer": predicted, "doctor_over_saved": round(predicted / measured, 3),
                          "torch": torch.__version__, "seconds": round(time.perf_counter() - start, 1)}), flush=True)


def family_layers(family: str, tokens: int, device: torch.device, dtype: torch.dtype) -> None:
    """One JSON line per layer kind of a families.py shape (its first layers up to one of each kind), eager."""
    import transformers

    from families import SHAPES
    from phaserl.models.families import config_from_hf

    spec = SHAPES[family]
    full = config_from_hf(getattr(transformers, spec["cls"])(**spec["config"]).to_dict())
    kinds = {}  # kind -> its first layer index
    for i in range(full.num_hidden_layers):
        kind = "linear" if full.is_linear(i) else "moe" if full.is_moe(i) else full.layer_types[i] if full.layer_types \
            else "attention"
        kinds.setdefault(kind, i)
    n = max(kinds.values()) + 1
    cfg = full.replace(num_hidden_layers=n, vocab_size=1024, layer_types=full.layer_types and full.layer_types[:n])
    torch.manual_seed(0)
    with torch.device(device):
        model = CausalLM(cfg).to(dtype).train()
    decoder._attend = torch.compiler.disable(flash_like)
    predicted = train_bytes_per_token(ModelShape.of(model), False) / n  # the doctor's per-layer mean
    for kind, i in kinds.items():
        measured = saved_bytes(model, tokens, device, layer=i) / tokens
        print(json.dumps({"bench": "saved_activations", "family": family, "device": device.type, "dtype": str(dtype),
                          "layer_kind": kind, "layer": i, "tokens": tokens, "saved_bytes_per_token_layer": measured,
                          "doctor_bytes_per_token_layer_mean": predicted,
                          "doctor_over_saved": round(predicted / measured, 3), "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
