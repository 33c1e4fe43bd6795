"""Turn `reward.functions` entries into callables and score responses with their weighted sum.

A name is a built-in (`rules.BUILTIN_REWARDS`), `path/to/file.py:function` (relative paths are
relative to the working directory) or `package.module:function` (an importable module); the Python API
may also pass the function itself. `RuleRewards` calls every function on every response and checks
what comes back: a real number (bool counts as 0/1; int, float, numpy scalar, one-element tensor)
that is finite. Anything else, an exception, or a call that outlives `timeout_s` (reward.timeout_s)
is a `RewardError` naming the function, the row and the response. With `workers` > 0 the calls run in
worker processes (pool.py) and `submit` returns at once, so scoring can overlap other work; the
scores, and which error is raised, do not depend on where the calls ran or in which order they
finished. This module does not run the reward model.

Two calling conventions, told apart by the function's parameter names (`_convention`):
- phaserl's: `fn(prompt, response, ground_truth, **kwargs, **row)`, where `kwargs` are the config's and
  `row` the dataset record's other fields (minus `prompt`, `response`, `ground_truth` and internal
  `__...__` keys; config kwargs win over a row field of the same name). A function without `**row`
  receives only the row fields it names as parameters.
- verl's: `compute_score(data_source, solution_str, ground_truth, extra_info=None)`, called by name
  with the row's `data_source` and `extra_info` (and the config kwargs); a dict result is read at "score",
  as verl does.
Anything else is refused with both signatures shown. In the main process the timeout runs each call on
a worker thread and stops waiting after `timeout_s`: a hung call is abandoned there (the run stops with
the error), so it cannot block the run; a C extension that holds the GIL forever cannot be interrupted
this way. In a worker process a hung call is ended by stopping the process (pool.py).
"""
from __future__ import annotations

import difflib
import inspect
import logging
import math
import numbers
import queue
import re
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

from phaserl.errors import ConfigError, RewardError
from phaserl.rewards.rules import BUILTIN_REWARDS
from phaserl.userfiles import import_module, load_file

log = logging.getLogger(__name__)

_RESERVED_ROW_KEYS = ("prompt", "response", "ground_truth")
_VERL_PARAMS = ("data_source", "solution_str", "ground_truth")
SIGNATURES = ("phaserl: def fn(prompt, response, ground_truth, **row) -> float   (row: the dataset record's "
              "other fields; name only those you need, or take **row)\n"
              "  verl:    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float")
DEFAULT_TIMEOUT_S = 300.0


def resolve_reward_fn(name) -> Callable:
    """A built-in reward by name, `function` from `path/to/file.py:function`, or from `package.module:function`;
    a callable (the Python API) is itself."""
    if callable(name):
        return name
    if not isinstance(name, str):
        raise ConfigError(f"reward function {name!r}: expected a name (a built-in, 'path/to/file.py:function' or "
                          f"'package.module:function') or a function, got {type(name).__name__}")
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    path, sep, fn_name = name.rpartition(":")
    if sep and fn_name and not path.endswith(".py") and re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", path):
        return _from_module(path, fn_name, name)
    if not sep or not path.endswith(".py"):
        close = difflib.get_close_matches(name, list(BUILTIN_REWARDS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown reward function {name!r}.{hint} Built-ins: {', '.join(BUILTIN_REWARDS)}; "
                          "your own function is written 'path/to/file.py:function_name' or "
                          "'package.module:function_name'.")
    module = load_file(path, f"reward function {name!r}")
    if not hasattr(module, fn_name):
        defined = [n for n, obj in vars(module).items()
                   if inspect.isfunction(obj) and obj.__module__ == module.__name__ and not n.startswith("_")]
        raise ConfigError(f"reward function {name!r}: {path} defines no {fn_name!r}. "
                          f"Functions defined there: {', '.join(defined) or '(none)'}.")
    fn = getattr(module, fn_name)
    if not callable(fn):
        raise ConfigError(f"reward function {name!r}: {fn_name} in {path} is a {type(fn).__name__}, not a "
                          f"function; point the name at a def fn(prompt, response, ground_truth, **row).")
    return fn


def _from_module(module_name: str, fn_name: str, name: str) -> Callable:
    module = import_module(module_name, f"reward function {name!r}", name_hint="function_name")
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"reward function {name!r}: {module_name} has no function {fn_name!r}")
    return fn


