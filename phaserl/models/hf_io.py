"""Reading and writing Hugging Face model directories (config.json + safetensors + tokenizer files).

Every directory written here loads in transformers (`AutoModelForCausalLM`, or
`AutoModelForSequenceClassification` for value models) with the same outputs, and every directory of a
native family (families.py) that transformers writes loads here into our own decoder. Other architectures
load through transformers itself (hf_fallback.HFCausalLM, slow path, exact logits). Writes are atomic: a reader
never sees a half-written directory. Not here: sharded (FSDP/DCP) checkpoints, the hub (local only).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from phaserl.errors import ConfigError
from phaserl.models import gemma4_composite
from phaserl.models.config import DecoderConfig
from phaserl.models.decoder import CausalLM
from phaserl.models.families import (
    FAMILIES,
    NATIVE_MODEL_TYPES,
    config_from_hf,
    config_to_hf,
    hf_state,
    native_names,
    native_state,
)
from phaserl.models.hf_fallback import HFCausalLM, HFValueModel
from phaserl.models.moe import file_expert, stack_experts
from phaserl.models.qwen_vl import build_vl, is_vl_config, vl_config_to_hf
from phaserl.models.value import ValueModel

log = logging.getLogger("phaserl")

_SINGLE_FILE, _INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# Old checkpoints carry derived rotary tables; they are recomputed from the config, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

PathLike = Union[str, os.PathLike]


# ---------------------------------------------------------------------------------------------- reading

def _read_config(path: PathLike) -> tuple[Path, dict]:
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"model directory {str(directory)!r} does not exist (or is not a directory)")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{config_file}: missing; a Hugging Face model directory needs config.json")
    try:
        return directory, json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config_file}: not valid JSON ({e})") from None


@contextmanager
def _open_weights(file: Path, device: str = "cpu"):
    """safe_open, with a damaged file (truncated download, disk full while saving) named in a ConfigError."""
    try:
        with safe_open(file, framework="pt", device=device) as f:
            yield f
    except SafetensorError as e:
        raise ConfigError(f"{file}: not a complete safetensors file ({e}); it is truncated or damaged. "
                          "Re-download the model or re-export it") from None


def _weight_locations(directory: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it (single file or sharded index)."""
    index = directory / _INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        for file in sorted(set(weight_map.values())):  # the headers: a truncated shard is named before loading
            with _open_weights(directory / file):
                pass
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / _SINGLE_FILE
    if single.is_file():
        with _open_weights(single) as f:
            return {name: single for name in f.keys()}
    raise ConfigError(f"{directory}: no {_SINGLE_FILE} or {_INDEX_FILE} found (only safetensors weights "
                      "are supported; convert .bin checkpoints with transformers' save_pretrained)")


def _mismatch_error(directory: Path, missing: list, unexpected: list, mismatched: list = ()) -> ConfigError:
    shapes = f", wrong shape {len(mismatched)} tensor(s) {list(mismatched)[:5]}" if mismatched else ""
    return ConfigError(f"{directory}: the weights do not match config.json's architecture; "
                       f"missing {len(missing)} tensor(s) {missing[:5]}, unexpected {len(unexpected)} "
                       f"tensor(s) {unexpected[:5]}{shapes}; a model meant to start from random weights "
                       "for what is missing says so with model.allow_random_init=true")


