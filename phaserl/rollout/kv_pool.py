"""KVPool: the rollout engine's preallocated key/value memory, carved into fixed-length slots.

One flat buffer per pool holds the keys and values of every layer. A generate call asks for a layout
(`num_slots` slots of `slot_len` positions each) and gets views into that buffer: slot s, position p
holds the key/value of the token at RoPE position p of the sequence that owns slot s. Nothing is
copied when the layout changes; only the views do.

Layers are grouped by the width of their KV row (Hkv × D: Gemma 4's global layers are wider than its
sliding ones), and each width group has its own region of the buffer, [Lg, 2, capacity × width], so every
layer's row is exactly as wide as its own keys and values. Slot s sits at the same slot index in every group:
moving whole slots is one index copy per group (`slot_rows`), a handful at most, not one per layer; the slot
numbers reach the device without a stream sync (`slot_index`, `exchange_index`).

Gemma 4's KV-sharing layers (E2B/E4B) keep no rows of their own: `layout` hands each of them the views of the
layer whose keys and values it reads (DecoderConfig.kv_source), so the pool holds only the layers that write.

Size: an explicit token budget, or `memory_fraction` of the free accelerator memory at wake() time,
capped at `max_tokens` (what the run can use: its most slots times its longest slot), so a small
model with short sequences does not take 40% of a GPU.
On the CPU without a budget the buffer is sized on demand (exactly what a call needs).
`sleep()` frees the buffer (the hybrid actor's switch to training), `wake()` allocates it again.
Not here: which sequence owns which slot (scheduler.py), the math that fills the slots (runner.py).

Legend: L layers with KV, G width groups, Lg layers of a group, S slot_len, Hkv key/value heads, D head_dim.
"""
from __future__ import annotations

from typing import Optional

import torch

from phaserl.errors import ConfigError
from phaserl.models.config import DecoderConfig


