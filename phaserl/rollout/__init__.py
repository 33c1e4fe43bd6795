"""Rollout: turning prompts (token ids) into sampled responses with their log-probs.

    sampling.py   SamplingParams, sample_next (temperature / top-k / top-p / greedy), pure functions
    generate.py   generate(): batched prefill + KV-cache decode, GenerationResult (any model; the fallback)
    engine.py     RolloutEngine: the fast path for our CausalLM (slot KV pool, refill, CUDA graphs)
    kv_pool.py    KVPool (slot KV cache, sleep/wake), SlotState (per-slot decode state on the device)
    scheduler.py  Scheduler, Sequence: slots for sequences, continuous refill, compaction
    runner.py     ModelRunner: prefill and graph-captured decode (fused qkv / gate-up copies of the weights)
    recurrent_state.py  HybridRunner, RecurrentState: Qwen3.5's per-slot DeltaNet/conv state beside the KV
    delta_kernel.py     Triton kernel of the DeltaNet decode step (the state read and written once)
    extend_kernel.py    Triton kernels of the extend pass: its KV write and its attention over the slots in place
    kernels.py    Triton kernels of the decode step on CUDA: attention over each row's own context,
                  one-pass sampling with in-kernel random numbers (pure-torch twins in torch_path.py)
    torch_path.py the pure-torch attention (decode, extend, cached) and sampling: the CPU path, the reference
"""
from phaserl.rollout.engine import EngineConfig, RolloutEngine
from phaserl.rollout.generate import GenerationResult, generate
from phaserl.rollout.sampling import SamplingParams, sample_next

__all__ = ["SamplingParams", "GenerationResult", "generate", "sample_next", "RolloutEngine", "EngineConfig"]
