"""Images in prompt rows (verl's multimodal schema) and the one processor call per row that turns them into model
inputs.

A vision row is a prompt row with an `images` column: a list of images, each raw bytes, a `{"bytes": ..., "path":
...}` struct (how Hugging Face datasets store an Image feature in parquet), or a file path (relative paths are read
from the data file's directory: JSONL rows with paths). Its prompt messages hold one `<image>` placeholder per image,
in order. `process_vision_row` makes a row's model inputs in one call:
  1. each `<image>` becomes the family's `<|vision_start|><|image_pad|><|vision_end|>` before the chat template,
  2. the images go through the image processor once, which decides each image's grid and so its token count,
  3. each `<|image_pad|>` id is expanded to that many ids, and where each image's run starts is recorded.
Its ids and its `ImageInputs` (pixel_values, grids, starts) travel together from then on: the rollout engine, the
reference, the old-policy pass and the update all read the same object, and the model checks that the ids hold
exactly the processor's token count for each image at its recorded start. A missing file, an undecodable image,
or placeholders that do not match the images is a DataError naming the file and row.
Not here: the vision tower (models/vision.py), reading files (files.py), text-only prompts (prompts.py).

Legend: N patches of a row's images, F features per patch.
"""
from __future__ import annotations

import dataclasses
import io
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from phaserl.errors import ConfigError, DataError

PLACEHOLDER = "<image>"                # verl's placeholder in prompt text
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"  # Qwen2-VL family


@dataclass(eq=False)  # compared by identity: rows that share one object share one tower pass
class ImageInputs:
    """One row's images as the processor made them."""
    pixel_values: torch.Tensor      # [N, F] float32
    grids: tuple                    # ((t, h, w), ...) in patches, one per image, in prompt order
    tokens: tuple = field(default=())  # placeholder tokens per image (t * h * w / merge^2)
    starts: tuple = field(default=())  # each image's first placeholder, as an index into the ids made with it (a
    # prompt's, an observation's; an episode's joined object: its row's ids from the first real token); () where no
    # one recorded them (the model then places the images on the ids' segments in order: models/mrope.place_images)

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.pixel_values.numel() * self.pixel_values.element_size()


def join_images(parts: Sequence[Optional[ImageInputs]], offsets: Optional[Sequence[int]] = None
                ) -> Optional[ImageInputs]:
    """The images of several pieces of one sequence as one ImageInputs, in order (a multi-turn episode: its prompt's
    and its observations'); None when no piece has any, the piece itself when only one has and it sits at 0.
    offsets: where each piece's ids begin in the sequence (default 0 each); the pieces' recorded starts move by it,
    and the joined object records none unless every piece with images does."""
    offsets = [0] * len(parts) if offsets is None else list(offsets)
    kept = [(p, at) for p, at in zip(parts, offsets) if p is not None]
    if not kept:
        return None
    recorded = all(len(p.starts) == len(p.grids) for p, _ in kept)
    starts = tuple(s + at for p, at in kept for s in p.starts) if recorded else ()
    if len(kept) == 1 and (kept[0][1] == 0 or not recorded):
        return kept[0][0]  # shared by identity (the n samples of a prompt share one tower pass)
    pieces = [p for p, _ in kept]
    return ImageInputs(pixel_values=torch.cat([p.pixel_values for p in pieces]),   # [sum N, F]
                       grids=tuple(g for p in pieces for g in p.grids),
                       tokens=tuple(t for p in pieces for t in p.tokens), starts=starts)


def image_starts(ids: Sequence[int], image_token_id: int, tokens: Sequence[int]) -> tuple:
    """The index of each image's first placeholder in ids whose k-th run of image_token_id is image k's tokens[k]
    (what expand_placeholders made)."""
    ids, starts, at = list(ids), [], 0
    for n in tokens:
        at = ids.index(image_token_id, at)
        starts.append(at)
        at += n
    return tuple(starts)


