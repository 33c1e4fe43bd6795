"""The vision world's task: count the red squares in a small picture, with a teacher that misses a column.

A scene is a 24 x 24 RGB picture cut into 3 x 3 cells of 8 x 8 pixels (one cell = one image token of the tiny
VLM: 2 x 2 patches of 4 pixels, merged), with 1 to MAX_SQUARES red squares in distinct cells and a few blue
distractor squares in others, on a noisy dark background. The question is `<image>how many red squares?`, the
answer the count in decimal. Scenes are made locally from a seed (numpy), so every split is reproducible; the sft,
train and val splits draw from disjoint seed ranges.
The warm-start answers come from a sloppy teacher that, on most scenes (SLOPPY_RATE), skips the right column of
cells (it counts the red squares of the left two columns): a model that imitates it answers greedily right only
when no red square sits in the right column (about a third of the scenes), and samples the right count about one
time in five otherwise. RL with the exact-match reward (`tiny_exact`: the first integer of the response) then
teaches it to count the whole picture.
The tokenizer is the tiny world's characters plus the Qwen2-VL family's vision tokens.
Not here: the model and its warm start (vision_build.py), the reward rule (rewards/rules.py).
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from phaserl.world.tokenizer import CHARACTERS, CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS, UNK

DATA_SOURCE = "tiny_count"
REWARD_RULE = "tiny_exact"
SIDE, CELL, GRID = 24, 8, 3            # pixels per side, per cell side; cells per side
MAX_SQUARES, MAX_DISTRACTORS = 4, 2
SLOPPY_RATE = 0.8  # chance that the teacher skips the right column of a scene
QUESTION = "<image>how many red squares?"
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
_SEED_BASE = {"sft": 0, "train": 1_000_000, "val": 2_000_000}  # disjoint seed ranges per split


@dataclass(frozen=True)
class Scene:
    pixels: np.ndarray   # [SIDE, SIDE, 3] uint8
    red_cells: tuple     # (row, column) of each red square
    blue_cells: tuple
    sloppy: bool         # the teacher skips the right column of this scene

    @property
    def count(self) -> int:
        return len(self.red_cells)

    @property
    def teacher_count(self) -> int:
        """What the teacher answers: the whole count, or (sloppy) the count of the left two columns."""
        return sum(1 for _, col in self.red_cells if col < GRID - 1 or not self.sloppy)


def make_scene(seed: int) -> Scene:
    rng = np.random.default_rng(seed)
    cells = [(r, c) for r in range(GRID) for c in range(GRID)]
    order = rng.permutation(len(cells))
    k = int(rng.integers(1, MAX_SQUARES + 1))
    d = int(rng.integers(0, MAX_DISTRACTORS + 1))
    red = tuple(sorted(cells[i] for i in order[:k]))
    blue = tuple(sorted(cells[i] for i in order[k:k + d]))
    pixels = rng.integers(0, 40, size=(SIDE, SIDE, 3)).astype(np.uint8)  # noisy dark background
    for (r, c), colour in [(cell, (220, 30, 30)) for cell in red] + [(cell, (30, 60, 220)) for cell in blue]:
        pixels[r * CELL:(r + 1) * CELL, c * CELL:(c + 1) * CELL] = colour  # a whole cell: its 4 patches
    return Scene(pixels, red, blue, sloppy=bool(rng.random() < SLOPPY_RATE))


def png_bytes(pixels: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def scene_record(scene: Scene, index: int, split: str) -> dict:
    """A verl-schema multimodal row: the image as PNG bytes in `images`, its placeholder in the prompt."""
    return {"prompt": [{"role": "user", "content": QUESTION}], "images": [{"bytes": png_bytes(scene.pixels)}],
            "data_source": DATA_SOURCE, "reward_model": {"style": "rule", "ground_truth": str(scene.count)},
            "extra_info": {"split": split, "index": index}}


def make_records(split: str, n: int) -> list[dict]:
    return [scene_record(make_scene(_SEED_BASE[split] + i), i, split) for i in range(n)]


def build_vision_tokenizer():
    """The tiny world's character tokenizer with the vision tokens added as special tokens (same chat template)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIAL_TOKENS + VISION_TOKENS
    vocab = {token: i for i, token in enumerate(specials + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                        model_max_length=256, padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
