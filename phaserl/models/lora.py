"""LoRA adapters: low-rank updates W + (alpha / r) · B · A on chosen linear projections of a built model.

`apply_lora(model, settings)` replaces the named projections (q/k/v/o/gate/up/down, and Qwen3.5's linear-attention
in_proj_qkv/z/b/a and out_proj) of phaserl's decoder
by `LoRALinear` modules after the model is built and loaded: the layer math in decoder.py is untouched
(a LoRALinear is called exactly where the nn.Linear was). The base weight keeps its parameter and its
name (`...q_proj.weight`), so loading, saving and the rollout engine's reads see the same tensor;
the adapters are new parameters `...q_proj.lora_A` [r, in] and `...q_proj.lora_B` [out, r], float32,
B zero-initialized (the adapted model starts equal to the base). Everything that is not an adapter is
frozen (`requires_grad_(False)`), except the modules named in `trainable` (the critic's value head).
Transformers-fallback models get their adapters from `peft` itself (`inject_adapter_in_model`).

Also here: switching adapters off (the reference policy is the base model: `adapters_disabled`), the
merged weight the rollout engine multiplies (`engine_weight`: never written into the base), the
adapter count for the doctor, and the PEFT file layout (`peft_adapter_files`) used by export.
Not here: the optimizer (roles take the trainable parameters), checkpoints (they keep trainable state),
sharding (FSDP2 shards adapters with their layer, like any parameter).

Legend: N tokens, in/out the projection's sizes, r rank.
"""
from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from phaserl.errors import ConfigError

# The decoder's projections, by full name; short names and PEFT's "all-linear" are accepted too. Qwen3.5's Gated
# DeltaNet layers (models/linear_attention.py) have their own (transformers' names); "all-linear" takes them too,
# as PEFT's all-linear does. Not adapted by any name: a MoE router (`mlp.gate`) and the stacked experts.
DENSE_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LINEAR_ATTENTION_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
PROJECTIONS = DENSE_PROJECTIONS + LINEAR_ATTENTION_PROJECTIONS
ALIASES = {p.removesuffix("_proj"): p for p in DENSE_PROJECTIONS}


@dataclass(frozen=True)
class LoRASettings:
    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple = PROJECTIONS

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def resolve_targets(names, *, key: str = "lora.target_modules") -> tuple:
    """['q', 'v_proj', ...] or ['all-linear'] -> full projection names in decoder order; unknown names are errors."""
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ConfigError(f"{key} is empty: name at least one of {', '.join(PROJECTIONS)} (or all-linear)")
    if "all-linear" in names:
        return PROJECTIONS
    unknown = [n for n in names if n not in PROJECTIONS and n not in ALIASES]
    if unknown:
        raise ConfigError(f"{key}: unknown projection(s) {unknown}; choose from {', '.join(PROJECTIONS)} "
                          "(or q, k, v, o, gate, up, down, or all-linear; in_proj_* and out_proj are Qwen3.5's "
                          "linear-attention layers')")
    wanted = {ALIASES.get(n, n) for n in names}
    return tuple(p for p in PROJECTIONS if p in wanted)


