"""OpenEnv environments as phaserl Environments.

OpenEnv (`pip install openenv`) environments are `reset(seed=..., episode_id=...) -> Observation` and
`step(Action) -> Observation`, where Action and Observation are pydantic models and an Observation
carries `done`, `reward` and `metadata` beside its own fields. Their HTTP/WebSocket clients have the
same two methods and return a StepResult(observation, reward, done) instead; both shapes work here:

    agent:
      env: phaserl.agents.adapters.openenv:OpenEnvEnvironment
      kwargs: {make: "my_env.server:WordleEnvironment", action_field: guess}

The model's text becomes an Action: the env's Action class (found from its `Environment[Act, Obs,
State]` base, or given as `action`) built with the text in its one string field (or `action_field`),
or whatever a callable `action(text)` returns. The observation's text is `observation_field` if
given, else the first string field among prompt/text/message/content/feedback/observation, else the
observation's other fields as JSON. A reward of None counts as 0.
Not here: starting OpenEnv servers or containers (make a connected client in your `make` function).
"""
from __future__ import annotations

import json
import typing
import uuid
from typing import Callable, Optional, Union

from phaserl.agents.env import Environment, StepResult
from phaserl.agents.tools import load_object

TEXT_FIELDS = ("prompt", "text", "message", "content", "feedback", "observation")
_BASE_FIELDS = ("done", "reward", "metadata")


class OpenEnvEnvironment(Environment):
    def __init__(self, make: Union[str, Callable], make_kwargs: Optional[dict] = None,
                 action: Union[str, Callable, type, None] = None, action_field: Optional[str] = None,
                 observation_field: Optional[str] = None, observation_as: str = "user"):
        factory = load_object(make, what="OpenEnvEnvironment make") if isinstance(make, str) else make
        self.name = make if isinstance(make, str) else getattr(make, "__name__", repr(make))
        self.env = factory(**dict(make_kwargs or {}))
        if isinstance(action, str):
            action = load_object(action, what="OpenEnvEnvironment action")
        self.to_action = _action_builder(action if action is not None else _action_type(self.env, self.name),
                                         action_field, self.name)
        if observation_as not in ("user", "text"):
            raise ValueError(f"OpenEnvEnvironment: observation_as={observation_as!r}; choose 'user' or 'text'")
        self.observation_field, self.observation_as = observation_field, observation_as

    def reset(self, row, *, seed: int):
        observation, _, _ = _unwrap(self.env.reset(seed=seed, episode_id=uuid.uuid4().hex))
        return self._text(observation, "reset")

    def step(self, action: str) -> StepResult:
        observation, reward, done = _unwrap(self.env.step(self.to_action(action)))
        metadata = getattr(observation, "metadata", None) or {}
        text = self._text(observation, "step")
        return StepResult(None if done and not text else text, 0.0 if reward is None else reward, done,
                          {"openenv_metadata": metadata})

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()

    def _text(self, observation, where: str):
        if observation is None:
            return ""
        text = _observation_text(observation, self.observation_field, f"{self.name} {where}()")
        if not text:
            return ""
        return [{"role": "user", "content": text}] if self.observation_as == "user" else text


def _unwrap(result) -> tuple:
    """(observation, reward, done) from an Observation or a client's StepResult."""
    if hasattr(result, "observation") and not hasattr(result, "model_fields_set"):  # a client's StepResult
        return result.observation, result.reward, bool(result.done)
    return result, getattr(result, "reward", None), bool(getattr(result, "done", False))


def _observation_text(observation, field: Optional[str], where: str) -> str:
    if isinstance(observation, str):
        return observation
    data = observation.model_dump() if hasattr(observation, "model_dump") else dict(observation)
    if field is not None:
        if field not in data:
            raise ValueError(f"{where}: the observation has no field {field!r} (fields: {', '.join(data)})")
        return str(data[field])
    for name in TEXT_FIELDS:
        if isinstance(data.get(name), str):
            return data[name]
    rest = {k: v for k, v in data.items() if k not in _BASE_FIELDS}
    return json.dumps(rest, default=str, ensure_ascii=False) if rest else ""


def _action_type(env, name: str):
    """The Act of `class MyEnv(Environment[Act, Obs, State])`."""
    for cls in type(env).__mro__:
        for base in getattr(cls, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type):
                return args[0]
    raise ValueError(f"OpenEnvEnvironment: cannot tell the Action class of {name}; pass action=<Action class "
                     "or 'module:Class'> or a function text -> Action")


def _action_builder(action, field: Optional[str], name: str) -> Callable:
    fields = getattr(action, "model_fields", None) if isinstance(action, type) else None
    if fields is None:
        if not callable(action):
            raise ValueError(f"OpenEnvEnvironment: action={action!r} is neither an Action class nor a function")
        return action
    if field is None:
        strings = [k for k, f in fields.items() if f.annotation is str]
        if len(strings) != 1:
            raise ValueError(f"OpenEnvEnvironment: {action.__name__} of {name} has string fields {strings}; "
                             "name the one the model's text goes into with action_field")
        field = strings[0]
    elif field not in fields:
        raise ValueError(f"OpenEnvEnvironment: {action.__name__} has no field {field!r} (fields: {', '.join(fields)})")
    return lambda text: action(**{field: text})
