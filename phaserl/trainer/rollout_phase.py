"""Phase 2 (rollout), single turn: prompts → generation requests → a padded `RolloutBatch`.

The n responses of a prompt are consecutive rows and share a group id, so group baselines (GRPO,
RLOO) are exact and stay on one rank. Multi-turn episodes are trainer/agent_phase.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..batch import RolloutBatch, layout_ids, layout_routes, right_padded
from ..data.prompts import decode_responses
from ..rollout import GenerationResult

if TYPE_CHECKING:
    from .rollout_context import RolloutContext


def single_turn_rollout(ctx: "RolloutContext", items: list, params, n: int) -> RolloutBatch:
    """n responses per prompt, rollout.batch_size prompts per generate call.

    Each call's generator is seeded from the global index of the call's first prompt (`SeedStreams.generate_call`),
    never from the rank: when rollout.batch_size divides the prompts per rank, a prompt's samples are the same
    on any number of ranks (the invariance test relies on it; docs/distributed.md).
    """
    run = ctx.run
    first = ctx.rank * len(items)  # global index of this rank's first prompt (contiguous, equal shares)
    parts = []
    for start in range(0, len(items), run.generate_batch_size):
        chunk = repeat_prompts(items[start:start + run.generate_batch_size], n)
        run.sampling_generator.manual_seed(ctx.seeds.generate_call(first + start, n))
        vision = {} if row_images(chunk) is None else {"images": row_images(chunk)}  # the prompts' pixels
        parts.append(ctx.actor.generate(
            [list(item.prompt_ids) for item in chunk], params,
            eos_token_ids=[] if run.ignore_eos else run.eos_token_ids,
            pad_token_id=run.pad_token_id, batch_size=len(chunk), generator=run.sampling_generator, **vision))
    result = GenerationResult(*([x for part in parts for x in getattr(part, name)]
                                for name in ("response_ids", "logprobs", "finish_reasons")),
                              routes=None if parts[0].routes is None else [r for part in parts for r in part.routes])
    return build_rollout_batch(items, n, result, tokenizer=run.tokenizer, pad_token_id=run.pad_token_id,
                               group_offset=group_offset(ctx), device=ctx.actor.device)


def group_offset(ctx) -> int:
    """The first group id of this rank's prompts at this step (ids unique across ranks and steps); `ctx` is a
    RolloutContext or anything else with its `rank` and `step_num` (the trainer, in the streams)."""
    return (ctx.rank * 1_000_000) + ctx.step_num * 10_000


def row_images(items: list) -> Optional[list]:
    """Each prompt item's ImageInputs (data.images: one processor call per row), or None when none has any."""
    images = [getattr(item, "images", None) for item in items]
    return images if any(im is not None for im in images) else None


def repeat_prompts(items: list, n: int) -> list:
    """Each prompt item n times in a row."""
    return [item for item in items for _ in range(n)]


def build_rollout_batch(items: list, n: int, result: GenerationResult, *, tokenizer, pad_token_id: int,
                        group_offset: int, device) -> RolloutBatch:
    """Pack prompt items (each repeated n times) and their generated responses into one batch."""
    rows = repeat_prompts(items, n)
    assert len(result.response_ids) == len(rows), (len(result.response_ids), len(rows))
    input_ids, attention_mask, P = layout_ids([item.prompt_ids for item in rows], result.response_ids,
                                              pad_token_id)                                      # [B, S] each
    R = input_ids.shape[1] - P
    logprobs = right_padded(result.logprobs, R, torch.float32)                                   # [B, R]
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, S] on the device: no CPU kernels
    group_ids = torch.arange(len(items)).repeat_interleave(n) + group_offset  # [B]
    texts = decode_responses(tokenizer, result.response_ids)
    routes = None if result.routes is None else layout_routes([len(r.prompt_ids) for r in rows], result.routes, P, R)
    return RolloutBatch(
        input_ids=input_ids, attention_mask=attention_mask,
        position_ids=position_ids, response_mask=attention_mask[:, P:].contiguous(),
        prompt_width=P, group_ids=group_ids.to(device), rollout_logprobs=logprobs.to(device),
        prompts=[item.row.prompt for item in rows], response_texts=texts,
        rows=[item.row for item in rows], finish_reasons=list(result.finish_reasons), routed_experts=routes,
        images=row_images(rows),
    )