class LoRALinear(nn.Module):
    """y = x Wᵀ + b + scaling · dropout(x) Aᵀ Bᵀ; W and b are the wrapped nn.Linear's own (frozen) parameters.

    The adapter path runs in x's dtype (A and B are cast, a small copy per call; their gradients come
    back in float32): with a bf16 base nothing of size [N, in] is upcast. The scaling rides on B (an
    [out, r] multiply), so no [N, out] tensor is scaled, forward or backward; the sum with the base output
    is one add, which torch.compile fuses into whatever reads the projection next (RoPE, SiLU·up, the
    residual). With dropout 0 the adapter reads x itself (no copy). The frozen W gets no gradient (autograd
    skips it: requires_grad is False), only x does.
    `adapter_enabled = False` gives the base projection exactly.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight.requires_grad_(False)  # [out, in]
        self.bias = None if base.bias is None else base.bias.requires_grad_(False)
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, dtype=torch.float32, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=torch.float32, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's (and nn.Linear's) init of A
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.adapter_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)  # [N, out]
        if not self.adapter_enabled:
            return out
        low = F.linear(self.dropout(x), self.lora_A.to(x.dtype))  # [N, r]
        return out + F.linear(low, self.scaled_B(x.dtype))  # a plain add: compiled, it fuses into the next kernel

    def scaled_B(self, dtype: torch.dtype) -> torch.Tensor:
        """scaling · B in `dtype`.  [out, r]"""
        return (self.lora_B * self.scaling).to(dtype)

    def merged_weight(self) -> torch.Tensor:
        """W + scaling · B A, summed in float32 and rounded once to W's dtype (export).  [out, in]"""
        merged = torch.addmm(self.weight.float(), self.lora_B.float(), self.lora_A.float(), alpha=self.scaling)
        return merged.to(self.weight.dtype)

    def merge_into(self, out: torch.Tensor) -> torch.Tensor:
        """W + (s B)·A written into `out` [out, in] (W's dtype) by one GEMM: the factors rounded to W's dtype as the
        forward rounds them, the product and W summed in the GEMM's float32 accumulator, rounded once. No
        float32 [out, in] temporaries (a 7B layer's gate/up/down would take 0.8 GB of them, every switch)."""
        dtype = self.weight.dtype
        return torch.addmm(self.weight, self.scaled_B(dtype), self.lora_A.to(dtype), out=out)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.lora_A.shape[0]}, scaling={self.scaling:g}"


def _is_peft_target(model: nn.Module) -> bool:
    return hasattr(model, "hf_model")  # models.hf_fallback.HFCausalLM (kept duck-typed: no import cycle)


def apply_lora(model: nn.Module, settings: LoRASettings, *, trainable: tuple = (), base_path: Optional[str] = None,
               key: str = "lora") -> list[str]:
    """Put adapters on every projection named in `settings.target_modules`; freeze all else but `trainable`.

    `trainable`: top-level module names that stay fully trained (the critic's `score` head). `base_path`:
    the base model's directory, kept on the model for export. `key`: the config section the errors name
    (`actor.lora`, `critic.lora`). Returns the adapted module names.
    """
    if settings.rank < 1:
        raise ConfigError(f"{key}.rank={settings.rank}: a LoRA rank is at least 1 (0 means no LoRA)")
    if has_lora(model):
        raise ConfigError(f"{type(model).__name__} already has LoRA adapters; apply_lora runs once per model")
    targets = resolve_targets(settings.target_modules, key=f"{key}.target_modules")
    model.requires_grad_(False)
    if _is_peft_target(model):
        names = _inject_peft(model, settings, targets, key)
    else:
        names = []
        skip = tuple(getattr(model, "lora_skip", ()))  # subtrees without adapters (a vision tower: qwen_vl.py)
        for name, module in list(model.named_modules()):
            if name.split(".")[0] in skip:
                continue
            for child_name, child in list(module.named_children()):
                if child_name in targets and isinstance(child, nn.Linear):
                    setattr(module, child_name, LoRALinear(child, settings.rank, settings.alpha, settings.dropout))
                    names.append(f"{name}.{child_name}" if name else child_name)
    if not names:
        raise ConfigError(f"{key}.target_modules={list(targets)} matched no linear layer of {type(model).__name__}")
    for head in trainable:
        getattr(model, head).requires_grad_(True)
    if not _is_peft_target(model):
        # what the checkpoint record and a PEFT export name: the targets this model has (all-linear on a dense
        # model is its seven projections, not the linear-attention names it lacks)
        adapted = {name.rsplit(".", 1)[-1] for name in names}
        targets = tuple(t for t in targets if t in adapted)
    model.lora_settings = replace(settings, target_modules=targets)
    model.lora_base_path = os.path.abspath(base_path) if base_path and os.path.isdir(base_path) else base_path
    return names


