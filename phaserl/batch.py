"""Typed data that travels between the phases of one RL step.

Layout (as in verl): every response row is `prompt (left-padded to P) + response (right-padded to R)`.
Legend: B = responses in the batch (prompts × n), P = padded prompt width, R = padded response width,
S = P + R. Response-aligned tensors are [B, R]; sequence tensors are [B, S].

Two masks over the response region: `response_mask` says which positions hold real tokens (what the
forward passes attend and score), `loss_mask` which of them the policy trained on: the sampled
tokens. They differ in multi-turn episodes, whose responses interleave model turns and observation
tokens (phaserl.agents): losses, KL, entropy, advantages, their whitening and token counts use
`loss_mask`; log-prob and value passes, packing and micro-batch sizes use `response_mask`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Optional

import numpy as np
import torch


@dataclass
class RolloutBatch:
    """What the rollout phase produces: token ids and the sampler's log-probs."""

    input_ids: torch.Tensor        # [B, S] prompt (left-padded) + response (right-padded)
    attention_mask: torch.Tensor   # [B, S] 1 = real token
    position_ids: torch.Tensor     # [B, S]
    response_mask: torch.Tensor    # [B, R] 1 = response token (EOS included)
    prompt_width: int              # P
    group_ids: torch.Tensor        # [B] responses of one prompt share an id
    rollout_logprobs: torch.Tensor  # [B, R] log-probs reported by the sampler
    prompts: list                  # [B] the prompt (str or chat messages) of each response
    response_texts: list           # [B] decoded responses, special tokens stripped
    rows: list                     # [B] the PromptRow each response answers
    finish_reasons: list           # [B] "stop" | "length" (episodes: why each ended, agents.episodes)
    loss_mask: Optional[torch.Tensor] = None  # [B, R] 1 = sampled token; None -> response_mask (single turn)
    episodes: Optional[list] = None  # [B] agents.Episode of each row (multi-turn runs), else None
    rollout_metrics: dict = field(default_factory=dict)  # name -> float, logged with the step (agent/*)
    # MoE routing replay (actor.routing_replay): the experts the rollout engine used at each position, per MoE layer
    routed_experts: Optional[torch.Tensor] = None  # [B, S, L, k] int16, -1 = not recorded (padding, last token)
    # The policy version (optimizer steps taken before it) that sampled each response token; -1 where nothing was
    # sampled. None = every token by the weights being trained (the synchronous step, rollout.max_staleness 0).
    token_versions: Optional[torch.Tensor] = None  # [B, R] int64
    # Vision-language rows: each row's data.images.ImageInputs (its prompt's pixels from the one processor call; the
    # n responses of a prompt share the object), None for a text row. None = a text batch.
    images: Optional[list] = None  # [B]
    # CPU copies of fields (on_host), made once per batch; a new batch (select, replace) starts empty.
    _host: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.loss_mask is None:
            self.loss_mask = self.response_mask

    @property
    def num_responses(self) -> int:
        return self.input_ids.shape[0]

    def on_host(self, name: str) -> torch.Tensor:
        """A CPU copy of tensor field `name` (e.g. the masks), made on first use: packing plans its
        micro-batches on the host from it, with one device sync per batch instead of several per
        micro-batch. The batch's tensors are not modified after it is built."""
        if name not in self._host:
            self._host[name] = getattr(self, name).cpu()
        return self._host[name]

    @property
    def response_ids(self) -> torch.Tensor:  # [B, R]
        return self.input_ids[:, self.prompt_width:]

    def response_lengths(self) -> torch.Tensor:  # [B]
        return self.response_mask.sum(dim=1)

    def sampled_lengths(self) -> torch.Tensor:  # [B] tokens the policy sampled (= response_lengths in one turn)
        return self.loss_mask.sum(dim=1)

    def select(self, index: torch.Tensor) -> "RolloutBatch":
        """Rows `index` (a 1-D long tensor) of every field."""
        idx = index.tolist()
        take = _row_taker(index)
        return replace(
            self,
            input_ids=take(self.input_ids), attention_mask=take(self.attention_mask),
            position_ids=take(self.position_ids), response_mask=take(self.response_mask),
            group_ids=take(self.group_ids), rollout_logprobs=take(self.rollout_logprobs),
            prompts=[self.prompts[i] for i in idx], response_texts=[self.response_texts[i] for i in idx],
            rows=[self.rows[i] for i in idx], finish_reasons=[self.finish_reasons[i] for i in idx],
            loss_mask=take(self.loss_mask),
            episodes=None if self.episodes is None else [self.episodes[i] for i in idx],
            routed_experts=None if self.routed_experts is None else take(self.routed_experts),
            token_versions=None if self.token_versions is None else take(self.token_versions),
            images=None if self.images is None else [self.images[i] for i in idx],
        )


@dataclass
class Scores:
    """What the score phase produces."""

    total: torch.Tensor            # [B] float32 weighted sum of every reward source
    by_source: dict = field(default_factory=dict)  # name -> [B] float32 raw score of one function / the RM
    token_rewards: Optional[torch.Tensor] = None   # [B, R] where the total lies (per-turn rewards of an
                                                   # episode); None = all of it on the last sampled token


