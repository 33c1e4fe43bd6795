"""Multi-turn agentic RL: environments, tools and token-exact episodes (docs/agents.md).

`env.py` is the contract between phaserl and a user's environment; the episode runner, tools
(tools.py, tool_parsers.py, tool_env.py), adapters (adapters/) and the OpenAI-compatible endpoint
(server.py, completion.py, recorder.py, harness.py) build on it. This package knows nothing of the trainer.
"""
from phaserl.agents.env import Environment, Episode, ImageObservation, Observation, Segment, StepResult, as_step_result
from phaserl.agents.tool_env import ToolEnvironment
from phaserl.agents.tools import Tool, tool

__all__ = ["Environment", "Episode", "ImageObservation", "Observation", "Segment", "StepResult", "as_step_result",
           "Tool", "ToolEnvironment", "tool"]