def _inject_peft(model: nn.Module, settings: LoRASettings, targets: tuple, key: str) -> list[str]:
    """The transformers fallback: peft's own LoRA layers, injected in place (the model stays a transformers model)."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as exc:
        raise ConfigError("LoRA on a transformers-fallback model needs the `peft` package: "
                          "pip install 'phaserl[lora]' (or pip install peft)") from exc
    # every projection = all-linear: peft's own rule then finds this architecture's linear layers (GPT-2's Conv1D
    # c_attn / c_fc too), the vocabulary head excepted, instead of matching our decoder's names
    wanted = "all-linear" if set(targets) == set(PROJECTIONS) else list(targets)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=wanted, bias="none")
    try:
        model.hf_model = inject_adapter_in_model(config, model.hf_model)
    except ValueError as exc:  # peft: no module of the model matches the targets
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.hf_model.named_modules()
                         if type(m).__name__ in ("Linear", "Conv1D")})
        raise ConfigError(f"{key}.target_modules={list(targets)} matched no layer of this transformers model "
                          f"({type(model.hf_model).__name__}); its linear layers are named {linear[:12]}: use "
                          "all-linear") from exc
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return sorted({name.rsplit(".lora_", 1)[0] for name, _ in model.named_parameters() if "lora_" in name})


def lora_modules(model: nn.Module) -> Iterator[nn.Module]:
    """Our LoRALinear modules, or peft's LoRA layers on a transformers-fallback model."""
    for m in model.modules():
        if isinstance(m, LoRALinear) or hasattr(m, "enable_adapters") and hasattr(m, "lora_A"):
            yield m


def state_dict_options(model: nn.Module):
    """What a checkpoint of `model` keeps (torch.distributed.checkpoint's StateDictOptions): every weight, or with
    LoRA only the trainable ones (adapters, a critic's value head); the frozen base is the run's model directory."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    trainable_only = has_lora(model)
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def is_adapter_parameter(name: str) -> bool:
    """`...q_proj.lora_A` (ours) or `...q_proj.lora_A.default.weight` (peft's)."""
    return ".lora_A" in name or ".lora_B" in name


def has_lora(model: nn.Module) -> bool:
    return getattr(model, "lora_settings", None) is not None


@contextmanager
def adapters_disabled(model: nn.Module):
    """Run `model` as its base: every adapter off inside the block, back on after (the reference pass)."""
    modules = list(lora_modules(model))
    for m in modules:
        _enable(m, False)
    try:
        yield model
    finally:
        for m in modules:
            _enable(m, True)


def _enable(module: nn.Module, on: bool) -> None:
    if isinstance(module, LoRALinear):
        module.adapter_enabled = on
    else:
        module.enable_adapters(on)  # peft's BaseTunerLayer


def engine_weight(linear: nn.Module, into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The weight the rollout engine multiplies for projection `linear`: its own tensor (read in place), or
    for a LoRALinear the merged W + scaling · B A (`LoRALinear.merge_into`), written straight into `into` (an
    engine-owned buffer of the same shape and dtype, refilled in place so captured graphs keep their
    pointers) or into a new tensor. The base weight is never written."""
    if not isinstance(linear, LoRALinear) or not linear.adapter_enabled:
        return linear.weight
    w = linear.weight
    if into is None or (into.shape, into.dtype) != (w.shape, w.dtype) or into.data_ptr() == w.data_ptr():
        into = torch.empty_like(w)
    return linear.merge_into(into)


def adapter_parameter_count(model: nn.Module, settings: LoRASettings) -> int:
    """Parameters the adapters of `settings` would add to `model` (not yet adapted): r × (in + out) per target."""
    targets = resolve_targets(settings.target_modules)
    return sum(settings.rank * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets)


def trainable_summary(model: nn.Module) -> str:
    """'1.23M trainable of 494.03M parameters (0.25%)' for logs."""
    total = sum(p.numel() for p in model.parameters())
    train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"{train / 1e6:.2f}M trainable of {total / 1e6:.2f}M parameters ({100 * train / max(total, 1):.2f}%)"


def lora_record(model: nn.Module) -> dict:
    """What a checkpoint notes about a LoRA model (architecture/{role}.json): the settings and the base directory."""
    s: LoRASettings = model.lora_settings
    return {"rank": s.rank, "alpha": s.alpha, "dropout": s.dropout, "target_modules": list(s.target_modules),
            "base_path": model.lora_base_path}


def settings_from_record(record: dict) -> LoRASettings:
    return LoRASettings(rank=record["rank"], alpha=record["alpha"], dropout=record["dropout"],
                        target_modules=tuple(record["target_modules"]))


# ----- PEFT's file layout (export) ------------------------------------------------------------------
def peft_adapter_files(model: nn.Module, base_name: str = "", fused: list = ()) -> tuple[dict, dict]:
    """(adapter_config.json dict, adapter_model.safetensors tensors) in the layout `peft.PeftModel.from_pretrained`
    reads: keys `base_model.model.<module>.lora_A.weight`, float32, our decoder's names being transformers'.
    `fused`: the family's fused checkpoint modules (families.fused_projections: Phi-3's qkv_proj, gate_up_proj),
    whose parts' adapters are written as one exact adapter each."""
    s: LoRASettings = model.lora_settings
    adapters = {name: p.detach().float().cpu() for name, p in model.named_parameters()
                if name.endswith((".lora_A", ".lora_B"))}
    targets, ranks, alphas = list(s.target_modules), {}, {}
    for module, parts, sizes in fused:  # Phi-3: transformers' q/k/v (gate/up) are one module
        adapters, n = _fuse_adapters(adapters, module, parts, sizes, s.rank)
        if n:
            short = lambda m: m.rsplit(".", 1)[-1]  # noqa: E731
            targets = [t for t in targets if t not in map(short, parts)] + [short(module)]
            ranks[short(module)], alphas[short(module)] = n * s.rank, n * s.alpha  # alpha / r stays the scaling
    tensors = {f"base_model.model.{name}.weight": t.contiguous() for name, t in adapters.items()}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": s.rank, "lora_alpha": s.alpha,
              "lora_dropout": s.dropout, "target_modules": targets, "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
              "use_dora": False, "modules_to_save": None, "base_model_name_or_path": base_name,
              "rank_pattern": ranks, "alpha_pattern": alphas}
    return config, tensors


