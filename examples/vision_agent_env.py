"""A tiny multi-turn vision environment for the built-in vision world (examples/vision_agent.yaml): the model counts
the red squares of the row's picture; a wrong count gets the picture back, once, with a request to count again.

It shows the shape of an environment whose observations hold images: `ImageObservation(content, images)`, one
`<image>` placeholder per picture in the content (here chat messages, rendered by the chat template as the next user
turn), the pictures as the row stores them (PNG bytes) or as PIL images, paths or bytes of one's own.
"""
import re

from phaserl.agents import Environment, ImageObservation, StepResult


class CountAgain(Environment):
    def __init__(self, retries: int = 1):
        self.retries = retries

    def reset(self, row, *, seed):
        self.picture, self.answer, self.left = row["images"][0], int(row["ground_truth"]), self.retries
        return ""

    def step(self, action):
        match = re.search(r"\d+", action)
        right = match is not None and int(match.group()) == self.answer
        if right or self.left == 0:
            return StepResult(None, float(right), done=True)
        self.left -= 1
        again = [{"role": "user", "content": "<image>how many red squares?"}]
        return StepResult(ImageObservation(again, [self.picture]), 0.0, done=False)
