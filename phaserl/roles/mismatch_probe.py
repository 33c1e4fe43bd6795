"""Sample with the actor's rollout path, recompute with its training forward: the mismatch of one batch.

The doctor's "rollout/training mismatch" check calls `measure_mismatch` before training; the trainer
measures the same quantity every step from its own batches (`algo.mismatch`). Both sides are
log-probs of softmax(logits / T) at the rollout temperature, under the same weights. Nothing is trained.

Legend: B = responses (prompts × n), P = padded prompt width, R = padded response width.
"""
from __future__ import annotations

import torch

from ..algo import mismatch_metrics
from ..batch import RolloutBatch, layout_routes
from ..rollout import EngineConfig, SamplingParams
from .actor import HybridActor
from .forward import batch_logprobs


def measure_mismatch(actor: HybridActor, prompts: list, *, n: int, engine: str, max_new_tokens: int,
                     temperature: float, top_p: float, top_k: int, eos_token_ids: list, pad_token_id: int,
                     token_budget: int, seed: int, replay: bool = False) -> tuple[dict, int, str]:
    """(the `mismatch/*` metrics, sampled tokens, "builtin engine" | "transformers generate") for `n`
    responses to each prompt (token ids) sampled the way the run samples (rollout.engine = `engine`;
    replay: MoE routing replay, actor.routing_replay)."""
    actor.configure_rollout(engine, EngineConfig(cuda_graphs=False, compile=False, record_routes=replay,
                                                 max_seq_tokens=max(map(len, prompts)) + max_new_tokens))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    ids = [p for p in prompts for _ in range(n)]
    generator = torch.Generator(device=actor.device).manual_seed(seed)
    with actor.rollout_mode():
        result = actor.generate(ids, params, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                                batch_size=len(ids), generator=generator)
    batch = _batch(ids, result.response_ids, result.logprobs, pad_token_id, actor.device)
    if result.routes is not None:
        batch.routed_experts = layout_routes(list(map(len, ids)), result.routes, batch.prompt_width,
                                             batch.response_mask.shape[1])
    trainer = batch_logprobs(actor.model, batch, temperature=temperature if temperature > 0 else 1.0,
                             token_budget=token_budget, packing=False, replay=replay)  # [B, R]
    path = "builtin engine" if actor.engine is not None else "transformers generate"
    return mismatch_metrics(trainer, batch.rollout_logprobs, batch.response_mask), int(batch.response_mask.sum()), path


def _batch(prompts: list, responses: list, logprobs: list, pad: int, device) -> RolloutBatch:
    """The smallest RolloutBatch a forward pass needs (no texts, rows or groups)."""
    B, P, R = len(prompts), max(map(len, prompts)), max(1, max(map(len, responses)))
    input_ids = torch.full((B, P + R), pad, dtype=torch.long)  # [B, S]
    attention = torch.zeros((B, P + R), dtype=torch.long)  # [B, S]
    rollout = torch.zeros((B, R), dtype=torch.float32)  # [B, R]
    for i, (p, r, lp) in enumerate(zip(prompts, responses, logprobs)):
        input_ids[i, P - len(p):P] = torch.tensor(p)
        input_ids[i, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
        attention[i, P - len(p):P + len(r)] = 1
        rollout[i, :len(lp)] = torch.tensor(lp)
    return RolloutBatch(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                        position_ids=(attention.cumsum(dim=1) - 1).clamp(min=0).to(device),
                        response_mask=attention[:, P:].to(device), prompt_width=P,
                        group_ids=torch.arange(B, device=device), rollout_logprobs=rollout.to(device),
                        prompts=[""] * B, response_texts=[""] * B, rows=[None] * B, finish_reasons=[""] * B)
