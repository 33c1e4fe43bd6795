"""ToolEnvironment: an Environment in which the model calls tools until it gives a final answer.

Each model turn is parsed with the configured tool-call parser (tool_parsers.py):
  - calls found     -> they run (tools.run_tool_calls: schema check, threads, timeout) and their
                       results come back as `tool` messages, one per call; reward 0, not done
  - only broken calls -> one `tool` message per problem, so the model can correct itself
  - no call at all  -> the turn is the final answer: the episode ends with `final_reward`, a rule
                       reward (a `reward.functions` name, or a callable of the same convention
                       fn(prompt, response, ground_truth, **row)) scored on that last turn's text

The runner renders the prompt with `tools=env.tool_schemas` in the chat template, so the model sees
the tools in the format its template uses. Per-step counts go to `StepResult.info["metrics"]`:
tool_calls (calls the model made, broken ones included), tool_errors (calls that did not return a
result: broken, unknown tool, invalid arguments, raised, timed out), tool_timeouts (of those, cut off
by the timeout) and tool_seconds (wall time of the tools this turn).

In the config (agents-core's `agent.env`): `phaserl.agents.tool_env:ToolEnvironment` with kwargs
{tools: ["my_tools.py:search", ...], parser: hermes, final_reward: gsm8k, timeout_s: 10}.
Not here: turn and token limits, rendering and tokenizing observations (the episode runner).
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional, Union

from phaserl.agents.env import Environment, StepResult
from phaserl.agents.tool_parsers import ParsedTurn, get_tool_parser
from phaserl.agents.tools import as_tool, run_tool_calls

ON_TIMEOUT = ("continue", "end")
OBSERVATION_ROLES = ("tool", "user")


class ToolEnvironment(Environment):
    def __init__(self, tools: list, parser: Union[str, Callable] = "hermes",
                 final_reward: Union[str, Callable, None] = None, reward_kwargs: Optional[dict] = None,
                 timeout_s: float = 30.0, on_timeout: str = "continue", max_calls_per_turn: int = 8,
                 max_result_chars: int = 4096, observation_role: str = "tool"):
        """tools: Tools, typed functions or 'file.py:name' specs. parser: a TOOL_PARSERS name or a
        callable text -> ParsedTurn. on_timeout: 'continue' (the model reads a timeout error) or 'end'
        (the episode ends, reward 0). observation_role: 'user' for chat templates without a tool role."""
        loaded = [as_tool(t) for t in tools]
        self.tools = {t.name: t for t in loaded}
        if len(self.tools) != len(loaded):
            names = [t.name for t in loaded]
            raise ValueError(f"ToolEnvironment: tool names must be unique, got {names}")
        self.parse = get_tool_parser(parser) if isinstance(parser, str) else parser
        if on_timeout not in ON_TIMEOUT:
            raise ValueError(f"ToolEnvironment: on_timeout={on_timeout!r}; choose one of {ON_TIMEOUT}")
        if observation_role not in OBSERVATION_ROLES:
            raise ValueError(f"ToolEnvironment: observation_role={observation_role!r}; "
                             f"choose one of {OBSERVATION_ROLES}")
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"ToolEnvironment: timeout_s={timeout_s!r} must be a positive number of seconds")
        if max_calls_per_turn < 1:
            raise ValueError(f"ToolEnvironment: max_calls_per_turn={max_calls_per_turn} must be >= 1")
        self.final_reward = final_reward_fn(final_reward, dict(reward_kwargs or {}))
        self.timeout_s, self.on_timeout = float(timeout_s), on_timeout
        self.max_calls_per_turn, self.max_result_chars = max_calls_per_turn, max_result_chars
        self.observation_role = observation_role
        self.row: dict = {}

    @property
    def tool_schemas(self) -> list:
        """[{"type": "function", "function": {...}}]: pass as `tools=` to apply_chat_template."""
        return [t.schema for t in self.tools.values()]

    def reset(self, row: dict, *, seed: int):
        self.row = dict(row)
        return ""  # the prompt (rendered with the tools) is the whole first observation

    def step(self, action: str) -> StepResult:
        parsed: ParsedTurn = self.parse(action)
        if not parsed.calls and not parsed.errors:
            reward = self.final_reward(self.row, action)
            return StepResult(None, reward, True, {"metrics": _metrics(0, 0, 0, 0.0)})
        calls, extra = parsed.calls[:self.max_calls_per_turn], parsed.calls[self.max_calls_per_turn:]
        start = time.perf_counter()
        outcomes = run_tool_calls(calls, self.tools, timeout_s=self.timeout_s, max_result_chars=self.max_result_chars)
        seconds = time.perf_counter() - start
        messages = [self._message(o.content, o.call.name, o.call.id) for o in outcomes]
        messages += [self._message(f"Error: {e}", None, None) for e in parsed.errors]
        messages += [self._message(f"Error: at most {self.max_calls_per_turn} tool calls per turn; "
                                   f"{c.name} was not run.", c.name, c.id) for c in extra]
        timeouts = sum(o.status == "timeout" for o in outcomes)
        errors = sum(not o.ok for o in outcomes) + len(parsed.errors) + len(extra)
        info = {"metrics": _metrics(len(parsed.calls) + len(parsed.errors), errors, timeouts, seconds),
                "tool_calls": [{"name": o.call.name, "arguments": o.call.arguments, "status": o.status,
                                "seconds": o.seconds} for o in outcomes]}
        if timeouts and self.on_timeout == "end":
            info["end_reason"] = "tool_timeout"
            return StepResult(None, 0.0, True, info)
        return StepResult(messages, 0.0, False, info)

    def _message(self, content: str, name, call_id) -> dict:
        if self.observation_role == "user":
            return {"role": "user", "content": content if name is None else f"[{name}] {content}"}
        message = {"role": "tool", "content": content}
        if name is not None:
            message["name"] = name
        if call_id is not None:
            message["tool_call_id"] = call_id
        return message


def _metrics(calls: int, errors: int, timeouts: int, seconds: float) -> dict:
    return {"tool_calls": float(calls), "tool_errors": float(errors), "tool_timeouts": float(timeouts),
            "tool_seconds": float(seconds)}


def final_reward_fn(spec, kwargs: dict, *, where: str = "ToolEnvironment") -> Callable:
    """(row, response) -> float, for a reward.functions name, a callable, or None (always 0)."""
    if spec is None:
        if kwargs:
            raise ValueError(f"{where}: reward_kwargs {kwargs} given without a final_reward")
        return lambda row, response: 0.0
    from phaserl.rewards.registry import RuleRewards  # the same checks and errors as reward.functions

    if isinstance(spec, str):
        rules = RuleRewards([(spec, 1.0, kwargs)])
    elif callable(spec):
        rules = RuleRewards([])
        rules.rewards.append(_weighted(spec, kwargs, where))
    else:
        raise ValueError(f"{where}: final_reward must be a reward function name or a callable, got {spec!r}")

    def score(row: dict, response: str) -> float:
        totals, _ = rules.score([row.get("prompt")], [response], [row.get("ground_truth")], [row])
        return totals[0]

    return score


def _weighted(fn: Callable, kwargs: dict, where: str):
    from phaserl.rewards.registry import WeightedReward, _check_signature

    where = f"{where} final_reward {getattr(fn, '__name__', fn)!r}"
    return WeightedReward(getattr(fn, "__name__", "final_reward"), fn, 1.0, kwargs, where,
                          _check_signature(fn, kwargs, where, builtin=False))
