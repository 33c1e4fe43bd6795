"""The multimodal Gemma 4 directory (`model_type: gemma4`, Gemma4ForConditionalGeneration) read as its text model.

Gemma 4 E2B/E4B (and the larger Gemma 4 models) are published as one composite: config.json holds the text model's
keys under `text_config` beside `vision_config` / `audio_config`, and model.safetensors holds the text weights under
`model.language_model.*` beside the vision and audio towers and their embedding projectors (`model.vision_tower.*`,
`model.audio_tower.*`, `model.embed_vision.*`, `model.embed_audio.*`). For text-only RL the native decoder reads:
  - the config: `text_config` as a gemma4_text config.json, with the composite's `tie_word_embeddings` (absent:
    true) deciding whether the output head is the embedding, as transformers decides it for the composite, and the
    composite's token ids where the text config has none;
  - the weights: `model.language_model.X` is our `model.X`; the towers' tensors are skipped (`text_name`).
On text-only input the logits equal transformers' Gemma4ForConditionalGeneration. What the native model does not
do: images and audio (their placeholder tokens are plain tokens here; transformers swaps them for the pad
embedding and the tower's features).
Writing (`to_hf`): the composite again, so that the written directory replaces the one read: config.json is the
source's with our text config and dtype, the text weights under their composite names, and the towers' tensors
copied unchanged from the source directory (`Composite.source`; it must still exist when exporting). A LoRA run's
PEFT adapter (`peft_composite_adapter`) names the composite's text modules, so that peft loads it onto the composite.
Not here: the text model's math (gemma4.py, layers.py), reading and writing files (hf_io.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from phaserl.errors import ConfigError

MODEL_TYPE = "gemma4"
TEXT_PREFIX = "model.language_model."
TOWER_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
TOWERS_NOT_LOADED = "vision/audio towers not loaded: text-only RL"
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class Composite:
    """Where a native model's text came from: the composite directory and its config.json (for export)."""
    source: str   # the directory read; export copies its towers' tensors
    config: dict  # its config.json, text_config included

    def record(self) -> dict:
        return {"source": self.source, "config": self.config}

    @classmethod
    def from_record(cls, record: dict) -> "Composite":
        return cls(source=record["source"], config=record["config"])


def is_composite(hf_config: dict) -> bool:
    return hf_config.get("model_type") == MODEL_TYPE


def has_towers(hf_config: dict) -> bool:
    return hf_config.get("vision_config") is not None or hf_config.get("audio_config") is not None


def text_config(hf_config: dict, source: str) -> dict:
    """The gemma4_text config.json dict the composite's text model is built from (module docstring)."""
    text = hf_config.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: model_type='gemma4' without a text_config object; the multimodal Gemma 4 "
                          "config.json holds its text model's keys there (re-save it with transformers)")
    tie = hf_config.get("tie_word_embeddings")
    ids = {k: hf_config[k] for k in _TOKEN_IDS if hf_config.get(k) is not None}
    return {**ids, **text, "model_type": "gemma4_text", "tie_word_embeddings": True if tie is None else bool(tie)}


def text_name(name: str) -> Optional[str]:
    """Our name of a composite checkpoint tensor: None for a tower's; names outside the composite pass unchanged."""
    if name.startswith(TOWER_PREFIXES):
        return None
    if name.startswith(TEXT_PREFIX):
        return "model." + name[len(TEXT_PREFIX):]
    return name


def is_tower(name: str) -> bool:
    return name.startswith(TOWER_PREFIXES)


def file_name(name: str) -> str:
    """The composite's name of one of our tensors (lm_head.weight, untied, keeps its name)."""
    return TEXT_PREFIX + name[len("model."):] if name.startswith("model.") else name


def peft_composite_adapter(config: dict, tensors: dict) -> tuple[dict, dict]:
    """A PEFT adapter of our text model (lora.peft_adapter_files) for the composite: the text model's module names,
    and target_modules a pattern that matches them only (the towers have q_proj ... of their own)."""
    prefix = "base_model.model."
    renamed = {prefix + file_name(k[len(prefix):]): v for k, v in tensors.items()}
    targets = "|".join(config["target_modules"])
    return {**config, "target_modules": rf"{TEXT_PREFIX.replace('.', '[.]')}.*[.]({targets})"}, renamed


def to_hf(composite: Composite, text: dict[str, Any], state: dict, towers: dict, dtype: str) -> tuple[dict, dict]:
    """(config.json, tensors) of the composite directory holding `state` (ours, in the gemma4_text layout) as its
    text model, with `text` (families.config_to_hf of our config) as its text_config and `towers` (the source's
    tensors, unchanged) beside it."""
    source_text = composite.config.get("text_config") or {}
    # Ours describe the network; the source's other keys stay. Image tokens' bidirectional attention is the
    # multimodal model's business, not ours (gemma4.hf_fields writes none): the source's value stays.
    text = {**source_text, **{k: v for k, v in text.items() if k != "architectures"}, "dtype": dtype,
            "use_bidirectional_attention": source_text.get("use_bidirectional_attention")}
    text.pop("torch_dtype", None)
    config = {**composite.config, "text_config": text, "dtype": dtype,
              "tie_word_embeddings": text["tie_word_embeddings"]}
    config.pop("torch_dtype", None)
    return config, {**{file_name(k): v for k, v in state.items()}, **towers}
