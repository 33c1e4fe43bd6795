"""Rollout/training mismatch on the GPU: the sampler's log-probs against the trainer's, same weights, same tokens.

For each generation path (phaserl's RolloutEngine, with and without CUDA graphs, and the plain
KV-cache `generate` path) it samples responses from a Qwen2-shaped model with random weights, recomputes
every sampled token's log-prob with the trainer's forward (`roles.forward.batch_logprobs`, padded and
packed), and prints one JSON line per (path, dtype, packing) with the metrics the trainer logs every
step (`mismatch/k3`, `abs_diff_mean`, `abs_diff_max`, `ratio_out_frac`). Not a speed benchmark.

    python benchmarks/mismatch.py --shape 0.5b            # bf16 and fp32 on the GPU
    python benchmarks/mismatch.py --smoke                 # CPU, tiny shape: checks the script
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from phaserl.algo import mismatch_metrics  # noqa: E402
from phaserl.models import CausalLM  # noqa: E402
from phaserl.roles.forward import batch_logprobs  # noqa: E402
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams, generate  # noqa: E402
from phaserl.trainer.rollout_phase import build_rollout_batch  # noqa: E402
from qwen2_shapes import SHAPES, decoder_config  # noqa: E402


class _NoText:
    """build_rollout_batch decodes responses for the reward; nothing reads them here."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return [""] * len(ids)


def measure(model, path: str, prompts: list, n: int, params: SamplingParams, device, packing: bool,
            reference=None) -> dict:
    """The mismatch/* metrics of `path`'s log-probs against the trainer's forward on the same tokens. reference: the
    same weights in float32 (a copy of the bf16 model, upcast): adds how far the bf16 trainer itself is from it
    (noise/abs_diff_mean, the model's own bf16 noise at these tokens) and mismatch_over_noise, the engine/trainer
    mismatch in units of that noise: architectures differ in how far bf16 moves their log-probs, so a raw |diff|
    compares models, this ratio compares the two paths."""
    ids = [p for p in prompts for _ in range(n)]
    gen = torch.Generator(device=device).manual_seed(0)
    common = dict(eos_token_ids=[], pad_token_id=0, batch_size=len(ids), generator=gen)
    if path == "hf":
        result = generate(model, ids, params, **common)
    else:
        engine = RolloutEngine(model, EngineConfig(max_slots=len(ids), cuda_graphs=path == "engine_graphs",
                                                   compile=False,
                                                   max_seq_tokens=len(prompts[0]) + params.max_new_tokens))
        engine.wake()
        result = engine.generate(ids, params, **common)
        engine.sleep()
    items = [SimpleNamespace(prompt_ids=p, row=SimpleNamespace(prompt="")) for p in prompts]
    batch = build_rollout_batch(items, n, result, tokenizer=_NoText(), pad_token_id=0, group_offset=0, device=device)
    trainer = batch_logprobs(model, batch, temperature=params.temperature, token_budget=1 << 16, packing=packing)
    out = mismatch_metrics(trainer, batch.rollout_logprobs, batch.response_mask)
    if reference is not None:
        exact = batch_logprobs(reference, batch, temperature=params.temperature, token_budget=1 << 16, packing=packing)
        noise = mismatch_metrics(trainer, exact, batch.response_mask)["mismatch/abs_diff_mean"]
        out["noise/abs_diff_mean"] = noise
        out["noise/engine_vs_float32"] = mismatch_metrics(batch.rollout_logprobs, exact,
                                                          batch.response_mask)["mismatch/abs_diff_mean"]
        out["mismatch_over_noise"] = out["mismatch/abs_diff_mean"] / max(noise, 1e-12)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="0.5b", choices=list(SHAPES))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--smoke", action="store_true", help="CPU, the tiny shape, few tokens")
    a = parser.parse_args()
    if a.smoke:
        a.shape, a.prompts, a.n, a.prompt_len, a.new_tokens = "tiny", 2, 2, 8, 6
    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 4000, (a.prompts, a.prompt_len), generator=g).tolist()
    params = SamplingParams(max_new_tokens=a.new_tokens, temperature=a.temperature)
    dtypes = [torch.float32] if device.type == "cpu" else [torch.bfloat16, torch.float32]
    paths = ["engine", "hf"] if device.type == "cpu" else ["engine", "engine_graphs", "hf"]
    for dtype in dtypes:
        with torch.device(device):
            model = CausalLM(decoder_config(a.shape)).to(dtype).eval()
        reference = copy.deepcopy(model).float() if dtype != torch.float32 else None
        for path in paths:
            for packing in ([False] if device.type == "cpu" else [False, True]):
                m = measure(model, path, prompts, a.n, params, device, packing, reference)
                print(json.dumps({"bench": "mismatch", "shape": a.shape, "device": device.type, "dtype": str(dtype),
                                  "path": path, "packing": packing, "temperature": a.temperature,
                                  "tokens": a.prompts * a.n * a.new_tokens, **m}), flush=True)
        del model, reference


if __name__ == "__main__":
    main()