class KVPool:
    def __init__(self, cfg: DecoderConfig, dtype: torch.dtype, device: torch.device | str, *,
                 token_budget: Optional[int] = None, memory_fraction: float = 0.4, max_tokens: Optional[int] = None):
        if token_budget is not None and token_budget < 1:
            raise ConfigError(f"KVPool token_budget={token_budget}: must be >= 1 (or None to size from memory)")
        if not 0 < memory_fraction < 1:
            raise ConfigError(f"KVPool memory_fraction={memory_fraction}: must be in (0, 1)")
        self.cfg = cfg
        self.layer_heads = self.kv_layer_heads(cfg)
        self.num_layers = len(self.layer_heads)
        # per attention layer (linear ones left out): the index into layer_heads of the layer whose KV it reads
        owners = [i for i in range(cfg.num_hidden_layers) if self.keeps_kv(cfg, i)]
        self.reads = [owners.index(cfg.kv_source(i)) for i in range(cfg.num_hidden_layers) if not cfg.is_linear(i)]
        self.groups = self.width_groups(self.layer_heads)  # [G] (Hkv * D, the pool's layers of that width)
        # per layer with KV: (its group, its index among the group's layers)
        self.place = {i: (g, j) for g, (_, layers) in enumerate(self.groups) for j, i in enumerate(layers)}
        self.dtype, self.device = dtype, torch.device(device)
        self.token_budget, self.memory_fraction, self.max_tokens = token_budget, memory_fraction, max_tokens
        self.buffer: Optional[torch.Tensor] = None  # [capacity * 2 * sum of every layer's Hkv * D], flat
        self.regions: list[torch.Tensor] = []  # per group [Lg, 2, capacity * width]: views of the buffer
        self.capacity_tokens = 0

    @staticmethod
    def keeps_kv(cfg: DecoderConfig, layer: int) -> bool:
        """True when `layer` writes keys and values of its own: not a linear-attention layer (Qwen3.5: its state
        lives in rollout/recurrent_state.py), nor a KV-sharing one (Gemma 4 E2B/E4B)."""
        return not cfg.is_linear(layer) and cfg.kv_source(layer) == layer

    @classmethod
    def kv_layer_heads(cls, cfg: DecoderConfig) -> list[tuple[int, int]]:
        """(Hkv, D) of every layer that keeps keys and values (keeps_kv). Gemma 4's global layers differ from its
        sliding ones. Sliding layers get the whole slot, not only their window (slot positions are RoPE positions
        in every layer)."""
        return [cfg.heads(i)[1:] for i in range(cfg.num_hidden_layers) if cls.keeps_kv(cfg, i)]

    @staticmethod
    def width_groups(layer_heads: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
        """(row width Hkv * D, the indices into layer_heads of the layers that wide), widths in order of first use.
        Layers of equal width share a group whatever their head split (2 x 8 and 1 x 16 both take 16)."""
        groups: dict[int, list[int]] = {}
        for i, (h, d) in enumerate(layer_heads):
            groups.setdefault(h * d, []).append(i)
        return list(groups.items())

    @classmethod
    def token_bytes(cls, cfg: DecoderConfig, dtype: torch.dtype) -> int:
        """Keys + values of one token over all layers, as the buffer holds them: 2 × sum over the layers with KV
        of Hkv × D × itemsize, each layer's row exactly its own width (Gemma 4's sliding layers do not take their
        global layers' width). Gemma 4's k_eq_v layers store values too (the keys' projection, but value-normed
        and not rotated: not the keys). The doctor's memory count calls this (rollout/slot_memory.py)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * sum(h * d for h, d in cls.kv_layer_heads(cfg)) * itemsize

    @property
    def bytes_per_token(self) -> int:
        """Keys + values of one token over all layers."""
        return self.token_bytes(self.cfg, self.dtype)

    @property
    def awake(self) -> bool:
        return self.buffer is not None

    @property
    def allocated_bytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()

    def _target_tokens(self) -> Optional[int]:
        """How many tokens wake() allocates: the budget, a fraction of free memory, or None (CPU: on demand)."""
        if self.token_budget is not None:
            return self.token_budget
        if self.device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            tokens = int(free_bytes * self.memory_fraction) // self.bytes_per_token
            return tokens if self.max_tokens is None else min(tokens, self.max_tokens)
        return None

    def _allocate(self, tokens: int) -> None:
        self.buffer, self.regions = None, []  # free the old buffer before taking the new one
        elements = 2 * sum(width * len(layers) for width, layers in self.groups)  # one token, every layer
        # Zeros, not empty: attention multiplies masked-out positions by 0, and 0 * NaN garbage is NaN.
        self.buffer = torch.zeros(tokens * elements, dtype=self.dtype, device=self.device)
        start = 0
        for width, layers in self.groups:
            size = len(layers) * 2 * tokens * width
            self.regions.append(self.buffer[start:start + size].view(len(layers), 2, tokens * width))
            start += size
        self.capacity_tokens = tokens

    def wake(self) -> int:
        """Allocate the buffer (if sized up front); returns the bytes allocated by this call."""
        if self.awake:
            return 0
        tokens = self._target_tokens()
        if tokens is not None:
            if tokens < 1:
                raise ConfigError(f"KVPool: no room for a KV cache ({self.bytes_per_token} bytes per token, "
                                  f"memory_fraction={self.memory_fraction}); free accelerator memory or set "
                                  "rollout token_budget")
            self._allocate(tokens)
        return self.allocated_bytes

    def sleep(self) -> int:
        """Free the buffer; returns the bytes released. Views handed out earlier must be dropped too."""
        freed = self.allocated_bytes
        self.buffer, self.regions, self.capacity_tokens = None, [], 0
        return freed

    def slots_that_fit(self, slot_len: int) -> Optional[int]:
        """Slots of `slot_len` positions the buffer holds; None = unlimited (CPU, sized on demand)."""
        if self.token_budget is None and self.device.type != "cuda":
            return None
        if not self.awake:
            self.wake()
        return self.capacity_tokens // slot_len

    def layout(self, num_slots: int, slot_len: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per attention layer keys and values, each [num_slots, Hkv, S, D], viewing the buffer (grown on demand on
        CPU); a KV-sharing layer gets its source's views."""
        needed = num_slots * slot_len
        if self.slots_that_fit(slot_len) is None:  # sized on demand
            if not self.awake or needed > self.capacity_tokens:
                self._allocate(needed)
        elif needed > self.capacity_tokens:
            raise ConfigError(f"KVPool holds {self.capacity_tokens} tokens but {num_slots} slots x {slot_len} "
                              f"positions = {needed} were asked for; raise token_budget / memory_fraction or "
                              "lower max_new_tokens")
        rows = self.slot_rows(num_slots, slot_len)  # per group [Lg, 2, slots, S * width]: views, no copy
        views = []
        for i, (h, d) in enumerate(self.layer_heads):
            g, j = self.place[i]
            views.append(rows[g][j].unflatten(-1, (h, slot_len, d)))  # [2, slots, Hkv, S, D]
        return [views[i][0] for i in self.reads], [views[i][1] for i in self.reads]

    def slot_rows(self, num_slots: int, slot_len: int) -> list[torch.Tensor]:
        """All of the KV as one [Lg, 2, num_slots, S * width] per width group, for moving whole slots with one
        index copy per group."""
        return [region[:, :, :num_slots * slot_len * width].view(len(layers), 2, num_slots, -1)
                for region, (width, layers) in zip(self.regions, self.groups)]


def slot_index(device: torch.device, values: list) -> torch.Tensor:
    """Slot numbers as int64 on the device, without a stream sync (torch.tensor(values, device=cuda) copies from
    pageable memory blocking, which drains the decode step in flight; a non-blocking copy only stages them)."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def exchange_index(pairs: list[tuple[int, int]], chunk: int, device: torch.device) -> torch.Tensor:
    """[2, 2k] (src; dst) on the device for exchanging slot pairs (a, b): chunk by chunk its a's, then its b's (every
    slice of 2 * chunk is an exchange of its own)."""
    parts = [list(zip(*pairs[i:i + chunk])) for i in range(0, len(pairs), chunk)]  # [(a's, b's)] per chunk
    return slot_index(device, [[s for a, b in parts for s in a + b], [s for a, b in parts for s in b + a]])


STOP_WIDTH = 32  # stop-token ids one call may use; fixed so that captured graphs keep their shapes


class SlotState:
    """The decode state of every slot, on the device next to the KV: what the next step feeds and records.

    A slot is `finished` when it holds no running sequence or its sequence has stopped; a finished
    slot's step changes nothing but its own trash column and its KV at its frozen position.
    """

    def __init__(self, num_slots: int, max_new: int, device: torch.device):
        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)
        self.tokens = zeros(num_slots)                 # [slots] the token the next step feeds
        self.pos = zeros(num_slots)                    # [slots] its RoPE position = its KV position
        self.n_gen = zeros(num_slots)                  # [slots] tokens generated so far
        self.max_new = zeros(num_slots)                # [slots] this sequence's cap
        self.key = zeros(num_slots)                    # [slots] its noise key (runner.prefill sets it; it moves
                                                       # with the sequence: move(), runner.swap_slots)
        self.finished = torch.ones(num_slots, dtype=torch.bool, device=device)  # [slots]
        self.out_tokens = zeros(num_slots, max_new + 1)  # [slots, N + 1]; column N is a trash column
        self.out_logprobs = zeros(num_slots, max_new + 1, dtype=torch.float32)
        self.stop_ids = torch.full((STOP_WIDTH,), -1, dtype=torch.long, device=device)  # -1 never matches
        self.max_new_tokens = max_new

    def reset(self, stop_ids: list[int]) -> None:
        if len(stop_ids) > STOP_WIDTH:
            raise ConfigError(f"{len(stop_ids)} EOS/stop token ids given; the rollout engine supports at most "
                              f"{STOP_WIDTH}")
        self.finished.fill_(True)
        self.pos.zero_()
        self.stop_ids.fill_(-1)
        if stop_ids:
            self.stop_ids[:len(stop_ids)] = torch.tensor(stop_ids, dtype=torch.long)

    def is_stop(self, tokens: torch.Tensor) -> torch.Tensor:
        return (tokens[:, None] == self.stop_ids[None, :]).any(-1)  # [b]

    def start(self, slots: torch.Tensor, first: torch.Tensor, logprobs: torch.Tensor, prompt_lens: torch.Tensor,
              caps: torch.Tensor) -> None:
        """Sequences enter `slots` [A] with their first sampled token; the prompt KV is already in place."""
        self.tokens[slots], self.pos[slots] = first, prompt_lens
        self.n_gen.index_fill_(0, slots, 1)  # not n_gen[slots] = 1: that copies a host scalar (no CUDA graph)
        self.max_new[slots] = caps
        self.out_tokens[slots, 0], self.out_logprobs[slots, 0] = first, logprobs
        self.finished[slots] = self.is_stop(first) | (caps <= 1)

    def record(self, b: int, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """After a decode step over slots [0, b): store each running slot's token, stop it or move it on."""
        active = ~self.finished[:b]  # [b]
        n_gen = self.n_gen[:b]
        column = torch.where(active, n_gen, self.max_new_tokens)[:, None]  # [b, 1], trash column when idle
        self.out_tokens[:b].scatter_(1, column, tokens[:, None])
        self.out_logprobs[:b].scatter_(1, column, logprobs[:, None])
        n_gen += active
        stop = active & (self.is_stop(tokens) | (n_gen >= self.max_new[:b]))
        self.finished[:b] |= stop
        self.tokens[:b] = torch.where(active, tokens, self.tokens[:b])
        # A stopped row moves on too: its frozen steps then write its last token's KV at that token's own
        # position, so the KV of everything before stays intact for a continuation (rollout/session.py).
        self.pos[:b] += active

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slot dst[i] takes slot src[i]'s state, and the sources stop (compaction)."""
        self.exchange(src, dst)
        self.finished[src] = True

    def exchange(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slot dst[i] takes slot src[i]'s state; src and dst [k] may be one permutation of the same slots (the
        right side is gathered first: a true exchange)."""
        for t in (self.tokens, self.pos, self.n_gen, self.max_new, self.key, self.finished, self.out_tokens,
                  self.out_logprobs):
            t[dst] = t[src]
