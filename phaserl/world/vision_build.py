"""The vision world on disk: its prompt files in the cache directory, and its committed warm-started tiny VLM.

`prepare_vision_world()` writes train.parquet (2,000 scenes) and val.parquet (200) the first time it runs, in verl's
multimodal schema (vision_task.py: an `images` column of PNG bytes, `<image>` in the prompt), and points `model_dir`
at the committed model under phaserl/world/assets/vision-sft/: a Qwen2.5-VL-shaped model (a 2-layer decoder with
M-RoPE, a 2-block vision tower with window and full attention: 0.1 M parameters) warm-started on the teacher that
misses the right column of cells. `warm_start()` rebuilds it from nothing (about a minute on a 2-core CPU):

    python -m phaserl.world.vision_build --regenerate

The configs name this world `tiny_vision` (model.path, data.train_files, data.val_files; resolve.py).
Not here: the scenes and the tokenizer (vision_task.py), the model code (models/qwen_vl.py).

Legend: B rows of a batch, L prompt tokens (every prompt has the same ids: only its image differs), V vocabulary.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from phaserl.data.files import write_records
from phaserl.data.images import expand_placeholders, image_processor, process_images, with_vision_markers
from phaserl.errors import ConfigError
from phaserl.world.build import cache_root
from phaserl.world.vision_task import QUESTION, SIDE, build_vision_tokenizer, make_records, make_scene

ASSETS_DIR = Path(__file__).resolve().parent / "assets" / "vision-sft"
DATA_VERSION = "v1"
NUM_TRAIN, NUM_VAL = 2000, 200
REGENERATE_COMMAND = "python -m phaserl.world.vision_build --regenerate"
PATCH, MERGE = 4, 2  # a 24 x 24 scene: 6 x 6 patches, 3 x 3 image tokens (one per cell)
# The warm-start recipe: every parameter (the tower too) on the teacher's answers.
SFT_SCENES, SFT_STEPS, SFT_BATCH, SFT_LR, SFT_WARMUP = 4000, 1000, 64, 2e-3, 100


@dataclass(frozen=True)
class VisionWorld:
    model_dir: str   # the warm-started policy (Hugging Face directory, tokenizer included)
    train_file: str  # RL prompts with images, verl-schema parquet
    val_file: str    # held-out prompts


def prepare_vision_world(root: str | os.PathLike | None = None) -> VisionWorld:
    """Write the prompt files under `root` (default $PHASERL_CACHE_DIR/vision-world) if missing; return all paths."""
    data_dir = (Path(root) if root is not None else cache_root() / "vision-world") / DATA_VERSION
    files = {"train": data_dir / "train.parquet", "val": data_dir / "val.parquet"}
    for split, n in (("train", NUM_TRAIN), ("val", NUM_VAL)):
        if not files[split].is_file():
            write_records(files[split], make_records(split, n))
    if not (ASSETS_DIR / "model.safetensors").is_file():
        raise ConfigError(f"the vision-world model is missing from {ASSETS_DIR}; rebuild it with "
                          f"`{REGENERATE_COMMAND}` (about a minute on CPU)")
    return VisionWorld(model_dir=str(ASSETS_DIR), train_file=str(files["train"]), val_file=str(files["val"]))


def tiny_vlm(tokenizer):
    """The world's model, randomly initialized: Qwen2.5-VL's layout at a tiny size."""
    from phaserl.models.config import DecoderConfig
    from phaserl.models.qwen_vl import ImageTokenIds, VisionLM
    from phaserl.models.vision import VisionConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")}
    cfg = DecoderConfig(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=192,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                        max_position_embeddings=128, rope_theta=10000.0, tie_word_embeddings=True,
                        mrope_section=(2, 3, 3), eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    vision = VisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                          patch_size=PATCH, spatial_merge_size=MERGE, window_size=16, fullatt_block_indexes=(1,))
    tokens = ImageTokenIds(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|image_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    return VisionLM(cfg, vision, tokens, vision_trainable=True)


def world_processor():
    return image_processor(patch_size=PATCH, merge_size=MERGE, min_pixels=SIDE * SIDE, max_pixels=SIDE * SIDE)


def prompt_ids(tokenizer, tokens_per_image: int) -> list[int]:
    """The world's prompt (every scene asks the same question) with its placeholder expanded."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": with_vision_markers(QUESTION)}],
                                         add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return expand_placeholders(ids, tokenizer.convert_tokens_to_ids("<|image_pad|>"), [tokens_per_image],
                               source="vision world")


