"""Find the tool calls in a model turn's text, in the format its chat template taught it.

A parser turns the decoded text of one assistant turn into a `ParsedTurn`: the text meant for the
reader (`content`, tool-call markup removed), the `ToolCall`s it contains, and one message per call
that could not be read (bad JSON, no name, arguments that are not an object). Broken calls are
reported, never raised: the environment shows them to the model as errors.

Parsers are found by name in `TOOL_PARSERS` (the config picks one); `register_tool_parser` adds
your own. Built in:

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>  (Hermes, Qwen2.5, Qwen3)
    llama3_json  the whole turn is {"name": ..., "parameters": {...}} (optionally after <|python_tag|>),
                 several calls separated by ";"   (Llama 3.1/3.2 JSON tool calling)
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]  (Mistral v3 and later)

Not here: running the tools (tools.py), rendering calls back into the prompt (the chat template does).
"""
from __future__ import annotations

import difflib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class ToolCall:
    name: str
    arguments: dict                 # parsed JSON object
    id: str = ""                    # "call_<hex>" when the format has none

    def __post_init__(self):
        if not self.id:
            self.id = "call_" + uuid.uuid4().hex[:24]


@dataclass
class ParsedTurn:
    content: str                                 # the turn's text without tool-call markup
    calls: list = field(default_factory=list)    # [ToolCall]
    errors: list = field(default_factory=list)   # [str], one per call that could not be read


TOOL_PARSERS: dict[str, Callable] = {}


def register_tool_parser(name: str):
    """Decorator: make `fn(text) -> ParsedTurn` available as `parser: <name>`."""
    def add(fn):
        TOOL_PARSERS[name] = fn
        return fn
    return add


def get_tool_parser(name: str) -> Callable:
    if name not in TOOL_PARSERS:
        close = difflib.get_close_matches(name, list(TOOL_PARSERS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown tool-call parser {name!r}.{hint} Known: {', '.join(sorted(TOOL_PARSERS))}; "
                         "add your own with phaserl.agents.tool_parsers.register_tool_parser(name).")
    return TOOL_PARSERS[name]


def call_from_object(obj, *, args_key: str = "arguments", where: str = "tool call"):
    """A ToolCall from a decoded {"name", args_key} object, or an error message (str)."""
    if not isinstance(obj, dict):
        return f"{where}: expected a JSON object with 'name' and '{args_key}', got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"{where}: no 'name' string in {_short(json.dumps(obj))}"
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string, like the OpenAI API
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return f"{where} {name!r}: its arguments string is not JSON ({exc.msg} at char {exc.pos})"
    if not isinstance(args, dict):
        return f"{where} {name!r}: '{args_key}' must be a JSON object, got {type(args).__name__}"
    call_id = obj.get("id") if isinstance(obj.get("id"), str) else ""
    return ToolCall(name, args, call_id)


def _decode(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        return _BadJSON(f"{where}: not valid JSON ({exc.msg} at char {exc.pos}): {_short(text)}")


@dataclass
class _BadJSON:
    message: str


def _collect(objects: list, out: ParsedTurn, args_key: str) -> None:
    for i, obj in enumerate(objects):
        if isinstance(obj, _BadJSON):
            out.errors.append(obj.message)
            continue
        call = call_from_object(obj, args_key=args_key, where=f"tool call {i + 1}")
        (out.calls if isinstance(call, ToolCall) else out.errors).append(call)


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@register_tool_parser("hermes")
def parse_hermes(text: str) -> ParsedTurn:
    """Every <tool_call>...</tool_call> block (an unclosed last one counts: the turn may have hit EOS)."""
    blocks = [m.group(1).strip() for m in _HERMES.finditer(text)]
    out = ParsedTurn(_HERMES.sub("", text).strip())
    _collect([_decode(b, f"tool call {i + 1}") for i, b in enumerate(blocks)], out, "arguments")
    return out


@register_tool_parser("llama3_json")
def parse_llama3_json(text: str) -> ParsedTurn:
    """A turn that is (after an optional <|python_tag|>) JSON call objects joined by ';' is a call;
    any other turn is plain content."""
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    body = body.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedTurn(text.strip())
    parts = [p.strip() for p in _split_top_level(body, ";") if p.strip()]
    decoded = [_decode(p, f"tool call {i + 1}") for i, p in enumerate(parts)]
    if not tagged and all(isinstance(d, _BadJSON) for d in decoded):
        return ParsedTurn(text.strip())  # prose that happens to start with "{"
    out = ParsedTurn("")
    _collect(decoded, out, "parameters")
    return out


@register_tool_parser("mistral")
def parse_mistral(text: str) -> ParsedTurn:
    """[TOOL_CALLS] followed by a JSON list of call objects (or a single object). [TOOL_CALLS] is a
    special token, so text decoded without special tokens has lost it: a turn that is just a JSON list
    of objects with a "name" then counts as the calls."""
    head, sep, tail = text.partition("[TOOL_CALLS]")
    out = ParsedTurn(head.strip())
    if not sep:
        bare = _decode(text.strip(), "[TOOL_CALLS]") if text.strip().startswith("[{") else None
        if isinstance(bare, list) and bare and all(isinstance(c, dict) and "name" in c for c in bare):
            out.content = ""
            _collect(bare, out, "arguments")
        return out
    decoded = _decode(tail.strip(), "[TOOL_CALLS]")
    if isinstance(decoded, _BadJSON):
        out.errors.append(decoded.message)
        return out
    _collect(decoded if isinstance(decoded, list) else [decoded], out, "arguments")
    return out


def _split_top_level(text: str, sep: str) -> list:
    """Split on `sep` outside JSON strings and brackets."""
    parts, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if ch == '"' and not escaped:
                in_string = False
            escaped = not escaped and ch == "\\"
            continue
        if ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def _short(text: str, limit: int = 120) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} chars)"
