"""Vision prompts in the rollout engine: the image features over the placeholder rows of a prefill, its M-RoPE
tables, Qwen3-VL's deepstack additions after the first layers, and the shift decoding adds to its positions.

A vision-language model (models/qwen_vl.VisionLM) prefills an image prompt from embeddings in which the tower's
output replaces the placeholder tokens, at M-RoPE positions (models/mrope.py); the KV of each token still goes to
its slot position. Every token after the prompt is text, whose M-RoPE position is plain RoPE at `slot position +
delta` (delta <= 0: an image of n tokens spans fewer positions). The runner keeps that delta per slot
(`ModelRunner.rope_shift`), moves it with the slot, and decodes through the layer functions that take RoPE tables
(the fused decode kernels index RoPE by slot position themselves, so a vision model's decode does not use them).
The features come from the same `VisionLM.prefill_inputs` (embed, tower, scatter, positions) as the training
forward, so sampled and trained log-probs see the same inputs; in the bitwise numerics mode the same bits (the
tower's invariant kernels give an image's features whatever else the call holds, and the M-RoPE tables are one
elementwise function of the positions on both sides), so nothing here changes with the mode.
Multi-turn sessions append ids to a parked slot (an extend pass): an observation's images are placed the same way,
their M-RoPE positions are the observation's own (from prefill_inputs) moved to where the slot's text stands
(`slot position + delta`), and the slot's delta then grows by the observation's: the positions equal those the
training forward computes over the whole episode with all its images in order.
Images are placed as the training forward places them (models/mrope.place_images): at the starts recorded with
them (data.images.ImageInputs.starts: an index into the prompt, or into the observation's ids, moved past the last
sampled id an extend pass feeds first), or, for images that record none, on the image segments (`<|vision_start|>`,
placeholders, `<|vision_end|>`) of the ids in order. A marker id the policy sampled is text on both sides: decode
embeds every sampled id as text, and the last sampled id, fed again at the head of an extend pass, is never an
image's. Ids without images may hold lone placeholders (text), never a segment.
Not here: the tower and the positions (models/), the slot loop (engine.py, runner.py).

Legend: L a prompt's tokens, H hidden, D head_dim, U prompts of a prefill pass, P their padded width.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from phaserl.errors import ConfigError, DataError


def vision_prefills(model, prompts: Sequence[Sequence[int]], images: Optional[Sequence]) -> dict:
    """Sequence index -> (embeds [L, H], positions [3, L], delta) for the prompts that have images; each distinct
    (prompt, image object) pair is computed once (the n samples of a prompt share it)."""
    if getattr(model, "takes_images", False):  # an image segment without pixels: never decoded as text
        bare = next((i for i, p in enumerate(prompts) if (images is None or images[i] is None)
                     and model.image_token_id in p and model.image_segments(p)), None)
        if bare is not None:
            raise ValueError(f"prompt {bare} holds image placeholder tokens but no images were given: the pixels of "
                             "its row were lost on the way")
    if images is None:
        return {}
    if len(images) != len(prompts):
        raise DataError(f"images has {len(images)} entries for {len(prompts)} prompts")
    if not any(im is not None for im in images):
        return {}
    if not getattr(model, "takes_images", False):
        raise ConfigError(f"prompts with images, but the policy ({type(model).__name__}) is not a vision-language "
                          "model (docs/vision.md)")
    first: dict = {}  # (prompt, id(image)) -> the first sequence index that has it
    for i, (prompt, image) in enumerate(zip(prompts, images)):
        if image is not None:
            first.setdefault((tuple(prompt), id(image)), i)
    distinct = list(first.values())
    made = model.prefill_inputs([prompts[i] for i in distinct], [images[i] for i in distinct])
    by_key = {key: inputs for key, inputs in zip(first, made)}
    return {i: by_key[(tuple(p), id(im))] for i, (p, im) in enumerate(zip(prompts, images)) if im is not None}


def place_images(runner, groups: list, P: int, h: torch.Tensor, rope: list) -> None:
    """In place, for a prefill pass of `groups` (prompt, slots, caps, noise keys = sequence indices): each vision
    prompt's embeddings over its rows of h [U * P, H] and its M-RoPE tables over its rows of rope's [U * P, D]; every
    admitted slot's rope_shift set (0 for text prompts)."""
    if runner.rope_shift is None:
        return
    runner.deepstack = []  # this pass's (rows of h, [k, L, H] additions) of Qwen3-VL prompts
    for u, (_, slots, _, keys) in enumerate(groups):
        prefill = runner.vision.get(keys[0])
        delta = 0
        if prefill is not None:
            embeds, positions, delta, deepstack = prefill
            L = embeds.shape[0]
            h[u * P:u * P + L] = embeds.to(h.dtype)
            if deepstack is not None:
                runner.deepstack.append((slice(u * P, u * P + L), deepstack))
            tables = runner.model.model.rope(positions[:, None, :], h.dtype)  # [(cos, sin) [1, L, D]] per table
            for (cos, sin), (c, s) in zip(rope, tables):
                cos[u * P:u * P + L], sin[u * P:u * P + L] = c[0], s[0]
        runner.rope_shift[torch.tensor(slots, device=runner.rope_shift.device)] = delta


