"""The tiny world's multi-turn task: answer, hear "no", try again (`phaserl quickstart --task agent`).

An episode starts from a tiny-world arithmetic row (`57+68=`). The model answers; a right answer
ends the episode with reward 1. A wrong one gets the environment's feedback, a user message that
says no and repeats the question (`no 57+68=`), and the model answers again, up to agent.max_turns
turns; the episode's reward is 1 if any turn was right, else 0. The warm-started model, taught by a
teacher that drops carries, follows the format (its later turns are answers too) but greedily
repeats its mistake; RL on whole episodes teaches it to carry and to change a rejected answer, so
the held-out success within the turns rises. Success needs the environment's feedback only in the
sense that a later turn is a second chance: the feedback says *that*, not *how*, the answer is wrong.
Not here: the episode loop (phaserl.agents), the single-turn task (task.py).
"""
from __future__ import annotations

from phaserl.agents.env import Environment, StepResult


class RetryArithmetic(Environment):
    """reset: nothing to add (the prompt is the question); step: reward 1 and done when right, else "no"."""

    def __init__(self, feedback: str = "no"):
        self.feedback = feedback
        self.question = self.answer = None

    def reset(self, row: dict, *, seed: int) -> str:
        prompt = row["prompt"]
        self.question = prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)
        self.answer = str(row["ground_truth"]).strip()
        return ""

    def step(self, action: str) -> StepResult:
        if action.strip() == self.answer:
            return StepResult(observation=None, reward=1.0, done=True, info={"metrics": {"solved": 1.0}})
        return StepResult(observation=[{"role": "user", "content": f"{self.feedback} {self.question}"}],
                          reward=0.0, done=False)
