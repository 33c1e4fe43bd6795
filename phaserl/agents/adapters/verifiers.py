"""verifiers environments as phaserl's episode source: their own rollout loop, the policy's ids.

A verifiers environment (`pip install "phaserl[verifiers]"`, Python >= 3.11; `import verifiers.v1 as
vf`: the Environments Hub format) is a taskset of typed tasks, a harness that drives each task's
conversation through an OpenAI-compatible client, and the task's `@vf.reward` / `@vf.metric`
functions, scored on the finished trace. phaserl runs the environment's own episode
(`Env.run_episode`) with that client pointed at its endpoint, so every harness works unchanged, and
trains on the ids the endpoint sampled (the token-exact record of server.py / recorder.py):

    load_environment("my_env", kwargs)        an installed module or 'path/to/env.py' -> vf.Env
    VerifiersSource("my_env", env)            its tasks as verl-schema rows; task_for(row)
    run_samples(source, tasks, rows, server)  [[Episode]] per (task, sample), in order

The module named either defines `load_environment(**kwargs) -> vf.Env`, or is a taskset package (its
`__all__` exports a `vf.Taskset`, optionally its `vf.Harness` and `vf.Env`), loaded as `vf-eval` loads
it with `kwargs` as the environment config (`{taskset: {...}, agent: {harness: ..., runtime: ...}}`).

Exactly one agent seat of the environment may talk to the run's endpoint (the others pin a `client` of
their own, e.g. a fixed opponent): its trace is the episode. Its rewards' weighted sum is the episode's
reward; each reward's score and each metric are logged (`vf_reward/<name>`, `vf_metric/<name>`). The
seat's `max_turns` is capped at `max_turns` (verifiers stops the rollout there and still scores it), the
environment's episode deadline at `timeout_s`. An episode that fails (its harness, runtime or rewards
raised; verifiers records the error on the trace) or times out keeps its recorded turns with reward 0
(`vf_errors`, `vf_timeouts`), or stops the run with `on_env_error="stop"`; verifiers' whole-episode
retries are not used. A request the endpoint refuses at an episode limit ends the episode there.

Verifiers' chat programs stream; `_Front` serves each request through `ChatServer.chat` (validation,
limits, the record) and sends the whole completion as server-sent events when asked to stream.
Not here: the trainer's side (trainer/harness_phase.py: prompts, groups, batches).
"""
from __future__ import annotations

import asyncio
import importlib
import json
import logging
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from phaserl.errors import ConfigError, DataError
from phaserl.userfiles import load_file

log = logging.getLogger("phaserl.agents.verifiers")

MODEL_NAME = "phaserl-policy"
SESSION_HEADER = "X-Session-ID"  # verifiers' per-rollout routing header: the trace id, the same every turn
KEY_VAR = "PHASERL_VERIFIERS_API_KEY"  # verifiers reads the client's key from an env var; unset is fine ("EMPTY")


def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ImportError("agent.harness: verifiers needs the verifiers package (Python >= 3.11): "
                          "pip install \"phaserl[verifiers]\"") from exc
    return vf


# ----- loading ------------------------------------------------------------------------------------
def load_environment(env_id: str, kwargs: Optional[dict] = None, *, max_turns: Optional[int] = None,
                     timeout_s: Optional[float] = None):
    """The vf.Env that `env_id` names (module docstring), its trained seat's turns capped at `max_turns` and
    its episode deadline at `timeout_s`; every failure is a ConfigError naming `env_id`."""
    vf = _vf()
    kwargs = dict(kwargs or {})
    what = f"agent.verifiers.env={env_id!r}"
    module = load_file(env_id, what) if env_id.endswith(".py") else _import(env_id, what)
    loader = getattr(module, "load_environment", None)
    try:
        if callable(loader) and getattr(loader, "__module__", None) == module.__name__:  # its own, not vf's
            env = loader(**kwargs)
            if not isinstance(env, vf.Env):
                raise ConfigError(f"{what}: load_environment() returned a {type(env).__name__}; return a "
                                  "verifiers.v1.Env (e.g. vf.load_environment(vf.resolve_env_config({...})))")
        else:
            taskset = dict(kwargs.get("taskset") or {})
            env = vf.load_environment(vf.resolve_env_config({**kwargs, "taskset": {**taskset,
                                                                                   "id": _plugin_id(module)}}))
    except ConfigError:
        raise
    except Exception as exc:  # pydantic's validation errors, a taskset that cannot load its data, ...
        raise ConfigError(f"{what} with agent.verifiers.kwargs={kwargs}: loading the environment failed with "
                          f"{type(exc).__name__}: {_short(exc)}") from exc
    trained_seat(env, env_id)
    _cap(env, max_turns, timeout_s)
    return env


