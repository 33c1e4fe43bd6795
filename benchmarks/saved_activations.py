"""What one decoder layer saves for backward, per token, eager and torch.compile'd, against the doctor's count
(memory/budget.layer_bytes, train_bytes_per_token): the numbers behind the update's activation estimate and
`rollout.engine_keep_awake=auto`.

One layer of phaserl's decoder (a Qwen2 shape from qwen2_shapes.py, random weights, the compute dtype) runs forward
on T tokens under `torch.autograd.graph.saved_tensors_hooks`; the bytes of every distinct storage it saves that is
still held when the forward returns are summed, less the parameters, the RoPE tables and Qwen3.5's Segments (shared
by all layers: the doctor counts them once). The attention core is a stand-in that saves what the varlen flash
kernel saves (q, k, v and the output; its log-sum-exp is a few bytes per token), so the CPU measures what the GPU's
packed update keeps. One JSON line per variant:

    python benchmarks/saved_activations.py --shape 0.5b --tokens 4096          # on the H200 (bf16)
    python benchmarks/saved_activations.py --family qwen35-0.8b --tokens 4096 --seq-len 512  # each layer kind
    python benchmarks/saved_activations.py --family qwen35-0.8b --tokens 4096 --seq-len 512 --attention varlen
    python benchmarks/saved_activations.py --smoke                              # tiny shape, CPU
    python benchmarks/saved_activations.py --smoke --family qwen35-tiny         # tiny Qwen3.5, CPU
    python benchmarks/saved_activations.py --family gemma4-1b --tokens 4096 --seq-len 512  # Gemma 4's two layer kinds

Measured on the CPU (torch 2.13, bf16, inductor C++, `--smoke`; 2026-12-01): a compiled layer saves 6h + 3I + 2 Hkv D
values per token (its input and normed input, q, the attention output, the residual after attention and its normed
copy, k and v, gate, up and their product; the doctor's compiled count within 0.5%: the norm statistics), an eager
one 10h + 4I + 2 Hkv D (each norm's float32 input copy, normed and weighted outputs too), which the doctor's
per-layer count (memory/activations.py) gives exactly, 2440 B per token at `--smoke`.
`--family` takes a benchmarks/families.py shape (its first layers: one of each kind), measures each layer kind
eagerly (the packed training path of hybrid and MoE layers is eager) on one row of `--tokens` tokens packed as
sequences of `--seq-len`, and the stack of those layers together (`layer_kind: "stack"`, against
train_bytes_per_token of that stack). Qwen3.5's Gated DeltaNet layers run the rule training runs there: the torch
chunked rule on the CPU, flash-linear-attention's kernels on CUDA where they import (`delta_rule` in each line says
which; the fla count is read from fla's source, so a GPU line is its check); `--attention varlen` (CUDA) runs the
real varlen flash kernel instead of the stand-in. At qwen35-0.8b on the CPU (torch rule,
bf16, 256 tokens as 2 sequences of 128): Gated DeltaNet 263.1 kB per token, gated attention 88.2 kB, the stack of
those 4 layers 877.5 kB, each within 0.05% of the doctor's count (which counted 47.1 kB for every layer before).
Dense families (2026-12-01, CPU, bf16, 512 tokens as 4 sequences of 128): gemma3-1b 112.2 kB per layer, gemma4-1b
113.2 kB (sliding) and 129.6 kB (global), mistral-7b 200.7 kB, each what the doctor counts to 0.04% (it counted
74.8, 74.8 and 184.3 kB before: 0.67, 0.58 and 0.92 of it). On CUDA, `--attention varlen` also runs Gemma 4's
head_dim-512 global layers as training does there (SDPA per sequence, attention.attend_each_sequence), which saves
more than the stand-in (k and v repeated to Hq heads, each sequence's output): the doctor does not count that.
Not here: the log-prob head, the optimizer, peak memory of a real step (benchmarks/train_step.py, grpo_step.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from phaserl.memory.activations import dense_kind  # noqa: E402
from phaserl.memory.budget import ModelShape, layer_bytes, train_bytes_per_token  # noqa: E402
from phaserl.models import (  # noqa: E402
    CausalLM,  # noqa: E402
    attention,
    decoder,
)
from qwen2_shapes import decoder_config  # noqa: E402


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


def held_bytes(run, leave_out=lambda storage: False, paused=lambda: False, backward: bool = False) -> int:
    """Bytes of the distinct storages that `run()` saves for backward and that are still held when it returns (a
    graph nothing can reach, such as the delta rule's unread final state, frees what it saved), less those
    `leave_out(storage)` names and those first saved while `paused()`. backward: then run backward from its output
    (every saved tensor unpacked: the graph is complete)."""
    saved: dict[int, list] = {}  # storage address -> [storage, weak refs to the tensors saved on it]
    left_out: set = set()

    def pack(t):
        address = t.untyped_storage().data_ptr()
        if paused() and address not in saved:
            left_out.add(address)
        saved.setdefault(address, [t.untyped_storage()]).append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    held = sum(v[0].nbytes() for address, v in saved.items() if any(r() is not None for r in v[1:])
               and address not in left_out and not leave_out(v[0]))
    if backward:
        out.float().square().mean().backward()
    del out
    return held


def storages(*tensors) -> set:
    return {t.untyped_storage().data_ptr() for t in tensors}


def packed_row(tokens: int, seq_len: Optional[int], device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """position_ids [1, T] and seq_ids [1, T] (None: one sequence) of one row packing sequences of `seq_len`."""
    at = torch.arange(tokens, device=device)
    if seq_len is None:
        return at[None], None
    return (at % seq_len)[None], (at // seq_len)[None]


def saved_bytes(model: CausalLM, tokens: int, device: torch.device, layer: int = 0,
                seq_len: Optional[int] = None, varlen: bool = False, backward: bool = False) -> int:
    """Bytes layer `layer` saves for backward on one row of `tokens` tokens (sequences of `seq_len` packed; None:
    one sequence), less the parameters, the RoPE tables and Qwen3.5's Segments (shared by every layer).
    varlen: attention layers get the packed boundaries, for the real varlen kernel (CUDA) instead of flash_like.
    backward: then run the layer's backward (held_bytes)."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    h = model.model.embed_tokens(ids).detach().requires_grad_(True)  # [1, T, H]
    block = model.model.layers[layer]
    positions, seq_ids = packed_row(tokens, seq_len, device)
    cos, sin = model.model.rope(positions, h.dtype)[block.spec.local_rope]
    attn, shared = None, (cos, sin, *model.parameters())
    if getattr(block, "linear", False):  # Qwen3.5's Gated DeltaNet layers read each sequence's tokens
        from phaserl.models.linear_attention import Segments

        attn = Segments.of(torch.ones(1, tokens, dtype=torch.long, device=device), seq_ids)
        shared += (attn.index, attn.real)
    elif varlen:
        rows = seq_ids if seq_ids is not None else torch.zeros(1, tokens, dtype=torch.long, device=device)
        attn = dataclasses.replace(attention.packed_boundaries(rows), window=block.spec.window)
    skip = storages(*shared)
    return held_bytes(lambda: block(h, cos, sin, attn), lambda s: s.data_ptr() in skip, backward=backward)


def doctor_kind(cfg, layer: int, counted: dict) -> str:
    """The memory.layer_bytes kind (a key of `counted`, its answer for this model) that layer `layer` of `cfg` is."""
    if cfg.hybrid:
        return "linear_attention" if cfg.is_linear(layer) else "gated_attention"
    if cfg.is_moe(layer):
        return "moe"
    return "dense" if "dense" in counted else dense_kind(cfg, layer)


def stack_saved_bytes(model: CausalLM, tokens: int, device: torch.device, seq_len: Optional[int] = None,
                      backward: bool = False) -> int:
    """Bytes the decoder's layers keep for backward on one packed row (as saved_bytes), the whole stack at once
    (its gradient checkpointing as set: then what the forward keeps), less the parameters, the token ids, the RoPE
    tables and what the final norm saves; Qwen3.5's Segments are in, once. The attention layers get the packed
    boundaries the GPU's varlen path gives them (no [T, T] mask, which a checkpointed layer would keep as an
    input): the attention core must be flash_like here."""
    dec = model.model
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    positions, seq_ids = packed_row(tokens, seq_len, device)
    tables: list = []
    rope = dec.rope
    dec.rope = lambda *a: (lambda out: tables.extend(t for pair in out for t in pair) or out)(rope(*a))
    final: list = []  # what is saved once the final norm starts is not the layers'
    hook = dec.norm.register_forward_pre_hook(lambda *_: final.append(True))
    varlen, decoder.use_varlen = decoder.use_varlen, lambda device, dtype: True
    try:
        skip = storages(ids, *model.parameters())
        return held_bytes(lambda: dec(ids, position_ids=positions, seq_ids=seq_ids),
                          lambda s: s.data_ptr() in skip | storages(*tables), paused=lambda: bool(final),
                          backward=backward)
    finally:
        hook.remove()
        del dec.rope
        decoder.use_varlen = varlen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="0.5b", help="a qwen2_shapes.py shape")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dtype", default=None, help="bfloat16 (default on CUDA) or float32")
    p.add_argument("--variants", default="eager,compiled")
    p.add_argument("--family", default=None, help="a benchmarks/families.py shape: each of its layer kinds, eager")
    p.add_argument("--seq-len", type=int, default=None, help="--family: pack the row as sequences of this many "
                   "tokens (default: one sequence)")
    p.add_argument("--attention", default="standin", choices=("standin", "varlen"),
                   help="--family: the attention core, flash_like (default) or the real varlen kernel (CUDA)")
    p.add_argument("--smoke", action="store_true", help="tiny shape, 256 tokens (CPU)")
    a = p.parse_args()
    if a.smoke:
        a.shape, a.tokens = "tiny", 256
        a.seq_len = a.seq_len or (128 if a.family else None)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype or "bfloat16")
    if a.attention == "varlen" and not (a.family and attention.use_varlen(device, dtype)):
        p.error("--attention varlen needs --family, CUDA and a half-precision --dtype (the varlen kernel)")
    if a.family:
        return family_layers(a.family, a.tokens, device, dtype, a.seq_len, varlen=a.attention == "varlen")
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
                          "doctor_bytes_per_token_layer": predicted,
                          "doctor_over_saved": round(predicted / measured, 3),
                          "torch": torch.__version__, "seconds": round(time.perf_counter() - start, 1)}), flush=True)