@dataclass
class WeightedReward:
    name: str        # metric name: reward/<name>
    fn: Callable
    weight: float
    kwargs: dict
    spec: str = ""   # the name as written in the config
    row_keys: Optional[frozenset] = field(default=None)  # row fields the fn accepts; None = all (**row)
    verl: bool = False  # called as compute_score(data_source=, solution_str=, ground_truth=, extra_info=)


class RuleRewards:
    """The configured rule functions, called on every response and summed with their weights.

    `workers` > 0: the calls of every function a worker process can load by name run in a pool of that
    many processes (pool.py), started on the first `submit` and reused until `close`; a lambda, or a function
    defined in the running script or inside another function, runs in the main process (one log line says so).
    """

    def __init__(self, specs: list[tuple], *, timeout_s: float = DEFAULT_TIMEOUT_S, workers: int = 0):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ConfigError(f"reward.workers must be a whole number >= 0 (0 = score in the main process), "
                              f"got {workers!r}")
        self.timeout_s = float(timeout_s)
        self.workers = workers
        self._caller = _TimedCaller()
        self._pool = None
        self._plan: Optional[list] = None  # (reward index, fn) of the functions the workers run
        self._addresses: dict = {}         # reward index -> where a worker loads it from (pool.worker_address)
        self.rewards: list[WeightedReward] = []
        taken: set[str] = set()
        for i, (spec_name, weight, kwargs) in enumerate(specs):
            label = spec_name if isinstance(spec_name, str) else getattr(spec_name, "__qualname__", repr(spec_name))
            where = f"reward.functions[{i}] ({label!r})"
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
                raise ConfigError(f"{where}: weight must be a finite number, got {weight!r}.")
            kwargs = {} if kwargs is None else kwargs
            if not isinstance(kwargs, dict):
                raise ConfigError(f"{where}: kwargs must be a mapping, got {type(kwargs).__name__} {kwargs!r}.")
            fn = resolve_reward_fn(spec_name)
            builtin = isinstance(spec_name, str) and spec_name in BUILTIN_REWARDS
            verl = _convention(fn, where) == "verl"
            row_keys = (_check_verl_signature(fn, kwargs, where) if verl
                        else _check_signature(fn, kwargs, where, builtin=builtin))
            if builtin:
                metric = spec_name
            elif isinstance(spec_name, str):
                metric = spec_name.rpartition(":")[2]
            else:
                metric = getattr(fn, "__name__", type(fn).__name__)
            base, n = metric, 2
            while metric in taken:  # the same function twice (e.g. different kwargs) gets name_2, name_3
                metric, n = f"{base}_{n}", n + 1
            taken.add(metric)
            self.rewards.append(WeightedReward(metric, fn, float(weight), dict(kwargs), label, row_keys, verl))

    def score(self, prompts: list, responses: list[str], ground_truths: list,
              rows: list[dict]) -> tuple[list[float], dict[str, list[float]]]:
        """Weighted total per response, and each function's raw scores by metric name."""
        return self.submit(prompts, responses, ground_truths, rows).result()

    def submit(self, prompts: list, responses: list[str], ground_truths: list, rows: list[dict]) -> "RuleScoring":
        """Start scoring these responses (e.g. one group of n) and return at once; `.result()` gives what
        `score` returns. The workers' calls start now; functions that run in the main process run in `result()`."""
        n = len(responses)
        if not (len(prompts) == len(ground_truths) == len(rows) == n):
            raise ValueError(f"RuleRewards.score: {len(prompts)} prompts, {n} responses, "
                             f"{len(ground_truths)} ground truths and {len(rows)} rows must be equally many")
        pooled = [f for f, fn in self._worker_plan() if self.rewards[f].fn is fn]
        job = None
        if pooled and n:
            if self._pool is None:
                from phaserl.rewards.pool import RewardPool

                functions = [(address, self.rewards[f].verl) for f, address in self._addresses.items()]
                self._pool = RewardPool(functions, workers=self.workers, timeout_s=self.timeout_s)
                weakref.finalize(self, self._pool.close)
            slot = {f: k for k, f in enumerate(self._addresses)}
            calls = [(slot[f], *_arguments(self.rewards[f], prompts[i], responses[i], ground_truths[i], rows[i]))
                     for f in pooled for i in range(n)]
            job = self._pool.submit(calls, describe=lambda k: _where(k % n, rows[k % n]))
        return RuleScoring(self, prompts, responses, ground_truths, rows, pooled, job)

    def close(self) -> None:
        """Stop the worker processes (a later `submit` starts new ones)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def smoke_test(self, prompt, ground_truth, row: dict) -> None:
        """Call every function on an empty and on a plausible dummy response; raises RewardError on failure."""
        dummy = f"The answer is \\boxed{{{ground_truth}}}.\n#### {ground_truth}"
        self.score([prompt, prompt], ["", dummy], [ground_truth, ground_truth], [row, row])

    def _worker_plan(self) -> list:
        """(reward index, fn) of each function the workers run; decided on first use, logged once."""
        if self._plan is None:
            self._plan, self._addresses = [], {}
            if self.workers:
                from phaserl.rewards.pool import worker_address

                for f, reward in enumerate(self.rewards):
                    address, why = worker_address(reward.fn)
                    if address is None:
                        log.info(f"[rewards] reward function {reward.spec!r} runs in the main process, not in the "
                                 f"{self.workers} reward worker(s): {why}")
                    else:
                        self._plan.append((f, reward.fn))
                        self._addresses[f] = address
        return self._plan

    def _in_process(self, reward: WeightedReward, prompts, responses, ground_truths, rows) -> list:
        """One function's outcomes, called here; the list ends at the first call that failed."""
        from phaserl.rewards.pool import Outcome

        calls = [_arguments(reward, prompts[i], responses[i], ground_truths[i], rows[i]) for i in range(len(responses))]
        # The calls before a failure are marked ok without a value: _collect raises at the failure before
        # it reads any value of this function.
        try:
            values = self._caller.map(reward.fn, calls, self.timeout_s)
        except _CallTimedOut as stuck:
            return [Outcome("ok")] * stuck.index + [Outcome("timeout")]
        except _CallFailed as failed:
            return [Outcome("ok")] * failed.index + [Outcome("raised", failed.error)]
        return [Outcome("ok", reward_value(value, reward.verl)) for value in values]

    def _collect(self, outcomes: dict, prompts, responses, ground_truths, rows):
        """(totals, raw) from each function's outcomes [row]: its first failed call in row order is the error,
        then its first unusable value (the order in which the main process calls them), function by function."""
        totals = [0.0] * len(responses)
        raw: dict[str, list[float]] = {}
        for f, reward in enumerate(self.rewards):
            calls = outcomes[f]() if callable(outcomes[f]) else outcomes[f]
            for i, outcome in enumerate(calls):
                if outcome.kind != "ok":
                    raise self._call_error(reward, i, outcome, responses[i], ground_truths[i], rows[i])
            values = [self._check(reward, i, calls[i].value, responses[i], rows[i]) for i in range(len(responses))]
            raw[reward.name] = values
            for i, value in enumerate(values):
                totals[i] += reward.weight * value
        return totals, raw

    def _call_error(self, reward: WeightedReward, i: int, outcome, response, ground_truth, row) -> RewardError:
        on = f"on {_where(i, row)}, response {_shorten(response)}, ground truth {ground_truth!r}"
        if outcome.kind == "raised":
            exc = outcome.value
            kind = getattr(exc, "type_name", type(exc).__name__)  # pool.RemoteError stands in for an odd one
            error = RewardError(f"reward function {reward.spec!r} raised {kind} {on}: {exc}")
            error.__cause__ = exc
            return error
        if outcome.kind == "timeout":
            stopped = " (its worker process was stopped and replaced)" if outcome.detail else ""
            error = RewardError(f"reward function {reward.spec!r} did not return within {self.timeout_s:g} s "
                                f"{on}{stopped}. Make it return (a hang, a slow external call?) or raise "
                                "reward.timeout_s")
        elif outcome.kind == "crashed":
            error = RewardError(f"reward function {reward.spec!r} ended its worker process ({outcome.detail}) {on}; "
                                "the worker was replaced. A crash in C code, running out of memory or os._exit in "
                                "the function does this; set reward.workers=0 to see it fail in the main process")
        else:  # "unavailable": the pool itself could not run the call
            error = RewardError(f"reward function {reward.spec!r} could not be called {on}: {outcome.detail}")
        error.__suppress_context__ = True
        return error

    def _check(self, reward: WeightedReward, i: int, value, response: str, row: dict) -> float:
        if isinstance(value, Unusable):
            raise RewardError(f"reward function {reward.spec!r} returned {value.type_name} {value.text} on "
                              f"{_where(i, row)}; it must return one number (a float).")
        if not math.isfinite(value):
            raise RewardError(f"reward function {reward.spec!r} returned {value} on {_where(i, row)}, response "
                              f"{_shorten(response)}; rewards must be finite or the advantages become NaN.")
        return value