def _short(exc: Exception) -> str:
    """One line: a pydantic error as `key.path: message` items, anything else as its text."""
    errors = getattr(exc, "errors", None)
    if callable(errors) and type(exc).__name__ == "ValidationError":
        items = [f"{'.'.join(str(p) for p in e['loc']) or '(config)'}: {e['msg']}" for e in errors()]
        return "; ".join(items[:5]) + (f" (and {len(items) - 5} more)" if len(items) > 5 else "")
    return str(exc)


def _import(env_id: str, what: str):
    """The installed module of `env_id`; a Hub id `owner/name@version` is installed as `name` (dashes as
    underscores)."""
    name = env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_")
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ConfigError(f"{what}: cannot import {name} ({exc}); install the environment's package, or give its "
                          "file as 'path/to/env.py'") from exc


def _plugin_id(module) -> str:
    """The id verifiers imports the module by (it lower-cases ids): a file's module is registered under it."""
    name = module.__name__.replace("-", "_").lower()
    sys.modules.setdefault(name, module)
    return name


def trained_seat(env, env_id: str) -> str:
    """The one agent seat that talks to the run's endpoint (no `client` of its own: a seat that pins only a
    `model` name still reaches phaserl's endpoint, and so the policy)."""
    from verifiers.v1.configs.agent import agent_config_fields

    seats = agent_config_fields(env.config)
    ours = [name for name, spec in seats.items() if spec.client is None]
    if len(ours) != 1:
        raise ConfigError(f"agent.verifiers.env={env_id!r}: {len(ours)} of its agent seats ({', '.join(seats)}) use "
                          "the run's endpoint; phaserl trains exactly one seat per episode: give the others an "
                          "endpoint of their own in agent.verifiers.kwargs (a fixed opponent), e.g. {<seat>: "
                          "{client: {type: eval, base_url: ...}, model: ...}}")
    return ours[0]


def _cap(env, max_turns: Optional[int], timeout_s: Optional[float]) -> None:
    """Cap the trained seat's max_turns and the episode deadline (Agents read env.config per episode)."""
    from verifiers.v1.configs.agent import agent_config_fields

    updates = {}
    if max_turns is not None:
        for name, spec in agent_config_fields(env.config).items():
            if spec.client is None and (spec.max_turns is None or spec.max_turns > max_turns):
                updates[name] = spec.model_copy(update={"max_turns": max_turns})
    deadline = env.config.timeout.episode
    if timeout_s is not None and (deadline is None or deadline > timeout_s):
        updates["timeout"] = env.config.timeout.model_copy(update={"episode": timeout_s})
    if updates:
        env.config = env.config.model_copy(update=updates)


# ----- tasks as rows ------------------------------------------------------------------------------
class VerifiersSource:
    """One loaded environment and its tasks (a bounded taskset, read once)."""

    def __init__(self, env_id: str, env):
        if not env.taskset.bounded:
            raise ConfigError(f"agent.verifiers.env={env_id!r}: its taskset {type(env.taskset).__name__} is infinite; "
                              "bound it in agent.verifiers.kwargs (e.g. its taskset's size setting), or give prompt "
                              "rows (agent.verifiers.prompts: files)")
        self.env_id, self.env = env_id, env
        self.seat = trained_seat(env, env_id)
        self.tasks = list(env.taskset)

    def records(self) -> list:
        """The tasks as verl-schema rows: the prompt as chat messages, `extra_info.verifiers_task` its index."""
        return [{"prompt": self._messages(task, i), "data_source": f"verifiers/{self.env_id}",
                 "extra_info": {"verifiers_task": i, "name": task.data.name or "", "id": task.data.id or ""}}
                for i, task in enumerate(self.tasks)]

    def row_source(self, index: int) -> str:
        return f"verifiers env {self.env_id!r}, task {index}"

    def where(self, row) -> str:
        """A row named for messages: its source, after the environment's id unless the source has it."""
        prefix = f"verifiers env {self.env_id!r}"
        return row.source if row.source.startswith(prefix) else f"{prefix}, {row.source}"

    def task_for(self, row):
        """The task a row stands for: its `extra_info.verifiers_task` when the row came from `records`, else the
        row's fields read as the taskset's task data (a DataError names the row and the field)."""
        from pydantic import ValidationError

        extra = row.extra_info if isinstance(row.extra_info, dict) else {}
        if row.data_source == f"verifiers/{self.env_id}" and isinstance(extra.get("verifiers_task"), int):
            return self.tasks[extra["verifiers_task"]]
        task_cls = type(self.env.taskset).task_type()
        try:
            data = task_cls.data_type().model_validate(dict(row.raw))
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "(row)"
            kind = task_cls.data_type().__name__
            raise DataError(f"{row.source}: not a task of verifiers env {self.env_id!r} ({kind}): field {field!r}: "
                            f"{first['msg']} ({exc.error_count()} problem(s)); give the row the task's fields, or "
                            "use the environment's own tasks (agent.verifiers.prompts: env)") from None
        return task_cls(data, self.env.taskset.config.task)

    def _messages(self, task, index: int) -> list:
        from verifiers.v1.types import content_text

        d = task.data
        messages = [{"role": "system", "content": d.system_prompt}] if d.system_prompt else []
        if isinstance(d.prompt, str):
            messages.append({"role": "user", "content": d.prompt})
        else:
            messages += [{"role": m.role, "content": content_text(getattr(m, "content", None))} for m in d.prompt or []]
        if not any(m["content"] for m in messages):
            raise DataError(f"{self.row_source(index)}: the task has no prompt text (its user opens the conversation); "
                            "phaserl needs a prompt per row: give the tasks prompts, or prompt rows "
                            "(agent.verifiers.prompts: files)")
        return messages


