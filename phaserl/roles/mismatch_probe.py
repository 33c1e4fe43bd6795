"""Sample with the actor's rollout path, recompute with its training forward: the mismatch of one batch.

The doctor's "rollout/training mismatch" check calls `measure_mismatch` before training; the trainer
measures the same quantity every step from its own batches (`algo.mismatch`). Both sides are
log-probs of softmax(logits / T) at the rollout temperature, under the same weights. Nothing is trained.

In bf16/fp16 a third forward, of a float32 copy of the same (rounded) weights, measures the model's own
precision noise at these tokens: how far the low-precision trainer is from exact arithmetic. Architectures
differ in it (on the CPU at one small width, Qwen3.5 moved log-probs 1.8x as far as a dense Qwen3), so the
mismatch in units of that noise (the doctor prints it; benchmarks/mismatch.py logs it as `mismatch_over_noise`)
says what the raw number cannot: near 1, the two paths differ only by rounding; far above it, they do not
compute the same thing.

Legend: B = responses (prompts × n), P = padded prompt width, R = padded response width.
"""
from __future__ import annotations

import copy
from typing import NamedTuple, Optional

import torch

from ..algo import mismatch_metrics
from ..batch import RolloutBatch, layout_routes
from ..rollout import EngineConfig, SamplingParams
from .actor import HybridActor
from .forward import batch_logprobs

COPY_SHARE = 0.5  # the float32 copy only where it takes at most this share of the free memory


class Probe(NamedTuple):
    metrics: dict            # the `mismatch/*` metrics of the batch
    tokens: int              # sampled tokens compared
    path: str                # "builtin engine" | "transformers generate"
    noise: Optional[float]   # mean |log p| distance of the trainer from its float32 copy; None: not measured
    noise_note: str          # why not measured ("" when measured, or float32 weights: nothing to measure)


def measure_mismatch(actor: HybridActor, prompts: list, *, n: int, engine: str, max_new_tokens: int,
                     temperature: float, top_p: float, top_k: int, eos_token_ids: list, pad_token_id: int,
                     token_budget: int, seed: int, replay: bool = False, free_bytes: Optional[int] = None,
                     images: Optional[list] = None) -> Probe:
    """The probe of `n` responses to each prompt (token ids) sampled the way the run samples (rollout.engine =
    `engine`; replay: MoE routing replay, actor.routing_replay). free_bytes: the device's free memory, for the
    float32 copy of a low-precision model (None: no copy, no noise measured). images: per prompt its
    data.images.ImageInputs or None (a vision-language model: both sides see the same pixels)."""
    actor.configure_rollout(engine, EngineConfig(cuda_graphs=False, compile=False, record_routes=replay,
                                                 max_seq_tokens=max(map(len, prompts)) + max_new_tokens))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    ids = [p for p in prompts for _ in range(n)]
    pixels = None if images is None else [im for im in images for _ in range(n)]
    generator = torch.Generator(device=actor.device).manual_seed(seed)
    with actor.rollout_mode():
        vision = {} if pixels is None else {"images": pixels}
        result = actor.generate(ids, params, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                                batch_size=len(ids), generator=generator, **vision)
    batch = _batch(ids, result.response_ids, result.logprobs, pad_token_id, actor.device)
    batch.images = pixels
    if result.routes is not None:
        batch.routed_experts = layout_routes(list(map(len, ids)), result.routes, batch.prompt_width,
                                             batch.response_mask.shape[1])
    forward = dict(temperature=temperature if temperature > 0 else 1.0, token_budget=token_budget, packing=False,
                   replay=replay)
    trainer = batch_logprobs(actor.model, batch, **forward)  # [B, R]
    path = "builtin engine" if actor.engine is not None else "transformers generate"
    metrics = mismatch_metrics(trainer, batch.rollout_logprobs, batch.response_mask)
    noise, note = precision_noise(actor.model, batch, trainer, forward, free_bytes)
    return Probe(metrics, int(batch.response_mask.sum()), path, noise, note)


def precision_noise(model: torch.nn.Module, batch: RolloutBatch, trainer: torch.Tensor, forward: dict,
                    free_bytes: Optional[int]) -> tuple[Optional[float], str]:
    """(mean |trainer - the same forward in float32| over the response tokens, "") for a bf16/fp16 model,
    (None, "") for a float32 one, or (None, why not). trainer [B, R]: the model's own log-probs of batch's
    tokens; forward: batch_logprobs' keys."""
    params = list(model.parameters())
    dtype = params[0].dtype
    if dtype == torch.float32:
        return None, ""
    need = sum(p.numel() for p in params) * 4
    if free_bytes is None or need > COPY_SHARE * free_bytes:
        return None, (f"its float32 copy ({need / 2**30:.1f} GiB) would take over {COPY_SHARE:.0%} of the free memory"
                      if free_bytes is not None else "no free-memory figure for a float32 copy")
    exact = copy.deepcopy(model).float()
    try:
        reference = batch_logprobs(exact, batch, **forward)  # [B, R]
    finally:
        del exact
    return mismatch_metrics(trainer, reference, batch.response_mask)["mismatch/abs_diff_mean"], ""


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