def _load_weights(module: nn.Module, directory: Path, dtype: torch.dtype, device, ignore: tuple[str, ...] = (),
                  allow_missing: bool = False):
    """Fill `module` (built on the meta device; with allow_missing, a materialized module whose missing tensors
    keep their init) with the tensors of `directory`, checking names and shapes. Fused checkpoint tensors
    (Phi-3's qkv_proj, gate_up_proj) are split into ours by name (families.native_state); per-expert tensors (MoE)
    are stacked into ours (moe.stack_experts)."""
    cfg = module.config
    locations = {native: file for name, file in _weight_locations(directory).items()
                 if not name.endswith(_IGNORED_SUFFIXES) and name not in ignore
                 for native in native_names(cfg, name)}
    expected = module.state_dict()
    missing = sorted(set(expected) - set(locations))
    unexpected = sorted(set(locations) - set(expected))
    if unexpected or (missing and not allow_missing):
        raise _mismatch_error(directory, missing, unexpected)
    if missing:
        log.warning("%s: %d tensor(s) missing, randomly initialized (model.allow_random_init): %s", directory,
                    len(missing), missing[:5])
    state, expert_parts = {}, {}
    for file in sorted(set(locations.values())):
        with _open_weights(file) as f:
            for stored in f.keys():
                if not any(name in expected for name in native_names(cfg, stored)):
                    continue
                expert = file_expert(stored) if cfg.num_experts else None
                if expert is not None:  # MoE: one tensor per expert, stacked once a parameter has them all
                    parts = expert_parts.setdefault(expert[0], {})
                    parts[expert[1:]] = f.get_tensor(stored)
                    if len(parts) == cfg.num_experts * (1 if expert[0].endswith("down_proj") else 2):
                        state[expert[0]] = _stacked(directory, expert[0], expert_parts.pop(expert[0]), cfg,
                                                    expected, dtype, device)
                    continue
                try:
                    pieces = native_state(cfg, stored, f.get_tensor(stored))
                except ConfigError as e:
                    raise ConfigError(f"{file}: {e}") from None
                for name, tensor in pieces.items():
                    if tuple(tensor.shape) != tuple(expected[name].shape):
                        raise ConfigError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, config.json "
                                          f"implies {tuple(expected[name].shape)}")
                    state[name] = tensor.to(device=device, dtype=dtype)
    for name, parts in expert_parts.items():  # incomplete: the error names the missing experts
        state[name] = _stacked(directory, name, parts, cfg, expected, dtype, device)
    module.load_state_dict(state, strict=not missing, assign=not missing)


def _stacked(directory: Path, name: str, parts: dict, cfg: DecoderConfig, expected: dict, dtype, device):
    """Our stacked expert parameter `name` from its per-expert file tensors, checked against config.json."""
    try:
        tensor = stack_experts(name, parts, cfg.num_experts)
    except ValueError as e:
        raise ConfigError(f"{directory}: {e}") from None
    if tuple(tensor.shape) != tuple(expected[name].shape):
        raise ConfigError(f"{directory}: experts of {name!r} stack to shape {tuple(tensor.shape)}, config.json "
                          f"implies {tuple(expected[name].shape)}")
    return tensor.to(device=device, dtype=dtype)


def _build_on_meta(cfg: DecoderConfig, factory):
    # The meta device skips random init of weights that are about to be overwritten.
    with torch.device("meta"):
        module = factory(CausalLM(cfg))
    return module


def _restore_rotary(module: nn.Module, cfg: DecoderConfig, device) -> None:
    module.model.build_rotary(device)  # its buffers were built on meta


IMPLEMENTATIONS = ("auto", "native", "transformers")


def load_pretrained(path: PathLike, *, dtype: torch.dtype = torch.float32, device="cpu",
                    trust_remote_code: bool = False, implementation: str = "auto",
                    allow_random_init: bool = False) -> Union[CausalLM, HFCausalLM]:
    """A causal LM from a Hugging Face directory: our CausalLM for the native families (families.py), else
    HFCausalLM. implementation: "auto" (native where it exists), "native" (an error otherwise) or
    "transformers". Weights missing from the directory are an error unless `allow_random_init`."""
    if implementation not in IMPLEMENTATIONS:
        raise ConfigError(f"model.implementation={implementation!r} is not one of {IMPLEMENTATIONS}")
    directory, hf_config = _read_config(path)
    model_type = hf_config.get("model_type")
    if implementation == "native" and model_type == "qwen3_5":  # the composite: the error says what to do
        config_from_hf(hf_config, source=str(directory / "config.json"))
    if gemma4_composite.is_composite(hf_config) and implementation != "transformers":
        model = _load_gemma4_composite(directory, hf_config, dtype, device, implementation, allow_random_init)
        if model is not None:
            return model
    if is_vl_config(hf_config) and implementation != "transformers":  # Qwen2.5-VL: the decoder + a vision tower
        return _load_vl(directory, hf_config, dtype, device, allow_random_init)
    if implementation == "native" and model_type not in NATIVE_MODEL_TYPES:
        raise ConfigError(f"{directory / 'config.json'}: model_type {model_type!r} has no native implementation "
                          f"(native: {', '.join(NATIVE_MODEL_TYPES)}); use model.implementation=auto")
    if model_type not in NATIVE_MODEL_TYPES or implementation == "transformers":
        return _load_fallback(directory, model_type, dtype, device, trust_remote_code, allow_random_init)
    return _load_native(directory, config_from_hf(hf_config, source=str(directory / "config.json")), dtype, device,
                        allow_random_init)


