"""A checkpoint → a Hugging Face model directory (`phaserl export CKPT OUT_DIR [--critic]`).

The actor becomes a causal-LM directory (model.safetensors, config.json, generation_config.json,
tokenizer files) that `transformers.AutoModelForCausalLM.from_pretrained` loads with the logits the
trainer had; the critic (`critic=True`) a `*ForSequenceClassification` directory with num_labels=1.
Everything comes from the checkpoint itself (architecture/, tokenizer/, dcp/): the base model the run
started from is not needed, except for a run on a multimodal Gemma 4 directory, whose export copies the vision
and audio towers from it (models/gemma4_composite.py). Runs in one process, whatever world size wrote the
checkpoint (DCP gathers the shards). LoRA checkpoints (adapters only) go through lora_export.py: merged into the
base, or a PEFT adapter directory (`--adapter`). Not here: pushing to the hub.
"""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Optional

import torch

from ..errors import CheckpointError, ConfigError
from ..models import CausalLM, ValueModel, load_tokenizer, save_pretrained, save_value_model, value_model_of
from ..models.families import config_from_hf
from ..models.gemma4_composite import Composite
from . import manifest, store
from .lora_export import export_lora_role
from .state import ARCH_DIR, TOKENIZER_DIR, load_module, read_architecture

log = logging.getLogger("phaserl")


def resolve_checkpoint(path: str) -> store.CheckpointInfo:
    """A complete, verified checkpoint: `path` itself, or the newest good one when `path` is a checkpoint_path root."""
    if not os.path.isdir(path):
        raise ConfigError(f"checkpoint {path!r} does not exist (or is not a directory)")
    meta, why = store.read_metadata(path)
    if meta is not None:
        problems = manifest.verify(path, full=True)
        if problems:
            raise CheckpointError(f"checkpoint {path!r} is damaged: {'; '.join(problems[:4])}; export an earlier "
                                  f"step_N (or the checkpoint_path {os.path.dirname(os.path.normpath(path))!r}: its "
                                  "newest good one)")
        return store.CheckpointInfo(path=path, step=int(meta["step"]), metadata=meta)
    if os.path.basename(os.path.normpath(path)).startswith((store.STEP_PREFIX, store.TMP_PREFIX)):
        raise ConfigError(f"checkpoint {path!r} is incomplete: {why}; use an earlier step_N directory "
                          f"(the newest complete one is named in {os.path.join(os.path.dirname(path), store.POINTER)})")
    found = store.scan(path)
    store.report_incomplete(found)
    for info in reversed(found.complete):
        problems = manifest.verify(info.path, full=True)
        if not problems:
            log.info(f"export: using the newest good checkpoint under {path}: {info.path}")
            return info
        log.warning(f"export: skipping the damaged {info.path}: {'; '.join(problems[:4])}")
    if found.complete:
        raise CheckpointError(f"every checkpoint under {path!r} is damaged (see the warnings above)")
    raise ConfigError(f"{path!r} is neither a checkpoint (step_N/ with {store.METADATA}) nor a "
                      "trainer.checkpoint_path holding complete ones")


def export_checkpoint(ckpt_dir: str, out_dir: str, *, critic: bool = False, overwrite: bool = False,
                      adapter: bool = False) -> Path:
    """Write the actor (or the critic) of checkpoint `ckpt_dir` as a Hugging Face directory `out_dir`;
    `adapter=True`: a LoRA actor's adapters alone, as a PEFT adapter directory."""
    info = resolve_checkpoint(ckpt_dir)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ConfigError(f"{out_dir!r} already exists and is not empty; pass --overwrite (overwrite=True) "
                          "to replace it, or choose another output directory")
    role = "critic" if critic else "actor"
    path = export_role(info.path, out_dir, role=role, adapter=adapter)
    log.info(f"export: step {info.step} {role}{' adapters' if adapter else ''} written to {path}")
    tokenizer_dir = os.path.join(info.path, TOKENIZER_DIR)
    wrote_tokenizer = os.path.isfile(os.path.join(path, "tokenizer.json"))  # not in a PEFT adapter directory
    if os.path.isdir(tokenizer_dir) and wrote_tokenizer:  # the usual AutoTokenizer call must give the training ids
        from .tokenizer_check import auto_tokenizer_hint

        hint = auto_tokenizer_hint(load_tokenizer(tokenizer_dir), str(path))
        if hint:
            log.warning(f"export: {hint}")
    return path