def family_layers(family: str, tokens: int, device: torch.device, dtype: torch.dtype,
                  seq_len: Optional[int] = None, varlen: bool = False) -> None:
    """One JSON line per layer kind of a families.py shape (its first layers up to one of each kind), eager, and
    one for those layers as a stack, each beside the doctor's count. varlen: the real varlen attention kernel."""
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
    if not varlen:
        decoder._attend = attention.attend = torch.compiler.disable(flash_like)  # hybrid.py calls attention.attend
    shape = ModelShape.of(model)  # on CUDA this asks linear_attention whether fla runs there, as training does
    counted = layer_bytes(shape, sequence_tokens=seq_len or tokens)
    common = {"bench": "saved_activations", "family": family, "device": device.type, "dtype": str(dtype),
              "tokens": tokens, "seq_len": seq_len or tokens, "delta_rule": shape.hybrid and shape.hybrid.delta_rule,
              "attention": "varlen" if varlen else "standin", "torch": torch.__version__}
    for kind, i in kinds.items():
        measured = saved_bytes(model, tokens, device, layer=i, seq_len=seq_len, varlen=varlen) / tokens
        kind_counted = doctor_kind(cfg, i, counted)
        predicted = counted[kind_counted][1]
        print(json.dumps({**common, "layer_kind": kind, "doctor_kind": kind_counted, "layer": i,
                          "saved_bytes_per_token_layer": round(measured, 1),
                          "doctor_bytes_per_token_layer": round(predicted, 1),
                          "doctor_over_saved": round(predicted / measured, 3)}), flush=True)
    measured = stack_saved_bytes(model, tokens, device, seq_len) / tokens
    predicted = train_bytes_per_token(shape, False, sequence_tokens=seq_len or tokens)
    print(json.dumps({**common, "layer_kind": "stack", "layers": n, "saved_bytes_per_token": round(measured, 1),
                      "doctor_bytes_per_token": predicted, "doctor_over_saved": round(predicted / measured, 3)}),
          flush=True)


if __name__ == "__main__":
    main()
