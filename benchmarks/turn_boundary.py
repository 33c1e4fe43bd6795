"""The host's own work at multi-turn turn boundaries, on the real engine session (CPU, a one-layer model).

agent_rollout.py's shape (256 episodes x 4 turns x 64 sampled tokens, 128-token prompts, 32-token observations,
its SimulatedTool and stand-in tokenizer), driven by the real EpisodeRunner over the real DecodeSession and
ModelRunner, on the CPU with a one-layer model so that a run takes seconds. The wall is split into
    compute_s   the model's passes (runner.decode, prefill, extend's forward): device work on a GPU
    kv_move_s   KV exchanged between slots (runner.swap_slots), with `swaps` (pairs moved)
    tool_wait_s the runner blocked on environment calls (concurrent.futures.wait: the tools' latency)
    host_s      everything else: the session's bookkeeping (snapshots, retiring turns, packing), handing turns to
                their environments, collecting and applying answers, building the passes' inputs
and host_s is broken down by where it went (step_host_s: inside session.step outside the passes; ended_s, answers_s,
apply_s: the runner's). boundary_host_ms = host_s / turns: the host's share of one turn boundary (every turn of
every episode ends at one). On a GPU the host's work between a turn's end and the next pass is time the device
idles (lock-step) or decodes fewer rows; `compute_s` here is not what a GPU spends. One JSON line per latency.

    python benchmarks/turn_boundary.py                        # latencies 0 and 50 ms, and 50 ms jittered
    python benchmarks/turn_boundary.py --episodes 16 --turns 2 --latency-ms 0 --jitter-ms   # a quick look
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from agent_rollout import IdsTokenizer, SimulatedTool, prompts, starts  # noqa: E402
from phaserl.agents import episodes as episodes_module  # noqa: E402
from phaserl.agents.episodes import AgentLimits, EpisodeRunner  # noqa: E402
from phaserl.agents.loader import EnvironmentFactory  # noqa: E402
from phaserl.agents.workers import Workers  # noqa: E402
from phaserl.models import CausalLM, DecoderConfig  # noqa: E402
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402

ONE_LAYER = dict(model_type="qwen2", attention_bias=True, max_position_embeddings=4096, rope_theta=1e6,
                 rms_norm_eps=1e-6, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=64, vocab_size=512, tie_word_embeddings=True)


class Timers:
    """Seconds and calls per name, by wrapping bound methods (undone by close())."""

    def __init__(self):
        self.seconds, self.calls, self._wrapped = {}, {}, []

    def wrap(self, obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0
                self.calls[label] = self.calls.get(label, 0) + 1
        setattr(obj, name, timed)
        self._wrapped.append((obj, name))

    def close(self) -> None:
        for obj, name in self._wrapped:
            delattr(obj, name)
        self._wrapped = []


def one_run(engine, runner: EpisodeRunner, ids, a) -> dict:
    episode_len = a.prompt + a.turns * a.turn_tokens + (a.turns - 1) * a.obs_tokens
    params = SamplingParams(max_new_tokens=a.turn_tokens, temperature=1.0)
    t = Timers()
    for name in ("decode", "prefill", "_extend_forward", "swap_slots"):
        t.wrap(engine.runner, name, name)
    for name in ("_ended_turns", "_answers", "_apply"):
        t.wrap(runner, name, name)
    # the runner's blocking waits on environment calls: its module's concurrent.futures, with wait() timed
    waiting = types.SimpleNamespace(**{k: getattr(cf, k) for k in ("FIRST_COMPLETED", "Future")}, wait=cf.wait)
    t.wrap(waiting, "wait", "tool_wait")
    episodes_module.cf = waiting
    try:
        t0 = time.perf_counter()
        with engine.session(params, slot_len=episode_len, eos_token_ids=[], num_slots=len(ids)) as session:
            t.wrap(session, "step", "step")
            episodes = runner.run_session(session, starts(ids))
        wall = time.perf_counter() - t0
    finally:
        episodes_module.cf = cf
        t.close()
    assert all(e.num_turns == a.turns for e in episodes), [e.finish_reason for e in episodes[:4]]
    s = t.seconds
    compute = sum(s.get(k, 0.0) for k in ("decode", "prefill", "_extend_forward"))
    kv_move, wait = s.get("swap_slots", 0.0), s.get("tool_wait", 0.0)
    host = wall - compute - kv_move - wait
    parts = dict(step_host_s=s.get("step", 0.0) - compute - kv_move, ended_s=s.get("_ended_turns", 0.0),
                 answers_s=s.get("_answers", 0.0) - wait, apply_s=s.get("_apply", 0.0))
    parts["loop_s"] = host - sum(parts.values())
    st = engine.last_stats
    return dict(wall_s=wall, compute_s=compute, kv_move_s=kv_move, tool_wait_s=wait, host_s=host,
                boundary_host_ms=1000 * host / a.turns, swaps=st["swaps"], decode_steps=st["steps"],
                extend_passes=t.calls.get("_extend_forward", 0), **parts)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=256)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--turn-tokens", type=int, default=64)
    p.add_argument("--obs-tokens", type=int, default=32)
    p.add_argument("--latency-ms", type=float, nargs="*", default=[0.0, 50.0])
    p.add_argument("--jitter-ms", type=float, nargs="*", default=[50.0])
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case; the run of median host_s reported")
    p.add_argument("--label", default="", help="a name for this build, copied into every line")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = CausalLM(DecoderConfig(**ONE_LAYER)).eval()
    episode_len = a.prompt + a.turns * a.turn_tokens + (a.turns - 1) * a.obs_tokens
    engine = RolloutEngine(model, EngineConfig(max_slots=a.episodes, max_seq_tokens=episode_len))
    engine.wake()
    pool = Workers(a.episodes, name="bench-env")
    ids = prompts(a.episodes, a.prompt, ONE_LAYER["vocab_size"])
    limits = AgentLimits(max_turns=a.turns, max_turn_tokens=a.turn_tokens, max_episode_tokens=episode_len,
                         context_limited=False, step_timeout_s=60.0, on_env_error="stop", workers=a.episodes,
                         overlap=True)
    with torch.inference_mode():
        for latency, jitter in [(ms, False) for ms in a.latency_ms] + [(ms, True) for ms in a.jitter_ms]:
            env = dict(latency_s=latency / 1000, obs_tokens=a.obs_tokens, turns=a.turns, jitter=jitter)
            runner = EpisodeRunner(EnvironmentFactory(SimulatedTool, env), IdsTokenizer(), limits, workers=pool)
            one_run(engine, runner, ids, a)  # warm-up: worker threads, the session's layout
            runs = sorted((one_run(engine, runner, ids, a) for _ in range(a.repeats)), key=lambda r: r["host_s"])
            mid = runs[len(runs) // 2]
            print(json.dumps(dict(case="turn_boundary", label=a.label, latency_ms=latency, jitter=jitter,
                                  episodes=a.episodes, turns=a.turns,
                                  **{k: round(v, 4) if isinstance(v, float) else v for k, v in mid.items()},
                                  host_s_all=[round(r["host_s"], 4) for r in runs])), flush=True)


if __name__ == "__main__":
    main()
