"""Export of a LoRA role: the base directory + the checkpoint's adapters -> merged HF weights, or a PEFT dir.

A LoRA checkpoint's dcp/ holds the trainable state only (adapters; a critic's value head too), and
architecture/{role}.json records the LoRA settings and the base directory the run started from. Export
loads that base, puts the same adapters on it, fills them from dcp/, then either
  merged   W + (alpha / r) B A written into every adapted projection: a plain Hugging Face directory
           (`AutoModelForCausalLM.from_pretrained`), same logits as the trained actor up to rounding to
           the base dtype, or
  adapter  PEFT's layout: adapter_config.json + adapter_model.safetensors, loaded on the base with
           `peft.PeftModel.from_pretrained(base, dir)` (the actor only; peft itself is not needed here).
Not here: the plain (full-parameter) export (export.py), loading checkpoints in a live run (state.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import ConfigError
from ..models import load_pretrained, load_value_model, save_pretrained, save_value_model, value_model_of
from ..models.families import fused_projections
from ..models.gemma4_composite import peft_composite_adapter
from ..models.lora import apply_lora, merge_lora, peft_adapter_files, settings_from_record
from .state import load_module

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def export_lora_role(ckpt_dir: str, out_dir: str, arch: dict, *, role: str, adapter: bool, tokenizer) -> Path:
    """`role` of checkpoint `ckpt_dir` (with LoRA) as merged HF weights, or (`adapter`) as a PEFT adapter dir."""
    record = arch.get("lora")
    if record is None:
        raise ConfigError(f"export --adapter: the {role} of {ckpt_dir!r} was trained without LoRA (no adapters to "
                          "write); drop --adapter to export its full weights")
    if adapter and role != "actor":
        raise ConfigError("export --adapter writes a causal-LM adapter (the actor); export the critic merged "
                          "(drop --adapter)")
    base_path = record["base_path"]
    if not base_path or not os.path.isdir(base_path):
        raise ConfigError(f"{ckpt_dir!r} holds the {role}'s LoRA adapters only; its base model directory "
                          f"{base_path!r} (architecture/{role}.json, lora.base_path) is not there. Put the base "
                          "model back at that path (or edit lora.base_path to where it now is) and export again")
    dtype = getattr(torch, arch["dtype"])
    model = _load_base(base_path, role, dtype)
    apply_lora(model, settings_from_record(record), trainable=("score",) if role == "critic" else (),
               base_path=base_path)
    load_module(model, ckpt_dir, role)
    if adapter:
        return write_peft_adapter(model, out_dir, base_path)
    merge_lora(model)
    if role == "critic":
        return save_value_model(model, out_dir, tokenizer=tokenizer, dtype=dtype)
    return save_pretrained(model, out_dir, tokenizer=tokenizer, dtype=dtype)


def _load_base(base_path: str, role: str, dtype: torch.dtype) -> torch.nn.Module:
    if role != "critic":
        return load_pretrained(base_path, dtype=dtype)
    with open(os.path.join(base_path, "config.json"), encoding="utf-8") as f:
        architectures = json.load(f).get("architectures") or []
    if any(str(a).endswith("ForSequenceClassification") for a in architectures):  # critic.init_from=reward_model
        return load_value_model(base_path, dtype=dtype)
    return value_model_of(load_pretrained(base_path, dtype=dtype))


def write_peft_adapter(model: torch.nn.Module, out_dir: str, base_path: str) -> Path:
    """adapter_config.json + adapter_model.safetensors of `model`'s adapters, in `out_dir` (created)."""
    if hasattr(model, "hf_model"):
        raise ConfigError("export --adapter of a transformers-fallback model is not supported: its adapters are "
                          "peft's own; export merged weights (drop --adapter)")
    config, tensors = peft_adapter_files(model, base_name=os.path.abspath(base_path),
                                         fused=fused_projections(model.config))
    if getattr(model, "hf_composite", None) is not None:  # a multimodal Gemma 4 base: its text model's names
        config, tensors = peft_composite_adapter(config, tensors)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(out / ADAPTER_CONFIG, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return out
