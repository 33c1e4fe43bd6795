"""Finding the user's environment class from the config, and making one instance per episode.

`agent.env` names a class as `path/to/file.py:ClassName` (a file, imported once) or
`package.module:ClassName` / `package.module.ClassName` (an importable module); `agent.kwargs` go to
its constructor. `agent.harness` names an external harness function the same way
(`load_harness_function`; phaserl.agents.harness runs it). `EnvironmentFactory.make()` builds a fresh instance for every episode, so episodes
(the n samples of a prompt included) never share state.
Not here: running episodes (episodes.py).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Callable

from phaserl.errors import ConfigError

_files: dict = {}  # absolute path -> module, so a file runs once


def load_environment_class(spec: str) -> type:
    """The class `spec` names; a ConfigError names the file/module and what it defines instead."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("agent.env is empty; set it to 'path/to/file.py:ClassName' or 'package.module:ClassName'")
    where, sep, name = spec.rpartition(":")
    if not sep:  # package.module.ClassName
        where, _, name = spec.rpartition(".")
    if not where or not name:
        raise ConfigError(f"agent.env={spec!r}: write 'path/to/file.py:ClassName' or 'package.module:ClassName'")
    module = _load_file(where, spec) if where.endswith(".py") else _import(where, spec)
    cls = getattr(module, name, None)
    if cls is None:
        defined = [n for n, obj in vars(module).items() if inspect.isclass(obj) and obj.__module__ == module.__name__]
        raise ConfigError(f"agent.env={spec!r}: {where} defines no {name!r}; classes defined there: "
                          f"{', '.join(defined) or '(none)'}")
    if not inspect.isclass(cls) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise ConfigError(f"agent.env={spec!r}: {name} must be a class with reset(row, *, seed) and step(action) "
                          "(subclass phaserl.agents.Environment)")
    return cls


def _import(module_name: str, spec: str, key: str = "agent.env"):
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}={spec!r}: cannot import {module_name} ({exc}); check the name, install the "
                          "package, or give a file as 'path/to/file.py:Name'") from exc


def _load_file(path: str, spec: str, key: str = "agent.env"):
    full = os.path.abspath(path)
    if full in _files:
        return _files[full]
    if not os.path.isfile(full):
        raise ConfigError(f"{key}={spec!r}: file {path} not found (looked at {full}; relative paths are "
                          f"relative to the working directory {os.getcwd()})")
    module_name = f"phaserl_user_env_{os.path.splitext(os.path.basename(full))[0]}_" \
                  f"{hashlib.sha1(full.encode()).hexdigest()[:8]}"
    module_spec = importlib.util.spec_from_file_location(module_name, full)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ConfigError(f"{key}={spec!r}: importing {path} failed with {type(exc).__name__}: {exc}") from exc
    _files[full] = module
    return module


def load_harness_function(spec: str) -> Callable:
    """The function `spec` names (agent.harness): `harness(base_url, row) -> reward | None`."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("agent.harness is empty; set it to 'path/to/file.py:function' or 'package.module:function'")
    where, sep, name = spec.rpartition(":")
    if not sep:
        where, _, name = spec.rpartition(".")
    if not where or not name:
        raise ConfigError(f"agent.harness={spec!r}: write 'path/to/file.py:function' or 'package.module:function'")
    module = _load_file(where, spec, "agent.harness") if where.endswith(".py") else _import(where, spec, "agent.harness")
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
