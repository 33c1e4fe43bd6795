"""Where the config's names become things: 'tiny', 'auto', device and dtype names, and the reward sources.

One home for every resolver, shared by the trainer's builder (`trainer/build.py`), the doctor
(`phaserl doctor` builds what `train` would build) and `phaserl train-rm` (through `resolve_rm_config`):

    'tiny'    as a model or tokenizer path: the tiny world's warm-started model (phaserl.world)
    'tiny_vision'  as a model path or data file: the vision world's tiny VLM and counting scenes (world/vision_build.py)
              as a data file: the tiny world's train / val prompt file
              as a reward-model path: the tiny world's reward model, trained on first use (phaserl.rm)
              as a train-rm preference file: tiny-world pairs written under the run's out_dir
    'auto'    as a device: cuda when a GPU is visible, else cpu; cuda means this rank's GPU
    the compile cache: torch.compile's persistent caches under phaserl's cache directory (compile_cache.py)

What it does not do: load models (phaserl.models), read rows (phaserl.data) or validate the config
(phaserl.config). The tiny world and the tiny RM are imported on first use, so that importing this
module stays cheap.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch

from .errors import ConfigError

if TYPE_CHECKING:
    from .config import Config
    from .rewards import RewardSources
    from .rm import RMTrainConfig

TINY = "tiny"
TINY_VISION = "tiny_vision"  # the vision world (world/vision_build.py): its tiny VLM and its counting scenes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    """model.dtype's names (the schema checks the choice)."""
    return DTYPES[name]


def resolve_device(name: str, *, key: str = "trainer.device") -> torch.device:
    """'auto' | 'cuda' | 'cpu' (`key` names the setting in the error); 'cuda' is this rank's GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}=cuda but no CUDA device is visible; use {key}=cpu")
    if name == "cuda":
        from .parallel import rank_and_world

        return torch.device("cuda", rank_and_world()[0] % torch.cuda.device_count())
    return torch.device(name)


def resolve_compile_cache_dir() -> str:
    """Where torch.compile's caches persist across runs: $PHASERL_CACHE_DIR/torch-compile (~/.cache/phaserl/...)."""
    from .world.build import cache_root

    return str(cache_root() / "torch-compile")


def resolve_model_path(path: str) -> str:
    """'tiny' names the built-in tiny world's warm-started model, 'tiny_vision' the vision world's tiny VLM; any
    other path is returned as it is."""
    if path == TINY:
        from .world import prepare_tiny_world

        return prepare_tiny_world().model_dir
    if path == TINY_VISION:
        from .world.vision_build import prepare_vision_world

        return prepare_vision_world().model_dir
    return path


def reference_is_lora_base(cfg: "Config") -> bool:
    """A LoRA actor whose reference starts from the actor's own directory: the reference is then the actor's
    base with its adapters off, no second copy (the builder makes it; the doctor counts it)."""
    if not cfg.actor.lora.rank:
        return False
    return cfg.ref.path is None or resolve_model_path(cfg.ref.path) == resolve_model_path(cfg.model.path)


def resolve_data_files(files: list[str], split: str) -> list[str]:
    """data.train_files / data.val_files: 'tiny' is the tiny world's file of that split ('train' | 'val'),
    'tiny_vision' the vision world's."""
    if TINY_VISION in files:
        from .world.vision_build import prepare_vision_world

        world = prepare_vision_world()
        files = [(world.train_file if split == "train" else world.val_file) if f == TINY_VISION else f for f in files]
    if TINY not in files:
        return list(files)
    from .world import prepare_tiny_world

    world = prepare_tiny_world()
    tiny = world.train_file if split == "train" else world.val_file
    return [tiny if f == TINY else f for f in files]


def resolve_reward_model_path(path: Optional[str]) -> Optional[str]:
    """'tiny' names the built-in tiny-world reward model (trained on first use); any other path (or None)
    is returned as it is."""
    if path == TINY:
        from .rm.tiny_model import prepare_tiny_reward_model

        return prepare_tiny_reward_model()
    return path


def resolve_preference_files(files: list[str], split: str, *, out_dir: str, n_train: int, n_val: int,
                             seed: int) -> list[str]:
    """train-rm's train_files / val_files: 'tiny' is the tiny-world pair file of that split, written under
    {out_dir}/data (n_train / n_val pairs drawn with `seed`)."""
    if TINY not in files:
        return list(files)
    import os

    from .rm.tiny_prefs import write_tiny_preference_files

    train, val = write_tiny_preference_files(os.path.join(out_dir, "data"), n_train=n_train, n_val=n_val, seed=seed)
    return [(train if split == "train" else val) if f == TINY else f for f in files]


def resolve_rm_config(cfg: "RMTrainConfig") -> "RMTrainConfig":
    """A train-rm config with no names left: model and tokenizer paths, device, preference files."""
    def files(names: list[str], split: str) -> list[str]:
        return resolve_preference_files(names, split, out_dir=cfg.out_dir, n_train=cfg.tiny_train_pairs,
                                        n_val=cfg.tiny_val_pairs, seed=cfg.seed)

    return dataclasses.replace(
        cfg, model_path=resolve_model_path(cfg.model_path),
        tokenizer_path=resolve_model_path(cfg.tokenizer_path) if cfg.tokenizer_path else None,
        device=str(resolve_device(cfg.device, key="device")),
        train_files=files(cfg.train_files, "train"), val_files=files(cfg.val_files, "val"))


def resolve_reward_workers(cfg: "Config") -> int:
    """reward.workers, or when auto the rule's answer for this machine (logged once, with why)."""
    import logging
    import os

    from .config.auto import choose, reward_workers_rule

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's count of ranks on this machine
    choice = choose("reward.workers", cfg.reward.workers,
                    reward_workers_rule(functions=[f.name for f in cfg.reward.functions], cpus=cpus,
                                        ranks_here=ranks_here))
    if cfg.reward.workers is None:
        logging.getLogger(__name__).info(f"[rewards] {choice.line()}")
    return choice.value


def build_reward_sources(cfg: "Config", device: torch.device) -> "RewardSources":
    """The score phase's sources from `reward.*` and `reward_model.*`, exactly as `train` builds them (the
    doctor's probes score real rows with the same objects)."""
    from .rewards import RewardSources, RuleRewards
    from .roles import RewardModelWrapper

    rules = None
    if cfg.reward.functions:
        rules = RuleRewards([(f.name, f.weight, f.kwargs) for f in cfg.reward.functions],
                            timeout_s=cfg.reward.timeout_s, workers=resolve_reward_workers(cfg))
    rm = None
    if cfg.reward_model.enable:
        rc = cfg.reward_model
        rm = RewardModelWrapper.from_pretrained(
            resolve_reward_model_path(rc.path), tokenizer_path=rc.tokenizer_path, engine=rc.engine,
            apply_chat_template=rc.apply_chat_template, chat_template=rc.chat_template, response_key=rc.response_key,
            max_length=rc.max_length, truncation=rc.truncation, truncation_side=rc.truncation_side,
            batch_size=rc.batch_size, micro_batch_tokens=rc.micro_batch_tokens, packing=rc.packing, device=device)
    return RewardSources(rules=rules, reward_model=rm, reward_model_weight=cfg.reward.reward_model_weight)