def image_processor(*, patch_size: int, merge_size: int, temporal_patch_size: int = 2, min_pixels: int = 56 * 56,
                    max_pixels: int = 28 * 28 * 1280):
    """transformers' Qwen2-VL image processor built locally (no hub, no torchvision): resize so that each side is a
    multiple of patch_size * merge_size with min_pixels <= area <= max_pixels, normalize, cut into patches."""
    try:
        from PIL import Image  # noqa: F401
    except ImportError:
        raise ConfigError("vision-language rows need Pillow: pip install 'phaserl[vision]'") from None
    try:  # transformers >= 5.2x: the PIL backend by name; earlier 5.x: the class itself is PIL-based
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as cls
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as cls
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    return cls(patch_size=patch_size, temporal_patch_size=temporal_patch_size, merge_size=merge_size, size=size,
               min_pixels=min_pixels, max_pixels=max_pixels)


def load_image(value, *, source: str, index: int, base_dir: Optional[str]):
    """One entry of a row's `images` column as an RGB PIL image; errors name the row and the image."""
    from PIL import Image, UnidentifiedImageError

    where = f"{source}: images[{index}]"
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):  # a datasets Image struct: bytes win, else the path
        value = value.get("bytes") or value.get("path") or value.get("image")
    if isinstance(value, (bytes, bytearray, memoryview)):
        data, name = bytes(value), "its bytes"
    elif isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if not os.path.isabs(path) and base_dir:
            path = os.path.join(base_dir, path)
        if not os.path.isfile(path):
            raise DataError(f"{where}: image file {path!r} does not exist. Fix the path (relative paths are read from "
                            "the data file's directory) or remove the row.")
        with open(path, "rb") as f:
            data, name = f.read(), repr(path)
    else:
        raise DataError(f"{where} is a {type(value).__name__}; expected image bytes, a file path or "
                        "{\"bytes\": ..., \"path\": ...}.")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"{where}: {name} is not a readable image ({e}). Re-encode it (PNG/JPEG) or remove the row.") \
            from None
    return image.convert("RGB")


def row_images(raw: dict, *, source: str, image_key: str = "images") -> list:
    """The raw entries of a row's images column ([] when it has none)."""
    value = raw.get(image_key)
    if value is None:
        return []
    if hasattr(value, "tolist") and not isinstance(value, (bytes, dict)):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        value = [value]
    return list(value)


def count_placeholders(prompt) -> int:
    messages = [{"content": prompt}] if isinstance(prompt, str) else prompt
    return sum(m["content"].count(PLACEHOLDER) for m in messages)


def with_vision_markers(prompt):
    """The prompt with each `<image>` replaced by the family's `<|vision_start|><|image_pad|><|vision_end|>`."""
    marker = VISION_START + IMAGE_PAD + VISION_END
    if isinstance(prompt, str):
        return prompt.replace(PLACEHOLDER, marker)
    return [{**m, "content": m["content"].replace(PLACEHOLDER, marker)} for m in prompt]


def expand_placeholders(ids: Sequence[int], image_token_id: int, tokens: Sequence[int], *, source: str) -> list[int]:
    """ids with the k-th image_token_id repeated tokens[k] times; one placeholder id per image is required."""
    at = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(at) != len(tokens):
        raise DataError(f"{source}: the tokenized prompt holds {len(at)} image placeholder(s) for {len(tokens)} "
                        "image(s); the prompt text itself must not contain the image token")
    out, last = [], 0
    for i, n in zip(at, tokens):
        out.extend(ids[last:i])
        out.extend([image_token_id] * n)
        last = i + 1
    out.extend(ids[last:])
    return out