class RuleScoring:
    """The scores of one `RuleRewards.submit`: `done()` says whether the workers finished its calls, `result()`
    waits for them (and runs the functions that stay in the main process) and returns (totals, raw)."""

    def __init__(self, rules: RuleRewards, prompts, responses, ground_truths, rows, pooled: list, job):
        self._rules, self._job, self._pooled = rules, job, pooled
        self._inputs = (prompts, responses, ground_truths, rows)
        self._result = None

    def done(self) -> bool:
        """True when `result()` will not wait for a worker (the main process's own calls run inside it)."""
        return self._job is None or self._job.done()

    def result(self) -> tuple[list[float], dict[str, list[float]]]:
        """Weighted total per response and each function's raw scores; a RewardError names the function and row."""
        if self._result is None:
            rules, inputs = self._rules, self._inputs
            n = len(inputs[1])
            outcomes = {}
            for f, reward in enumerate(rules.rewards):
                if f in self._pooled:
                    k = self._pooled.index(f)
                    outcomes[f] = (lambda k=k: self._job.outcomes()[k * n:(k + 1) * n])
                else:
                    outcomes[f] = (lambda reward=reward: rules._in_process(reward, *inputs))
            self._result = rules._collect(outcomes, *inputs)
        return self._result


class Unusable(NamedTuple):
    """What a reward call returned when it was not one number: its type name and a short repr."""

    type_name: str
    text: str


