"""An OpenAI-compatible chat-completions endpoint on localhost, backed by the policy during rollout.

External agent harnesses (anything written against the `openai` client) drive their conversations
through it while phaserl records the exact token ids and log-probs of every completion:

    GET  /v1/models
    POST /v1/chat/completions            (non-streaming; n = 1)
    ...  /c/<conversation id>/v1/...     the same, with the conversation named in the URL

Per request: the messages (and `tools`) go through the tokenizer's chat template with the generation
prompt; the ids go to a `CompletionBackend` (completion.py); the sampled text comes back with its
tool calls parsed by the configured parser (tool_parsers.py) as OpenAI `tool_calls`.

Token-exactness. A continuing request's prompt must start with the previous prompt + the sampled ids.
The plain rendering usually does; when it does not (the template re-renders our reply as different
tokens, e.g. a BPE merge across the turn boundary), the server splices: if the request repeats the
previous messages and our reply unchanged, and the template renders that reply as text that starts
with the sampled text, the prompt becomes previous prompt + sampled ids + the tokens of the text after
them. Otherwise the request starts a new piece of the record (recorder.py), with a warning and the
`prefix_mismatches` metric. The model always sees the ids that training will see.

Sampling. By default a request's own temperature / top_p win (OpenAI's defaults 1.0 / 1.0 when it
gives none). With `sampling=(temperature, top_p, top_k)` (what the trainer passes: the run's rollout
settings) every request samples with those, and a request asking for other values is answered with
the run's settings and a one-time warning: training assumes the log-probs of rollout.temperature.
`seed` is honoured either way (it fixes the sample, not the distribution).

Limits (the trainer passes agent.max_turns, rollout.max_new_tokens and the episode token budget):
`max_tokens` is capped by `max_turn_tokens` and the room left in `max_context`; a conversation that
asks past `max_turns` completions, or outgrows `max_context`, gets an HTTP 400 (`max_turns_exceeded`,
`context_length_exceeded`: the openai client raises BadRequestError with the message) and its
episode ends with that limit as its finish reason (recorder.py; metric `refused_at_limit`).

Not here: running a harness over data rows (harness.py). Binds 127.0.0.1 unless told otherwise;
there is no authentication (any api_key is accepted).
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from phaserl.agents.completion import CompletionRequest
from phaserl.agents.recorder import ConversationStore, Turn
from phaserl.agents.tool_parsers import get_tool_parser

log = logging.getLogger("phaserl.agents.server")

ROLES = ("system", "developer", "user", "assistant", "tool")
IGNORED = ("frequency_penalty", "presence_penalty", "logit_bias", "response_format", "parallel_tool_calls",
           "top_logprobs", "service_tier", "user", "metadata", "store", "reasoning_effort")
_PATH = re.compile(r"^(?:/c/(?P<conv>[A-Za-z0-9_.-]{1,128}))?/v1/(?P<what>models|chat/completions)/?$")


class RequestError(Exception):
    def __init__(self, message: str, *, param: Optional[str] = None, code: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


class _Listener(ThreadingHTTPServer):
    # socketserver's default backlog is 5: a harness opening hundreds of conversations at once had its
    # connections reset (seen on the H200 with 512 conversations). One slot per conversation a rollout runs.
    request_queue_size = 4096
    daemon_threads = True


class ChatServer:
    def __init__(self, backend, tokenizer, *, parser: str = "hermes", model_name: str = "phaserl-policy",
                 host: str = "127.0.0.1", port: int = 0, default_max_tokens: int = 256,
                 max_context: Optional[int] = None, chat_template: Optional[str] = None,
                 sampling: Optional[tuple] = None, max_turns: Optional[int] = None,
                 max_turn_tokens: Optional[int] = None, context_reason: str = "max_tokens"):
        self.backend, self.tokenizer = backend, tokenizer
        # Episode limits (the trainer's agent.*): completions per conversation, sampled ids per completion, and
        # which limit `max_context` stands for ("max_tokens": agent.max_episode_tokens, "context": the model's).
        self.max_turns, self.max_turn_tokens, self.context_reason = max_turns, max_turn_tokens, context_reason
        self.sampling = sampling      # (temperature, top_p, top_k) that every request samples with, or None
        self.parse = get_tool_parser(parser)
        self.model_name, self.default_max_tokens, self.max_context = model_name, default_max_tokens, max_context
        self.chat_template = chat_template
        self.store = ConversationStore()
        self.metrics = {"requests": 0, "errors": 0, "prefix_mismatches": 0, "spliced_turns": 0, "refused_at_limit": 0}
        self._warned: set = set()
        self._lock = threading.Lock()
        self._http = _Listener((host, port), _handler_for(self))
        self._thread: Optional[threading.Thread] = None

    # ----- lifecycle --------------------------------------------------------------------------
    @property
    def root_url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def base_url(self) -> str:
        return self.root_url + "/v1"

    def conversation_url(self, conversation_id: str) -> str:
        """A base_url whose requests all belong to one conversation (what run_harness hands out)."""
        return f"{self.root_url}/c/{conversation_id}/v1"

    def start(self) -> "ChatServer":
        self._thread = threading.Thread(target=self._http.serve_forever, name="phaserl-chat-server", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # ----- requests ---------------------------------------------------------------------------
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "phaserl"}]}

    def chat(self, body: dict, conversation_id: Optional[str] = None) -> dict:
        """The whole request: validate, render, complete, record, answer (an OpenAI chat.completion)."""
        settings = self._settings(body)
        messages = [_normalize(m, i) for i, m in enumerate(body["messages"])]
        tools = body.get("tools") or None
        try:
            conv = (self.store.get(conversation_id) if conversation_id is not None
                    else self.store.find(messages) or self.store.get(uuid.uuid4().hex))
        except KeyError:
            raise RequestError(f"conversation {conversation_id} is closed (its episode was already collected, e.g. "
                               "after the harness timed out)", code="conversation_closed", status=410) from None
        with conv.lock:
            if self.max_turns is not None and len(conv.turns) >= self.max_turns:
                self._refuse(conv, "max_turns")
                raise RequestError(f"conversation {conv.id} already has {len(conv.turns)} completions, the most one "
                                   f"episode may have (agent.max_turns={self.max_turns}): the episode is over; stop "
                                   "calling and return its reward", code="max_turns_exceeded")
            prompt_ids, spliced = self._prompt_ids(conv, messages, tools)
            max_tokens = settings["max_tokens"]
            if self.max_turn_tokens is not None:
                max_tokens = min(max_tokens, self.max_turn_tokens)
            if self.max_context is not None:
                room = self.max_context - len(prompt_ids)
                if room < 1:
                    if conv.turns:  # a continuing conversation outgrew the episode budget: its episode ends here
                        self._refuse(conv, self.context_reason)
                    what = "agent.max_episode_tokens" if self.context_reason == "max_tokens" else "the model's context"
                    raise RequestError(f"the prompt has {len(prompt_ids)} tokens and the context holds "
                                       f"{self.max_context} ({what}); the episode is over: stop calling and return "
                                       "its reward", code="context_length_exceeded")
                max_tokens = min(max_tokens, room)
            request = CompletionRequest(tuple(prompt_ids), max_tokens, settings["temperature"], settings["top_p"],
                                        settings["top_k"], settings["stop_token_ids"], settings["seed"])
            completion = self.backend.complete(request)
            turn = Turn(list(prompt_ids), list(completion.token_ids), list(completion.logprobs),
                        completion.finish_reason, spliced)
            if not conv.add(turn):
                self._count("prefix_mismatches")
                log.warning("conversation %s: request %d's prompt does not continue the previous completion token "
                            "for token; recording it as a new piece (see docs/agents.md, the endpoint)",
                            conv.id, len(conv.turns))
            if spliced:
                self._count("spliced_turns")
            text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            message, finish = self._reply(text, completion.finish_reason, tools, body.get("tool_choice"))
            conv.messages, conv.reply = messages, _normalize(message, len(messages))
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": [self._logprob_entry(t, lp) for t, lp in
                                              zip(completion.token_ids, completion.logprobs)]}
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion.token_ids),
                 "total_tokens": len(prompt_ids) + len(completion.token_ids)}
        return {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice], "usage": usage,
                "phaserl": {"conversation_id": conv.id, "turn": len(conv.turns),
                            "turns_left": None if self.max_turns is None else self.max_turns - len(conv.turns)}}

    def _settings(self, body) -> dict:
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list of chat messages", param="messages")
        if body.get("stream"):
            raise RequestError("stream=true is not supported by phaserl's endpoint; call without streaming",
                               param="stream")
        if body.get("n", 1) != 1:
            raise RequestError(f"n={body.get('n')} is not supported: send one request per sample (each its own "
                               "conversation), so every sample is recorded as its own episode", param="n")
        for key in IGNORED:
            if body.get(key) not in (None, False, 0, [], {}) and key not in self._warned:
                self._warned.add(key)
                log.warning("chat completions: '%s' is ignored by phaserl's endpoint", key)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or self.default_max_tokens
        temperature, top_p = body.get("temperature", 1.0), body.get("top_p", 1.0)
        temperature = 1.0 if temperature is None else temperature
        top_p = 1.0 if top_p is None else top_p
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(f"max_tokens={max_tokens!r} must be a positive integer", param="max_tokens")
        if not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
            raise RequestError(f"temperature={temperature!r} must be in [0, 2]", param="temperature")
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise RequestError(f"top_p={top_p!r} must be in (0, 1]", param="top_p")
        seed = body.get("seed")
        if seed is not None and not isinstance(seed, int):
            raise RequestError(f"seed={seed!r} must be an integer", param="seed")
        temperature, top_p, top_k = self._sampling(body, float(temperature), float(top_p))
        return {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
                "stop_token_ids": self._stop_ids(body.get("stop"))}

    def _sampling(self, body: dict, temperature: float, top_p: float) -> tuple:
        """(temperature, top_p, top_k) of this request: the server's fixed ones when set (module docstring)."""
        if self.sampling is None:
            return temperature, top_p, 0
        for key, value in zip(("temperature", "top_p"), self.sampling):
            asked = body.get(key)
            if asked is not None and float(asked) != float(value) and f"sampling:{key}" not in self._warned:
                self._warned.add(f"sampling:{key}")
                log.warning("chat completions: %s=%s asked, but this run samples with rollout.%s=%s (training "
                            "assumes the rollout's log-probs); the request's value is ignored", key, asked, key, value)
        return float(self.sampling[0]), float(self.sampling[1]), int(self.sampling[2])

    def _stop_ids(self, stop) -> tuple:
        if stop is None:
            return ()
        ids = []
        for s in [stop] if isinstance(stop, str) else list(stop):
            encoded = self.tokenizer(s, add_special_tokens=False)["input_ids"]
            if len(encoded) != 1:
                raise RequestError(f"stop sequence {s!r} is {len(encoded)} tokens; phaserl stops only on single "
                                   "tokens (sampled ids must not be cut inside a token)", param="stop")
            ids.append(encoded[0])
        return tuple(ids)

    def _render(self, messages: list, tools, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt,
                **({"chat_template": self.chat_template} if self.chat_template else {}))
        except Exception as exc:  # a template that rejects the messages (unknown role, ...)
            raise RequestError(f"the chat template could not render these messages: {type(exc).__name__}: {exc}",
                               param="messages") from exc

    def _encode(self, text: str) -> list:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _prompt_ids(self, conv, messages: list, tools) -> tuple:
        """(prompt ids, spliced?) for this request; see the module docstring."""
        full_text = self._render(messages, tools, True)
        ids = self._encode(full_text)
        if not conv.turns or conv.extends(ids):
            return ids, False
        k = len(conv.messages)
        if conv.reply is None or len(messages) <= k + 1 or messages[:k] != conv.messages or messages[k] != conv.reply:
            return ids, False
        before = self._render(conv.messages, tools, True)
        head = self._render(messages[:k + 1], tools, False)
        sampled = self.tokenizer.decode(conv.turns[-1].token_ids, skip_special_tokens=False)
        if not (head.startswith(before) and full_text.startswith(head) and head[len(before):].startswith(sampled)):
            return ids, False
        after = head[len(before) + len(sampled):] + full_text[len(head):]
        return conv.full_ids() + self._encode(after), True

    def _reply(self, text: str, finish_reason: str, tools, tool_choice) -> tuple:
        message = {"role": "assistant", "content": text}
        if not tools or tool_choice == "none":
            return message, finish_reason
        parsed = self.parse(text)
        if not parsed.calls:
            return message, finish_reason
        message["content"] = parsed.content if not parsed.errors else text
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name,
                                               "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                                 for c in parsed.calls]
        return message, "tool_calls"

    def _logprob_entry(self, token_id: int, logprob: float) -> dict:
        token = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": float(logprob), "bytes": list(token.encode("utf-8")), "top_logprobs": []}

    def _refuse(self, conv, reason: str) -> None:
        """An episode limit refused a request of `conv`: its episode ends with that reason (counted)."""
        if conv.ended is None:
            conv.ended = reason
            self._count("refused_at_limit")

    def _count(self, key: str) -> None:
        with self._lock:
            self.metrics[key] += 1


