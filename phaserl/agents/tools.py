"""Tools in the OpenAI function-calling shape, and running their calls safely.

A `Tool` is a name, a description, a JSON-schema for its parameters and a Python callable. Its
`schema` is the dict that `tokenizer.apply_chat_template(messages, tools=[...])` and the OpenAI API
both take: {"type": "function", "function": {"name", "description", "parameters"}}. The `@tool`
decorator builds the schema from a typed function and its docstring:

    @tool
    def add(a: int, b: int) -> int:
        '''Add two integers.

        Args:
            a: the first addend
            b: the second addend
        '''
        return a + b

`run_tool_calls` checks each call's arguments against its schema, runs the valid ones at the same
time (one daemon thread per call), and waits at most `timeout_s` for them. Whatever goes wrong (an
unknown tool, bad arguments, an exception, a timeout) becomes a `ToolOutcome` whose text tells the
model what happened; nothing here raises because of a model's call.

Limits stated plainly: a Python thread cannot be killed, so a timed-out tool is abandoned (its
daemon thread runs on, its result is dropped); tools that can hang forever should put their own
limit on the work (subprocess timeouts, socket timeouts). The schema check covers `type`, `required`,
`properties`, `additionalProperties`, `enum` and `items`; other JSON-schema keywords are not checked.
Not here: parsing calls from text (tool_parsers.py), the environment around them (tool_env.py).
"""
from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import time
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional

from phaserl.agents.tool_parsers import ToolCall
from phaserl.userfiles import load_module

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict           # JSON schema of the arguments object
    fn: Callable               # fn(**arguments) -> result (str, or anything json.dumps can write)

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.name or ""):
            raise ValueError(f"tool name {self.name!r}: use 1-64 letters, digits, '_' or '-' (OpenAI's rule)")
        if not isinstance(self.parameters, dict) or self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema of type 'object', "
                             f"got {self.parameters!r}")
        if not callable(self.fn):
            raise ValueError(f"tool {self.name!r}: fn is a {type(self.fn).__name__}, not a callable")

    @property
    def schema(self) -> dict:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def __call__(self, **arguments):
        return self.fn(**arguments)


def tool(fn: Optional[Callable] = None, *, name: Optional[str] = None, description: Optional[str] = None):
    """Decorator (bare or with arguments): a Tool whose schema comes from fn's type hints and docstring.

    Parameters without a default are required. Supported hints: str, int, float, bool, list[X],
    dict, Optional[X], Literal[...]; an unannotated parameter accepts any JSON value.
    """
    def build(f: Callable) -> Tool:
        summary, arg_docs = _parse_docstring(inspect.getdoc(f) or "")
        hints = typing.get_type_hints(f)
        properties, required = {}, []
        for p in inspect.signature(f).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ValueError(f"tool {f.__name__}: *args/**kwargs cannot be described by a schema; "
                                 "name every parameter")
            prop = _schema_of(hints.get(p.name, Any), where=f"tool {f.__name__}, parameter {p.name!r}")
            if p.name in arg_docs:
                prop["description"] = arg_docs[p.name]
            properties[p.name] = prop
            if p.default is p.empty:
                required.append(p.name)
        params = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
        return Tool(name or f.__name__, description if description is not None else summary, params, f)

    return build(fn) if fn is not None else build


def _schema_of(hint, *, where: str) -> dict:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return {}
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:  # Optional[X]: X, or null
            inner = _schema_of(rest[0], where=where)
            return {**inner, "type": [inner["type"], "null"]} if "type" in inner else inner
        return {"anyOf": [_schema_of(a, where=where) for a in args]}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (list, tuple, set) or hint in (list, tuple, set):
        return {"type": "array", **({"items": _schema_of(args[0], where=where)} if args else {})}
    if origin is dict or hint is dict:
        return {"type": "object"}
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    raise ValueError(f"{where}: type {hint!r} has no JSON-schema form here; use str, int, float, bool, "
                     "list[...], dict, Optional[...] or Literal[...], or build Tool(...) with your own schema")


def _parse_docstring(doc: str) -> tuple[str, dict]:
    """The summary (text before 'Args:') and {name: description} from a Google-style Args section."""
    summary, _, rest = doc.partition("\nArgs:")
    arg_docs, current = {}, None
    for line in rest.splitlines():
        m = re.match(r"^\s{2,}(\w+)(?:\s*\([^)]*\))?\s*:\s*(.*)$", line)
        if m:
            current = m.group(1)
            arg_docs[current] = m.group(2).strip()
        elif current and line.strip() and not re.match(r"^\S", line):
            arg_docs[current] += " " + line.strip()
        elif line.strip():
            break  # Returns:, Raises: ... end the section
    return " ".join(summary.split()), arg_docs


def as_tool(obj) -> Tool:
    """A Tool from a Tool, a plain function (through @tool), or a spec 'path/file.py:name' / 'module:name'."""
    if isinstance(obj, str):
        obj = load_object(obj, what="tool")
    if isinstance(obj, Tool):
        return obj
    if callable(obj):
        return tool(obj)
    raise ValueError(f"a tool must be a Tool, a function or 'file.py:name'; got {type(obj).__name__} {obj!r}")


