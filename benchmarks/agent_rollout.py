"""Multi-turn rollout throughput: episodes with simulated tool latency vs the single-turn engine, one run.

One JSON line per measurement on stdout. Shape (issue 15): Qwen2-0.5B architecture, random weights,
bf16; 256 episodes x 4 turns, prompt 128 tokens, 64 sampled tokens per turn (EOS ignored: fixed
lengths), a 32-token observation after each of the first 3 turns; every environment step sleeps the
simulated tool latency (0 / 50 / 500 ms) on its worker thread (one per episode) while the engine
decodes the other episodes. The single-turn number is `RolloutEngine.generate` over the same 256
prompts with 4 x 64 = 256 new tokens each, in the same process. Target: with 50 ms tools, multi-turn
generated tokens/s >= 70% of single-turn.

    python benchmarks/agent_rollout.py                      # H200: 0.5b, latencies 0 50 500
    python benchmarks/agent_rollout.py --profile            # also the device's busy share per case
    python benchmarks/agent_rollout.py --smoke              # CPU: the tiny shape, a few episodes

Fields: tokens_per_s (sampled tokens / wall), vs_single_turn (that over the single-turn tokens/s),
slot_occupancy (decoding slot-steps / (steps x slots): the rest were parked waiting for a tool or
free), decode_steps, seconds, device_busy (with --profile: device kernel time / wall).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from phaserl.agents import Environment, StepResult  # noqa: E402
from phaserl.agents.episodes import AgentLimits, EpisodeRunner, EpisodeStart  # noqa: E402
from phaserl.agents.loader import EnvironmentFactory  # noqa: E402
from phaserl.data.prompts import PromptItem  # noqa: E402
from phaserl.data.rows import PromptRow  # noqa: E402
from phaserl.models import CausalLM  # noqa: E402
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402
from qwen2_shapes import decoder_config  # noqa: E402


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


class IdsTokenizer:
    """Text is space-separated token ids: the environment's observation is exactly the ids it names."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


class SimulatedTool(Environment):
    """Each step sleeps `latency_s` (a tool call), then answers with `obs_tokens` token ids."""

    def __init__(self, latency_s: float, obs_tokens: int, turns: int):
        self.latency_s, self.obs_tokens, self.turns, self.steps = latency_s, obs_tokens, turns, 0

    def reset(self, row, *, seed):
        self.base = 100 + seed % 1000
        return ""

    def step(self, action):
        time.sleep(self.latency_s)
        self.steps += 1
        obs = " ".join(str(self.base + i) for i in range(self.obs_tokens))
        return StepResult(obs, 0.0, self.steps >= self.turns)


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, min(vocab, 4000), (n, length), generator=g).tolist()


def starts(ids: list[list[int]]) -> list:
    out = []
    for i, p in enumerate(ids):
        row = PromptRow("", "bench", None, {}, f"bench:row {i}", i, {})
        out.append(EpisodeStart(PromptItem(row, tuple(p), ""), seed=i, label=f"bench:row {i}"))
    return out


def multi_turn(engine, ids, a, latency_s: float, profile: bool) -> dict:
    episode_len = a.prompt + a.turns * a.turn_tokens + (a.turns - 1) * a.obs_tokens
    limits = AgentLimits(max_turns=a.turns, max_turn_tokens=a.turn_tokens, max_episode_tokens=episode_len,
                         context_limited=False, step_timeout_s=60.0, on_env_error="stop", workers=len(ids), overlap=True)
    runner = EpisodeRunner(EnvironmentFactory(SimulatedTool, dict(latency_s=latency_s, obs_tokens=a.obs_tokens,
                                                                  turns=a.turns)), IdsTokenizer(), limits)
    params = SamplingParams(max_new_tokens=a.turn_tokens, temperature=1.0)

    def once():
        with engine.session(params, slot_len=episode_len, eos_token_ids=[], num_slots=len(ids)) as session:
            return runner.run_session(session, starts(ids))
    busy = None
    sync(a.device)
    t0 = time.perf_counter()
    if profile:
        busy, episodes = profiled(once, a.device)
    else:
        episodes = once()
    sync(a.device)
    seconds = time.perf_counter() - t0
    assert all(e.num_turns == a.turns for e in episodes), [e.finish_reason for e in episodes[:4]]
    sampled = sum(len(s.token_ids) for e in episodes for s in e.segments if s.kind == "model")
    st = engine.last_stats
    return dict(seconds=seconds, sampled_tokens=sampled, tokens_per_s=sampled / seconds, decode_steps=st["steps"],
                slot_occupancy=st["busy_slot_steps"] / max(1, st["steps"] * st["slots"]),
                extend_tokens=st["extend_tokens"], device_busy=busy)


def single_turn(engine, ids, a, profile: bool) -> dict:
    params = SamplingParams(max_new_tokens=a.turns * a.turn_tokens, temperature=1.0)
    run = lambda: engine.generate(ids, params, eos_token_ids=[], pad_token_id=0, ignore_eos=True)  # noqa: E731
    busy = None
    sync(a.device)
    t0 = time.perf_counter()
    if profile:
        busy, result = profiled(run, a.device)
    else:
        result = run()
    sync(a.device)
    seconds = time.perf_counter() - t0
    sampled = sum(map(len, result.response_ids))
    return dict(seconds=seconds, sampled_tokens=sampled, tokens_per_s=sampled / seconds,
                decode_steps=engine.last_stats["steps"], device_busy=busy)


def profiled(fn, device: str):
    """(device kernel time / wall, fn's result) under torch.profiler (CUDA kernels only)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        out = fn()
        sync(device)
    wall = time.perf_counter() - t0
    if device != "cuda":
        return None, out
    kernel_us = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA"
                    and not e.key.startswith(("cudaGraph", "Memcpy", "Memset")))
    return kernel_us / 1e6 / wall, out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--episodes", type=int, default=256)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--turn-tokens", type=int, default=64)
    p.add_argument("--obs-tokens", type=int, default=32)
    p.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 50.0, 500.0])
    p.add_argument("--profile", action="store_true", help="measure the device's busy share (slower)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shape, 8 episodes x 2 turns")
    a = p.parse_args(argv)
    a.device = "cuda"
    if a.smoke:
        a.device, a.shape, a.episodes, a.turns, a.prompt, a.turn_tokens, a.obs_tokens = "cpu", "tiny", 8, 2, 16, 8, 4
        a.latency_ms = [0.0, 20.0]
        torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    with torch.device(a.device):
        model = CausalLM(decoder_config(a.shape)).to(dtype).eval()
    episode_len = a.prompt + a.turns * a.turn_tokens + (a.turns - 1) * a.obs_tokens
    engine = RolloutEngine(model, EngineConfig(max_slots=a.episodes, max_seq_tokens=episode_len))
    engine.wake()
    ids = prompts(a.episodes, a.prompt, model.config.vocab_size)
    common = dict(shape=a.shape, device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                  episodes=a.episodes, turns=a.turns, prompt=a.prompt, turn_tokens=a.turn_tokens,
                  obs_tokens=a.obs_tokens)
    with torch.inference_mode():
        single_turn(engine, ids, a, False)              # warm-up: layout, fused weights, graphs, compile
        multi_turn(engine, ids, a, 0.0, False)
        base = single_turn(engine, ids, a, a.profile)
        emit(case="single_turn", **common, **base)
        for latency in a.latency_ms:
            r = multi_turn(engine, ids, a, latency / 1000, a.profile)
            emit(case="multi_turn", latency_ms=latency, **common, **r,
                 vs_single_turn=r["tokens_per_s"] / base["tokens_per_s"])


if __name__ == "__main__":
    main()
