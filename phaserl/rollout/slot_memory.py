"""What the rollout engine holds per slot, read from the code that allocates it, so that the doctor's memory count
(memory/budget.py) and the engine cannot drift apart.

Per slot of S positions, in the dtype of the engine's weights:
  KV       KVPool.token_bytes × S: keys and values of the attention layers only (none for Qwen3.5's linear-attention
           layers), each layer's row exactly its own kv heads × head_dim wide (Gemma 4's global layers wider than its
           sliding ones), sliding-window layers over the whole slot (the pool does not store only the window), values
           stored for k_eq_v layers too
  state    RecurrentState.bytes_per_slot: per linear-attention layer the short conv's last K-1 inputs (model dtype)
           and the DeltaNet state [Hv, Dk, Dv] (float32), whatever S is
  routes   with routing replay (actor.routing_replay), the experts every MoE layer chose at every position:
           S × MoE layers × k int16 ids (runner.route_columns)
Not here: how many slots the pool holds (kv_pool.py sizes itself from its budget or free memory), the weights, their
fused copies and the graphs (the doctor counts those as the weights once more), the per-slot decode bookkeeping
(SlotState: a few bytes per generated token).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from phaserl.models.config import DecoderConfig
from phaserl.models.layers import layer_spec
from phaserl.rollout.kv_pool import KVPool
from phaserl.rollout.recurrent_state import RecurrentState
from phaserl.rollout.runner import ROUTE_DTYPE, route_columns


@dataclass(frozen=True)
class SlotMemory:
    """Bytes of one engine slot: per position (KV, routes) and per slot (recurrent state)."""

    kv_per_token: int        # KVPool.token_bytes
    state_per_slot: int      # RecurrentState.bytes_per_slot (0 without linear-attention layers)
    routes_per_token: int    # the routing-replay record (0 without MoE layers)
    kv_layers: int = 0       # layers with KV of their own (Gemma 4's KV-sharing layers read another's)
    # for the doctor's words: (layers, their kv heads × head_dim) per row width, kv_per_token = 2 × Σ layers × width × b
    kv_rows: tuple[tuple[int, int], ...] = ()
    linear_layers: int = 0   # layers with a recurrent state instead

    def slot_bytes(self, tokens: int, *, routes: bool = False) -> int:
        """One slot of `tokens` positions; `routes`: routing replay is on."""
        return self.kv_per_token * tokens + self.state_per_slot + (self.routes_per_token * tokens if routes else 0)


def slot_memory(cfg: DecoderConfig, dtype: torch.dtype) -> SlotMemory:
    """What one slot of an engine over a model of `cfg` with `dtype` weights allocates."""
    moe_layers, k = route_columns([layer_spec(cfg, i) for i in range(cfg.num_hidden_layers)])
    heads = KVPool.kv_layer_heads(cfg)
    return SlotMemory(kv_per_token=KVPool.token_bytes(cfg, dtype),
                      state_per_slot=RecurrentState.bytes_per_slot(cfg, dtype),
                      routes_per_token=moe_layers * k * ROUTE_DTYPE.itemsize,
                      kv_layers=len(heads),
                      kv_rows=tuple((len(layers), width) for width, layers in KVPool.width_groups(heads)),
                      linear_layers=sum(cfg.is_linear(i) for i in range(cfg.num_hidden_layers)))