# ----- running episodes ---------------------------------------------------------------------------
def run_samples(source: VerifiersSource, tasks: list, rows: list, server, *, samples_per_row: int,
                max_workers: int, on_env_error: str = "end", timeout_s: Optional[float] = None) -> list:
    """[[Episode]] per (task, sample), row-major: the recorded pieces of each episode (see recorder.py), [] for
    an episode that made no request. rows[i] (a PromptRow) is what each Episode of tasks[i] holds."""
    assert len(tasks) == len(rows), (len(tasks), len(rows))
    run_id = uuid.uuid4().hex[:8]
    jobs = [(i, k, f"vf-{run_id}-{i}-{k}") for i in range(len(tasks)) for k in range(samples_per_row)]
    outcomes = _run_to_end(_run(source, tasks, jobs, server, max_workers=max_workers, timeout_s=timeout_s))
    per_sample, failures = [], []
    for (i, k, conv_id), (status, value) in zip(jobs, outcomes):
        conv = server.store.pop(conv_id)
        episodes, failure = _episodes(source, status, value, conv, rows[i])
        if failure is not None:
            failures.append((rows[i], k, failure))
        per_sample.append(episodes)
    if failures:
        row, k, failure = failures[0]
        where = f"{source.where(row)}, sample {k}"
        if on_env_error == "stop":
            raise RuntimeError(f"{where}: {failure} (agent.on_env_error=stop; `end` keeps training with such "
                               "episodes at reward 0)")
        log.warning("%s: %s; %d of %d episodes failed this call: their recorded turns are kept with reward 0 "
                    "(agent/vf_errors_mean, agent/vf_timeouts_mean)", where, failure, len(failures), len(jobs))
    if not any(per_sample) and failures:
        raise RuntimeError(f"verifiers env {source.env_id!r}: no episode reached phaserl's endpoint; the first "
                           f"failure, on {source.where(failures[0][0])}: {failures[0][2]}")
    return per_sample


