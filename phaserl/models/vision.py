"""The Qwen2.5-VL and Qwen3-VL vision towers: image patches -> transformer blocks -> 2x2 patch merger -> the language
model's width.

`VisionTower(cfg)(pixels, grids)` takes the image processor's output as it is (`pixel_values` [N, F], one row per
patch in the processor's order, and `image_grid_thw` [I, 3]) and returns per merged token [M, 1 + k, O]: column 0 the
embedding that replaces the image placeholder token of the prompt, columns 1..k Qwen3-VL's deepstack features (added
to the decoder's hidden states at the image tokens after its first k layers; k = 0 for Qwen2.5-VL). Parameter names
equal transformers' (`visual.blocks.0.attn.qkv.weight`, `visual.merger.mlp.0.weight`, ...). The family is a field
of the config, not a second tower:
  qwen2_5_vl  RMSNorm, gated SiLU MLP, window attention but in `fullatt_block_indexes`, RMSNorm + MLP merger
  qwen3_vl    LayerNorm, plain GELU(tanh) MLP, full attention everywhere, a learned position table bilinearly
              resized to each image (`pos_embed`), LayerNorm + MLP merger, deepstack mergers after chosen blocks
The math follows transformers' towers; where it is written differently the result is the same:
  - window attention: transformers reorders the patches so that each window is contiguous, attends per window and
    orders them back. Attention does not care about order (no causal mask; RoPE carries the positions), so here the
    patches keep the processor's order and each attends to the patches of its own window (full-attention blocks:
    its own image frame), through one padded SDPA call per block.
  - the patch embedding is a Conv3d whose kernel equals its stride over one patch: a matmul of the flattened patch.
  - 2D RoPE: the first half of each head's rotary frequencies turn with the patch's row, the second with its column.
In the bitwise numerics mode (rollout.bitwise, models/invariant.py) every piece takes the batch-invariant kernels:
the linears, norms (LayerNorm too) and activations (the mergers' erf GELU too) as the decoder's do, and attention per
group through invariant.attention, the group's patches in processor order, so that an image's features have the same
bits whichever call computes them (the engine's prefill, the trainer's micro-batch) and whatever else it holds.
Not here: the decoder (decoder.py), M-RoPE positions of the language model (mrope.py), loading (qwen_vl.py).

Legend: N patches, E tower width, Hv heads, Dv head dim, F patch features (C * Tp * P * P), M merged tokens
(N / merge^2), O output width, I images, G attention groups (windows or frames), L their longest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from phaserl.errors import ConfigError
from phaserl.models import invariant
from phaserl.models.layers import activation, linear, rope_tables, rotate
from phaserl.models.modules import RMSNorm

VISION_EPS = 1e-6  # the tower's and the merger's norm epsilon (fixed in the architecture, not in config.json)
VISION_FAMILIES = ("qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True)
class VisionConfig:
    """The shape of a Qwen2.5-VL vision tower (config.json's vision_config)."""
    depth: int
    hidden_size: int                     # E
    intermediate_size: int               # the blocks' gated-MLP width
    num_heads: int                       # Hv
    out_hidden_size: int                 # O: the language model's hidden size
    in_channels: int = 3
    patch_size: int = 14                 # P: pixels per patch side
    temporal_patch_size: int = 2         # Tp: frames per patch (an image is repeated to fill them)
    spatial_merge_size: int = 2          # merge: merge x merge patches become one token
    window_size: int = 112               # pixels per window side in windowed blocks
    fullatt_block_indexes: tuple = ()    # blocks that attend over the whole image frame
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    family: str = "qwen2_5_vl"           # VISION_FAMILIES
    num_position_embeddings: int = 0     # qwen3_vl: entries of the learned square position table
    deepstack_visual_indexes: tuple = ()  # qwen3_vl: blocks whose output also feeds the decoder's first layers

    def __post_init__(self):
        object.__setattr__(self, "fullatt_block_indexes", tuple(self.fullatt_block_indexes))
        object.__setattr__(self, "deepstack_visual_indexes", tuple(self.deepstack_visual_indexes))
        if self.family not in VISION_FAMILIES:
            raise ConfigError(f"vision_config: family {self.family!r} is not one of {VISION_FAMILIES}")
        side = int(round(self.num_position_embeddings ** 0.5))
        if self.family == "qwen3_vl" and (side < 2 or side * side != self.num_position_embeddings):
            raise ConfigError(f"vision_config: num_position_embeddings={self.num_position_embeddings} must be a "
                              "square (a side x side table) of side >= 2")
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise ConfigError(f"vision_config: deepstack_visual_indexes {list(self.deepstack_visual_indexes)} are "
                              f"not blocks of a depth-{self.depth} tower")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ConfigError(f"vision_config: hidden_size={self.hidden_size} / num_heads={self.num_heads} must be a "
                              "head dim divisible by 4 (2D rotary embeddings: half the frequencies per axis)")
        if self.window_size < self.patch_size * self.spatial_merge_size:
            raise ConfigError(f"vision_config: window_size={self.window_size} is smaller than one merged token "
                              f"(patch_size * spatial_merge_size = {self.patch_size * self.spatial_merge_size})")
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ConfigError(f"vision_config: fullatt_block_indexes {bad} are not blocks of a depth-{self.depth} "
                              "tower")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ConfigError(f"vision_config: hidden_act={self.hidden_act!r} is not supported natively "
                              "(silu, gelu_pytorch_tanh)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches per merged token."""
        return self.spatial_merge_size ** 2

    @property
    def patch_features(self) -> int:
        """F: the processor's values per patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def qwen3(self) -> bool:
        return self.family == "qwen3_vl"

    def windowed(self, block: int) -> bool:
        """True when block `block` attends within windows (Qwen2.5-VL's blocks outside fullatt_block_indexes)."""
        return not self.qwen3 and block not in self.fullatt_block_indexes

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """Merged tokens (placeholder tokens in the prompt) of one image of processor grid (t, h, w)."""
        t, h, w = grid
        return t * h * w // self.merge_unit


class PatchLayout(NamedTuple):
    """Where each patch of a batch of images sits: its (row, column) in its image, and its attention groups."""
    rows: torch.Tensor      # [N] patch row within its image
    cols: torch.Tensor      # [N] patch column
    frames: torch.Tensor    # [N] group id for full attention (image frame)
    windows: torch.Tensor   # [N] group id for windowed attention


def patch_layout(grids: list[tuple[int, int, int]], cfg: VisionConfig) -> PatchLayout:
    """The layout of the processor's patch order: frame by frame, merge x merge blocks in row-major order, the
    patches of a block in row-major order inside it (transformers' block-major order)."""
    m = cfg.spatial_merge_size
    per_window = cfg.window_size // m // cfg.patch_size  # merged tokens per window side
    rows, cols, frames, windows = [], [], [], []
    frame_base = window_base = 0
    for t, h, w in grids:
        if h % m or w % m:
            raise ValueError(f"image grid (t={t}, h={h}, w={w}) is not a multiple of spatial_merge_size={m}; "
                             "pixel_values come from a processor of another merge size")
        hm, wm = h // m, w // m
        r = torch.arange(h).view(hm, m, 1, 1).expand(hm, m, wm, m).transpose(1, 2).reshape(-1)  # [h * w]
        c = torch.arange(w).view(1, 1, wm, m).expand(hm, m, wm, m).transpose(1, 2).reshape(-1)
        rows.append(r.repeat(t))
        cols.append(c.repeat(t))
        frames.append(frame_base + torch.arange(t).repeat_interleave(h * w))
        nw_h, nw_w = -(-hm // per_window), -(-wm // per_window)
        win = (r // m // per_window) * nw_w + (c // m // per_window)  # [h * w] window of each patch in a frame
        windows.append(window_base + (torch.arange(t)[:, None] * nw_h * nw_w + win).reshape(-1))
        frame_base += t
        window_base += t * nw_h * nw_w
    return PatchLayout(*(torch.cat(x) for x in (rows, cols, frames, windows)))


class Groups(NamedTuple):
    """Patches gathered per attention group, padded to the longest group (L), planned once per forward on the host and
    sent to the device once: every block reads them without a host sync."""
    gather: torch.Tensor    # [G, L] the patch at each place of each group (padding: patch 0, masked out)
    valid: torch.Tensor     # [G, L] bool: the place holds a patch of the group
    cells: torch.Tensor     # [N] where each patch sits in the flattened [G * L] table

    def to(self, device) -> "Groups":
        return Groups(*(t.to(device) for t in self))


def groups_of(ids: torch.Tensor) -> Groups:
    """The padded group table of group ids [N] (ids 0..G-1, each used)."""
    counts = torch.bincount(ids)                                      # [G]
    order = torch.argsort(ids, stable=True)                           # [N] patches by group
    G, L = counts.numel(), int(counts.max())
    starts = torch.cumsum(counts, 0) - counts                         # [G]
    slot = torch.arange(ids.numel()) - starts[ids[order]]              # [N] place within its group
    gather = torch.zeros((G, L), dtype=torch.long)
    valid = torch.zeros((G, L), dtype=torch.bool)
    gather[ids[order], slot], valid[ids[order], slot] = order, True
    cells = torch.empty_like(ids)
    cells[order] = ids[order] * L + slot
    return Groups(gather, valid, cells)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Bidirectional attention of each patch over the patches of its group. q, k, v [N, Hv, Dv] -> [N, Hv * Dv]."""
    if invariant.enabled():  # the bitwise numerics mode: a patch's bits do not depend on the call's other images
        return invariant_grouped_attention(q, k, v, groups)
    qg, kg, vg = (x[groups.gather].transpose(1, 2) for x in (q, k, v))             # [G, Hv, L, Dv]
    out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=groups.valid[:, None, None, :])  # [G, Hv, L, Dv]
    return out.transpose(1, 2).flatten(-2).flatten(0, 1)[groups.cells]            # [N, Hv * Dv]


def invariant_grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Groups) -> torch.Tensor:
    """grouped_attention through invariant.attention: group g's n_g patches sit at places 0..n_g - 1 (processor order,
    whatever else the call holds) and every one of its queries stands at place n_g - 1, so it sees exactly its
    group, summed in the fixed key-block order; the padding places weigh 0. [N, Hv, Dv] each -> [N, Hv * Dv]"""
    qg, kg, vg = (x[groups.gather] for x in (q, k, v))                              # [G, L, Hv, Dv]
    last = groups.valid.sum(-1, keepdim=True) - 1                                   # [G, 1]
    out = invariant.attention(qg, last.expand(groups.valid.shape), kg, vg)          # [G, L, Hv, Dv]
    return out.flatten(-2).flatten(0, 1)[groups.cells]                              # [N, Hv * Dv]


def gelu(x: torch.Tensor) -> torch.Tensor:
    """The mergers' erf GELU (nn.GELU's); the invariant kernel's in the bitwise mode."""
    return invariant.activation(x, "gelu") if invariant.enabled() else F.gelu(x)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (its parameter names), through invariant.layer_norm in the bitwise mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if invariant.enabled():
            return invariant.layer_norm(x, self.weight, self.bias, self.eps)
        return super().forward(x)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=cfg.qwen3)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, F] -> [N, E]: the Conv3d over one patch (kernel = stride) is a matmul of the flat patch."""
        w = self.proj.weight
        return linear(pixels.to(w.dtype), w.flatten(1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: Groups) -> torch.Tensor:
        q, k, v = linear(x, self.qkv).unflatten(-1, (3, self.heads, -1)).unbind(1)  # [N, Hv, Dv] each
        # RoPE in float32, then back (as transformers does for the tower)
        q, k = (rotate(t.float(), cos, sin).to(t.dtype) for t in (q, k))
        return linear(grouped_attention(q, k, v, groups), self.proj)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.act = cfg.hidden_act
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(activation(linear(x, self.gate_proj), self.act) * linear(x, self.up_proj), self.down_proj)


class PlainMLP(nn.Module):
    """Qwen3-VL's block MLP: fc2(act(fc1(x)))."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.act = cfg.hidden_act
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(activation(linear(x, self.linear_fc1), self.act), self.linear_fc2)


def _norm(cfg: VisionConfig, width: int) -> nn.Module:
    return LayerNorm(width, eps=VISION_EPS) if cfg.qwen3 else RMSNorm(width, VISION_EPS)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1, self.norm2 = _norm(cfg, cfg.hidden_size), _norm(cfg, cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.mlp = PlainMLP(cfg) if cfg.qwen3 else VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: Groups) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm per patch, then each merge x merge block of patches (consecutive rows) through a 2-layer GELU MLP."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        width = cfg.hidden_size * cfg.merge_unit
        self.ln_q = RMSNorm(cfg.hidden_size, VISION_EPS)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, E] -> [M, O]"""
        x = self.ln_q(x).reshape(-1, self.mlp[0].in_features)
        return linear(gelu(linear(x, self.mlp[0])), self.mlp[2])


class LayerNormMerger(nn.Module):
    """Qwen3-VL's merger: LayerNorm per patch (or, `postshuffle`, over the merged block), then fc2(GELU(fc1(.)))."""

    def __init__(self, cfg: VisionConfig, postshuffle: bool = False):
        super().__init__()
        width = cfg.hidden_size * cfg.merge_unit
        self.postshuffle = postshuffle
        self.norm = LayerNorm(width if postshuffle else cfg.hidden_size, eps=VISION_EPS)
        self.linear_fc1 = nn.Linear(width, width)
        self.linear_fc2 = nn.Linear(width, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, E] -> [M, O]"""
        width = self.linear_fc1.in_features
        x = self.norm(x.reshape(-1, width) if self.postshuffle else x).reshape(-1, width)
        return linear(gelu(linear(x, self.linear_fc1)), self.linear_fc2)


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        if cfg.qwen3:
            self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = LayerNormMerger(cfg) if cfg.qwen3 else PatchMerger(cfg)
        if cfg.deepstack_visual_indexes:
            self.deepstack_merger_list = nn.ModuleList(LayerNormMerger(cfg, postshuffle=True)
                                                       for _ in cfg.deepstack_visual_indexes)

    def learned_positions(self, grids: list[tuple[int, int, int]], layout: PatchLayout) -> torch.Tensor:
        """Qwen3-VL: the square position table bilinearly resized (corners aligned) to each image's grid, read at
        each patch's (row, column).  [N, E]"""
        table = self.pos_embed.weight
        side = int(round(table.shape[0] ** 0.5))
        grid = table.t().reshape(1, -1, side, side)  # [1, E, side, side]
        out, start = [], 0
        for t, h, w in grids:
            resized = F.interpolate(grid.float(), size=(h, w), mode="bilinear", align_corners=True)[0]  # [E, h, w]
            n = t * h * w
            rows, cols = layout.rows[start:start + n].to(table.device), layout.cols[start:start + n].to(table.device)
            out.append(resized[:, rows, cols].t())  # [n, E]
            start += n
        return torch.cat(out).to(table.dtype)

    def rope(self, layout: PatchLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [N, Dv] in float32: row angles on the first half of the frequencies, columns on the
        second."""
        half = self.config.head_dim // 2  # each axis turns with frequencies over half the head dim
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
        angles = torch.cat([layout.rows[:, None] * inv_freq, layout.cols[:, None] * inv_freq], dim=-1)  # [N, Dv/2]
        angles = torch.cat([angles, angles], dim=-1).to(device)  # [N, Dv]
        return rope_tables(angles.cos(), angles.sin())

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixels [N, F] (the processor's pixel_values), grids: each image's (t, h, w) in patches -> [M, 1 + k, O]:
        the merged embeddings and the k deepstack features of each merged token."""
        cfg = self.config
        expected = sum(t * h * w for t, h, w in grids)
        if pixels.shape != (expected, cfg.patch_features):
            raise ValueError(f"pixel_values has shape {tuple(pixels.shape)}, the image grids {list(grids)} imply "
                             f"({expected}, {cfg.patch_features}): the images were processed for another tower")
        layout = patch_layout(grids, cfg)
        full = groups_of(layout.frames).to(pixels.device)
        windowed = None if cfg.qwen3 else groups_of(layout.windows).to(pixels.device)
        cos, sin = self.rope(layout, pixels.device)
        x = self.patch_embed(pixels)  # [N, E]
        if cfg.qwen3:
            x = x + self.learned_positions(grids, layout)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, windowed if cfg.windowed(i) else full)
            if i in cfg.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[cfg.deepstack_visual_indexes.index(i)](x))  # [M, O]
        return torch.stack([self.merger(x), *deepstack], dim=1)  # [M, 1 + k, O]


def set_trainable(tower: nn.Module, trainable: bool) -> None:
    """Freeze (the default for RL) or unfreeze the vision tower and its merger."""
    for p in tower.parameters():
        p.requires_grad_(trainable)
