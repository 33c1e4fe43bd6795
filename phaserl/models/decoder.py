"""The Llama / Qwen2 / Qwen3 decoder: one readable implementation for training and rollout.

`CausalLM(cfg)(input_ids, ...)` returns the final-normed hidden states, not logits: callers project to
the vocabulary in chunks (`model.output_weight`) so that a [B, T, V] tensor never has to exist.
Parameter names equal transformers' (`model.layers.0.self_attn.q_proj.weight`, ...), so safetensors
files load by name. Attention is `scaled_dot_product_attention` with an explicit boolean mask (causal
AND key-is-not-padding), which handles left- and right-padded batches and the KV cache alike.
Packed sequences (`seq_ids=`, phaserl.packing) run the varlen flash kernel on CUDA in bf16/fp16
(`torch.nn.attention.varlen`: sequence boundaries as cumulative lengths, no [T, T] mask); elsewhere
the mask is made block-diagonal (dense, O(T^2) memory: fine on CPU, the reason for the kernel).
`enable_compile(model)` runs each decoder layer through `torch.compile` (attention stays eager).
Not here: loading weights (hf_io.py), sampling (phaserl/rollout), paged caches.

Legend: B batch, T new tokens, S key slots (cache prefix + T), H hidden, D head_dim,
Hq query heads, Hkv key/value heads, V vocab.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from phaserl.models.config import DecoderConfig
from phaserl.models.rope import RotaryEmbedding, apply_rotary


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
        shape = (batch_size, cfg.num_key_value_heads, max_len, cfg.head_dim)
        layers = range(cfg.num_hidden_layers)
        return cls(keys=[torch.zeros(shape, dtype=dtype, device=device) for _ in layers],
                   values=[torch.zeros(shape, dtype=dtype, device=device) for _ in layers],
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


@dataclass(frozen=True)
class PackedSeqs:
    """Boundaries of packed sequences for the varlen kernel: sequence k is flat tokens [cu[k], cu[k + 1])."""
    cu_seqlens: torch.Tensor  # [n + 1] int32, over the B * T flattened tokens
    max_len: int              # longest sequence


def packed_boundaries(seq_ids: torch.Tensor) -> PackedSeqs:
    """seq_ids [B, T] (each sequence a contiguous run of equal ids) -> PackedSeqs over the flattened tokens."""
    B, T = seq_ids.shape
    flat = seq_ids.reshape(-1)  # [B*T]
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::T] = True  # a new row always starts a new sequence
    cu = torch.cat([starts.nonzero().squeeze(1), torch.tensor([B * T], device=flat.device)]).to(torch.int32)
    return PackedSeqs(cu_seqlens=cu, max_len=int((cu[1:] - cu[:-1]).max()))  # one host sync per forward


def _varlen_kernel():
    """(varlen_attn, causal kwargs, native GQA) when this torch has a usable varlen flash API, else None.

    torch 2.10 spells causal `is_causal=True`, 2.11+ `window_size=(-1, 0)`; 2.12 added `enable_gqa`.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        causal = {"is_causal": True}
    elif "window_size" in params:
        causal = {"window_size": (-1, 0)}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params


_VARLEN = _varlen_kernel() if torch.cuda.is_available() else None
USE_VARLEN = True  # False forces the dense block-diagonal mask on CUDA too (debugging, kernel comparisons)


_GQA_PROBED: dict = {}  # device -> whether this torch's varlen kernel takes fewer kv heads as they are


def _varlen_takes_gqa(device: torch.device) -> bool:
    """True when varlen_attn accepts k/v with fewer heads than q (torch 2.12+ says so with enable_gqa;
    older ones may pass them straight to the flash kernel, which supports it): probed once on tiny
    tensors, forward and backward against the repeated heads, so a torch that does not is never trusted."""
    varlen_attn, causal, native_gqa = _VARLEN
    if native_gqa:
        return True
    if device not in _GQA_PROBED:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(8, h, 64, device=device, dtype=torch.bfloat16, generator=g) for h in (4, 2, 2))
        cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
        try:
            with torch.inference_mode(False), torch.enable_grad():  # the first call may come from a no-grad pass
                q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
                out = varlen_attn(q, k, v, cu, cu, 5, 5, **causal)
                grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
                ref = varlen_attn(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), cu, cu, 5, 5,
                                  **causal)
                ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
            ok = all(torch.allclose(a.float(), b.float(), atol=1e-2, rtol=1e-2)
                     for a, b in zip((out, *grads), (ref, *ref_grads)))
        except Exception:  # noqa: BLE001 - whatever the kernel says about these shapes, the answer is no
            ok = False
        _GQA_PROBED[device] = ok
    return _GQA_PROBED[device]


