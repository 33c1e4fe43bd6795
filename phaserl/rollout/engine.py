"""RolloutEngine: the built-in fast rollout path for our CausalLM (every family of phaserl.models).

Same contract as `generate()`: token ids in, `GenerationResult` out, results in prompt order, the
log-prob of each sampled token under log_softmax(logits / T). Underneath:
  kv_pool.py    preallocated slot KV cache (token budget or a fraction of free memory), sleep()/wake()
  scheduler.py  slots for sequences, continuous refill, compaction as the batch drains
  runner.py     prefill (shared by the n samples of a prompt) and decode (CUDA graphs per bucket)
The host loop runs one step ahead of what it knows: it launches step t, then reads the finished flags
of step t-1 (copied asynchronously), so the GPU never waits for Python. A sequence that stopped at
t-1 therefore idles for one step before its slot is refilled.
Sampling noise is keyed by (the call's seed, drawn from `generator`; the sequence's index in the call; the
position): a call's samples are a function of its generator, prompts and caps, whatever batch_size, refill or
compaction do with the slots (exactly so where the logits do not depend on the batch, as on the CPU).
On the CPU the same code runs eagerly (no graphs), so CPU tests and the quickstart exercise it.
Not here: models other than CausalLM (generate.py keeps the transformers fallback), detokenizing.
"""
from __future__ import annotations

import importlib.util
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from phaserl.errors import ConfigError, DataError
from phaserl.models.decoder import CausalLM
from phaserl.rollout.fused import decodes_fused
from phaserl.rollout.generate import GenerationResult, check_prompts
from phaserl.rollout.images import vision_prefills
from phaserl.rollout.kv_pool import KVPool
from phaserl.rollout.runner import ModelRunner
from phaserl.rollout.sampling import SamplingParams
from phaserl.rollout.scheduler import Scheduler, Sequence
from phaserl.rollout.session import DecodeSession, session_slots

SLOT_ROUNDING = 64  # slot lengths are rounded up to this, so that nearby calls reuse one layout and its graphs