def _fuse_adapters(adapters: dict, fused: str, parts: tuple, sizes: list, rank: int) -> tuple[dict, int]:
    """Adapters of our separate `parts` (e.g. q/k/v) as one exact adapter of the checkpoint's fused module: A
    stacks the parts' A [n r, in], B is block-diagonal [sum(sizes), n r] (zero rows for a part without an
    adapter), so B A = [B_q A_q; B_k A_k; B_v A_v]. Returns the new dict and n, the parts that had adapters."""
    out, n = dict(adapters), 0
    prefixes = {name[: -len(part) - len(".lora_A")] for name in adapters for part in parts
                if name.endswith(f"{part}.lora_A")}
    for prefix in sorted(prefixes):
        have = [(i, part) for i, part in enumerate(parts) if f"{prefix}{part}.lora_A" in adapters]
        n = len(have)
        A = torch.cat([out.pop(f"{prefix}{part}.lora_A") for _, part in have])          # [n r, in]
        B = torch.zeros(sum(sizes), n * rank)                                          # [out, n r]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        for j, (i, part) in enumerate(have):
            B[offsets[i]:offsets[i] + sizes[i], j * rank:(j + 1) * rank] = out.pop(f"{prefix}{part}.lora_B")
        out[f"{prefix}{fused}.lora_A"], out[f"{prefix}{fused}.lora_B"] = A, B
    return out, n


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every LoRALinear by a plain nn.Linear holding the merged weight (in place; for export only)."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if hasattr(child, "get_base_layer") and hasattr(child, "lora_A"):  # peft's layer (fallback models)
                child.merge()
                setattr(module, child_name, child.get_base_layer())
            elif isinstance(child, LoRALinear):
                plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                  device="meta")
                plain.weight = nn.Parameter(child.merged_weight().detach(), requires_grad=False)
                plain.bias = child.bias
                setattr(module, child_name, plain)
    model.lora_settings = None
    return model
