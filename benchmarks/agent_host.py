"""The episode runner's own host time at turn boundaries, without a model: a stand-in decode session whose steps
and passes are sleeps (the device's time: the GIL is free meanwhile, as while a GPU runs), so whatever the wall
holds beyond them is the runner's work: ending turns (decoding their text, submitting the environment calls),
the worker threads waking up and answering, applying the answers.

Same shape as agent_rollout.py (256 episodes x 4 turns x 64 tokens, 32-token observations, its SimulatedTool and
stand-in tokenizer). A decode step sleeps --step-ms (1.8: the H200's 0.5B step at 256 rows), a prefill or extend
pass --pass-ms plus --pass-row-ms per row (9 + 0.03: its eager extend passes). One JSON line per latency:

    wall_s          the run
    ideal_s         decode steps + one pass + (turns - 1) x latency: nothing else cost anything
    boundary_ms     per turn boundary: from the decode step that ended every turn to the next pass (lock-step
                    latencies only; it holds the latency)
    turns_ms, answers_ms, applies_ms (one boundary, from its first turn end): when the 256 turns were handed
                    over, the first and last environment answers, the first and last answers applied

    python benchmarks/agent_host.py                     # this host, latencies 0 and 50 ms, and 50 ms jittered
    python benchmarks/agent_host.py --episodes 16 --turns 2 --latency-ms 5    # a quick look (the test's)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from agent_rollout import IdsTokenizer, SimulatedTool, prompts, starts  # noqa: E402
from phaserl.agents.episodes import AgentLimits, EpisodeRunner  # noqa: E402
from phaserl.agents.loader import EnvironmentFactory  # noqa: E402
from phaserl.agents.workers import Workers  # noqa: E402
from phaserl.rollout.session import Turn  # noqa: E402


class SleepSession:
    """DecodeSession's surface for the runner (start, extend, step, release, the counts), with sleeps for the
    device. Every decoding sequence samples token 7 until its cap; a step after starts or extends runs one pass
    for them first, as the engine's session does."""

    def __init__(self, slots: int, step_s: float, pass_s: float, pass_row_s: float):
        self.step_s, self.pass_s, self.pass_row_s = step_s, pass_s, pass_row_s
        self.live: dict = {}      # key -> [cap, decoding?, sampled ids]
        self.free_slots, self.decoding, self.queued = slots, 0, []
        self.steps = self.passes = 0
        self.events: list = []    # (what, host clock): "ended" (a step ended the last decoding turn), "pass"

    idle = property(lambda self: not self.queued and not self.decoding)
    gather_seconds = property(lambda self: self.pass_s)

    def start(self, key, ids, cap, noise_key=None) -> None:
        self.free_slots -= 1
        self.live[key] = [cap, False, []]
        self.queued.append(key)

    def extend(self, key, ids, cap) -> None:
        self.live[key][0] = cap
        self.queued.append(key)

    def release(self, key) -> None:
        del self.live[key]
        self.free_slots += 1

    def routes(self, key):
        return None

    def step(self) -> list:
        if self.queued:
            self.events.append(("pass", time.perf_counter()))
            time.sleep(self.pass_s + self.pass_row_s * len(self.queued))
            for key in self.queued:
                self.live[key][1:] = [True, []]
            self.decoding += len(self.queued)
            self.passes, self.queued = self.passes + 1, []
        time.sleep(self.step_s)
        self.steps += 1
        ended = []
        for key, seq in self.live.items():
            if seq[1]:
                seq[2].append(7)
                if len(seq[2]) >= seq[0]:
                    seq[1] = False
                    ended.append(Turn(key, seq[2], [0.0] * len(seq[2]), False))
        self.decoding -= len(ended)
        if ended and not self.decoding:
            self.events.append(("ended", time.perf_counter()))
        return ended


class Marks:
    """Host clock of each turn handed over, answer computed and answer applied (wrapping the runner's methods)."""

    def __init__(self, runner: EpisodeRunner):
        self.turns, self.answers, self.applies = [], [], []
        for name, where in (("_turn_ended", self.turns), ("_step", self.answers), ("_apply", self.applies)):
            setattr(runner, name, self._after(getattr(runner, name), where))

    @staticmethod
    def _after(fn, where: list):
        def marked(*args):
            out = fn(*args)
            where.append(time.perf_counter())
            return out
        return marked


def run(a, latency_s: float, jitter: bool, pool: Workers) -> dict:
    limits = AgentLimits(max_turns=a.turns, max_turn_tokens=a.turn_tokens,
                         max_episode_tokens=a.prompt + a.turns * a.turn_tokens + (a.turns - 1) * a.obs_tokens,
                         context_limited=False, step_timeout_s=60.0, on_env_error="stop", workers=a.episodes,
                         overlap=True)
    env = EnvironmentFactory(SimulatedTool, dict(latency_s=latency_s, obs_tokens=a.obs_tokens, turns=a.turns,
                                                 jitter=jitter))
    episodes = starts(prompts(a.episodes, a.prompt, 1000))
    sleeps = (a.step_ms / 1e3, a.pass_ms / 1e3, a.pass_row_ms / 1e3)
    EpisodeRunner(env, IdsTokenizer(), limits, workers=pool).run_session(SleepSession(a.episodes, *sleeps), episodes)
    runner = EpisodeRunner(env, IdsTokenizer(), limits, workers=pool)  # the warm-up above started the threads
    marks, session = Marks(runner), SleepSession(a.episodes, *sleeps)
    t0 = time.perf_counter()
    runner.run_session(session, episodes)
    wall = time.perf_counter() - t0
    ideal = a.turns * a.turn_tokens * sleeps[0] + sleeps[1] + (a.turns - 1) * latency_s
    out = dict(case="jitter" if jitter else "lock-step", latency_ms=latency_s * 1e3, episodes=a.episodes,
               turns=a.turns, wall_s=round(wall, 4), ideal_s=round(ideal, 4), over_ideal_s=round(wall - ideal, 4),
               decode_steps=session.steps, passes=session.passes)
    ended = [t for what, t in session.events if what == "ended"]
    passes = [t for what, t in session.events if what == "pass"]
    out["boundary_ms"] = [round(1e3 * (min(p for p in passes if p > e) - e), 1) for e in ended
                          if any(p > e for p in passes)]
    if not jitter and a.turns > 1:  # the first boundary: its turns are the first n turn ends
        n, first = a.episodes, marks.turns[0]
        span = lambda ts: [round(1e3 * (min(ts) - first), 1), round(1e3 * (max(ts) - first), 1)]  # noqa: E731
        out.update(turns_ms=span(marks.turns[:n]), answers_ms=span(marks.answers[:n]),
                   applies_ms=span(marks.applies[n:2 * n]))  # the resets' applies come first
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=256)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--turn-tokens", type=int, default=64)
    p.add_argument("--obs-tokens", type=int, default=32)
    p.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 50.0])
    p.add_argument("--jitter-ms", type=float, nargs="*", default=[50.0], help="jittered cases (mean latency)")
    p.add_argument("--step-ms", type=float, default=1.8)
    p.add_argument("--pass-ms", type=float, default=9.0)
    p.add_argument("--pass-row-ms", type=float, default=0.03)
    a = p.parse_args(argv)
    pool = Workers(a.episodes)
    try:
        for latency in a.latency_ms:
            print(json.dumps(run(a, latency / 1e3, False, pool)), flush=True)
        for latency in a.jitter_ms:
            print(json.dumps(run(a, latency / 1e3, True, pool)), flush=True)
    finally:
        pool.shutdown()


if __name__ == "__main__":
    main()
