"""A reward and an environment whose scores vary with the sampled text, so that GRPO groups have nonzero
advantages and every step moves the weights (tests of exact resume need steps that train)."""
from phaserl.agents import Environment, StepResult


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(sum(map(ord, solution_str)) % 7) / 7.0


class Varied(Environment):
    """Two steps; each observation is "ab" and each reward depends on the action's characters."""

    def __init__(self):
        self.steps = 0

    def reset(self, row, *, seed):
        return ""

    def step(self, action):
        self.steps += 1
        return StepResult("ab", float(sum(map(ord, action)) % 5) / 5.0, self.steps >= 2, {})