def _normalize(message, index: int) -> dict:
    """The fields that matter to the template and to comparisons, in one canonical form (tool-call
    arguments as objects: templates json-encode them themselves)."""
    if not isinstance(message, dict):
        raise RequestError(f"messages[{index}] must be an object, got {type(message).__name__}", param="messages")
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(f"messages[{index}].role={role!r}; use one of {', '.join(ROLES)}", param="messages")
    out = {"role": "system" if role == "developer" else role, "content": _text_of(message.get("content"), index)}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = [_normalize_call(c, index) for c in message["tool_calls"]]
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None:
                out[key] = str(message[key])
    return out


def _text_of(content, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"messages[{index}].content has a {kind!r} part; only text parts are supported",
                                   param="messages")
            parts.append(part.get("text", ""))
        return "".join(parts)
    raise RequestError(f"messages[{index}].content must be text or a list of text parts", param="messages")


def _normalize_call(call, index: int) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f"messages[{index}].tool_calls: each call needs function.name", param="messages")
    args = function.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise RequestError(f"messages[{index}].tool_calls: arguments of {function['name']!r} are not JSON "
                               f"({exc.msg})", param="messages") from exc
    return {"id": str(call.get("id") or ""), "type": "function",
            "function": {"name": function["name"], "arguments": args}}