def add_deepstack(runner, layer: int, h: torch.Tensor) -> torch.Tensor:
    """After prefill layer `layer`: Qwen3-VL's deepstack features of this pass's image prompts added to their rows of
    h [U * P, H] (place_images recorded them), as the training forward adds them after its first k layers."""
    for rows, additions in getattr(runner, "deepstack", ()):
        if layer < additions.shape[0]:
            h[rows] += additions[layer].to(h.dtype)
    return h


def extend_images(runner, items: list, M: int) -> list:
    """For an extend pass of `items` (slot, tokens, start, cap, ImageInputs or None), right-padded to M: per row with
    images, (its rows of the pass's h as a slice, embeds [L, H], M-RoPE positions [3, L] where the slot's text
    stands, the slot's delta after it, deepstack [k, L, H] or None, its slot). The image-token count is checked
    against the images (prefill_inputs); appended ids with image tokens but no images are a ValueError too."""
    model = runner.model
    if not getattr(model, "takes_images", False):
        if any(item[4] is not None for item in items):
            raise ConfigError(f"appended ids with images, but the policy ({type(model).__name__}) is not a "
                              "vision-language model (docs/vision.md)")
        return []
    for slot, tokens, _, _, image in items:  # tokens[0]: the last sampled id, fed again (text, whatever its id)
        if image is None and model.image_token_id in tokens[1:] and model.image_segments(tokens[1:]):
            raise ValueError(f"ids appended to slot {slot} hold image placeholder tokens but no images were given: "
                             "the observation's pixels were lost on the way")
    rows = [r for r, item in enumerate(items) if item[4] is not None]
    if not rows:
        return []
    # the images' recorded starts index the appended ids; tokens[0] is the last sampled id in front of them
    made = model.prefill_inputs([items[r][1] for r in rows], [shifted(items[r][4], 1) for r in rows])
    out = []
    for r, (embeds, positions, delta, deepstack) in zip(rows, made):
        slot, _, start, _, _ = items[r]
        shift = int(runner.rope_shift[slot])  # the slot's text so far stands at slot position + shift
        out.append((slice(r * M, r * M + embeds.shape[0]), embeds, positions + (start + shift), shift + delta,
                    deepstack, slot))
    return out


def shifted(image, by: int):
    """image with its recorded starts (data.images.ImageInputs.starts) moved by `by` ids, the same tensors; as it is
    when it records none."""
    starts = tuple(getattr(image, "starts", ()) or ())
    return dataclasses.replace(image, starts=tuple(s + by for s in starts)) if starts else image


def place_extend_images(runner, made: list, h: torch.Tensor, rope: list) -> None:
    """In place, for an extend pass: each row's image embeddings over its rows of h [C * M, H] and its M-RoPE
    tables over rope's [C * M, D]; the deepstack additions recorded for add_deepstack; the slots' new delta set."""
    runner.deepstack = []
    for rows, embeds, positions, shift, deepstack, slot in made:
        h[rows] = embeds.to(h.dtype)
        if deepstack is not None:
            runner.deepstack.append((rows, deepstack))
        tables = runner.model.model.rope(positions[:, None, :], h.dtype)  # [(cos, sin) [1, L, D]] per table
        for (cos, sin), (c, s) in zip(rope, tables):
            cos[rows], sin[rows] = c[0], s[0]
        runner.rope_shift[slot] = shift
