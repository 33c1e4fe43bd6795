"""Multi-turn agentic RL: environments, tools and token-exact episodes (docs/agents.md).

`env.py` is the contract between phaserl and a user's environment; the episode runner, tools,
adapters and the OpenAI-compatible endpoint build on it. This package knows nothing of the trainer.
"""
from phaserl.agents.env import Environment, Episode, Observation, Segment, StepResult, as_step_result

__all__ = ["Environment", "Episode", "Observation", "Segment", "StepResult", "as_step_result"]
