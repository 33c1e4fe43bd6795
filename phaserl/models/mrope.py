"""Multimodal rotary positions (M-RoPE, Qwen2.5-VL and Qwen3-VL): three position axes (time, row, column) per token.

Text tokens sit at one position on all three axes, counting up as in plain RoPE; an image's placeholder tokens take
(the image's start, start + row, start + column) of their merged patch, and the text after the image continues from
the largest position so far + 1. The rotary frequencies of each head are shared out over the three axes by
`mrope_section` (counts summing to head_dim / 2): in blocks (Qwen2.5-VL: time, then row, then column) or interleaved
(Qwen3-VL: time, row, column, time, ...; `mrope_interleaved`). With all three axes equal (text only) that is
exactly plain RoPE, so decoding after the prompt is plain RoPE at the shifted position `slot position + delta`
(delta = max position + 1 - prompt length).
  mrope_positions        one row's real tokens -> [3, L] positions and its delta
  batch_mrope_positions  a padded batch [B, S] (left-padded prompts, responses after) -> [3, B, S]
  MRotaryEmbedding       cos/sin tables from [3, B, T] positions ([B, T] ones: plain RoPE)
Not here: the vision tower (vision.py), the image processor (data/images.py).

Legend: L tokens of a row, B rows, S padded width, T tokens of a call, D head_dim.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from phaserl.models.rope import RotaryEmbedding


def mrope_positions(ids: Sequence[int], grids: Sequence[tuple[int, int, int]], *, image_token_id: int,
                    merge: int) -> tuple[torch.Tensor, int]:
    """(positions [3, L] int64, delta) of one row's real tokens `ids` whose images have processor grids `grids`
    (in order). Each image's placeholder run must hold exactly t * h * w / merge^2 tokens: a mismatch between the
    ids and the images is a ValueError, never shifted positions. Vectorized over tokens (numpy), a loop over images:
    the trainer computes it for every row of every micro-batch."""
    ids = np.asarray(list(ids), dtype=np.int64)
    L = len(ids)
    where = np.flatnonzero(ids == image_token_id)  # [n_all] the placeholder tokens
    images, used = [], 0  # (first token, tokens, t, rows, columns) per image
    for k, (t, h, w) in enumerate(grids):
        hm, wm = h // merge, w // merge
        n = t * hm * wm
        if used + n > len(where) or where[used + n - 1] - where[used] != n - 1:
            rest = where[used:]
            breaks = np.flatnonzero(np.diff(rest) != 1)  # the placeholder run at `used` ends at its first break
            run = int(breaks[0]) + 1 if len(breaks) else len(rest)
            raise ValueError(f"image {k} (grid {t}x{h}x{w}) needs {n} placeholder tokens, the ids hold a run of "
                             f"{run}: the ids and the images did not come from one processor call")
        images.append((int(where[used]), n, t, hm, wm))
        used += n
    if used != len(where):
        raise ValueError(f"the ids hold {len(where)} image placeholder tokens, the {len(grids)} image(s) given need "
                         f"{used}: the ids and the images did not come from one processor call")
    # Text positions count up; an image of n tokens spans max(rows, columns) positions (transformers' rule for still
    # images), so the text after it is shifted by that minus n.
    shift = np.zeros(L + 1, dtype=np.int64)
    for first, n, _, hm, wm in images:
        shift[first + n] += max(hm, wm) - n
    text = np.arange(L) + np.cumsum(shift[:L])  # [L]
    out = np.repeat(text[None], 3, axis=0)  # [3, L]
    for first, n, t, hm, wm in images:
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(hm), np.arange(wm), indexing="ij")).reshape(3, -1)
        out[:, first:first + n] = text[first] + grid  # [3, n]: (t, row, column) from the image's start
    last = int(out.max()) + 1 if L else 0
    return torch.from_numpy(out), last - L


def batch_mrope_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor, grids: list[Optional[list]], *,
                          image_token_id: int, merge: int) -> torch.Tensor:
    """[3, B, S] positions of a padded batch: each row's real tokens (attention_mask 1) get mrope_positions over
    them, in order; padding gets 0. grids[b]: row b's image grids (None or [] for a text row)."""
    B, S = input_ids.shape
    out = torch.zeros(3, B, S, dtype=torch.long)
    ids_host, mask_host = input_ids.cpu(), attention_mask.bool().cpu()
    for b in range(B):
        real = mask_host[b]
        pos, _ = mrope_positions(ids_host[b][real].tolist(), grids[b] or [], image_token_id=image_token_id,
                                 merge=merge)
        out[:, b, real] = pos
    return out.to(input_ids.device)


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