@dataclass
class ScoredBatch:
    """What phases 2-3 (rollout, score) produce together; dynamic sampling joins several of these."""

    batch: RolloutBatch
    scores: Scores
    baseline_scores: Optional[torch.Tensor] = None  # [B] score of the prompt's greedy response (remax), else None

    def select(self, index: torch.Tensor) -> "ScoredBatch":
        """Rows `index` (a 1-D long tensor on the batch's device) of the batch, its scores and baseline."""
        take = _row_taker(index)
        placed = self.scores.token_rewards
        scores = Scores(total=take(self.scores.total), by_source={k: take(v) for k, v in self.scores.by_source.items()},
                        token_rewards=None if placed is None else take(placed))
        baseline = None if self.baseline_scores is None else take(self.baseline_scores)
        return ScoredBatch(self.batch.select(index), scores, baseline)


@dataclass
class TrainBatch:
    """Everything the update phase needs, one row per response."""

    rollout: RolloutBatch
    old_logprobs: Optional[torch.Tensor]   # [B, R]; None = the update's own detached log-probs (on-policy)
    ref_logprobs: Optional[torch.Tensor]   # [B, R]
    advantages: torch.Tensor               # [B, R]
    returns: torch.Tensor                  # [B, R]
    old_values: Optional[torch.Tensor]     # [B, R]

    @property
    def num_responses(self) -> int:
        return self.rollout.num_responses

    def select(self, index: torch.Tensor) -> "TrainBatch":
        take = _row_taker(index)
        pick = lambda t: None if t is None else take(t)  # noqa: E731
        return TrainBatch(
            rollout=self.rollout.select(index), old_logprobs=pick(self.old_logprobs),
            ref_logprobs=pick(self.ref_logprobs), advantages=take(self.advantages),
            returns=take(self.returns), old_values=pick(self.old_values),
        )


def layout_ids(prompts: list, responses: list, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Token id lists laid out as a batch: (input_ids [B, S], attention_mask [B, S], P), prompts left-padded to
    P, responses right-padded to R = max(1, longest). Filled through masks in one copy each, not a row at a
    time: row-major order of a mask's True cells is the order of the concatenated lists (512 rows of 384
    tokens: ~1,500 small tensors a step before, tens of ms of host time). In numpy: each torch CPU kernel woke
    torch's thread pool, and on the H200's 16-core host these few [512, 384] operations took up to ~100 ms a
    step (cProfile, 2026-12-04; 8 ms on a 2-core CPU)."""
    P = max(map(len, prompts))
    R = max(1, max(map(len, responses)))
    prompt_cells = np.arange(P) >= P - _lengths(prompts)[:, None]     # [B, P] left padding
    response_cells = _right_padded_cells(responses, R)                 # [B, R]
    input_ids = np.full((len(prompts), P + R), pad_token_id, dtype=np.int64)  # [B, S]
    input_ids[:, :P][prompt_cells] = _flat(prompts, np.int64)
    input_ids[:, P:][response_cells] = _flat(responses, np.int64)
    mask = np.concatenate([prompt_cells, response_cells], axis=1).astype(np.int64)
    return torch.from_numpy(input_ids), torch.from_numpy(mask), P


def right_padded(values: list, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Lists of numbers as rows [B, width], zero after each list's end."""
    out = np.zeros((len(values), width), dtype=_NUMPY[dtype])
    out[_right_padded_cells(values, width)] = _flat(values, _NUMPY[dtype])
    return torch.from_numpy(out)


def _right_padded_cells(values: list, width: int) -> np.ndarray:
    """[B, width] True on the first len(values[i]) cells of row i."""
    return np.arange(width) < _lengths(values)[:, None]


def _lengths(values: list) -> np.ndarray:
    return np.fromiter(map(len, values), dtype=np.int64, count=len(values))  # [B]


def _flat(values: list, dtype) -> np.ndarray:
    """The lists concatenated [sum of lengths]; numpy's fromiter reads Python numbers ~4x faster than torch.tensor."""
    count = sum(map(len, values))
    return np.fromiter(chain.from_iterable(values), dtype=dtype, count=count)


_NUMPY = {torch.long: np.int64, torch.float32: np.float32}


def layout_routes(prompt_lengths: list, routes: list, P: int, R: int) -> torch.Tensor:
    """The engine's per-sequence expert routes (GenerationResult.routes: [prompt + response, L, k] each) laid out
    like input_ids (prompt left-padded to P, response right-padded to R), -1 at padding.  [B, P + R, L, k]"""
    first = routes[0]
    out = torch.full((len(routes), P + R, *first.shape[1:]), -1, dtype=first.dtype, device=first.device)
    for i, (p, route) in enumerate(zip(prompt_lengths, routes)):
        out[i, P - p:P - p + route.shape[0]] = route
    return out


PIN_HOST_COPIES = True  # False: send() copies from pageable memory (comparisons: benchmarks/grpo_step.py --ab)


def send(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without making the host wait: to a GPU through pinned memory (torch's caching host
    allocator keeps the block until the copy is done). A copy from pageable memory can wait for the stream to reach
    it, so the host stops queueing work while the GPU drains (the update's `aten::copy_` gaps on the H200,
    BENCHMARKS.md, 2026-12-04)."""
    device = torch.device(device)
    if PIN_HOST_COPIES and t.device.type == "cpu" and device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _row_taker(index: torch.Tensor):
    """t -> t[index], the index sent once to each device it meets, without waiting: indexing a CUDA
    tensor with a CPU index copies the index with a host sync, once per field and micro-batch."""
    on_device: dict = {index.device: index}

    def take(t: torch.Tensor) -> torch.Tensor:
        if t.device not in on_device:
            on_device[t.device] = send(index, t.device)
        return t[on_device[t.device]]
    return take