def process_images(images: list, processor, *, merge_size: int) -> ImageInputs:
    """One processor call for a row's PIL images."""
    out = processor(images=images, return_tensors="pt")
    grids = tuple(tuple(int(x) for x in g) for g in out["image_grid_thw"].tolist())
    tokens = tuple(t * h * w // merge_size ** 2 for t, h, w in grids)
    return ImageInputs(pixel_values=out["pixel_values"].float(), grids=grids, tokens=tokens)


def process_vision_row(row, tokenizer, processor, *, merge_size: int, apply_chat_template: bool,
                       base_dir: Optional[str] = None, image_key: str = "images") -> tuple[list[int], str,
                                                                                        Optional[ImageInputs]]:
    """(ids with expanded placeholders, the templated text, the row's ImageInputs or None) of one PromptRow."""
    entries = row_images(row.raw, source=row.source, image_key=image_key)
    placeholders = count_placeholders(row.prompt)
    if placeholders != len(entries):
        more = "more" if placeholders > len(entries) else "fewer"
        raise DataError(f"{row.source}: the prompt has {placeholders} '{PLACEHOLDER}' placeholder(s) and the "
                        f"'{image_key}' column {len(entries)} image(s) ({more} placeholders than images). Put one "
                        f"'{PLACEHOLDER}' in the prompt text per image, in order.")
    prompt = with_vision_markers(row.prompt)
    if apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    elif isinstance(prompt, str):
        text = prompt
    else:
        raise DataError(f"{row.source}: chat messages need data.apply_chat_template=true")
    ids = tokenizer(text, add_special_tokens=not apply_chat_template)["input_ids"]
    if not entries:
        return list(ids), text, None
    pictures = [load_image(v, source=row.source, index=i, base_dir=base_dir) for i, v in enumerate(entries)]
    inputs = process_images(pictures, processor, merge_size=merge_size)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    ids = expand_placeholders(ids, image_token_id, inputs.tokens, source=row.source)
    return ids, text, with_starts(inputs, image_starts(ids, image_token_id, inputs.tokens))


def with_starts(inputs: ImageInputs, starts: Sequence[int]) -> ImageInputs:
    """inputs with its images' recorded starts (an index into the ids made with them), the same tensors."""
    return dataclasses.replace(inputs, starts=tuple(int(s) for s in starts))


def data_file_dir(source: str) -> str:
    """The directory of the data file a row came from (its source is "path:row N ...")."""
    return os.path.dirname(source.rsplit(":row ", 1)[0])


def build_vision_dataset(rows: Sequence, tokenizer, processor, *, merge_size: int, max_prompt_length: int,
                         overlong: str, apply_chat_template: bool, image_key: str = "images"):
    """data.prompts.build_prompt_dataset for rows that may hold images: one process_vision_row call per row; each
    PromptItem carries its ImageInputs. A prompt with images is never cut (the cut could split an image's tokens):
    overlong rows are an error or dropped."""
    from phaserl.data.prompts import PromptDataset, PromptItem

    if overlong not in ("error", "drop"):
        raise ConfigError(f"data.overlong_prompts={overlong!r}: prompts with images are never cut; use 'error' or "
                          "'drop'")
    if not rows:
        raise DataError("there are no prompt rows to tokenize; check data.train_files / data.val_files.")
    items, dropped = [], 0
    for row in rows:
        ids, text, inputs = process_vision_row(row, tokenizer, processor, merge_size=merge_size,
                                               apply_chat_template=apply_chat_template,
                                               base_dir=data_file_dir(row.source), image_key=image_key)
        if len(ids) > max_prompt_length:
            if overlong == "drop":
                dropped += 1
                continue
            raise DataError(f"{row.source}: the prompt is {len(ids)} tokens with its image tokens, over "
                            f"data.max_prompt_length={max_prompt_length}. Raise data.max_prompt_length, lower "
                            "data.max_pixels (fewer tokens per image) or set data.overlong_prompts=drop.")
        items.append(PromptItem(row=row, prompt_ids=tuple(ids), prompt_text=text, images=inputs))
    if not items:
        raise DataError(f"all {len(rows)} prompts (first: {rows[0].source}) are longer than data.max_prompt_length="
                        f"{max_prompt_length} with their image tokens and were dropped.")
    return PromptDataset(items=items, dropped=dropped, truncated=0)


def check_no_images(rows: Sequence, image_key: str = "images") -> None:
    """A DataError naming the first row that has images, for a policy that cannot see them (a text model)."""
    row = next((r for r in rows if r.raw.get(image_key) is not None and len(r.raw[image_key]) > 0), None)
    if row is not None:
        raise DataError(f"{row.source}: the row has images (column '{image_key}') but the policy is a text model, "
                        "which would read the '<image>' placeholder as text. Use a vision-language model "
                        "(docs/vision.md) or drop the column.")


def processor_for(vision_config, *, min_pixels: int, max_pixels: int):
    """The image processor that matches a vision tower's config (models/vision.VisionConfig: patch, merge, frames;
    Qwen3-VL normalizes with mean = std = 0.5, Qwen2.5-VL with CLIP's)."""
    processor = image_processor(patch_size=vision_config.patch_size, merge_size=vision_config.spatial_merge_size,
                                temporal_patch_size=vision_config.temporal_patch_size, min_pixels=min_pixels,
                                max_pixels=max_pixels)
    if getattr(vision_config, "family", "") == "qwen3_vl":
        processor.image_mean, processor.image_std = [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]
    return processor