def load_object(spec: str, *, what: str):
    """`name` from 'path/to/file.py:name' (relative to the working directory) or 'package.module:name'."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"{what} {spec!r}: write 'path/to/file.py:name' or 'package.module:name'")
    module = load_module(path, f"{what} {spec!r}")  # a ConfigError (a ValueError) naming the file and the fix
    if not hasattr(module, name):
        raise ValueError(f"{what} {spec!r}: {path} defines no {name!r}")
    return getattr(module, name)


def validate_arguments(schema: dict, value, path: str = "arguments") -> list:
    """Messages for every way `value` breaks `schema` (the subset in the module docstring); [] if none."""
    errors = []
    expected = schema.get("type")
    if expected is not None:
        allowed = expected if isinstance(expected, list) else [expected]
        if not any(_is_type(value, t) for t in allowed):
            return [f"{path} must be of type {' or '.join(allowed)}, got {_json_type(value)} {_short(value)}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path} must be one of {schema['enum']}, got {_short(value)}")
    if "anyOf" in schema and all(validate_arguments(s, value, path) for s in schema["anyOf"]):
        errors.append(f"{path} matches none of the allowed forms: {_short(value)}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path} is missing the required {key!r}")
        for key, item in value.items():
            if key in props:
                errors += validate_arguments(props[key], item, f"{path}.{key}")
            elif schema.get("additionalProperties", True) is False:
                errors.append(f"{path} has an unknown {key!r} (allowed: {', '.join(props) or 'none'})")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += validate_arguments(schema["items"], item, f"{path}[{i}]")
    return errors


def _is_type(value, json_type: str) -> bool:
    if json_type == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                or (isinstance(value, float) and value.is_integer()))
    if json_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    python = {"string": str, "boolean": bool, "object": dict, "array": list, "null": type(None)}.get(json_type)
    return python is not None and isinstance(value, python)


def _json_type(value) -> str:
    for t in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _is_type(value, t):
            return t
    return type(value).__name__


@dataclass
class ToolOutcome:
    call: ToolCall
    status: str        # ok | unknown_tool | invalid_arguments | error | timeout
    content: str       # what the model reads in the tool message
    seconds: float     # wall time of the call (the timeout for one that was cut off)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_tool_calls(calls: list, tools: dict, *, timeout_s: float, max_result_chars: int = 4096) -> list:
    """Run `calls` ([ToolCall]) against `tools` ({name: Tool}) concurrently; one ToolOutcome per call, in order."""
    outcomes: list = [None] * len(calls)
    running = []
    for i, call in enumerate(calls):
        target = tools.get(call.name)
        if target is None:
            outcomes[i] = ToolOutcome(call, "unknown_tool", f"Error: there is no tool named {call.name!r}. "
                                      f"Available tools: {', '.join(sorted(tools)) or 'none'}.", 0.0)
            continue
        problems = validate_arguments(target.parameters, call.arguments)
        if problems:
            outcomes[i] = ToolOutcome(call, "invalid_arguments", f"Error: invalid arguments for {call.name}: "
                                      + "; ".join(problems), 0.0)
            continue
        box: dict = {}
        thread = threading.Thread(target=_call_into, args=(target, _coerce(target.parameters, call.arguments), box),
                                  name=f"phaserl-tool-{call.name}", daemon=True)
        thread.start()
        running.append((i, call, thread, box, time.perf_counter()))
    deadline = time.perf_counter() + timeout_s  # the calls run together: one deadline for all of them
    for i, call, thread, box, start in running:
        thread.join(max(0.0, deadline - time.perf_counter()))
        if thread.is_alive():
            outcomes[i] = ToolOutcome(call, "timeout", f"Error: tool {call.name} did not finish within {timeout_s:g} s "
                                      "and was stopped; try different arguments or another approach.", timeout_s)
        elif "error" in box:
            exc = box["error"]
            outcomes[i] = ToolOutcome(call, "error", f"Error: tool {call.name} raised {type(exc).__name__}: {exc}",
                                      box["seconds"])
        else:
            outcomes[i] = ToolOutcome(call, "ok", _as_text(box["result"], max_result_chars), box["seconds"])
    return outcomes


def _call_into(target: Tool, arguments: dict, box: dict) -> None:
    start = time.perf_counter()
    try:
        result = target.fn(**arguments)
        if inspect.isawaitable(result):
            result = asyncio.run(_await(result))
        box["result"] = result
    except Exception as exc:  # the model sees it as an error observation
        box["error"] = exc
    box["seconds"] = time.perf_counter() - start


async def _await(awaitable):
    return await awaitable


def _coerce(schema: dict, arguments: dict) -> dict:
    """Integral floats (2.0) where the schema asks for an integer become ints, as JSON means them."""
    props = schema.get("properties", {})
    return {k: int(v) if props.get(k, {}).get("type") == "integer" and isinstance(v, float) else v
            for k, v in arguments.items()}


def _as_text(result, limit: int) -> str:
    text = result if isinstance(result, str) else json.dumps(result, default=str, ensure_ascii=False)
    if len(text) > limit:
        text = text[:limit] + f"\n[output truncated: {len(text)} characters, showing the first {limit}]"
    return text


def _short(value, limit: int = 60) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "..."
