"""The numerics modes in one run: what the bitwise mode (rollout.bitwise) costs, and the float16 vs bfloat16 mismatch.

On a Qwen2-shaped model with random weights, for each shape, the same process measures
  decode      the engine's seconds per decode step (`--prompts` sequences, `--new-tokens` each, EOS ignored), default
              kernels vs bitwise ones
  step        a GRPO step's model work on those sequences as the default configuration runs it (one optimizer step
              a batch: the update's own log-probs are the old ones, no old log-prob pass): the rollout and one
              update forward + backward over the batch (packed micro-batches of `--micro-tokens`), default vs
              bitwise; step_old_pass_s adds the old log-prob pass that more mini-batches or epochs take, and
              step_between_checks_s is the bitwise step between its checks (rollout.bitwise_check_every > 1: the
              update's loss takes the engine's log-probs, so only the default forward and backward run)
  mismatch    the trainer's log-probs against the sampler's for the same tokens (`mismatch/*`, as logged every
              step) in bfloat16, float16 and bfloat16 bitwise
One JSON line per measurement; `ratio` = bitwise / default time. Each time is the median of `--repeats` timed rounds
(3) after an untimed one: the default step's own time varies ~20% between single runs on one GPU.

    python benchmarks/numerics.py                       # 0.5b and 1.5b on the GPU
    python benchmarks/numerics.py --smoke               # CPU, tiny shape: checks the script
    python benchmarks/numerics.py --cpu --shapes tiny --prompts 16 --new-tokens 32   # the CPU's own numbers
    python benchmarks/numerics.py --shapes 0.5b --profile 15   # and where each mode's time goes, by kernel

--profile N: one more generate (CUDA graphs off, so the profiler sees every kernel; the kernels are the graphs')
and one more update forward + backward per mode under torch.profiler (profiling.profile_call); a `profile` line
per (mode, part): wall and device ms, the device's busy share, kernel groups and the N kernels of most device time
(CUDA only: on the CPU the kernel lists are empty).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from phaserl.algo import mismatch_metrics  # noqa: E402
from phaserl.batch import RolloutBatch, layout_ids, right_padded  # noqa: E402
from phaserl.models import CausalLM, invariant  # noqa: E402
from phaserl.roles.forward import batch_logprobs, rows_logprobs, split_rows  # noqa: E402
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402
from qwen2_shapes import decoder_config  # noqa: E402


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


REPEATS = 3  # timed rounds of each measure (--repeats): the median is reported; one untimed round goes first


def median(values: list) -> float:
    """The middle value (the lower middle of an even count)."""
    return sorted(values)[(len(values) - 1) // 2]


def timed(fn, device) -> tuple:
    """(fn()'s last result, the median seconds of REPEATS timed calls after an untimed one)."""
    times = []
    for _ in range(1 + REPEATS):
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return result, median(times[1:])


def sample(model, prompts, new_tokens: int, seed: int = 0):
    """(result, median seconds of REPEATS identical calls after an untimed one, its decode steps): the engine as a
    run makes it (CUDA graphs; the first call captures them and compiles the kernels)."""
    engine = RolloutEngine(model, EngineConfig(max_slots=len(prompts), keep_awake=True))
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    device = model.output_weight.device
    engine.wake()
    result, seconds = timed(lambda: engine.generate(prompts, params, eos_token_ids=[], pad_token_id=0, ignore_eos=True,
                                                    generator=torch.Generator(device=device).manual_seed(seed)), device)
    steps = engine.last_stats["steps"]
    engine.release()
    return result, seconds, steps


def rollout_batch(prompts, result, device) -> RolloutBatch:
    input_ids, mask, P = layout_ids(prompts, result.response_ids, 0)
    input_ids, mask = input_ids.to(device), mask.to(device)
    n = len(prompts)
    return RolloutBatch(input_ids=input_ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                        response_mask=mask[:, P:].contiguous(), prompt_width=P,
                        group_ids=torch.arange(n, device=device),
                        rollout_logprobs=right_padded(result.logprobs, input_ids.shape[1] - P,
                                                      torch.float32).to(device),
                        prompts=[None] * n, response_texts=[""] * n, rows=[None] * n,
                        finish_reasons=list(result.finish_reasons))


def step_parts(model, batch, micro_tokens: int) -> tuple[float, float]:
    """(old log-prob pass seconds, update forward + backward seconds) over the whole batch, packed: medians of
    REPEATS rounds after one untimed round (kernel compiles)."""
    _step_parts(model, batch, micro_tokens)
    rounds = [_step_parts(model, batch, micro_tokens) for _ in range(REPEATS)]
    return median([r[0] for r in rounds]), median([r[1] for r in rounds])


def _step_parts(model, batch, micro_tokens: int) -> tuple[float, float]:
    device = model.output_weight.device
    sync(device)
    start = time.perf_counter()
    model.eval()
    old = batch_logprobs(model, batch, temperature=1.0, token_budget=micro_tokens, packing=True)
    sync(device)
    old_s = time.perf_counter() - start
    model.train()
    start = time.perf_counter()
    update_pass(model, batch, micro_tokens)
    sync(device)
    model.zero_grad(set_to_none=True)
    del old
    return old_s, time.perf_counter() - start


def profile_parts(model, prompts, batch, new_tokens: int, micro_tokens: int, top: int) -> dict:
    """{part: profiling.profile_call's record (wall, device ms and busy share, kernel groups, the `top` kernels)} for
    decode (a generate without graphs, its prefill included) and update (forward + backward over the batch)."""
    from profiling import profile_call

    device = model.output_weight.device
    engine = RolloutEngine(model, EngineConfig(max_slots=len(prompts), keep_awake=True, cuda_graphs=False))
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    engine.wake()

    def generate():
        engine.generate(prompts, params, eos_token_ids=[], pad_token_id=0, ignore_eos=True)

    generate()  # compiles outside the profile
    parts = {"decode": profile_call(generate, device.type, top=top)}
    engine.release()
    model.train()
    parts["update"] = profile_call(lambda: update_pass(model, batch, micro_tokens), device.type, top=top)
    model.zero_grad(set_to_none=True)
    return parts


def update_pass(model, batch, micro_tokens: int, exact: bool = True) -> None:
    """The update's forward + backward over the batch, packed in micro-batches of micro_tokens (no optimizer step),
    with the entropies the actor takes for its metrics. exact=False: the bitwise mode between its checks
    (rollout.bitwise_check_every), the default forward only."""
    for idx in split_rows(batch, micro_tokens, packing=True):
        logp, _, mask = rows_logprobs(model, batch, idx, packing=True, temperature=1.0, with_entropy=True,
                                      exact=exact)
        (logp * mask).sum().backward()


def between_checks_s(model, batch, micro_tokens: int) -> float:
    """Median seconds of the bitwise update between its checks over REPEATS rounds, after one untimed round."""
    model.train()

    def update():
        update_pass(model, batch, micro_tokens, exact=False)
        model.zero_grad(set_to_none=True)
    return timed(update, model.output_weight.device)[1]


def mismatch(model, prompts, result, device) -> dict:
    batch = rollout_batch(prompts, result, device)
    model.eval()
    trainer = batch_logprobs(model, batch, temperature=1.0, token_budget=1 << 15, packing=device.type == "cuda")
    return mismatch_metrics(trainer, batch.rollout_logprobs, batch.response_mask)


def main() -> None:
    global REPEATS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--micro-tokens", type=int, default=8192)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, few tokens")
    parser.add_argument("--cpu", action="store_true", help="on the CPU (with --shapes tiny: the CPU's own numbers)")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="also the N kernels of most device time "
                        "in each mode's decode and update (torch.profiler)")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed rounds of each measure (their median)")
    a = parser.parse_args()
    REPEATS = max(1, a.repeats)
    if a.smoke:
        a.shapes, a.prompts, a.prompt_tokens, a.new_tokens, a.micro_tokens, a.cpu = ["tiny"], 4, 8, 4, 256, True
    device = torch.device("cuda" if torch.cuda.is_available() and not a.cpu else "cpu")
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    for shape in a.shapes:
        torch.manual_seed(0)
        with torch.device(device):
            base = CausalLM(decoder_config(shape)).eval()
        vocab = base.config.vocab_size
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(10, vocab, (a.prompts, a.prompt_tokens), generator=g).tolist()
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        model = base.to(dtype)
        common = {"bench": "numerics", "shape": shape, "device": card, "dtype": str(dtype).split(".")[-1],
                  "prompts": a.prompts, "new_tokens": a.new_tokens}
        times = {}
        for mode in ("default", "bitwise"):
            with invariant.bitwise(mode == "bitwise"):
                result, seconds, steps = sample(model, prompts, a.new_tokens)
                batch = rollout_batch(prompts, result, device)
                old_s, update_s = step_parts(model, batch, a.micro_tokens)
                times[mode] = {"decode_step_s": seconds / max(steps, 1), "rollout_s": seconds, "old_logprob_s": old_s,
                               "update_s": update_s, "step_s": seconds + update_s,
                               "step_old_pass_s": seconds + old_s + update_s}
                if mode == "bitwise":  # rollout.bitwise_check_every > 1: the steps between the checks
                    between = between_checks_s(model, batch, a.micro_tokens)
                    times[mode].update(update_between_checks_s=between, step_between_checks_s=seconds + between)
                print(json.dumps({**common, "measure": "time", "mode": mode, **times[mode]}), flush=True)
                if mode == "bitwise":
                    print(json.dumps({**common, "measure": "mismatch", "mode": "bitwise",
                                      **mismatch(model, prompts, result, device)}), flush=True)
                if a.profile:
                    for part, spent in profile_parts(model, prompts, batch, a.new_tokens, a.micro_tokens,
                                                     a.profile).items():
                        print(json.dumps({**common, "measure": "profile", "mode": mode, "part": part, **spent}),
                              flush=True)
        parts = ("decode_step_s", "update_s", "step_s", "step_old_pass_s")
        ratio = {k: times["bitwise"][k] / times["default"][k] for k in parts}
        ratio["step_between_checks_s"] = times["bitwise"]["step_between_checks_s"] / times["default"]["step_s"]
        print(json.dumps({**common, "measure": "ratio", **ratio}), flush=True)
        for half in ([torch.bfloat16, torch.float16] if device.type == "cuda" else [torch.float32]):
            model = base.to(half)
            result, _, _ = sample(model, prompts, a.new_tokens)
            print(json.dumps({**common, "dtype": str(half).split(".")[-1], "measure": "mismatch", "mode": "default",
                              **mismatch(model, prompts, result, device)}), flush=True)
        del base, model
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