def use_varlen(device: torch.device, dtype: torch.dtype) -> bool:
    """Packed forwards take the varlen kernel: CUDA, half precision, and a torch that has it."""
    return USE_VARLEN and _VARLEN is not None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: Union[torch.Tensor, PackedSeqs]) -> torch.Tensor:
    """q [B, T, Hq, D], k/v [B, S, Hkv, D] -> [B, T, Hq, D]; `attn` is a boolean mask [B, 1, T, S] or PackedSeqs."""
    B, T, Hq, D = q.shape
    groups = Hq // k.shape[2]
    if isinstance(attn, PackedSeqs):
        varlen_attn, causal, native_gqa = _VARLEN
        k, v = k.reshape(B * T, -1, D), v.reshape(B * T, -1, D)  # [B*T, Hkv, D]
        extra = {}
        if groups > 1 and native_gqa:
            extra["enable_gqa"] = True
        elif groups > 1 and not _varlen_takes_gqa(q.device):
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [B*T, Hq, D]
        out = varlen_attn(q.reshape(B * T, Hq, D), k, v, attn.cu_seqlens, attn.cu_seqlens, attn.max_len,
                          attn.max_len, **causal, **extra)  # [B*T, Hq, D]
        return out.view(B, T, Hq, D)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T|S, D]
    if groups > 1:  # grouped-query attention: each kv head serves `groups` consecutive query heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [B, Hq, S, D]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn).transpose(1, 2)  # [B, T, Hq, D]


_attend = attend  # what layers call; enable_compile swaps in a compile-disabled wrapper (graph break)


def build_attention_mask(key_valid: torch.Tensor, start: int, num_queries: int) -> torch.Tensor:
    """Boolean mask [B, 1, T, S], True = may attend: causal by slot index and the key is not padding.

    Query i sits in slot start + i. Every query may also see its own slot: a padding query would
    otherwise have no visible key, and softmax over nothing is NaN. Padding outputs are garbage
    by design (finite), and no real token ever sees a padding key.
    """
    num_slots = key_valid.shape[1]
    query_slot = torch.arange(start, start + num_queries, device=key_valid.device)[:, None]  # [T, 1]
    key_slot = torch.arange(num_slots, device=key_valid.device)[None, :]  # [1, S]
    causal = key_slot <= query_slot  # [T, S]
    mask = (causal[None] & key_valid[:, None, :]) | (key_slot == query_slot)[None]  # [B, T, S]
    return mask[:, None]