def _round_slot(tokens: int) -> int:
    return -(-tokens // SLOT_ROUNDING) * SLOT_ROUNDING


def engine_slot_tokens(max_seq_tokens: int) -> int:
    """The length of one KV slot for sequences of up to `max_seq_tokens` (the doctor counts the pool with it)."""
    return _round_slot(max_seq_tokens)


@dataclass(frozen=True)
class EngineConfig:
    max_slots: int = 512                  # most sequences decoded together (the largest graph bucket)
    token_budget: Optional[int] = None    # KV cache size in tokens; None = memory_fraction of free memory
    memory_fraction: float = 0.4          # of the free accelerator memory at wake() time
    cuda_graphs: bool = True              # capture decode steps (CUDA only; ignored on the CPU)
    compile: Optional[bool] = None        # torch.compile the layer functions; None = on CUDA with Triton where
                                          # some layer is not fused (rollout/fused.py)
    prefill_tokens: int = 16384           # most (padded) prompt tokens in one prefill pass
    refill: bool = True                   # False = static batching: admit only when the batch is empty
    max_seq_tokens: Optional[int] = None  # longest prompt + response of the run: caps the KV cache at
                                          # max_slots slots of that length (None = memory_fraction alone)
    keep_awake: bool = False              # sleep() keeps the KV cache, fused weights and graphs: no re-capture
                                          # at the next rollout, their memory stays taken during training
    record_routes: bool = False           # MoE models: return the experts chosen at every position (routing
                                          # replay; GenerationResult.routes)

    def __post_init__(self):
        if self.max_seq_tokens is not None and self.max_seq_tokens < 1:
            raise ConfigError(f"EngineConfig: max_seq_tokens={self.max_seq_tokens} must be >= 1 (or None)")
        if self.max_slots < 1 or self.prefill_tokens < 1:
            raise ConfigError(f"EngineConfig: max_slots={self.max_slots} and prefill_tokens="
                              f"{self.prefill_tokens} must be >= 1")


class _Finished(NamedTuple):
    """Sequences that stopped together, and their outputs gathered on the device (ModelRunner.collect)."""

    seqs: list                      # k Sequences, in the order of the rows below
    tokens: torch.Tensor            # [k, N+1] sampled ids
    logprobs: torch.Tensor          # [k, N+1]
    lengths: torch.Tensor           # [k] tokens sampled per sequence
    routes: Optional[torch.Tensor]  # [k, S, L, top_k] experts at every position (routing replay), or None


@contextmanager
def _seeded(generator: Optional[torch.Generator], device: torch.device):
    """Draw one seed from `generator` and run under it; the global RNG state is restored afterwards.

    Graph-captured sampling can only use the device's default generator, so a user generator seeds it.
    """
    if generator is None:
        yield
        return
    seed = int(torch.randint(2**62, (1,), generator=generator, device=generator.device).item())
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if device.type == "cuda":
            torch.cuda.default_generators[device.index or torch.cuda.current_device()].manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        yield


class RolloutEngine:
    def __init__(self, model: CausalLM, config: Optional[EngineConfig] = None):
        if not isinstance(model, CausalLM):
            raise ConfigError(f"RolloutEngine runs phaserl's CausalLM only, got {type(model).__name__}; "
                              "use phaserl.rollout.generate for other models")
        self.model, self.config = model, config or EngineConfig()
        self.pool: Optional[KVPool] = None
        self.last_stats: dict = {}
        self._build()

    def _build(self) -> None:
        c, weight = self.config, self.model.output_weight
        cap = None if c.max_seq_tokens is None else c.max_slots * _round_slot(c.max_seq_tokens)
        self.pool = KVPool(self.model.config, weight.dtype, weight.device, token_budget=c.token_budget,
                           memory_fraction=c.memory_fraction, max_tokens=cap)
        compile = c.compile
        if compile is None:  # only where some layer decodes through the torch functions: the fused layers need no
            # compile (H200, 0.5B: 2.46 ms a step eager vs 2.83 ms compiled before them), and it costs a warm-up
            compile = weight.device.type == "cuda" and importlib.util.find_spec("triton") is not None and (
                not decodes_fused(self.model))
        runner = ModelRunner
        if self.model.config.hybrid:  # Qwen3.5: a recurrent state per slot beside the KV
            from phaserl.rollout.recurrent_state import HybridRunner as runner
        self.runner = runner(self.model, self.pool, cuda_graphs=c.cuda_graphs, compile=compile,
                             prefill_tokens=c.prefill_tokens, record_routes=c.record_routes)
        self._pinned: list[torch.Tensor] = []

    @staticmethod
    def supports(model) -> bool:
        """True for the models this engine runs (phaserl's CausalLM); others use generate()."""
        return isinstance(model, CausalLM)

    @property
    def device(self) -> torch.device:
        return self.model.output_weight.device

    def wake(self) -> int:
        """Allocate the KV cache (hybrid switch to rollout); returns the bytes allocated."""
        return self.pool.wake()

    @property
    def kept_awake(self) -> bool:
        """True while keep_awake holds an allocated KV cache (and graphs) across the switches."""
        return self.config.keep_awake and self.pool.awake

    def sleep(self) -> int:
        """Free the KV cache and the captured graphs (hybrid switch to training); returns the KV bytes freed.

        With config.keep_awake nothing is freed (returns 0): the next generate() replays the graphs it
        captured, as long as the model's parameters still sit at the same addresses (checked every call).
        """
        return 0 if self.config.keep_awake else self.release()

    def release(self) -> int:
        """Free the KV cache, the captured graphs and the fused weights whatever keep_awake says."""
        self.runner.release()
        return self.pool.sleep()

    def refresh_weights(self) -> None:
        """The model's parameters were overwritten in place (an in-flight weight update): refill the engine's
        derived copies so that the next prefill or decode step of an open session uses them (ModelRunner)."""
        self.runner.refresh_weights()

    # ----- generate -------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, *, eos_token_ids: list[int],
                 pad_token_id: int, batch_size: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 ignore_eos: bool = False, max_new_tokens: Optional[list[int]] = None,
                 images: Optional[list] = None) -> GenerationResult:
        """Sample one response per prompt (repeat a prompt for n samples; repeats share their prefill).

        batch_size: most sequences decoded together (None: config.max_slots). ignore_eos: EOS does not
        stop a response (benchmarks; stop_token_ids still do). max_new_tokens: a per-prompt cap
        <= params.max_new_tokens (benchmarks use it for long-tail lengths). pad_token_id is unused:
        responses are returned unpadded. images: per prompt None or its data.images.ImageInputs (a vision-language
        model: its features replace the prompt's placeholder tokens; rollout/images.py).
        """
        weight = self._follow_model()
        check_prompts(prompts, weight.shape[0])
        caps = self._caps(len(prompts), params, max_new_tokens)
        slot_len = _round_slot(max(map(len, prompts)) + max(caps))
        num_slots = min(batch_size or self.config.max_slots, self.config.max_slots, len(prompts))
        fit = self.pool.slots_that_fit(slot_len)
        if fit is not None and fit < 1:
            raise ConfigError(f"the rollout KV cache holds {self.pool.capacity_tokens} tokens, less than one "
                              f"sequence of {slot_len}; raise token_budget / memory_fraction")
        num_slots = num_slots if fit is None else min(num_slots, fit)
        stop_ids = sorted({*([] if ignore_eos else eos_token_ids), *params.stop_token_ids})
        media = images or [None] * len(prompts)
        sequences = [Sequence(i, tuple(p), cap, media=m) for i, (p, cap, m) in enumerate(zip(prompts, caps, media))]
        scheduler = Scheduler(sequences, num_slots, refill=self.config.refill, admit_threshold=num_slots // 16)
        start, steps, rows, finished = time.perf_counter(), 0, 0, []
        with torch.inference_mode(), _seeded(generator, self.device):
            self.runner.vision = vision_prefills(self.model, prompts, images)  # the tower, once per distinct image
            self.runner.begin(num_slots, slot_len, max(caps), params, stop_ids)
            begin_seconds = time.perf_counter() - start  # layout, fused weights, graph capture (host clock)
            known = None  # the snapshot of the previous step, read after the next step is launched
            while not scheduler.all_done:
                groups = scheduler.admit()
                if groups:
                    # noise keyed by the sequence's index in the call: its samples do not depend on its slot,
                    # batch_size or when it was admitted (runner.prefill)
                    self.runner.prefill([(prompt, [s.slot for s in seqs], [s.max_new_tokens for s in seqs],
                                          [s.index for s in seqs]) for prompt, seqs in groups])
                self._compact(scheduler)
                bucket = self.runner.bucket_for(scheduler.span)
                self.runner.decode(bucket)
                steps, rows = steps + 1, rows + bucket
                latest = self._snapshot(scheduler)
                if known is not None:
                    self._retire(known, scheduler, finished)
                known = latest
            result = self._result(len(prompts), finished, set(stop_ids))
        self.last_stats = {"steps": steps, "seconds": time.perf_counter() - start, "begin_seconds": begin_seconds,
                           "slots": num_slots, "stepped_rows": rows,
                           "slot_len": self.runner.layout[1], "graphs": len(self.runner.graphs),
                           "new_tokens": sum(map(len, result.response_ids))}
        return result

    # ----- multi-turn ------------------------------------------------------------------------------
    @contextmanager
    def session(self, params: SamplingParams, *, slot_len: int, eos_token_ids: list[int],
                num_slots: Optional[int] = None, generator: Optional[torch.Generator] = None):
        """A DecodeSession (session.py) for sequences that continue across turns in their slot.

        slot_len: the longest sequence (prompt + every turn and appended observation); params.max_new_tokens
        caps one turn. num_slots: most sequences held at once, decoding or parked (None: config.max_slots).
        """
        start = time.perf_counter()
        session = self.open_session(params, slot_len=slot_len, eos_token_ids=eos_token_ids, num_slots=num_slots,
                                    generator=generator)
        with session.phase():
            yield session
        st = session.stats
        self.last_stats = {"steps": st.steps, "seconds": time.perf_counter() - start, "slots": session.num_slots,
                           "slot_len": session.slot_len, "graphs": len(self.runner.graphs), "new_tokens": st.new_tokens,
                           "turns": st.turns, "extend_tokens": st.extend_tokens, "prefill_tokens": st.prefill_tokens,
                           "busy_slot_steps": st.busy_slot_steps, "stepped_rows": st.stepped_rows, "swaps": st.swaps,
                           **st.extra}

    def open_session(self, params: SamplingParams, *, slot_len: int, eos_token_ids: list[int],
                     num_slots: Optional[int] = None, generator: Optional[torch.Generator] = None) -> DecodeSession:
        """A DecodeSession that may outlive a rollout phase (session.py): its slots are laid out and its noise seed
        drawn now; every use runs inside `with session.phase():` (inference mode, the weight copies refilled).
        Between phases the engine must stay as it is (kept awake through training): any later generate(), session,
        release or model move makes this one lost (DecodeSession.lost), never silently reused. Arguments as
        session()'s."""
        weight = self._follow_model()
        slot_len = _round_slot(slot_len)
        slots = session_slots(num_slots, self.config.max_slots, self.pool.slots_that_fit(slot_len), slot_len,
                              self.pool.capacity_tokens)
        stop_ids = sorted({*eos_token_ids, *params.stop_token_ids})
        start = time.perf_counter()
        with torch.inference_mode(), _seeded(generator, self.device):
            self.runner.vision = {}  # the session sets its prompts' images at each prefill
            self.runner.begin(slots, slot_len, params.max_new_tokens, params, stop_ids)
        session = DecodeSession(self.runner, num_slots=slots, slot_len=slot_len, max_turn_tokens=params.max_new_tokens,
                                stop_ids=stop_ids, vocab_size=weight.shape[0])
        session.stats.extra["begin_seconds"] = time.perf_counter() - start
        return session

    def _follow_model(self) -> torch.Tensor:
        """The model's output weight, after rebuilding the pool and runner if the model moved or changed dtype
        since they were made."""
        weight = self.model.output_weight
        if (weight.dtype, weight.device) != (self.pool.dtype, self.pool.device):
            self.release()
            self._build()
        return weight

    @staticmethod
    def _caps(n: int, params: SamplingParams, max_new_tokens: Optional[list[int]]) -> list[int]:
        if max_new_tokens is None:
            return [params.max_new_tokens] * n
        if len(max_new_tokens) != n:
            raise DataError(f"max_new_tokens has {len(max_new_tokens)} entries for {n} prompts")
        bad = [c for c in max_new_tokens if not 1 <= c <= params.max_new_tokens]
        if bad:
            raise DataError(f"max_new_tokens entries {bad[:5]} are outside [1, {params.max_new_tokens}] "
                            "(params.max_new_tokens)")
        return list(max_new_tokens)

    def _compact(self, scheduler: Scheduler) -> None:
        if not scheduler.running:
            return
        target = self.runner.bucket_for(len(scheduler.running))
        if self.runner.bucket_for(scheduler.span) > target:
            self.runner.move(scheduler.compact(target))

    def _snapshot(self, scheduler: Scheduler):
        """The finished flags after the step just launched (copied without waiting) and who ran where."""
        flags = self.runner.state.finished
        if self.device.type != "cuda":
            return flags.clone(), dict(scheduler.running), None
        if not self._pinned or self._pinned[0].shape != flags.shape:
            self._pinned = [torch.empty(flags.shape, dtype=torch.bool, pin_memory=True) for _ in range(2)]
        self._pinned.reverse()  # double buffer: the other one still holds the previous step's flags
        self._pinned[0].copy_(flags, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return self._pinned[0], dict(scheduler.running), event

    def _retire(self, snapshot, scheduler: Scheduler, finished: list) -> None:
        """Sequences the snapshot shows stopped: gather their outputs (on the device) and free their slots."""
        flags, ran, event = snapshot
        if event is not None:
            event.synchronize()
        flags = flags.tolist()
        stopped = [seq for slot, seq in ran.items() if flags[slot] and not seq.done]
        if stopped:
            slots = [seq.slot for seq in stopped]
            routes = self.runner.collect_routes(slots) if self.runner.routes is not None else None
            finished.append(_Finished(stopped, *self.runner.collect(slots), routes))
            for seq in stopped:
                scheduler.finish(seq)

    @staticmethod
    def _result(n: int, finished: list, stop_ids: set[int]) -> GenerationResult:
        result = GenerationResult([[] for _ in range(n)], [[] for _ in range(n)], ["length"] * n)
        if not finished:
            return result
        tokens = torch.cat([f.tokens for f in finished]).tolist()
        logprobs = torch.cat([f.logprobs for f in finished]).tolist()
        lengths = torch.cat([f.lengths for f in finished]).tolist()
        seqs = [seq for f in finished for seq in f.seqs]
        for seq, toks, lps, length in zip(seqs, tokens, logprobs, lengths):
            result.response_ids[seq.index] = toks[:length]
            result.logprobs[seq.index] = lps[:length]
            result.finish_reasons[seq.index] = "stop" if toks[length - 1] in stop_ids else "length"
        if finished[0].routes is not None:  # routes of every position; the last token was never fed: -1 there
            result.routes = [None] * n
            routes = [row for f in finished for row in f.routes]  # [S, L, k] each
            for seq, row, length in zip(seqs, routes, lengths):
                end = len(seq.prompt) + length
                result.routes[seq.index] = torch.cat([row[:end - 1], torch.full_like(row[:1], -1)])
        return result