def _handler_for(server: ChatServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # requests are counted in server.metrics, not printed
            log.debug("%s " + fmt, self.address_string(), *args)

        def do_GET(self):
            match = _PATH.match(self.path.split("?")[0])
            if match and match["what"] == "models":
                return self._send(200, server.models())
            self._send(404, _error(f"no such endpoint: GET {self.path}", code="not_found"))

        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))  # always: the connection is reused
            match = _PATH.match(self.path.split("?")[0])
            if not match or match["what"] != "chat/completions":
                return self._send(404, _error(f"no such endpoint: POST {self.path}; use /v1/chat/completions",
                                              code="not_found"))
            server._count("requests")
            try:
                try:
                    body = json.loads(raw or b"null")
                except json.JSONDecodeError as exc:
                    raise RequestError(f"the request body is not JSON ({exc.msg})") from exc
                self._send(200, server.chat(body, match["conv"]))
            except RequestError as exc:
                server._count("errors")
                self._send(exc.status, _error(str(exc), param=exc.param, code=exc.code))
            except Exception as exc:  # a backend failure: the harness gets a 500 that says what broke
                server._count("errors")
                log.exception("chat completion failed")
                self._send(500, _error(f"{type(exc).__name__}: {exc}", kind="server_error"))

        def _send(self, status: int, payload: dict):
            data = json.dumps(payload).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def _error(message: str, *, param=None, code=None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