class RMSNorm(nn.Module):
    """x / rms(x) * weight, with the statistics in float32 (as transformers does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.head_dim)
        H, D = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=cfg.o_proj_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # Qwen3: normalize each head of q and k before RoPE
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: Union[torch.Tensor, PackedSeqs], kv_cache: Optional[KVCache]) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)  # [B, T, Hq, D]
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin, heads_dim=2), apply_rotary(k, cos, sin, heads_dim=2)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k.transpose(1, 2), v.transpose(1, 2))  # [B, Hkv, S, D]
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, S, Hkv, D]
        out = _attend(q, k, v, attn)  # [B, T, Hq, D]
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.compiled: Optional[str] = None  # enable_compile(): the torch.compile backend of cache-free calls

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Union[torch.Tensor, PackedSeqs],
                kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        # The module call (and any FSDP hook on it) stays outside torch.compile; only the math is compiled.
        if self.compiled and kv_cache is None:
            return _COMPILED_BLOCKS[self.compiled](self, h, cos, sin, attn)
        return layer_block(self, h, cos, sin, attn, kv_cache)


def layer_block(layer: DecoderLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: Union[torch.Tensor, PackedSeqs], kv_cache: Optional[KVCache] = None) -> torch.Tensor:
    """One pre-norm decoder layer: h [B, T, H] -> [B, T, H]."""
    h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, attn, kv_cache)
    return h + layer.mlp(layer.post_attention_layernorm(h))


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
        _COMPILED_BLOCKS[backend] = torch.compile(layer_block, dynamic=True, backend=backend)
    for layer in model.modules():
        if isinstance(layer, DecoderLayer):
            layer.compiled = backend if enabled else None


def is_compiled(model: nn.Module) -> Optional[str]:
    """The backend of the first compiled DecoderLayer of `model`, or None."""
    return next((m.compiled for m in model.modules() if isinstance(m, DecoderLayer) and m.compiled), None)


class DecoderModel(nn.Module):
    """Embedding, layers and final norm: the `model.` prefix of every parameter name.

    Shared by CausalLM (adds the vocabulary projection) and ValueModel (adds a scalar head).
    """

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        # An explicit weight skips Embedding's own normal_ init (init_weights does it): on the meta device
        # normal_ imports torch._dynamo, seconds of start-up for every model load.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)
        self.gradient_checkpointing = False

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None, *, seq_ids: Optional[torch.Tensor] = None,
                boundaries: Optional[PackedSeqs] = None) -> torch.Tensor:
        """input_ids [B, T] -> final-normed hidden states [B, T, H].

        attention_mask [B, T]: 1 = real token, 0 = padding (either side). position_ids [B, T]: when None,
        each real token's position is the number of real tokens before it in its row (cache included).
        With `kv_cache`, the T tokens are appended after the cached prefix and the cache advances by T.
        seq_ids [B, T] (packed rows, phaserl.packing): token i sees token j only when their ids are equal
        (and j <= i); needs explicit position_ids and no cache. boundaries: the same rows as the varlen
        kernel sees them (phaserl.packing.Packed.boundaries), when the caller knows them: saves the host
        sync of working them out from seq_ids.
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
        h = self.embed_tokens(input_ids)  # [B, T, H]
        if seq_ids is not None and no_padding and use_varlen(h.device, h.dtype):
            attn = boundaries if boundaries is not None else packed_boundaries(seq_ids)  # varlen: no mask at all
        else:
            attn = build_attention_mask(key_valid, start, T)  # [B, 1, T, S]
            if seq_ids is not None:  # block-diagonal: packed sequences never see each other
                attn = attn & (seq_ids[:, :, None] == seq_ids[:, None, :])[:, None]  # [B, 1, T, T]
        cos, sin = self.rotary_emb(position_ids, h.dtype)  # [B, T, D]
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and kv_cache is None:
                h = checkpoint(layer, h, cos, sin, attn, use_reentrant=False)
            else:
                h = layer(h, cos, sin, attn, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(T)
        return self.norm(h)


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """Random init for models trained from scratch: normal(0, std) weights, zero biases, unit norms."""
    with torch.no_grad():
        for m in module.modules():
            if any(p.is_meta for p in m.parameters(recurse=False)):
                continue  # built on meta to be filled from a checkpoint: nothing to initialize
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)


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
        self.model = DecoderModel(cfg)
        # Tied models have no lm_head at all, like the checkpoints transformers writes for them.
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        init_weights(self)

    @property
    def output_weight(self) -> torch.Tensor:
        """The vocabulary projection [V, H]: lm_head.weight, or the embedding when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V], in the parameter dtype."""
        return F.linear(hidden, self.output_weight)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None, *, seq_ids: Optional[torch.Tensor] = None,
                boundaries: Optional[PackedSeqs] = None) -> torch.Tensor:
        """input_ids [B, T] -> hidden [B, T, H]; see DecoderModel.forward for the arguments."""
        return self.model(input_ids, position_ids, attention_mask, kv_cache, seq_ids=seq_ids, boundaries=boundaries)
