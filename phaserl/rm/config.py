"""The config of `phaserl train-rm`: one flat, typed section, read from YAML with phaserl.config's rules.

Values are converted and range-checked by `phaserl.config.load.convert` (the same YAML 1.2 dialect,
the same messages: file, key, value, what was expected); an unknown key is an error that suggests the
closest key of *this* config. The defaults are the tiny-world recipe: `phaserl train-rm` with no file
trains the built-in tiny RM in under a minute on a CPU.

Not here: the training itself (train.py), the RL config's `reward_model` section (phaserl.config).
"""
from __future__ import annotations

import dataclasses
import difflib
import warnings
from dataclasses import dataclass
from typing import Iterable, Optional

import yaml

from phaserl.config.load import CLI, YamlLoader, convert, read_yaml, show
from phaserl.config.schema import spec
from phaserl.errors import ConfigError


@dataclass
class RMTrainConfig:
    model_path: str = spec("tiny", "RM init: a causal LM directory (gets a fresh zero score head) or a reward-model "
                                   "directory (keeps its head); 'tiny' = the tiny world's warm-started model")
    tokenizer_path: Optional[str] = spec(None, "the RM's tokenizer directory; null means model_path")
    train_files: list[str] = spec(None, "preference files (.jsonl/.parquet: prompt, chosen_response, "
                                        "rejected_response); 'tiny' = pairs made from the tiny world",
                                  factory=lambda: ["tiny"])
    val_files: list[str] = spec(None, "held-out preference files for pairwise accuracy; 'tiny' = tiny-world pairs",
                                factory=lambda: ["tiny"])
    steps: int = spec(1000, "optimizer steps", min=1)
    lr: float = spec(1e-3, "AdamW learning rate (constant after warmup)", min=1e-12)
    weight_decay: float = spec(0.0, "AdamW weight decay", min=0.0)
    warmup_steps: int = spec(0, "linear warmup, in optimizer steps", min=0)
    grad_clip: float = spec(1.0, "max gradient norm (0 = off)", min=0.0)
    batch_size: int = spec(32, "preference PAIRS per optimizer step (2x sequences in the forward)", min=1)
    max_length: int = spec(512, "tokens of prompt+response per input, at most (use the RL run's "
                                "reward_model.max_length)", min=8)
    truncation_side: str = spec("left", "which end to cut an over-long input (left keeps the response end)",
                                choices=["left", "right"])
    apply_chat_template: bool = spec(True, "format (prompt, response) with a chat template (as reward_model."
                                           "apply_chat_template will at scoring time)")
    chat_template: Optional[str] = spec(None, "a Jinja chat template overriding the tokenizer's own; saved as the "
                                              "exported tokenizer's template")
    out_dir: str = spec("runs/rm", "run directory: the RM goes to {out_dir}/model, tiny pairs to {out_dir}/data")
    seed: int = spec(0, "seed for init, pair order and the tiny pairs")
    device: str = spec("auto", "cpu, cuda, or auto (cuda when available)", choices=["auto", "cpu", "cuda"])
    log_every: int = spec(50, "log loss and pair accuracy every this many steps (0 = never)", min=0)
    tiny_train_pairs: int = spec(2000, "pairs generated for train_files: [tiny] (from the sft split)", min=1)
    tiny_val_pairs: int = spec(400, "pairs generated for val_files: [tiny] (from the val split)", min=1)


def _field_types() -> dict:
    import typing

    return typing.get_type_hints(RMTrainConfig)


def _meta(name: str) -> dict:
    return next(f.metadata for f in dataclasses.fields(RMTrainConfig) if f.name == name)


def _unknown(key: str, where: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(RMTrainConfig)]
    near = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    hint = f"; did you mean {near[0]}?\n  {near[0]}: {_meta(near[0])['help']}" if near else \
        f"; valid keys: {', '.join(names)}"
    return ConfigError(f"{where}: unknown key {key} in a train-rm config{hint}")


def _set(values: dict, key: str, value, where: str) -> None:
    types = _field_types()
    if key not in types:
        raise _unknown(key, where)
    values[key] = convert(value, types[key], _meta(key), key, where)


def load_rm_config(path: Optional[str], overrides: Iterable[str] = ()) -> RMTrainConfig:
    """The train-rm config of YAML file `path` (None = the defaults) with `key=value` overrides applied."""
    source = path if path is not None else "default train-rm config"
    data = read_yaml(path) if path is not None else None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of train-rm keys at the top level, got {show(data)}")
    values: dict = {}
    for key, value in (data or {}).items():
        _set(values, str(key), value, source)
    for text in overrides:
        key, sep, raw = text.partition("=")
        where = f"{CLI} {text!r}"
        if not sep or not key.strip():
            raise ConfigError(f"{where}: expected key=value, e.g. steps=500")
        try:
            value = yaml.load(raw, Loader=YamlLoader)
        except yaml.YAMLError:
            raise ConfigError(f"{where}: the value {raw!r} is not valid YAML; quote it to pass a string") from None
        _set(values, key.strip(), value, where)
    cfg = RMTrainConfig(**values)
    _check(cfg, source)
    return cfg


def _check(cfg: RMTrainConfig, source: str) -> None:
    if not cfg.train_files:
        raise ConfigError(f"{source}: train_files is empty; list preference files or write [tiny]")
    if not cfg.val_files:
        raise ConfigError(f"{source}: val_files is empty; held-out pairs are how you know the RM learned "
                          f"something: list held-out preference files (or [tiny])")
    if cfg.chat_template is not None and not cfg.apply_chat_template:
        warnings.warn(f"{source}: chat_template is ignored because apply_chat_template = false", stacklevel=3)
