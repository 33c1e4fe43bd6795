"""User code that a config names: `path/to/file.py` (run once per file) or an importable `package.module`.

`load_module(where, what)` gives the module behind the `where` part of a `where:name` spec: a file ending in
`.py` (relative to the working directory) is run once per absolute path and cached, under a stable module
name registered in `sys.modules` (dataclasses and pickling look a class's module up by name); anything else
is imported. `what` starts every error message: the config key and value as the user wrote them
(`agent.env='envs.py:Maze'`, `reward function 'my.py:score'`), so each ConfigError names the setting, the
file or module, and the fix. Reward functions, environment classes, harnesses and tools all load here.
`split_spec(spec, key, name_hint)` splits `where:name` (or `package.module.name`) for the callers that accept both.
Not here: checking what the named object is (its caller knows: a class with reset/step, a reward function).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from types import ModuleType

from phaserl.errors import ConfigError

_files: dict[str, ModuleType] = {}  # absolute path -> module, so a file runs only once per process


def split_spec(spec, key: str, *, name_hint: str = "name", dotted: bool = True) -> tuple[str, str]:
    """'path/to/file.py:Name' or 'package.module:Name' (with `dotted`, also 'package.module.Name') ->
    (where, Name); an empty or malformed spec is a ConfigError naming the key `key` and both forms."""
    forms = f"'path/to/file.py:{name_hint}' or 'package.module:{name_hint}'"
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{key} is empty; set it to {forms}")
    where, sep, name = spec.rpartition(":")
    if not sep and dotted:
        where, _, name = spec.rpartition(".")
    if not where or not name:
        raise ConfigError(f"{key}={spec!r}: write {forms}")
    return where, name


def load_module(where: str, what: str, *, name_hint: str = "name") -> ModuleType:
    """The module `where` names: a .py file (run once) or an importable module; `name_hint` is the word the
    fix suggests after the colon ('path/to/file.py:<name_hint>')."""
    return load_file(where, what) if where.endswith(".py") else import_module(where, what, name_hint=name_hint)


def load_file(path: str, what: str) -> ModuleType:
    """Run the Python file `path` once (later calls return the same module); a missing file or an exception
    while it runs is a ConfigError naming the file."""
    full = os.path.abspath(path)
    if full in _files:
        return _files[full]
    if not os.path.isfile(full):
        raise ConfigError(f"{what}: file {path} not found (looked at {full}; relative paths are relative to the "
                          f"working directory {os.getcwd()})")
    stem = os.path.splitext(os.path.basename(full))[0]
    module_name = f"phaserl_user_{stem}_{hashlib.sha1(full.encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(module_name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before running it: a dataclass in the file looks its module up
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ConfigError(f"{what}: importing {path} failed with {type(exc).__name__}: {exc}") from exc
    _files[full] = module
    return module


def import_module(module_name: str, what: str, *, name_hint: str = "name") -> ModuleType:
    """importlib.import_module, with an ImportError turned into a ConfigError that says how to fix it."""
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{what}: cannot import {module_name} ({exc}); check the name, install its package, or "
                          f"give a file as 'path/to/file.py:{name_hint}'") from exc