def reward_value(value, verl: bool):
    """A call's return value as a float, or Unusable when it is not one number (verl's dict: its "score")."""
    if verl and isinstance(value, dict) and "score" in value:
        value = value["score"]  # verl's compute_score may return {"score": ..., other metrics}
    number = _to_float(value)
    return Unusable(type(value).__name__, _shorten(repr(value))) if number is None else number


def _arguments(reward: WeightedReward, prompt, response: str, ground_truth, row: dict) -> tuple[tuple, dict]:
    """(args, kwargs) of one call, in the function's calling convention."""
    if reward.verl:
        named = {"data_source": row.get("data_source"), "solution_str": response, "ground_truth": ground_truth}
        if reward.row_keys is None or "extra_info" in reward.row_keys:
            named["extra_info"] = row.get("extra_info")
        return (), {**named, **reward.kwargs}
    named = {k: v for k, v in row.items()
             if k not in _RESERVED_ROW_KEYS and not (k.startswith("__") and k.endswith("__"))
             and (reward.row_keys is None or k in reward.row_keys)}
    named.update(reward.kwargs)
    return (prompt, response, ground_truth), named


def _convention(fn: Callable, where: str) -> str:
    """"verl" when the parameters start data_source, solution_str, ground_truth; "phaserl" when the function
    takes three positional arguments; otherwise a ConfigError showing both signatures."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables have no signature: trust them
        return "phaserl"
    positional = [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if tuple(positional[:3]) == _VERL_PARAMS or {"data_source", "solution_str"} <= set(sig.parameters):
        return "verl"
    try:
        sig.bind_partial("prompt", "response", "ground_truth")  # further parameters may come from the row
    except TypeError as exc:
        raise ConfigError(f"{where}: its signature {sig} fits neither calling convention ({exc}). phaserl calls "
                          f"one of:\n  {SIGNATURES}") from exc
    return "phaserl"


def _check_verl_signature(fn: Callable, kwargs: dict, where: str) -> Optional[frozenset]:
    """verl's compute_score: the three named parameters, extra_info optional; config kwargs must fit too."""
    sig = inspect.signature(fn)
    params = sig.parameters
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    missing = [name for name in _VERL_PARAMS if name not in params and not has_var_kw]
    unknown = [k for k in kwargs if k not in params and not has_var_kw]
    required = [p.name for p in params.values()
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                and p.name not in (*_VERL_PARAMS, "extra_info", *kwargs)]
    if missing or unknown or required:
        what = (f"it lacks {missing}" if missing else f"unknown kwarg {unknown[0]!r}" if unknown
                else f"it requires {required}, which phaserl does not pass")
        raise ConfigError(f"{where}: verl-style signature {sig}: {what}. phaserl calls one of:\n  {SIGNATURES}")
    return None if has_var_kw else frozenset(params)