def _load_native(directory: Path, cfg: DecoderConfig, dtype, device, allow_random_init: bool) -> CausalLM:
    if allow_random_init:  # materialized and initialized: what the directory lacks keeps its init
        model = CausalLM(cfg).to(device=device, dtype=dtype)
    else:
        model = _build_on_meta(cfg, lambda lm: lm)
    # Some exports store lm_head.weight even for tied models; the embedding is the one that counts.
    _load_weights(model, directory, dtype, device, ignore=("lm_head.weight",) if cfg.tie_word_embeddings else (),
                  allow_missing=allow_random_init)
    _restore_rotary(model, cfg, device)
    return model


def _load_gemma4_composite(directory: Path, hf_config: dict, dtype, device, implementation: str,
                           allow_random_init: bool) -> Optional[CausalLM]:
    """The multimodal Gemma 4 directory's text model on the native decoder (gemma4_composite.py); None under
    implementation=auto when its text model is not native (the MoE block): transformers runs the composite."""
    try:
        cfg = config_from_hf(hf_config, source=str(directory / "config.json"))
    except ConfigError as e:
        if implementation == "native":
            raise
        log.info("%s; using transformers", e)
        return None
    if gemma4_composite.has_towers(hf_config):
        log.info("%s: multimodal Gemma 4 read as its text model; %s", directory, gemma4_composite.TOWERS_NOT_LOADED)
    model = _load_native(directory, cfg, dtype, device, allow_random_init)
    model.hf_composite = gemma4_composite.Composite(source=str(directory.resolve()), config=hf_config)
    return model


def _composite_towers(composite: "gemma4_composite.Composite") -> dict[str, torch.Tensor]:
    """The tower tensors of the composite directory a model was read from, unchanged (export copies them)."""
    directory = Path(composite.source)
    if not directory.is_dir():
        raise ConfigError(f"{directory}: the multimodal Gemma 4 directory this model's text was read from is gone; "
                          "the export copies its vision/audio towers from there: put it back at that path")
    locations = {name: file for name, file in _weight_locations(directory).items() if gemma4_composite.is_tower(name)}
    towers = {}
    for file in sorted(set(locations.values())):
        with _open_weights(file) as f:
            towers.update((name, f.get_tensor(name)) for name, where in locations.items() if where == file)
    return towers


def _load_vl(directory: Path, hf_config: dict, dtype, device, allow_random_init: bool):
    model = build_vl(hf_config, str(directory / "config.json"), meta=not allow_random_init)
    if allow_random_init:
        model = model.to(device=device, dtype=dtype)
    ignore = ("lm_head.weight",) if model.config.tie_word_embeddings else ()
    _load_weights(model, directory, dtype, device, ignore=ignore, allow_missing=allow_random_init)
    _restore_rotary(model, model.config, device)
    return model


