"""Gym-style text environments (GEM, Gymnasium text envs) as phaserl Environments.

The shape adapted: `reset(seed=..., options=...)` returns an observation or (observation, info);
`step(action: str)` returns (observation, reward, terminated, truncated, info) or the old 4-tuple;
observations are text. GEM (`pip install gem-llm`) is exactly this:

    agent:
      env: phaserl.agents.adapters.gym:GymEnvironment
      kwargs: {make: "gem:make", make_kwargs: {env_id: "game:GuessTheNumber-v0-easy"}}

One wrapped environment is made per episode (phaserl makes one GymEnvironment per episode). Every
observation, the reset one included, is returned as a user message (the runner appends it after the
row's prompt, which may be empty for envs that pose their own task); `observation_as: text` returns
raw text instead. Gym's info dict is passed on as StepResult.info. With `options_from_row: true` the data row is
passed as reset's `options` (Gymnasium's way to parameterize an episode), so a dataset can drive the env.
Not here: vectorized envs, multi-agent turn order (TextArena's multi-player games).
"""
from __future__ import annotations

import inspect
from typing import Callable, Optional, Union

from phaserl.agents.env import Environment, StepResult, as_step_result
from phaserl.agents.tools import load_object


class GymEnvironment(Environment):
    def __init__(self, make: Union[str, Callable], make_kwargs: Optional[dict] = None,
                 reset_kwargs: Optional[dict] = None, options_from_row: bool = False, observation_as: str = "user"):
        """make: a class/function ('package.module:name' or 'file.py:name') returning the env."""
        factory = load_object(make, what="GymEnvironment make") if isinstance(make, str) else make
        if not callable(factory):
            raise ValueError(f"GymEnvironment: make={make!r} is not callable")
        if observation_as not in ("user", "text"):
            raise ValueError(f"GymEnvironment: observation_as={observation_as!r}; choose 'user' or 'text'")
        self.name = make if isinstance(make, str) else getattr(make, "__name__", repr(make))
        self.env = factory(**dict(make_kwargs or {}))
        for method in ("reset", "step"):
            if not callable(getattr(self.env, method, None)):
                raise ValueError(f"GymEnvironment: {self.name} made a {type(self.env).__name__} without {method}()")
        self.reset_kwargs, self.options_from_row = dict(reset_kwargs or {}), options_from_row
        self.observation_as = observation_as
        self._reset_params = _parameters(self.env.reset)

    def reset(self, row, *, seed: int):
        kwargs = dict(self.reset_kwargs)
        if "seed" in self._reset_params:
            kwargs["seed"] = seed
        if self.options_from_row:
            kwargs["options"] = dict(row) if isinstance(row, dict) else vars(row)
        out = self.env.reset(**kwargs)
        observation = out[0] if isinstance(out, tuple) else out
        return self._observation(observation, "reset")

    def step(self, action: str) -> StepResult:
        result = as_step_result(self.env.step(action), where=f"{self.name} ({type(self.env).__name__})")
        observation = None if result.done and not result.observation else self._observation(result.observation, "step")
        return StepResult(observation, result.reward, result.done, result.info)

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()

    def _observation(self, observation, where: str):
        if observation is None or observation == "":
            return ""
        if not isinstance(observation, str):
            raise ValueError(f"{self.name}: {where}() returned a {type(observation).__name__} observation; "
                             "GymEnvironment adapts text environments (observations must be strings)")
        return [{"role": "user", "content": observation}] if self.observation_as == "user" else observation


def _parameters(fn) -> set:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return {"seed"}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return {"seed", "options"}
    return {p.name for p in params}

