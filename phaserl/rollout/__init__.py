"""Rollout: turning prompts (token ids) into sampled responses with their log-probs.

    sampling.py   SamplingParams, sample_next (temperature / top-k / top-p / greedy), pure functions
    generate.py   generate(): batched prefill + KV-cache decode, GenerationResult
"""
from phaserl.rollout.generate import GenerationResult, generate
from phaserl.rollout.sampling import SamplingParams, sample_next

__all__ = ["SamplingParams", "GenerationResult", "generate", "sample_next"]