def _load_fallback(directory: Path, model_type, dtype, device, trust_remote_code: bool,
                   allow_random_init: bool = False) -> HFCausalLM:
    from transformers import AutoModelForCausalLM

    why = "is implemented natively, but model.implementation=transformers" if model_type in NATIVE_MODEL_TYPES \
        else "is not implemented natively"
    log.info("model_type %s %s; using transformers' AutoModelForCausalLM (slow path)", model_type, why)
    _weight_locations(directory)  # the same clear error as the native path when weights are missing
    kwargs = {"trust_remote_code": True} if trust_remote_code else {}
    try:
        hf_model, info = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True,
                                                              output_loading_info=True, **kwargs)
    except ValueError as e:
        raise ConfigError(f"{directory / 'config.json'}: transformers cannot build model_type {model_type!r}: "
                          f"{e}") from None
    missing, unexpected = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    mismatched = [str(m) for m in info.get("mismatched_keys") or ()]
    if unexpected or mismatched or (missing and not allow_random_init):
        raise _mismatch_error(directory, missing, unexpected, mismatched)
    if missing:
        log.warning("%s: %d tensor(s) missing, randomly initialized by transformers (model.allow_random_init): %s",
                    directory, len(missing), missing[:5])
    return HFCausalLM(hf_model.to(device))


def load_value_model(path: PathLike, *, dtype: torch.dtype = torch.float32,
                     device="cpu") -> Union[ValueModel, HFValueModel]:
    """A ValueModel from a `*ForSequenceClassification` directory written by save_value_model (or transformers);
    an architecture without a native decoder loads through transformers' own class (HFValueModel)."""
    directory, hf_config = _read_config(path)
    source = str(directory / "config.json")
    num_labels = len(hf_config["id2label"]) if "id2label" in hf_config else hf_config.get("num_labels", 2)
    if num_labels != 1:
        raise ConfigError(f"{source}: a value model has one output (num_labels=1), this one has {num_labels}; "
                          "to start a critic from a policy checkpoint use ValueModel(load_pretrained(path))")
    if hf_config.get("model_type") not in NATIVE_MODEL_TYPES:
        from transformers import AutoModelForSequenceClassification

        _weight_locations(directory)  # the same clear error as the native path when weights are missing
        classifier = AutoModelForSequenceClassification.from_pretrained(directory, dtype=dtype, local_files_only=True)
        return HFValueModel.from_classifier(classifier).to(device)
    cfg = config_from_hf(hf_config, source=source)
    model = _build_on_meta(cfg, ValueModel)
    _load_weights(model, directory, dtype, device)
    _restore_rotary(model, cfg, device)
    return model


def load_tokenizer(path: PathLike, *, trust_remote_code: bool = False):
    """transformers' AutoTokenizer from a local directory (never the hub)."""
    from transformers import AutoTokenizer

    directory = Path(path)
    if not directory.is_dir() or not any((directory / f).is_file() for f in _TOKENIZER_FILES):
        raise ConfigError(f"tokenizer directory {str(directory)!r} has none of {list(_TOKENIZER_FILES)}; "
                          "point model.tokenizer_path at a directory saved with tokenizer.save_pretrained")
    kwargs = {"trust_remote_code": True} if trust_remote_code else {}
    if _generic_tokenizer_class(directory):
        # tokenizer.json is the whole definition. AutoTokenizer would pick the class of config.json's
        # model_type (Qwen2Tokenizer for qwen2) and rebuild it from the vocab with that family's own
        # pre-tokenizer, silently dropping what it does not know (spaces, whole word-level tokens).
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)
    return AutoTokenizer.from_pretrained(directory, local_files_only=True, **kwargs)


_GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _generic_tokenizer_class(directory: Path) -> bool:
    """True when tokenizer_config.json names the generic fast class and a tokenizer.json exists."""
    config_file = directory / "tokenizer_config.json"
    if not (directory / "tokenizer.json").is_file() or not config_file.is_file():
        return False
    try:
        with open(config_file, encoding="utf-8") as f:
            named = json.load(f).get("tokenizer_class")
    except (OSError, ValueError) as err:
        raise ConfigError(f"{config_file}: not readable JSON ({err}); re-save the tokenizer with "
                          "tokenizer.save_pretrained") from err
    return named in _GENERIC_TOKENIZER_CLASSES


