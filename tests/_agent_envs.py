"""Environments for the agent tests: scripted feedback, failures of every kind, and slow steps.

Also loaded by path (`tests/_agent_envs.py:Name`) in the config tests.
"""
import math
import random
import threading
import time

from phaserl.agents import Environment, StepResult

MADE = []  # every instance made, in order (the tests check one per episode)
LOCK = threading.Lock()


class Feedback(Environment):
    """Each step: reward `reward`, observation `observation`; done after `turns` steps."""

    def __init__(self, turns: int = 2, observation="ab", reward: float = 0.5):
        self.turns, self.observation, self.reward = turns, observation, reward
        self.steps, self.actions, self.closed = 0, [], False
        with LOCK:
            MADE.append(self)

    def reset(self, row, *, seed):
        self.row, self.seed = row, seed
        return ""

    def step(self, action):
        self.steps += 1
        self.actions.append(action)
        return StepResult(self.observation, self.reward, self.steps >= self.turns, {"metrics": {"tool_calls": 1.0}})

    def close(self):
        self.closed = True


class NeverDone(Feedback):
    def step(self, action):
        return self.observation, 0.0, False, {}  # a 4-tuple is accepted too


class RaisesOnSecondStep(Feedback):
    def step(self, action):
        if self.steps == 1:
            raise RuntimeError("the sandbox crashed")
        return super().step(action)


class NanReward(Feedback):
    def step(self, action):
        return StepResult("ab", math.nan, False)


class Hangs(Feedback):
    """Row 0's episode hangs in step (for far longer than the test's timeout); the others answer."""

    def step(self, action):
        if self.row["extra_info"].get("index") == 0:
            time.sleep(30)
        return super().step(action)


class SlowFirstRow(Feedback):
    """Row 0's first step takes `delay` seconds; every episode records when its last step returned."""

    ENDED = {}

    def __init__(self, delay: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.delay = delay

    def step(self, action):
        if self.row["extra_info"].get("index") == 0 and self.steps == 0:
            time.sleep(self.delay)
        result = super().step(action)
        if result.done:
            SlowFirstRow.ENDED[(self.row["extra_info"]["index"], self.seed)] = time.monotonic()
        return result


class PausingRetry(Environment):
    """The tiny retry world (phaserl.world.agent_task), which pauses in a second-turn step while
    `pause_file` exists: the resume test SIGKILLs the run there, mid-episode."""

    def __init__(self, pause_file: str = ""):
        from phaserl.world.agent_task import RetryArithmetic

        self.inner, self.pause_file, self.steps = RetryArithmetic(), pause_file, 0

    def reset(self, row, *, seed):
        return self.inner.reset(row, seed=seed)

    def step(self, action):
        import os

        self.steps += 1
        if self.steps == 2 and self.pause_file and os.path.exists(self.pause_file):
            print("\nPAUSED env", flush=True)  # own line: the progress bar's text has no newline before it
            time.sleep(600)
        return self.inner.step(action)


class WithTools(Feedback):
    """Offers one tool (its schema goes into the prompt) and ends with its own reason."""

    tool_schemas = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

    def step(self, action):
        return StepResult(None, 0.0, True, {"end_reason": "tool_timeout", "metrics": {"tool_calls": 2.0}})


class Staggered(Feedback):
    """Feedback whose step answers after 30 ms x (seed % 4): four episodes answer at four different times."""

    def step(self, action):
        time.sleep(0.03 * (self.seed % 4))
        return super().step(action)


class Jittery(Feedback):
    """Feedback whose reset and steps answer after a random 0-40 ms (drawn from the clock, not the seed): the
    order in which episodes resume changes from run to run. Its observation echoes the action's length, so
    every sampled token shapes what comes after."""

    def reset(self, row, *, seed):
        time.sleep(random.Random().uniform(0, 0.04))
        return super().reset(row, seed=seed)

    def step(self, action):
        time.sleep(random.Random().uniform(0, 0.04))
        self.observation = f"n{len(action) % 10}"
        return super().step(action)


class FaultyEvenSeeds(Feedback):
    """A third-party environment: on the episodes of even seed, step() raises (`fault=raise`), hangs for
    30 s (`fault=hang`) or returns a dict for an observation (`fault=dict`); the others behave."""

    def __init__(self, fault: str = "raise", **kwargs):
        super().__init__(**kwargs)
        self.fault = fault

    def step(self, action):
        if self.seed % 2 == 0:
            if self.fault == "raise":
                raise ValueError("the simulator lost its state")
            if self.fault == "hang":
                time.sleep(30)
            if self.fault == "dict":
                return {"text": "ab"}, 0.0, False, {}
        return super().step(action)
