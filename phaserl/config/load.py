"""Read a config: YAML file + `key=value` overrides -> a typed, validated `Config`; and write one back.

Loading walks the YAML against the dataclasses of `schema.py`, converts and range-checks every value
with its field's `spec` metadata, applies command-line overrides on top, then runs the cross-field
rules of `validate.py`. Every mistake is a `ConfigError` naming the file (or the override), the full
dotted key, the value and what was expected; an unknown key comes with the closest valid one.
An optional on/off field (and a size marked auto) also takes `auto`, read as null (decided when the run is
built: `auto.py`).
Not here: resolving null/"auto" fields (`validate.derive`, `auto.py`) and anything about models or data files.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import os
import re
import types
import typing
from typing import Any, Iterable

import yaml

from phaserl.config.schema import Config
from phaserl.config.validate import validate
from phaserl.errors import ConfigError

CLI = "command line override"


# ---- YAML dialect -------------------------------------------------------------------------------
# PyYAML speaks YAML 1.1: `yes`/`no`/`on`/`off` are booleans and `1e-6` (no dot) is a string. We read
# YAML 1.2 style instead: only true/false are booleans, and 1e-6 is a float.
_FLOAT_TAG, _BOOL_TAG = "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool"
_SCIENTIFIC = re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$")


class YamlLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans/floats that refuses a key given twice in one mapping."""


class YamlDumper(yaml.SafeDumper):
    """SafeDumper that quotes strings YamlLoader would read as floats (such as '1e-6')."""


YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
YamlLoader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
for _cls in (YamlLoader, YamlDumper):
    _cls.add_implicit_resolver(_FLOAT_TAG, _SCIENTIFIC, list("-+0123456789"))


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *anchor` merges are allowed to repeat keys on purpose
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} appears twice (first on line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=True)


YamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


# ---- the schema, seen as types and dotted keys -------------------------------------------------

@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _meta(cls, name: str) -> dict:
    return next(f.metadata for f in dataclasses.fields(cls) if f.name == name)


def _unwrap_optional(tp) -> tuple[Any, bool]:
    """Optional[X] -> (X, True); X -> (X, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        assert len(args) == 1, f"only Optional[X] unions are supported, got {tp}"
        return args[0], True
    return tp, False


def _section_type(tp):
    """The dataclass behind a field type (plain or Optional), else None."""
    inner, _ = _unwrap_optional(tp)
    return inner if dataclasses.is_dataclass(inner) else None


@functools.lru_cache(maxsize=None)
def dotted_keys(cls=Config, prefix: str = "") -> tuple[str, ...]:
    """Every valid dotted key under `cls`, sections included ("ppo", "ppo.mini_batch_size", ...)."""
    keys: list[str] = []
    for name, tp in _hints(cls).items():
        keys.append(prefix + name)
        if _section_type(tp) is not None:
            keys.extend(dotted_keys(_section_type(tp), prefix + name + "."))
    return tuple(keys)


def _help(key: str) -> str:
    cls, parts = Config, key.split(".")
    for name in parts[:-1]:
        cls = _section_type(_hints(cls)[name])
    return _meta(cls, parts[-1])["help"]


# Keys the schema had once: what happened to each, and what to do.
REMOVED_KEYS = {
    "rollout.engine_extend_graphs": "the graphed multi-turn continuation passes measured 0.90-1.11x of the plain "
                                    "passes on the H200 and were removed; delete the key (multi-turn runs continue "
                                    "their slots through the plain extend pass)",
}


def _unknown_key(key: str, siblings: list[str], where: str) -> ConfigError:
    """Error for a key the schema lacks, with the likeliest intended key(s) and their help."""
    if key in REMOVED_KEYS:
        return ConfigError(f"{where}: {key} was removed: {REMOVED_KEYS[key]}")
    def leaf_of(k: str) -> str:
        return k.rsplit(".", 1)[-1]

    leaf, every = leaf_of(key), list(dotted_keys())
    # 1. a valid name in the wrong section (rollout.mini_batch_size -> ppo.mini_batch_size);
    # 2. a misspelling of a key of the same section; 3. a misspelling of a key of any section.
    guesses = [k for k in every if leaf_of(k) == leaf and k != key]
    for pool, cutoff in ((siblings, 0.6), (every, 0.7)):
        if not guesses:
            near = difflib.get_close_matches(leaf, list(dict.fromkeys(map(leaf_of, pool))), n=1, cutoff=cutoff)
            guesses = [k for k in pool if near and leaf_of(k) == near[0]]
    msg = f"{where}: unknown key {key}"
    if len(guesses) == 1:
        msg += f"; did you mean {guesses[0]}?"
    elif guesses:
        msg += f"; did you mean one of {', '.join(guesses)}?"
    else:
        msg += f"; valid keys here: {', '.join(s.rsplit('.', 1)[-1] for s in siblings)}"
    for g in guesses:
        if g in every:
            msg += f"\n  {g}: {_help(g)}"
    return ConfigError(msg)


# ---- values -------------------------------------------------------------------------------------

def show(value) -> str:
    """A value as the user would write it in YAML (null, true, 'text', 3)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value)


def _expected(tp, meta: dict) -> str:
    """What a field accepts, in words: 'an integer >= 1', 'null or a string', 'one of 'a', 'b''."""
    inner, optional = _unwrap_optional(tp)
    if typing.get_origin(inner) is list or inner is list:
        (item,) = typing.get_args(inner) or (Any,)
        words = _expected(item, meta) if item is not Any else "anything"
        words = f"a list, each item {words}"
    elif dataclasses.is_dataclass(inner):
        keys = ", ".join(f.name for f in dataclasses.fields(inner))
        words = f"a mapping with keys {keys}"
        if "name" in _hints(inner):
            words = f"a name or {words}"
    elif meta.get("choices"):
        words = "one of " + ", ".join(show(c) for c in meta["choices"])
        optional = optional and None not in meta["choices"]
    else:
        words = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
                 dict: "a mapping", Any: "anything"}[inner]
        lo, hi = meta.get("min"), meta.get("max")
        if lo is not None and hi is not None:
            words += f" in [{lo}, {hi}]"
        elif lo is not None:
            words += f" >= {lo}"
        elif hi is not None:
            words += f" <= {hi}"
    if inner is bool and optional:
        return "true, false, or auto (null)"
    if optional and meta.get("auto"):
        return f"{words}, or auto (null)"
    return f"null or {words}" if optional else words


def _scalar(value, tp):
    """`value` converted to the scalar type `tp`, or None when it is not one (bool is never a number)."""
    if tp is bool:
        return value if isinstance(value, bool) else None
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return float(value) if ok else None
    if tp is str:
        return value if isinstance(value, str) else None
    if tp is dict:
        return dict(value) if isinstance(value, dict) and all(isinstance(k, str) for k in value) else None
    assert tp is Any, f"unsupported field type {tp}"
    return value


def convert(value, tp, meta: dict, key: str, where: str):
    """`value` (from YAML) as field type `tp`, checked against `meta` (choices, min, max)."""
    inner, optional = _unwrap_optional(tp)

    def bad(hint: str = "") -> ConfigError:
        return ConfigError(f"{where}: {key} = {show(value)}: expected {_expected(tp, meta)}{hint}")

    section = _section_type(tp)
    if value is None and optional:
        return None
    if optional and value == "auto" and (inner is bool or meta.get("auto")):  # decided at build time (config/auto.py)
        return None
    if section is not None:
        return build(section, value, key + ".", where)
    if typing.get_origin(inner) is list or inner is list:
        if not isinstance(value, list):
            hint = f" (write [{value}] for a list of one)" if isinstance(value, (str, int, float)) else ""
            raise bad(hint)
        (item,) = typing.get_args(inner) or (Any,)
        if dataclasses.is_dataclass(item):  # a plain string item names the item: [tiny_exact]
            value = [{"name": v} if isinstance(v, str) else v for v in value]
        return [convert(v, item, meta, f"{key}[{i}]", where) for i, v in enumerate(value)]
    out = _scalar(value, inner)
    if out is None:
        raise bad()
    choices, lo, hi = meta.get("choices"), meta.get("min"), meta.get("max")
    if (choices and out not in choices) or (lo is not None and out < lo) or (hi is not None and out > hi):
        raise bad()
    return out


def build(cls, data, prefix: str, where: str):
    """An instance of dataclass `cls` from a YAML mapping; a missing or empty section means defaults."""
    if data is None:
        return cls()
    if not isinstance(data, dict):
        name = prefix.rstrip(".") or "the top level"
        raise ConfigError(f"{where}: {name} = {show(data)}: expected {_expected(cls, {})}")
    hints = _hints(cls)
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in hints:
            raise _unknown_key(key, [prefix + f for f in hints], where)
        kwargs[name] = convert(value, hints[name], _meta(cls, name), key, where)
    return cls(**kwargs)


# ---- overrides ----------------------------------------------------------------------------------

def _merge(base: dict, new: dict) -> dict:
    """`new` laid over `base`, section by section (so `actor={optim: {lr: 1e-5}}` keeps the rest)."""
    out = dict(base)
    for k, v in new.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def apply_override(cfg: Config, text: str) -> None:
    """Set one `dotted.key=value` (value parsed as YAML) on `cfg`, in place."""
    where = f"{CLI} {text!r}"
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"{where}: expected key=value, e.g. rollout.n=8")
    try:
        value = yaml.load(raw, Loader=YamlLoader)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{where}: the value {raw!r} is not valid YAML ({problem}); to pass it as a string, "
                          f"quote it: '{key}=\"{raw}\"'") from None
    set_key(cfg, key, value, where)


def set_key(cfg: Config, key: str, value: Any, where: str) -> None:
    """Set dotted `key` to the plain `value` on `cfg`, in place, converted and checked like a YAML value;
    `where` opens every error message."""
    parts, node = key.split("."), cfg
    for i, name in enumerate(parts):
        hints, path = _hints(type(node)), ".".join(parts[: i + 1])
        if name not in hints:
            raise _unknown_key(path, [f"{path.rpartition('.')[0]}.{f}".lstrip(".") for f in hints], where)
        section = _section_type(hints[name])
        if i == len(parts) - 1:
            break
        if section is None:
            is_list = isinstance(getattr(node, name), list)
            what = f"a list: give it whole, e.g. {path}=[...]" if is_list else "a single value"
            raise ConfigError(f"{where}: {path} is {what}; it has no key {parts[i + 1]!r}")
        if getattr(node, name) is None:  # an Optional section left null: start from its defaults
            setattr(node, name, section())
        node = getattr(node, name)
    if section is not None and isinstance(value, dict) and getattr(node, name) is not None:
        value = _merge(dataclasses.asdict(getattr(node, name)), value)
    setattr(node, name, convert(value, hints[name], _meta(type(node), name), key, where))


# ---- entry points -------------------------------------------------------------------------------

def read_yaml(path: str) -> Any:
    """The parsed content of a YAML file, with file/line in every error."""
    try:
        with open(path, encoding="utf-8") as f:
            content = yaml.load(f, Loader=YamlLoader)
        if content is None:  # an empty file (or comments only) is a mistake far more often than a wish for defaults
            raise ConfigError(f"config file {path!r} is empty (or holds only comments); phaserl does not take that "
                              "as 'all defaults'. Write the settings of your run into it (examples/ has complete "
                              "ones), or run `phaserl train --defaults [key=value ...]` to train on the built-in "
                              "defaults on purpose")
        return content
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist (cwd: {os.getcwd()})") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None


def config_from_dict(d: dict | None, *, source: str, world_size: int = 1) -> Config:
    """A validated Config from a plain dict (as YAML gives it); `source` names it in errors."""
    cfg = build(Config, d, "", source)
    validate(cfg, world_size, source=source)
    return cfg


def load_config(path: str | None, overrides: Iterable[str] = (), *, world_size: int = 1) -> Config:
    """The Config of YAML file `path` (None = all defaults) with `key=value` overrides applied, validated."""
    source = path if path is not None else "default config"
    cfg = build(Config, read_yaml(path) if path is not None else None, "", source)
    overrides = list(overrides)
    for text in overrides:
        apply_override(cfg, text)
    if overrides:
        source += f" + {len(overrides)} {CLI}{'s' if len(overrides) > 1 else ''}"
    validate(cfg, world_size, source=source)
    return cfg


def with_overrides(cfg: Config, values: dict[str, Any], *, source: str, world_size: int = 1) -> Config:
    """A validated copy of `cfg` with dotted keys set to plain Python values (`{"trainer.save_interval": 100}`),
    each checked like the same key in YAML; `source` names where the values came from in errors."""
    cfg = copy.deepcopy(cfg)
    for key, value in values.items():
        set_key(cfg, key, value, source)
    validate(cfg, world_size, source=source)
    return cfg


def to_dict(cfg) -> dict:
    """The config as plain dicts/lists/scalars (what `config_from_dict` takes back)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg) -> str:
    """The config as YAML text that `load_config` reads back to an equal Config."""
    return yaml.dump(to_dict(cfg), Dumper=YamlDumper, sort_keys=False, default_flow_style=False,
                     allow_unicode=True, width=100)


def dump_yaml(cfg, path: str) -> None:
    """Write `to_yaml(cfg)` to `path` atomically (a crash never leaves half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(to_yaml(cfg))
    os.replace(tmp, path)