def scenes(first_seed: int, n: int, processor) -> tuple[list, list]:
    """(ImageInputs, scene) of n scenes from seed `first_seed` on."""
    from PIL import Image

    made = [make_scene(first_seed + i) for i in range(n)]
    return [process_images([Image.fromarray(s.pixels)], processor, merge_size=MERGE) for s in made], made


@torch.no_grad()
def greedy_counts(model, prompt: list[int], inputs: list) -> list[int]:
    """The first token each scene's prompt answers greedily, as a digit (-1 when it is not one)."""
    out = []
    for i in range(0, len(inputs), 100):
        chunk = inputs[i:i + 100]
        hidden = model(torch.tensor([prompt] * len(chunk)), images=chunk)[:, -1]  # [B, H]
        out += model.logits(hidden).argmax(-1).tolist()
    return out


def warm_start(out_dir: str | os.PathLike = ASSETS_DIR, *, seed: int = 0, log_every: int = 100) -> dict:
    """Train the world's model from a seeded random init on the teacher's counts; write it with its tokenizer."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer, processor = build_vision_tokenizer(), world_processor()
    model = tiny_vlm(tokenizer)
    inputs, made = scenes(0, SFT_SCENES, processor)  # the sft split's seeds
    prompt = prompt_ids(tokenizer, inputs[0].num_tokens)
    answers = [tokenizer(str(s.teacher_count), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
               for s in made]  # [digit, EOS] each
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=SFT_LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: min(1.0, (step + 1) / SFT_WARMUP))
    start, L = time.perf_counter(), len(prompt)
    for step in range(1, SFT_STEPS + 1):
        rows = rng.sample(range(SFT_SCENES), SFT_BATCH)
        ids = torch.tensor([prompt + answers[r] for r in rows])  # [B, L + 2]
        hidden = model(ids, images=[inputs[r] for r in rows])[:, L - 1:-1]  # [B, 2, H] predicting digit, EOS
        loss = F.cross_entropy(model.logits(hidden).flatten(0, 1), ids[:, L:].flatten())
        optim.zero_grad()
        loss.backward()
        optim.step()
        schedule.step()
        if log_every and step % log_every == 0:
            print(f"[vision-world] step {step}: loss {loss.item():.3f}")
    model.eval()
    val_inputs, val_scenes = scenes(2_000_000, NUM_VAL, processor)  # the val split's seeds
    digits = [tokenizer.convert_ids_to_tokens(t) for t in greedy_counts(model, prompt, val_inputs)]
    stats = {"steps": SFT_STEPS, "seconds": round(time.perf_counter() - start, 1),
             "val_accuracy": sum(d == str(s.count) for d, s in zip(digits, val_scenes)) / NUM_VAL,
             "teacher_agreement": sum(d == str(s.teacher_count) for d, s in zip(digits, val_scenes)) / NUM_VAL}
    save(model, tokenizer, out_dir)
    return stats


def save(model, tokenizer, out_dir) -> None:
    from phaserl.models import save_pretrained

    save_pretrained(model, out_dir, tokenizer=tokenizer)
    config_path = Path(out_dir) / "tokenizer_config.json"  # the generic class: transformers 4.x loads it too
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m phaserl.world.vision_build",
                                     description="Prepare the vision world's prompt files, or rebuild its model.")
    parser.add_argument("--regenerate", action="store_true", help="rebuild the committed warm-started model")
    parser.add_argument("--out", default=str(ASSETS_DIR), help="where --regenerate writes the model")
    args = parser.parse_args(argv)
    if args.regenerate:
        torch.set_num_threads(1)  # the same weights on any machine with this torch build
        print(f"[vision-world] wrote {args.out}: {warm_start(args.out)}")
        return
    for key, value in vars(prepare_vision_world()).items():
        print(f"{key:12s} {value}")


if __name__ == "__main__":
    main()