def export_role(ckpt_dir: str, out_dir: str, *, role: str, adapter: bool = False) -> Path:
    """Rebuild `role`'s model empty from architecture/{role}.json, fill it from dcp/, save it as HF.

    A LoRA role's checkpoint holds its trainable state only: its base is loaded from the directory the
    run started from (architecture/{role}.json names it), the adapters are merged into the weights, or
    with `adapter=True` written alone in PEFT's layout (lora_export.py)."""
    arch = read_architecture(ckpt_dir, role)
    if arch is None:
        arch_dir = os.path.join(ckpt_dir, ARCH_DIR)
        have = sorted(f.removesuffix(".json") for f in os.listdir(arch_dir)) if os.path.isdir(arch_dir) else []
        fix = "drop --critic to export the actor" if role == "critic" else "was it written by phaserl?"
        raise ConfigError(f"checkpoint {ckpt_dir!r} has no {role} (roles saved: {have}); {fix}")
    dtype = getattr(torch, arch["dtype"])
    tokenizer_dir = os.path.join(ckpt_dir, TOKENIZER_DIR)
    try:
        tokenizer = load_tokenizer(tokenizer_dir) if os.path.isdir(tokenizer_dir) else None
    except Exception as exc:  # whatever the tokenizer library raises on a damaged file: name the directory
        raise CheckpointError(f"{tokenizer_dir}: the tokenizer files do not load ({type(exc).__name__}: {exc}); the "
                              "checkpoint is damaged: export an earlier step_N") from None
    if "lora" in arch or adapter:
        return export_lora_role(ckpt_dir, out_dir, arch, role=role, adapter=adapter, tokenizer=tokenizer)
    model = _empty_model(arch, role)
    load_module(model, ckpt_dir, role)
    if role == "critic":
        return save_value_model(model, out_dir, tokenizer=tokenizer, dtype=dtype)
    return save_pretrained(model, out_dir, tokenizer=tokenizer, dtype=dtype)


def _empty_model(arch: dict, role: str) -> torch.nn.Module:
    # Built on the meta device (no random init), then given uninitialized CPU storage for DCP to fill.
    dtype = getattr(torch, arch["dtype"])
    with torch.device("meta"):
        if arch["kind"] == "native":
            lm = CausalLM(config_from_hf(arch["hf_config"], source=f"architecture/{role}.json"))
            if "gemma4_composite" in arch:  # the multimodal Gemma 4 directory the text was read from
                lm.hf_composite = Composite.from_record(arch["gemma4_composite"])
            model = ValueModel(lm) if role == "critic" else lm
        else:
            model = _transformers_model(arch["hf_config"])
            model = value_model_of(model) if role == "critic" else model
    return model.to_empty(device="cpu").to(dtype)


def _transformers_model(hf_config: dict) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..models.hf_fallback import HFCausalLM

    config = dict(hf_config)
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    return HFCausalLM(AutoModelForCausalLM.from_config(config))


def cli_export(argv: Optional[list] = None) -> int:
    """`phaserl export CHECKPOINT OUT_DIR [--critic] [--overwrite]`; errors are raised as PhaserlError."""
    p = argparse.ArgumentParser(prog="phaserl export", description=(
        "Write a checkpoint's actor (or critic) as a Hugging Face model directory."))
    p.add_argument("checkpoint", help="a step_N directory, or a trainer.checkpoint_path (its newest complete step)")
    p.add_argument("out_dir")
    p.add_argument("--critic", action="store_true", help="export the value model (sequence classification)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    p.add_argument("--adapter", action="store_true", help="a LoRA actor: write its adapters as a PEFT adapter "
                   "directory (adapter_config.json + adapter_model.safetensors) instead of merged weights")
    args = p.parse_args(argv)
    path = export_checkpoint(args.checkpoint, args.out_dir, critic=args.critic, overwrite=args.overwrite,
                             adapter=args.adapter)
    print(f"exported to {path}")
    return 0
