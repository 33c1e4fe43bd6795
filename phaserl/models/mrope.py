"""Multimodal rotary positions (M-RoPE, Qwen2.5-VL and Qwen3-VL): three position axes (time, row, column) per token.

Which tokens are an image's is decided by position, not by id alone (`place_images`): an image segment is what the
processor writes, `<|vision_start|>`, a run of `<|image_pad|>` ids, `<|vision_end|>`, whose run must hold exactly
the image's t * h * w / merge^2 tokens. Where the images' starts were recorded with the ids (data.images.ImageInputs
.starts: the prompt's and each observation's processor call, moved to where they sit in an episode), image k is the
segment at its recorded start, checked; every other marker is text, a whole segment the policy sampled before an
image included. Without recorded starts (bare ImageInputs given to the model by hand), a row's images fill its
segments left to right, image k the k-th segment (responses come after the images they follow, so a sampled
segment after the last image is text; one before an image would take its place). Fewer segments or starts than
images, or a run of another length, is a ValueError (the ids and the pixels came from different processor calls).
Every other marker id is text: a placeholder outside a segment, a segment no image is placed on, in a row without
images too. Whether a row lost its pixels is decided where the ids' origin is known (VisionLM.check_pixels).
Text tokens sit at one position on all three axes, counting up as in plain RoPE; an image's placeholder tokens take
(the image's start, start + row, start + column) of their merged patch, and the text after the image continues from
the largest position so far + 1. The rotary frequencies of each head are shared out over the three axes by
`mrope_section` (counts summing to head_dim / 2): in blocks (Qwen2.5-VL: time, then row, then column) or interleaved
(Qwen3-VL: time, row, column, time, ...; `mrope_interleaved`). With all three axes equal (text only) that is
exactly plain RoPE, so decoding after the prompt is plain RoPE at the shifted position `slot position + delta`
(delta = max position + 1 - prompt length).
  image_segments         one row's `<|vision_start|> <|image_pad|>* <|vision_end|>` runs, in order
  place_images           which segment each image fills (recorded starts, else in order; checked) -> spans
  span_positions         [3, L] positions and the delta of a row with those spans
  mrope_positions        place_images + span_positions for one row's ids
  MRotaryEmbedding       cos/sin tables from [3, B, T] positions ([B, T] ones: plain RoPE)
Not here: the vision tower (vision.py), the image processor (data/images.py).

Legend: L tokens of a row, B rows, S padded width, T tokens of a call, D head_dim.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from phaserl.models.rope import RotaryEmbedding


def image_segments(ids: np.ndarray, tokens) -> list[tuple[int, int]]:
    """(first placeholder, placeholders) of each image segment of one row's ids [L], in order: a run of
    tokens.image_token_id with tokens.vision_start_token_id right before it and tokens.vision_end_token_id right
    after it (tokens: models.qwen_vl.ImageTokenIds)."""
    ids = np.asarray(ids, dtype=np.int64)
    edges = np.diff((ids == tokens.image_token_id).astype(np.int8), prepend=0, append=0)  # [L + 1]
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)  # [runs] each run's [start, end)
    inside = (starts > 0) & (ends < len(ids))
    keep = inside.copy()
    keep[inside] = ((ids[starts[inside] - 1] == tokens.vision_start_token_id)
                    & (ids[ends[inside]] == tokens.vision_end_token_id))
    return [(int(a), int(b - a)) for a, b in zip(starts[keep], ends[keep])]


def place_images(ids: Sequence[int], grids: Sequence[tuple[int, int, int]], *, tokens, merge: int,
                 starts: Sequence[int] = ()) -> list[tuple[int, int, int, int, int]]:
    """(first token, tokens, t, rows, columns) of each image of one row. starts (recorded where the ids were made:
    data.images.ImageInputs.starts): image k's first placeholder is ids[starts[k]], a segment of exactly
    t * h * w / merge^2 placeholders. Without them, image k fills the row's k-th image segment (image_segments).
    Every other marker is text. ValueError: as many starts as images, each on a segment of its image's size, in
    order; without starts, fewer segments than images, or a run of another length."""
    ids = np.asarray(ids, dtype=np.int64)
    if len(starts):
        return recorded_places(ids, grids, starts, tokens=tokens, merge=merge)
    segments = image_segments(ids, tokens) if len(grids) else []
    out = []
    for k, (t, h, w) in enumerate(grids):
        hm, wm = h // merge, w // merge
        n = t * hm * wm
        if k >= len(segments):
            raise ValueError(f"the ids hold {len(segments)} image segment(s) (<|vision_start|>, placeholders, "
                             f"<|vision_end|>) for {len(grids)} image(s): the ids and the images did not come from one "
                             "processor call")
        first, run = segments[k]
        if run != n:
            raise ValueError(f"image {k} (grid {t}x{h}x{w}) needs {n} placeholder tokens, the ids hold a run of "
                             f"{run}: the ids and the images did not come from one processor call")
        out.append((first, n, t, hm, wm))
    return out


def recorded_places(ids: np.ndarray, grids: Sequence[tuple[int, int, int]], starts: Sequence[int], *, tokens,
                    merge: int) -> list[tuple[int, int, int, int, int]]:
    """place_images for images whose starts were recorded: each checked to be a whole segment of its size."""
    if len(starts) != len(grids):
        raise ValueError(f"the images record {len(starts)} start(s) for {len(grids)} image(s): the ids and the "
                         "images did not come from one processor call")
    out, end = [], 0
    for k, ((t, h, w), first) in enumerate(zip(grids, starts)):
        hm, wm = h // merge, w // merge
        n = t * hm * wm
        if k and first < end:
            raise ValueError(f"image {k} is recorded at token {first}, before the end of image {k - 1}'s segment: "
                             "the images' starts are out of order")
        run = int(np.argmin(np.append(ids[max(first, 0):] == tokens.image_token_id, False)))  # from `first` on
        whole = (first >= 1 and run == n and first + n < len(ids)
                 and ids[first - 1] == tokens.vision_start_token_id and ids[first + n] == tokens.vision_end_token_id)
        if not whole:
            raise ValueError(f"image {k} (grid {t}x{h}x{w}) is recorded at token {first}, where the ids hold no "
                             f"segment of {n} placeholders (<|vision_start|>, {n} x <|image_pad|>, <|vision_end|>) "
                             f"but a run of {run}: the ids and the images did not come from one processor call")
        out.append((int(first), n, t, hm, wm))
        end = first + n + 1
    return out


def span_positions(L: int, spans: Sequence[tuple[int, int, int, int, int]]) -> tuple[torch.Tensor, int]:
    """(positions [3, L] int64, delta) of a row of L tokens whose images sit at `spans` (place_images); every other
    token is text. Vectorized over tokens (numpy), a loop over images: the trainer computes it for every row of every
    micro-batch."""
    # Text positions count up; an image of n tokens spans max(rows, columns) positions (transformers' rule for still
    # images), so the text after it is shifted by that minus n.
    shift = np.zeros(L + 1, dtype=np.int64)
    for first, n, _, hm, wm in spans:
        shift[first + n] += max(hm, wm) - n
    text = np.arange(L) + np.cumsum(shift[:L])  # [L]
    out = np.repeat(text[None], 3, axis=0)  # [3, L]
    for first, n, t, hm, wm in spans:
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(hm), np.arange(wm), indexing="ij")).reshape(3, -1)
        out[:, first:first + n] = text[first] + grid  # [3, n]: (t, row, column) from the image's start
    last = int(out.max()) + 1 if L else 0
    return torch.from_numpy(out), last - L


def mrope_positions(ids: Sequence[int], grids: Sequence[tuple[int, int, int]], *, tokens, merge: int,
                    starts: Sequence[int] = ()) -> tuple[torch.Tensor, int]:
    """(positions [3, L] int64, delta) of one row's real tokens `ids` whose images have processor grids `grids`
    (in order) and, where recorded, first placeholders `starts`: place_images, then span_positions. A mismatch
    between the ids and the images is a ValueError, never shifted positions."""
    ids = list(ids)
    return span_positions(len(ids), place_images(ids, grids, tokens=tokens, merge=merge, starts=starts))


def axis_of_frequency(sections: tuple, interleaved: bool) -> torch.Tensor:
    """The position axis (0 time, 1 row, 2 column) each of the D/2 rotary frequencies turns with.  [D/2]
    Blocks (Qwen2.5-VL): the first sections[0] frequencies time, the next sections[1] row, the rest column.
    Interleaved (Qwen3-VL): frequency j is row when j % 3 == 1 and j < 3 * sections[1], column when j % 3 == 2 and
    j < 3 * sections[2], else time."""
    if not interleaved:
        axes = [axis for axis, n in enumerate(sections) for _ in range(n)]
    else:
        axes = [1 if j % 3 == 1 and j < 3 * sections[1] else 2 if j % 3 == 2 and j < 3 * sections[2] else 0
                for j in range(sum(sections))]
    # On the CPU even inside a meta-device context (a model built on meta to be loaded): it is derived, not loaded.
    return torch.tensor(axes, dtype=torch.long, device="cpu")


class MRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding whose frequencies each turn with one position axis (cfg.mrope_section, cfg.mrope_interleaved)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.axis = axis_of_frequency(tuple(cfg.mrope_section), cfg.mrope_interleaved)  # [D/2], on the CPU

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [3, B, T] -> cos, sin [B, T, D]; [B, T] -> plain RoPE (every axis the same position)."""
        if position_ids.dim() == 2:
            return super().forward(position_ids, dtype)
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        angles = position_ids[..., None].float() * self.inv_freq.float()  # [3, B, T, D/2]
        axis = self.axis.to(position_ids.device).expand(1, *angles.shape[1:])  # [1, B, T, D/2]
        angles = angles.gather(0, axis)[0]  # [B, T, D/2]: each frequency at its axis's position
        angles = torch.cat((angles, angles), dim=-1)  # [B, T, D]
        return (angles.cos() * self.attention_scaling).to(dtype), (angles.sin() * self.attention_scaling).to(dtype)
