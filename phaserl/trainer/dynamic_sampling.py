"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476 §3.2): a wrapper around "produce a scored batch".

A group whose n rewards are all equal (all right, all wrong) has advantage 0 under every group
baseline, so it adds nothing to the gradient but dilutes the batch. With `algorithm.dynamic_sampling`
the step drops such groups and produces more (another `prompts per rank` prompts from the stream,
rolled out and scored the same way) until it holds its full number of informative groups, at most
`dynamic_sampling_max_rounds` extra rounds. If the cap is reached first, the step is filled with
zero-variance groups (so every phase keeps its sizes) and a warning says how many.

What "produce" does (single-turn generation today, multi-turn episodes later) is the caller's: this
module only calls it, picks rows and joins `ScoredBatch`es. Under torchrun every rank runs the same
number of rounds (the reward model and the sharded actor run collectives), decided by an all-reduce;
each rank keeps its own groups. Differences from verl: verl draws whole generation batches until the
*global* batch is full and errors out at the cap; phaserl fills per rank and falls back to
zero-variance groups with a warning (metric `sampling/filled_groups`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch
import torch.nn.functional as F

from ..algo import group_has_variance
from ..batch import RolloutBatch, ScoredBatch, Scores
from ..parallel import all_reduce_sum, rank_and_world

log = logging.getLogger("phaserl")

Produce = Callable[[list], ScoredBatch]    # prompt items -> their n responses each, scored
NextItems = Callable[[], list]             # the next prompt items of this rank (the prompt stream)


def single_round(produce: Produce, items: list, next_items: NextItems) -> tuple[ScoredBatch, dict]:
    """Phases 2-3 as they are: one round, nothing dropped."""
    return produce(items), {}


@dataclass(frozen=True)
class DynamicSampling:
    """`algorithm.dynamic_sampling`: keep informative groups, sample more rounds, at most `max_rounds` extra."""

    max_rounds: int
    pad_token_id: int

    def __call__(self, produce: Produce, items: list, next_items: NextItems) -> tuple[ScoredBatch, dict]:
        target = len(items)  # groups (prompts) this rank's step needs
        kept, spare, n_kept, n_spare, sampled, informative_total, rounds = [], [], 0, 0, 0, 0, 0
        first_group_id = None
        while True:
            scored = produce(items)
            rounds += 1
            n = scored.batch.num_responses // len(items)  # responses per group (consecutive rows)
            first_group_id = int(scored.batch.group_ids[0]) if first_group_id is None else first_group_id
            informative = group_has_variance(scored.scores.total, scored.batch.group_ids)[::n]  # [G] per group
            sampled += len(items)
            informative_total += int(informative.sum())
            good = informative.nonzero().squeeze(1)[: target - n_kept]  # [g] group indices
            bad = (~informative).nonzero().squeeze(1)[: target - n_spare]
            if len(good):
                kept.append(scored.select(_rows(good, n, scored.batch.group_ids.device)))
                n_kept += len(good)
            if len(bad) and n_spare < target:
                spare.append(scored.select(_rows(bad, n, scored.batch.group_ids.device)))
                n_spare += len(bad)
            missing_ranks = float(all_reduce_sum(torch.tensor(float(n_kept < target))))
            if missing_ranks == 0 or rounds > self.max_rounds:
                break
            items = next_items()
        filled = target - n_kept
        if filled:
            kept.append(_first_groups(join(spare, self.pad_token_id), filled, n))
            if rank_and_world()[0] == 0:
                log.warning(f"dynamic sampling: after {rounds} rounds only {n_kept} of {target} groups on this "
                            f"rank had different rewards; the step is filled with {filled} zero-variance groups "
                            "(advantage 0). "
                            "Raise algorithm.dynamic_sampling_max_rounds, raise rollout.n, or check the reward")
        out = join(kept, self.pad_token_id)
        n = out.batch.num_responses // target
        ids = (first_group_id + torch.arange(target).repeat_interleave(n)).to(out.batch.group_ids)  # [B] as one round
        out = replace(out, batch=replace(out.batch, group_ids=ids))
        stats = {"sampling/rounds": float(rounds), "sampling/informative_group_frac": informative_total / sampled,
                 "sampling/filled_groups": float(filled)}
        return out, stats


def _rows(groups: torch.Tensor, n: int, device) -> torch.Tensor:
    """Row indices of whole groups (each n consecutive rows).  [g] -> [g * n]"""
    return (groups.unsqueeze(1) * n + torch.arange(n, device=groups.device)).reshape(-1).to(device)


def _first_groups(scored: ScoredBatch, count: int, n: int) -> ScoredBatch:
    return scored.select(torch.arange(count * n, device=scored.batch.group_ids.device))


def join(parts: list, pad_token_id: int) -> ScoredBatch:
    """One ScoredBatch from several, rows in order (batches re-padded to the widest prompt and response)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0].scores
    placed = None  # [B, R] per-turn rewards of episodes, right-padded to the joined response width
    if first.token_rewards is not None:
        R = max(p.batch.response_mask.shape[1] for p in parts)
        placed = torch.cat([F.pad(p.scores.token_rewards, (0, R - p.scores.token_rewards.shape[1])) for p in parts])
    scores = Scores(total=torch.cat([p.scores.total for p in parts]),
                    by_source={k: torch.cat([p.scores.by_source[k] for p in parts]) for k in first.by_source},
                    token_rewards=placed)
    baseline = None if parts[0].baseline_scores is None else torch.cat([p.baseline_scores for p in parts])
    return ScoredBatch(concat_batches([p.batch for p in parts], pad_token_id), scores, baseline)


def concat_batches(parts: list, pad_token_id: int) -> RolloutBatch:
    """RolloutBatches joined row-wise, field by field: [B, S] tensors re-padded left (prompt) and right
    (response), [B, R] tensors right, [B] tensors and lists joined; a field of another kind is an error
    (a new RolloutBatch field must say how it joins)."""
    P = max(p.prompt_width for p in parts)
    R = max(p.response_mask.shape[1] for p in parts)
    values = {}
    for f in fields(RolloutBatch):
        if not f.init:
            continue
        first = getattr(parts[0], f.name)
        if f.name == "prompt_width":
            values[f.name] = P
        elif isinstance(first, list):
            values[f.name] = [x for p in parts for x in getattr(p, f.name)]
        elif first is None:  # an optional field no part has (episodes of a single-turn run)
            values[f.name] = None
        elif isinstance(first, dict):  # rollout_metrics: per-row means weighted by rows, maxima as maxima
            values[f.name] = _join_metrics(parts)
        elif isinstance(first, torch.Tensor):
            pad = {"input_ids": pad_token_id, "routed_experts": -1, "token_versions": -1}.get(f.name, 0)
            values[f.name] = torch.cat([_repad(getattr(p, f.name), p, P, R, pad, f.name) for p in parts])
        else:
            raise TypeError(f"concat_batches cannot join RolloutBatch.{f.name} ({type(first).__name__})")
    return RolloutBatch(**values)


def _join_metrics(parts: list) -> dict:
    rows = sum(p.num_responses for p in parts)
    keys = {k for p in parts for k in p.rollout_metrics}
    return {k: max(p.rollout_metrics.get(k, 0.0) for p in parts) if k.endswith("_max") else
            sum(p.rollout_metrics.get(k, 0.0) * p.num_responses for p in parts) / rows for k in sorted(keys)}


def _repad(t: torch.Tensor, part: RolloutBatch, P: int, R: int, pad: int, name: str) -> torch.Tensor:
    if t.dim() == 1:
        return t
    S_part, R_part = part.input_ids.shape[1], part.response_mask.shape[1]
    if t.dim() == 2 and t.shape[1] == S_part:  # [b, S]: prompt left-padded to P, response right-padded to R
        return F.pad(t, (P - part.prompt_width, R - R_part), value=pad)
    if t.dim() == 4 and t.shape[1] == S_part:  # [b, S, L, k] routed_experts: along S like [b, S]
        return F.pad(t, (0, 0, 0, 0, P - part.prompt_width, R - R_part), value=pad)
    if t.dim() == 2 and t.shape[1] == R_part:  # [b, R]
        return F.pad(t, (0, R - R_part), value=pad)
    raise TypeError(f"concat_batches cannot join RolloutBatch.{name} of shape {tuple(t.shape)}")