def _run_to_end(coroutine):
    """asyncio.run, on a thread of its own when this one already runs an event loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="phaserl-verifiers-loop") as pool:
        return pool.submit(asyncio.run, coroutine).result()


async def _run(source, tasks, jobs, server, *, max_workers: int, timeout_s: Optional[float]) -> list:
    vf = _vf()
    executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="phaserl-verifiers")
    front = _Front(server, executor)
    gate = asyncio.Semaphore(max_workers)
    # A backstop only: the environment's own deadline (capped at timeout_s) ends an episode first, and scored.
    backstop = None if timeout_s is None else timeout_s + 30.0

    async def one(i: int, conv_id: str):
        def opened(trace) -> None:  # each trace's requests carry its id in X-Session-ID: route them to conv_id
            front.conversations[trace.id] = conv_id

        async with gate:
            try:
                async with asyncio.timeout(backstop):
                    return "ok", await source.env.run_episode(tasks[i], ctx, on_trace=opened)
            except TimeoutError:
                return "timeout", None
            except Exception as exc:  # outside verifiers' own error boundary: still one episode's failure
                return "error", exc

    await front.start()
    # One client config for every episode: verifiers keeps one HTTP client per distinct config.
    ctx = vf.ModelContext(model=MODEL_NAME, client=vf.EvalClientConfig(base_url=front.url, api_key_var=KEY_VAR))
    try:
        async with source.env.serving():
            return await asyncio.gather(*(one(i, conv_id) for i, _, conv_id in jobs))
    finally:
        await front.close()
        executor.shutdown(wait=False, cancel_futures=True)


def _episodes(source: VerifiersSource, status: str, value, conv, row) -> tuple:
    """(the conversation's Episodes with the trace's reward and metrics, a failure message or None)."""
    trace = _trained_trace(source, value) if status == "ok" else None
    kind, failure = None, None
    if status == "timeout" or (status == "ok" and (value.is_timeout or (trace is not None and trace.is_timeout))):
        kind, failure = "timeout", "the episode ran past its deadline (agent.harness_timeout_s)"
    elif status == "error":
        kind, failure = "error", f"{type(value).__name__}: {value}"
    elif not value.ok and (conv is None or conv.ended is None):  # not a refusal at one of phaserl's limits
        errors = list(value.errors) + [e for t in value.traces for e in t.errors]
        kind, failure = "error", (f"{errors[-1].type}: {errors[-1].message}" if errors
                                  else "the episode did not complete")
    if conv is None or not conv.turns:
        return [], failure
    episodes = conv.episodes(row, trace.reward if trace is not None and kind is None else 0.0)
    if kind is not None:
        episodes[-1].finish_reason = "env_error"
    elif conv.ended is None and trace is not None and trace.stop_condition in LIMIT_REASONS:
        episodes[-1].finish_reason = LIMIT_REASONS[trace.stop_condition]
    metrics = {"vf_errors": float(kind == "error"), "vf_timeouts": float(kind == "timeout")}
    if trace is not None and kind is None:
        metrics.update({f"vf_reward/{name}": r.score for name, r in trace.rewards.items() if r is not None})
        metrics.update({f"vf_metric/{name}": float(v) for name, v in trace.metrics.items() if v is not None})
    for episode in episodes:
        episode.metrics.update(metrics)
    return episodes, failure


LIMIT_REASONS = {"max_turns": "max_turns", "max_input_tokens": "max_tokens", "max_output_tokens": "max_tokens",
                 "max_total_tokens": "max_tokens"}


def _trained_trace(source: VerifiersSource, episode):
    """The last trace of the trained seat (a seat that ran several times talked in several pieces)."""
    ours = [t for t in episode.traces if t.agent is not None and t.agent.name == source.seat and t.agent.trainable]
    return ours[-1] if ours else None


# ----- the endpoint as verifiers' clients see it ---------------------------------------------------
class _Front:
    """An aiohttp front of a ChatServer on 127.0.0.1 for verifiers' clients: `/v1/chat/completions`, the
    conversation named by verifiers' per-rollout `X-Session-ID` header (a trace id, mapped in
    `conversations`), answered by `ChatServer.chat` on a worker thread; `stream: true` gets the whole
    completion as server-sent events."""

    def __init__(self, server, executor):
        self.server, self.executor = server, executor
        self.conversations: dict = {}   # trace id -> conversation id
        self.url = ""
        self._runner = None

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}/v1"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _models(self, request):
        from aiohttp import web

        return web.json_response(self.server.models())

    async def _chat(self, request):
        from aiohttp import web

        from phaserl.agents.server import RequestError

        self.server._count("requests")
        conversation = self.conversations.get(request.headers.get(SESSION_HEADER, ""))
        if conversation is None:
            return web.json_response(_error(f"no episode is known by {SESSION_HEADER}="
                                            f"{request.headers.get(SESSION_HEADER)!r}", code="conversation_unknown"),
                                     status=410)
        try:
            body = json.loads(await request.read() or b"null")
        except json.JSONDecodeError as exc:
            return web.json_response(_error(f"the request body is not JSON ({exc.msg})"), status=400)
        stream = isinstance(body, dict) and bool(body.pop("stream", False))
        usage = stream and bool((body.pop("stream_options", None) or {}).get("include_usage"))
        loop = asyncio.get_running_loop()
        try:
            completion = await loop.run_in_executor(self.executor, self.server.chat, body, conversation)
        except RequestError as exc:
            self.server._count("errors")
            return web.json_response(_error(str(exc), param=exc.param, code=exc.code), status=exc.status)
        except Exception as exc:  # a backend failure: the harness gets a 500 that says what broke
            self.server._count("errors")
            log.exception("chat completion failed")
            return web.json_response(_error(f"{type(exc).__name__}: {exc}", kind="server_error"), status=500)
        if not stream:
            return web.json_response(completion)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for event in stream_events(completion, include_usage=usage):
            await response.write(event)
        await response.write_eof()
        return response


def stream_events(completion: dict, *, include_usage: bool) -> list:
    """A chat.completion as the chunks a streaming request gets: all the content (and tool calls) in one
    delta, then the finish reason, then the usage when asked, then [DONE]."""
    head = {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"],
            "model": completion["model"]}
    choice = completion["choices"][0]
    message = choice["message"]
    delta = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    chunks = [{**head, "choices": [{"index": 0, "delta": delta, "logprobs": choice.get("logprobs"),
                                    "finish_reason": None}]},
              {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]}]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": completion["usage"]})
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]


def _error(message: str, *, param=None, code=None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