def _check_signature(fn: Callable, kwargs: dict, where: str, builtin: bool) -> Optional[frozenset]:
    """Check that fn takes (prompt, response, ground_truth) and the config kwargs; the row keys it accepts."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables have no signature: trust them
        return None
    params = sig.parameters.values()
    try:
        sig.bind_partial("prompt", "response", "ground_truth")  # further parameters may come from the row
    except TypeError as exc:
        raise ConfigError(f"{where}: its signature {sig} fits neither calling convention ({exc}). phaserl calls "
                          f"one of:\n  {SIGNATURES}") from exc
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)][3:]
    # A built-in's **row is for dataset fields only, so a misspelt config kwarg must not vanish into it.
    if builtin or not has_var_kw:
        for key in kwargs:
            if key not in named:
                close = difflib.get_close_matches(key, named, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"{where}: unknown kwarg {key!r}.{hint} "
                                  f"The function accepts: {', '.join(named) or '(no kwargs)'}.")
    return None if has_var_kw else frozenset(named)


def _to_float(value) -> Optional[float]:
    """float(value) for a real number or one-element tensor/array; None for anything else."""
    torch = sys.modules.get("torch")  # a tensor can only come from a process that imported torch
    if torch is not None and isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return None
        return float(value.item())
    if isinstance(value, numbers.Real):  # includes bool (0/1) and numpy scalars
        return float(value)
    size = getattr(value, "size", None)
    if size == 1 and callable(getattr(value, "item", None)):  # a one-element numpy array
        item = value.item()
        return float(item) if isinstance(item, numbers.Real) else None
    return None


def _where(i: int, row: dict) -> str:
    source = row.get("__source__") if isinstance(row, dict) else None
    return f"row {i} of the batch" + (f" ({source})" if source is not None else "")


def _shorten(text: str, limit: int = 120) -> str:
    text = str(text)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:70]!r} ... {text[-40:]!r} ({len(text)} chars)"


class _CallTimedOut(Exception):
    def __init__(self, index: int):
        self.index = index


class _CallFailed(Exception):
    def __init__(self, index: int, error: BaseException):
        self.index, self.error = index, error


@dataclass
class _Job:
    fn: Callable
    calls: list                       # (args, kwargs) per call
    results: list = field(default_factory=list)
    error: Optional[_CallFailed] = None
    current: tuple = (0, 0.0)         # (index, time.monotonic() when it started)
    done: threading.Event = field(default_factory=threading.Event)


class _TimedCaller:
    """Runs a function over a list of calls on one daemon worker thread; gives up when one call outlives a timeout.

    One hand-off per batch, not per call. A call that times out keeps its worker (a thread cannot be
    killed); the next batch gets a fresh worker. A daemon thread never holds up the interpreter's exit.
    """

    def __init__(self):
        self._jobs: Optional[queue.Queue] = None

    def map(self, fn: Callable, calls: list, timeout_s: float) -> list:
        if self._jobs is None:
            self._jobs = queue.Queue()
            threading.Thread(target=_serve, args=(self._jobs,), name="phaserl-reward", daemon=True).start()
        job = _Job(fn, calls, current=(0, time.monotonic()))
        self._jobs.put(job)
        while not job.done.wait(timeout=max(job.current[1] + timeout_s - time.monotonic(), 0.0) + 0.01):
            index, started = job.current
            if time.monotonic() - started > timeout_s:
                self._jobs = None          # abandon the stuck worker
                raise _CallTimedOut(index)
        if job.error is not None:
            raise job.error
        return job.results


def _serve(jobs: queue.Queue) -> None:
    while True:
        job = jobs.get()
        for i, (args, kwargs) in enumerate(job.calls):
            job.current = (i, time.monotonic())
            try:
                job.results.append(job.fn(*args, **kwargs))
            except BaseException as exc:  # handed to the caller, which names the function and the row
                job.error = _CallFailed(i, exc)
                break
        job.done.set()