# ---------------------------------------------------------------------------------------------- writing

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _write_atomically(out_dir: PathLike, write) -> Path:
    """Run write(tmp_dir), then swap tmp_dir into out_dir; a crash leaves out_dir as it was."""
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = (out_dir.with_name(f".{out_dir.name}.{tag}-{os.getpid()}") for tag in ("tmp", "old"))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _cpu_state(module: nn.Module, dtype: Optional[torch.dtype]) -> dict[str, torch.Tensor]:
    return {name: (t if dtype is None else t.to(dtype)).detach().cpu().contiguous()
            for name, t in module.state_dict().items()}


def _write_common(directory: Path, config: dict, state: dict, cfg: DecoderConfig, tokenizer) -> None:
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, directory / _SINGLE_FILE, metadata={"format": "pt"})
    generation = {k: v for k, v in (("bos_token_id", cfg.bos_token_id), ("eos_token_id", cfg.eos_token_id),
                                    ("pad_token_id", cfg.pad_token_id)) if v is not None}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def save_pretrained(model: Union[CausalLM, HFCausalLM], out_dir: PathLike, *, tokenizer=None,
                    dtype: Optional[torch.dtype] = None) -> Path:
    """Write `model` as a Hugging Face directory; `dtype` converts the weights (None keeps theirs)."""
    if isinstance(model, HFCausalLM):
        def write_hf(tmp: Path):
            state = None if dtype is None else _cpu_state(model.hf_model, dtype)
            model.hf_model.save_pretrained(tmp, state_dict=state)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        return _write_atomically(out_dir, write_hf)
    # Tied models have no lm_head.weight (the HF layout for tied weights); Phi-3 stores fused tensors.
    state = hf_state(model.config, _cpu_state(model, dtype))
    dtype_name = _dtype_name(dtype or model.output_weight.dtype)
    composite = getattr(model, "hf_composite", None)
    if getattr(model, "takes_images", False):  # Qwen2.5-VL: the composite config (text_config, vision_config)
        config = vl_config_to_hf(model.config, model.vision_config, model.image_tokens, dtype_name)
    elif composite is not None:  # multimodal Gemma 4: the composite again, its towers copied from the source
        config, state = gemma4_composite.to_hf(composite, config_to_hf(model.config, dtype_name), state,
                                               _composite_towers(composite), dtype_name)
    else:
        config = config_to_hf(model.config, dtype_name)
    return _write_atomically(out_dir, lambda tmp: _write_common(tmp, config, state, model.config, tokenizer))


def check_value_model_export(model) -> None:
    """ConfigError when transformers has no *ForSequenceClassification class for the value model's model_type (Gemma
    4 has none): train-rm calls it before training, so that nothing is trained that cannot be written."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    model_type = model.config.model_type
    known = model_type in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES if isinstance(model, HFValueModel) \
        else FAMILIES[model_type].classifier is not None
    if not known:
        raise ConfigError(f"transformers has no *ForSequenceClassification class for model_type {model_type!r}, so a "
                          "value model of it cannot be exported as a Hugging Face directory (a PPO critic's own "
                          "checkpoints still save and resume it; a reward model needs another architecture)")


def save_value_model(model: ValueModel, out_dir: PathLike, *, tokenizer=None,
                     dtype: Optional[torch.dtype] = None) -> Path:
    """Write a `*ForSequenceClassification` directory (num_labels=1, `score.weight`); a transformers-path critic
    (HFValueModel) as transformers' own class of its model_type."""
    check_value_model_export(model)
    if isinstance(model, HFValueModel):
        classifier = model.to_sequence_classifier()

        def write_hf(tmp: Path):
            state = None if dtype is None else _cpu_state(classifier, dtype)
            classifier.save_pretrained(tmp, state_dict=state)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        return _write_atomically(out_dir, write_hf)
    cfg = model.config
    state = hf_state(cfg, _cpu_state(model, dtype))
    config = config_to_hf(cfg, _dtype_name(dtype or model.score.weight.dtype))
    config.update(architectures=[FAMILIES[cfg.model_type].classifier], id2label={"0": "LABEL_0"},
                  label2id={"LABEL_0": 0}, num_labels=1)
    return _write_atomically(out_dir, lambda tmp: _write_common(tmp, config, state, cfg, tokenizer))
