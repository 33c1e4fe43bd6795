"""Completion backends: token ids in, sampled ids + log-probs + finish reason out.

The OpenAI-compatible server (server.py) never touches a model; it asks a `CompletionBackend`:

    backend.complete(CompletionRequest(prompt_ids, max_tokens, temperature, ...)) -> Completion

`complete` is called from many HTTP threads at once. `GenerateBackend` (the default during rollout)
funnels those calls into one worker thread that takes every request waiting at that moment, groups
them by sampling settings (it keeps taking while requests arrive less than `gather_s` apart), and
makes one batched `generate` call per group, so that a harness driving 64 conversations at once
decodes them together on the rollout engine. It drives anything with the
actor's signature `generate(prompts, params, *, eos_token_ids, pad_token_id, batch_size, generator)`
(HybridActor, RolloutEngine) or a bare model through rollout.generate.generate.
`FakeBackend` answers from a function of the prompt, for tests without a model.
Not here: chat templates and text (server.py), recording conversations (recorder.py).
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

from phaserl.rollout.generate import generate as generate_with_model
from phaserl.rollout.sampling import SamplingParams


@dataclass(frozen=True)
class CompletionRequest:
    prompt_ids: tuple                 # the exact prompt token ids
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple = ()        # stop like EOS (kept in the output)
    seed: Optional[int] = None

    def params(self) -> SamplingParams:
        return SamplingParams(self.max_tokens, self.temperature, self.top_p, self.top_k, self.stop_token_ids)


@dataclass
class Completion:
    token_ids: list                   # sampled ids, ending with the stop token when one ended it
    logprobs: list                    # one per sampled id: log_softmax(logits / T) of the sampler
    finish_reason: str                # "stop" | "length"


class CompletionBackend(Protocol):
    def complete(self, request: CompletionRequest) -> Completion: ...


class FakeBackend:
    """Answers `reply(prompt_ids) -> token ids`; log-probs are -0.1, -0.2, ... so tests can tell them apart."""

    def __init__(self, reply: Callable, *, eos_token_ids: tuple = ()):
        self.reply, self.eos_token_ids = reply, tuple(eos_token_ids)
        self.requests: list = []      # every CompletionRequest seen, in order
        self._lock = threading.Lock()

    def complete(self, request: CompletionRequest) -> Completion:
        with self._lock:
            self.requests.append(request)
        ids = list(self.reply(list(request.prompt_ids)))
        stops = set(self.eos_token_ids) | set(request.stop_token_ids)
        cut = next((i + 1 for i, t in enumerate(ids) if t in stops), None)
        if cut is not None and cut <= request.max_tokens:
            return Completion(ids[:cut], [-(i + 1) / 10 for i in range(cut)], "stop")
        ids = ids[:request.max_tokens]
        return Completion(ids, [-(i + 1) / 10 for i in range(len(ids))], "length")


class GenerateBackend:
    """Batches concurrent requests onto `target.generate` (HybridActor / RolloutEngine) or a bare model."""

    def __init__(self, target, *, eos_token_ids: list, pad_token_id: int, max_batch: int = 256,
                 gather_s: float = 0.005, device=None, generator: Optional[torch.Generator] = None):
        self.generate = self._generate_fn(target)
        self.generator = generator    # unseeded requests sample from it (the run's seeded sampling generator)
        self.eos_token_ids, self.pad_token_id = list(eos_token_ids), pad_token_id
        self.max_batch, self.gather_s = max_batch, gather_s
        self.device = torch.device(device) if device is not None else _device_of(target)
        self.calls = 0                # generate calls made (tests and metrics: batching happened)
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._serve, name="phaserl-completion", daemon=True)
        self._worker.start()

    @staticmethod
    def _generate_fn(target) -> Callable:
        if hasattr(target, "generate") and not isinstance(target, torch.nn.Module):
            return target.generate   # HybridActor, RolloutEngine
        if isinstance(target, torch.nn.Module):
            return lambda prompts, params, **kw: generate_with_model(target, prompts, params, **kw)
        if callable(target):
            return target
        raise TypeError(f"GenerateBackend: {type(target).__name__} has no generate(); pass the actor, the "
                        "rollout engine, a model or a function with generate()'s signature")

    def complete(self, request: CompletionRequest) -> Completion:
        if not self._worker.is_alive():
            raise RuntimeError("GenerateBackend: the completion worker stopped; see the error logged before")
        done: Future = Future()
        self._queue.put((request, done))
        return done.result()

    def close(self) -> None:
        """Stop the worker once the requests already queued are answered."""
        self._queue.put(None)
        self._worker.join()

    def _serve(self) -> None:
        while True:
            batch = [self._queue.get()]
            try:  # take everything that arrives within gather_s, up to max_batch
                while len(batch) < self.max_batch and batch[-1] is not None:
                    batch.append(self._queue.get(timeout=self.gather_s))
            except queue.Empty:
                pass
            stop = batch[-1] is None
            batch = [item for item in batch if item is not None]
            groups: dict = {}
            for request, done in batch:
                # Seeded requests run alone: their seed fixes their sample, not their neighbours'.
                key = (request.params(), request.seed, id(done) if request.seed is not None else None)
                groups.setdefault(key, []).append((request, done))
            for (params, seed, _), items in groups.items():
                self._run(params, seed, items)
            if stop:
                return

    def _run(self, params: SamplingParams, seed: Optional[int], items: list) -> None:
        generator = self.generator
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        try:
            result = self.generate([list(r.prompt_ids) for r, _ in items], params, eos_token_ids=self.eos_token_ids,
                                   pad_token_id=self.pad_token_id, batch_size=len(items), generator=generator)
            self.calls += 1
        except Exception as exc:  # every waiting request gets the error; the worker lives on
            for _, done in items:
                done.set_exception(exc)
            return
        for i, (_, done) in enumerate(items):
            done.set_result(Completion(list(result.response_ids[i]), list(result.logprobs[i]),
                                       result.finish_reasons[i]))


def _device_of(target) -> torch.device:
    if isinstance(getattr(target, "device", None), torch.device):
        return target.device
    model = getattr(target, "model", target)
    if isinstance(model, torch.nn.Module):
        return next(model.parameters()).device
    return torch.device("cpu")
