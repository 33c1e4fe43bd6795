"""Finding the user's environment class from the config, and making one instance per episode.

`agent.env` names a class as `path/to/file.py:ClassName` (a file, run once) or
`package.module:ClassName` / `package.module.ClassName` (an importable module), both loaded by
phaserl/userfiles.py; `agent.kwargs` go to its constructor. `agent.harness` names an external harness
function the same way (`load_harness_function`; phaserl.agents.harness runs it).
`EnvironmentFactory.make()` builds a fresh instance for every episode, so episodes (the n samples of a
prompt included) never share state.
Not here: running episodes (episodes.py).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

from phaserl.errors import ConfigError
from phaserl.userfiles import load_module, split_spec


def load_environment_class(spec: str) -> type:
    """The class `spec` names; a ConfigError names the file/module and what it defines instead."""
    where, name = split_spec(spec, "agent.env", name_hint="ClassName")
    module = load_module(where, f"agent.env={spec!r}", name_hint="ClassName")
    cls = getattr(module, name, None)
    if cls is None:
        defined = [n for n, obj in vars(module).items() if inspect.isclass(obj) and obj.__module__ == module.__name__]
        raise ConfigError(f"agent.env={spec!r}: {where} defines no {name!r}; classes defined there: "
                          f"{', '.join(defined) or '(none)'}")
    if not inspect.isclass(cls) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise ConfigError(f"agent.env={spec!r}: {name} must be a class with reset(row, *, seed) and step(action) "
                          "(subclass phaserl.agents.Environment)")
    return cls


def load_harness_function(spec: str) -> Callable:
    """The function `spec` names (agent.harness): `harness(base_url, row) -> reward | None`."""
    where, name = split_spec(spec, "agent.harness", name_hint="function")
    module = load_module(where, f"agent.harness={spec!r}", name_hint="function")
    fn = getattr(module, name, None)
    if fn is None:
        defined = [n for n, obj in vars(module).items()
                   if inspect.isfunction(obj) and obj.__module__ == module.__name__]
        raise ConfigError(f"agent.harness={spec!r}: {where} defines no {name!r}; functions defined there: "
                          f"{', '.join(defined) or '(none)'}")
    try:
        inspect.signature(fn).bind("http://127.0.0.1:1/v1", {})
    except (TypeError, ValueError):
        raise ConfigError(f"agent.harness={spec!r}: {name} must be a function harness(base_url, row) -> reward or None "
                          "(docs/agents.md, the endpoint)") from None
    return fn


@dataclass(frozen=True)
class EnvironmentFactory:
    """Makes a fresh environment per episode: cls(**kwargs)."""

    cls: type
    kwargs: dict = field(default_factory=dict)

    @classmethod
    def from_spec(cls, spec: str, kwargs: dict) -> "EnvironmentFactory":
        env_cls = load_environment_class(spec)
        try:
            inspect.signature(env_cls).bind(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"agent.kwargs {sorted(kwargs)} do not fit {env_cls.__name__}.__init__: {exc}") from None
        return cls(env_cls, dict(kwargs))

    @property
    def name(self) -> str:
        return self.cls.__name__

    def make(self):
        return self.cls(**self.kwargs)
