"""Put the tiny world on disk: prompt files in a cache directory, and the committed warm-started model.

`prepare_tiny_world()` writes three JSONL files the first time it runs (later calls reuse them):

    train.jsonl  2,000 RL prompts (verl schema, split "train")
    val.jsonl      200 held-out prompts (split "val")
    sft.jsonl    the sloppy teacher's 5,948 SFT examples ({"prompt": [...], "response": "..."})

and points `model_dir` at the committed model under phaserl/world/assets/tiny-sft/ (a Hugging Face
directory: config.json, model.safetensors, generation_config.json and the tokenizer files).
`regenerate_assets()` rebuilds that model from nothing (tokenizer, seeded random init, SFT), which
takes about two minutes on a 2-core CPU:

    python -m phaserl.world.build --regenerate

Everything here is deterministic: the same code writes the same files (and, on the same machine and
torch build, the same weights).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from phaserl.data.files import write_records
from phaserl.errors import ConfigError
from phaserl.world.task import DATA_SOURCE, make_problems, make_teacher_problems, pool_size, to_record

ASSETS_DIR = Path(__file__).resolve().parent / "assets" / "tiny-sft"
DATA_VERSION = "v1"  # bump when the task or file format changes, so old caches are not reused
NUM_TRAIN, NUM_VAL = 2000, 200
DATA_SEED = 0
REGENERATE_COMMAND = "python -m phaserl.world.build --regenerate"


@dataclass(frozen=True)
class TinyWorld:
    model_dir: str  # the warm-started policy (Hugging Face directory)
    tokenizer_dir: str  # the same directory: the tokenizer is saved next to the weights
    train_file: str  # RL prompts, verl-schema JSONL
    val_file: str  # held-out prompts, verl-schema JSONL
    sft_file: str  # the teacher's (prompt, response) pairs the model was warm-started on


CACHE_ENV = "PHASERL_CACHE_DIR"  # where phaserl keeps what it builds on first use (default ~/.cache/phaserl)


def cache_root() -> Path:
    """phaserl's cache directory: $PHASERL_CACHE_DIR, else ~/.cache/phaserl (the test suite points it at a temp dir)."""
    return Path(os.environ.get(CACHE_ENV) or os.path.expanduser("~/.cache/phaserl"))


def default_root() -> Path:
    return cache_root() / "tiny-world"


def sft_record(question: str, response: str, index: int) -> dict:
    return {"prompt": [{"role": "user", "content": question}], "response": response,
            "data_source": DATA_SOURCE, "extra_info": {"split": "sft", "index": index}}


def prepare_tiny_world(root: str | os.PathLike | None = None) -> TinyWorld:
    """Write the prompt files under `root` (default $PHASERL_CACHE_DIR/tiny-world, ~/.cache/phaserl/tiny-world
    when unset) if missing; return all paths."""
    data_dir = Path(root) if root is not None else default_root()
    data_dir = data_dir / DATA_VERSION
    files = {"train": data_dir / "train.jsonl", "val": data_dir / "val.jsonl", "sft": data_dir / "sft.jsonl"}
    writers = {
        "train": lambda: [to_record(p, i, "train") for i, p in enumerate(make_problems("train", NUM_TRAIN, DATA_SEED))],
        "val": lambda: [to_record(p, i, "val") for i, p in enumerate(make_problems("val", NUM_VAL, DATA_SEED))],
        "sft": lambda: [sft_record(p.question, p.answer, i)
                        for i, p in enumerate(make_teacher_problems(pool_size("sft"), DATA_SEED))],
    }
    for name, path in files.items():
        if not path.is_file():
            write_records(path, writers[name]())  # atomic: a crash never leaves half a file behind
    if not (ASSETS_DIR / "model.safetensors").is_file():
        raise ConfigError(f"the tiny-world model is missing from {ASSETS_DIR}; rebuild it with "
                          f"`{REGENERATE_COMMAND}` (about two minutes on CPU)")
    return TinyWorld(model_dir=str(ASSETS_DIR), tokenizer_dir=str(ASSETS_DIR), train_file=str(files["train"]),
                     val_file=str(files["val"]), sft_file=str(files["sft"]))


def regenerate_assets(out_dir: str | os.PathLike = ASSETS_DIR, *, seed: int = 0, log_every: int = 500):
    """Rebuild the warm-started model from scratch (deterministic for a given machine and seed)."""
    import torch

    from phaserl.world.sft import run_sft  # torch and the model code load only when needed

    # One thread: the same weights on any machine with this torch build (and the model is too small to
    # gain from more; on a busy 2-core box two threads were several times slower).
    torch.set_num_threads(1)
    result = run_sft(str(out_dir), seed=seed, log_every=log_every)
    print(f"[tiny-world] wrote {result.out_dir}: {result.stats.steps} SFT steps in {result.stats.seconds:.0f} s, "
          f"greedy held-out accuracy {result.val_accuracy:.3f}")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m phaserl.world.build",
                                     description="Prepare the tiny world's data files, or rebuild its model.")
    parser.add_argument("--regenerate", action="store_true", help="rebuild the committed warm-started model")
    parser.add_argument("--out", default=str(ASSETS_DIR), help="where --regenerate writes the model")
    parser.add_argument("--root", default=None,
                        help="data cache directory (default $PHASERL_CACHE_DIR/tiny-world, "
                             "else ~/.cache/phaserl/tiny-world)")
    args = parser.parse_args(argv)
    if args.regenerate:
        regenerate_assets(args.out)
        return
    world = prepare_tiny_world(args.root)
    for key, value in vars(world).items():
        print(f"{key:14s} {value}")


if __name__ == "__main__":
    main()
