"""The basic rollout path: token ids in, sampled token ids and their log-probs out.

`generate` cuts the prompts into batches, left-pads each batch, runs one prefill over the prompts and
then decodes one token per step until every row hit EOS / a stop token or `max_new_tokens`. A row that
finished keeps emitting padding, which is masked out and never reported. The native CausalLM decodes
with a KVCache, the transformers path (HFCausalLM) with transformers' own cache; any other model
recomputes the whole sequence every step.
Not here: continuous refill of finished slots, paged KV, CUDA graphs (the fast engine), detokenizing.

Legend: B prompts in the batch, P longest prompt, N max_new_tokens, H hidden.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from phaserl.errors import DataError
from phaserl.models.decoder import CausalLM, KVCache
from phaserl.rollout.sampling import SamplingParams, sample_next


@dataclass
class GenerationResult:
    response_ids: list[list[int]]    # per prompt; ends with the EOS/stop token when one ended it
    logprobs: list[list[float]]      # per sampled token: log_softmax(logits / T), T = 1 when greedy
    finish_reasons: list[str]        # "stop" (EOS or stop token) or "length" (max_new_tokens reached)
    routes: Optional[list] = None    # MoE routing replay (engine, record_routes): per prompt [prompt + response,
                                     # L, k] int16 experts each MoE layer chose at each position, on the device


class _CachedDecoder:
    """Prefill the prompts into a KVCache once, then feed one token per step."""

    def __init__(self, model: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int):
        self.model, self.input_ids, self.attention_mask = model, input_ids, attention_mask
        B, P = input_ids.shape
        self.cache = KVCache.allocate(model.config, B, P + max_new_tokens, model.output_weight.dtype,
                                      input_ids.device)

    def prefill(self) -> torch.Tensor:
        return self.model(self.input_ids, attention_mask=self.attention_mask, kv_cache=self.cache)[:, -1]  # [B, H]

    def step(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self.model(tokens[:, None], attention_mask=valid[:, None], kv_cache=self.cache)[:, -1]  # [B, H]


class _HFCachedDecoder:
    """The transformers path (HFCausalLM): transformers' own KV cache, one token per step after the prefill."""

    def __init__(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int):
        self.model, self.input_ids, self.attention_mask = model, input_ids, attention_mask
        self.cache, self.next_position = None, None

    def prefill(self) -> torch.Tensor:
        positions = (self.attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, P]
        hidden, self.cache = self.model.forward_cached(self.input_ids, self.attention_mask, positions)
        self.next_position = positions[:, -1:] + 1  # [B, 1]
        return hidden[:, -1]  # [B, H]

    def step(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        self.attention_mask = torch.cat([self.attention_mask, valid[:, None].to(self.attention_mask.dtype)], dim=1)
        hidden, self.cache = self.model.forward_cached(tokens[:, None], self.attention_mask, self.next_position,
                                                       self.cache)
        self.next_position = self.next_position + valid[:, None].long()
        return hidden[:, -1]  # [B, H]


class _RecomputingDecoder:
    """For other models without a cache we know: run the full, growing sequence every step (slow, simple)."""

    def __init__(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int):
        self.model, self.input_ids, self.attention_mask = model, input_ids, attention_mask

    def prefill(self) -> torch.Tensor:
        return self.model(self.input_ids, attention_mask=self.attention_mask)[:, -1]  # [B, H]

    def step(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        self.input_ids = torch.cat([self.input_ids, tokens[:, None]], dim=1)
        self.attention_mask = torch.cat([self.attention_mask, valid[:, None].to(self.attention_mask.dtype)], dim=1)
        return self.prefill()


def _left_pad(prompts: list[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long)  # [B, P]
    attention_mask = torch.zeros(len(prompts), longest, dtype=torch.long)  # [B, P]
    for row, prompt in enumerate(prompts):
        input_ids[row, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, longest - len(prompt):] = 1
    return input_ids.to(device), attention_mask.to(device)


def _generate_batch(model: nn.Module, prompts: list[list[int]], params: SamplingParams, stop_ids: torch.Tensor,
                    pad_token_id: int, generator: Optional[torch.Generator]) -> GenerationResult:
    device = model.output_weight.device
    input_ids, attention_mask = _left_pad(prompts, pad_token_id, device)
    decoder_class = (_CachedDecoder if isinstance(model, CausalLM) else
                     _HFCachedDecoder if hasattr(model, "forward_cached") else _RecomputingDecoder)
    decoder = decoder_class(model, input_ids, attention_mask, params.max_new_tokens)

    B, N = len(prompts), params.max_new_tokens
    tokens = torch.full((B, N), pad_token_id, dtype=torch.long, device=device)  # [B, N]
    logprobs = torch.zeros(B, N, dtype=torch.float32, device=device)  # [B, N]
    finished = torch.zeros(B, dtype=torch.bool, device=device)  # [B] ended by EOS / stop token
    num_tokens = torch.full((B,), N, dtype=torch.long, device=device)  # [B] response length

    hidden = decoder.prefill()  # [B, H] at each prompt's last token
    for t in range(N):
        next_tokens, next_logprobs = sample_next(model.logits(hidden), params, generator)  # [B], [B]
        active = ~finished
        tokens[:, t] = torch.where(active, next_tokens, pad_token_id)
        logprobs[:, t] = torch.where(active, next_logprobs, 0.0)
        stopped = active & torch.isin(next_tokens, stop_ids)  # [B] ends this step, keeping the stop token
        num_tokens = torch.where(stopped, t + 1, num_tokens)
        finished |= stopped
        if t == N - 1 or bool(finished.all()):
            break
        hidden = decoder.step(tokens[:, t], ~finished)

    lengths = num_tokens.tolist()
    return GenerationResult(
        response_ids=[row[:n] for row, n in zip(tokens.tolist(), lengths)],
        logprobs=[row[:n] for row, n in zip(logprobs.tolist(), lengths)],
        finish_reasons=["stop" if done else "length" for done in finished.tolist()],
    )


def check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    if not prompts:
        raise DataError("generate() got no prompts")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise DataError(f"prompt {i} is empty; every prompt needs at least one token")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise DataError(f"prompt {i} has token ids {bad[:5]} outside the model's vocabulary [0, {vocab_size})")


def generate(model: nn.Module, prompts: list[list[int]], params: SamplingParams, *, eos_token_ids: list[int],
             pad_token_id: int, batch_size: Optional[int] = None,
             generator: Optional[torch.Generator] = None) -> GenerationResult:
    """Sample one response per prompt (repeat a prompt to get several); results in prompt order.

    `batch_size` prompts are decoded together (None: all at once). Seeded `generator` (on the model's
    device) -> the same responses every time, for the same batch_size.
    """
    check_prompts(prompts, model.output_weight.shape[0])
    batch_size = batch_size or len(prompts)
    stop_ids = torch.tensor(sorted({*eos_token_ids, *params.stop_token_ids}), dtype=torch.long,
                            device=model.output_weight.device)
    result = GenerationResult([], [], [])
    with torch.inference_mode():
        for start in range(0, len(prompts), batch_size):
            part = _generate_batch(model, prompts[start:start + batch_size], params, stop_ids, pad_token_id,
                                   generator)
            result.response_ids += part.response_ids
            result.logprobs += part.logprobs
            result.finish_reasons += part.finish_reasons
    return result
