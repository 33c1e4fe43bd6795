"""A pool of worker processes for rule reward calls, so that scoring runs in parallel and beside other work.

`RewardPool(functions, workers=, timeout_s=)` starts its workers on the first `submit` and reuses them until
`close()`. `submit(calls)` pickles the calls (function slot, args, kwargs), cuts them into chunks and returns
a `PoolJob` at once; a dispatcher thread hands chunks to idle workers and files each call's `Outcome` at the
call's own index, so what a job gives back never depends on which worker ran what or when it finished.

A worker reports every call as it ends, so the parent knows when the call in progress started: one that
outlives `timeout_s` is ended by killing its worker, one whose worker dies (a crash in C code, os._exit, the
out-of-memory killer) is reported as crashed; either way the rest of its chunk goes to a fresh worker.

A worker is a new interpreter (`python -m phaserl.rewards.worker`, worker.py): nothing is forked from a
process that holds torch's threads or CUDA, and, unlike multiprocessing's spawn, the training script is
never re-run in it, so a script without an `if __name__ == "__main__":` guard is safe. It gets the parent's
sys.path and working directory and loads each function from where it is defined (`worker_address`: a module
and name, or a .py file loaded as `phaserl.userfiles` loads it). Workers are in their own session, so a
Ctrl-C or a SIGTERM sent to the job's process group reaches only the trainer, which stops after the step;
they exit when the pool is closed, when the parent exits, or within a second of its death.

Not here: building the calls and judging what they return (registry.py); the worker's loop (worker.py).
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Callable, NamedTuple, Optional

from phaserl.errors import RewardError

log = logging.getLogger(__name__)

CHUNK_CALLS = 8        # calls handed to a worker at once: few hand-offs, and a group of 8 still spreads over workers
START_GRACE_S = 60.0   # beyond timeout_s, how long a new worker may take to import the reward functions
STOP_GRACE_S = 2.0     # how long close() waits for a worker to exit before it kills it


class Outcome(NamedTuple):
    """How one call ended."""

    kind: str             # ok | raised | timeout | crashed | unavailable
    value: object = None  # ok: a float or registry.Unusable; raised: the exception
    detail: str = ""      # timeout / crashed: how the worker ended; unavailable: why no worker could run the call


class RemoteError(Exception):
    """Stands in for an exception a reward function raised in a worker that could not be sent back as it is."""

    def __init__(self, type_name: str, message: str):
        super().__init__(message)
        self.type_name = type_name


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process (the cause of the exception it raised)."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


def worker_address(fn: Callable) -> tuple[Optional[tuple], str]:
    """Where a worker loads `fn` from: ("module", name, attr) or ("file", path, attr); (None, why) when it
    cannot (a lambda, a closure, a function of the running script, a callable object)."""
    module_name, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(name, str):
        return None, f"a {type(fn).__name__} object is not a function defined at the top level of a module"
    if "<" in name or "." in name:
        return None, ("it is a lambda, a method, or defined inside another function; a worker loads a function "
                      "by name: define it at the top level of a .py file and name it 'path/to/file.py:function'")
    module = sys.modules.get(module_name)
    if module_name == "__main__" or module is None:
        return None, ("it is defined in the running script, which a worker does not run; move it to a .py file "
                      "and name it 'path/to/file.py:function'")
    if getattr(module, name, None) is not fn:
        return None, f"{module_name}.{name} is not this function (it was replaced or wrapped after import)"
    if module_name.startswith("phaserl_user_"):  # a file that phaserl.userfiles ran
        return ("file", module.__file__, name), ""
    return ("module", module_name, name), ""


class PoolJob:
    """The outcomes of one `submit`, in the order of its calls."""

    def __init__(self, n: int):
        self._outcomes: list[Optional[Outcome]] = [None] * n
        self._left = n
        self._finished = threading.Event()
        if n == 0:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def outcomes(self) -> list[Outcome]:
        """Wait for every call; one Outcome per call (the pool's timeouts bound the wait)."""
        self._finished.wait()
        return self._outcomes

    def _file(self, index: int, outcome: Outcome) -> None:
        if self._outcomes[index] is None:
            self._left -= 1
        self._outcomes[index] = outcome
        if self._left == 0:
            self._finished.set()


@dataclass
class _Chunk:
    job: PoolJob
    indices: list      # the job's call index of each payload
    payloads: list     # the pickled calls, (slot, args, kwargs) each


class _Worker:
    def __init__(self, process: subprocess.Popen, conn: Connection):
        self.process, self.conn = process, conn
        self.ready = False
        self.chunk: Optional[_Chunk] = None
        self.position = 0                 # the chunk's call in progress
        self.started = time.monotonic()   # when that call (or, before ready, the process) started


class RewardPool:
    """Worker processes that run reward calls; `functions[slot]` = (worker_address, verl convention)."""

    def __init__(self, functions: list[tuple], *, workers: int, timeout_s: float):
        if workers < 1:
            raise ValueError(f"RewardPool: workers={workers}; it needs at least 1")
        self.functions, self.size, self.timeout_s = list(functions), workers, float(timeout_s)
        self._lock = threading.Lock()
        self._queue: deque[_Chunk] = deque()
        self._workers: list[_Worker] = []
        self._thread: Optional[threading.Thread] = None
        self._wake_r, self._wake_w = os.pipe()
        self._closed = False
        self._broken = ""  # why no worker can run a call; set once, then every call is unavailable

    def submit(self, calls: list[tuple], describe: Callable[[int], str] = str) -> PoolJob:
        """Queue `calls` [(slot, args, kwargs)] and return at once. `describe(k)` names call k's row in the error
        raised here when its arguments cannot be pickled."""
        payloads = []
        for k, call in enumerate(calls):
            try:
                payloads.append(pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL))
            except Exception as exc:  # what pickle raises for an odd object varies
                raise RewardError(f"the arguments for {describe(k)} cannot be sent to a reward worker process "
                                  f"({type(exc).__name__}: {exc}); keep the row's fields plain data (str, numbers, "
                                  f"lists, dicts) or set reward.workers=0") from exc
        job = PoolJob(len(calls))
        size = max(1, min(CHUNK_CALLS, -(-len(calls) // self.size)))
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool.submit after close()")
            for s in range(0, len(calls), size):
                self._queue.append(_Chunk(job, list(range(s, min(s + size, len(calls)))), payloads[s:s + size]))
            if self._broken:
                self._fail_queued(self._broken)
            elif self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="phaserl-reward-pool", daemon=True)
                self._thread.start()
        os.write(self._wake_w, b"x")
        return job

    def close(self) -> None:
        """Stop the workers (each finishes nothing more); calls not yet done end as unavailable."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers, self._workers = self._workers, []
            for w in workers:
                self._requeue(w, w.position)
            self._fail_queued("the reward pool was closed")
        os.write(self._wake_w, b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)  # before the connections close under it
        for w in workers:
            try:
                w.conn.send(None)  # "stop"; a busy worker stops after its call, or is killed below
            except OSError:
                pass
        ends = time.monotonic() + STOP_GRACE_S
        for w in workers:
            try:
                w.process.wait(timeout=max(0.0, ends - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.process.kill()
                w.process.wait()
            w.conn.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---- the dispatcher thread ----------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed:
                        return
                    self._dispatch()
                    conns = [w.conn for w in self._workers]
                    deadlines = [self._deadline(w) for w in self._workers if w.chunk is not None or not w.ready]
                timeout = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
                try:
                    ready = wait(conns + [self._wake_r], timeout)
                except (OSError, ValueError):
                    if self._closed:  # close() ended the pool while this thread waited
                        return
                    raise
                with self._lock:
                    if self._closed:
                        return
                    if self._wake_r in ready:
                        os.read(self._wake_r, 4096)
                    for w in [w for w in self._workers if w.conn in ready]:
                        self._receive(w)
                    now = time.monotonic()
                    for w in [w for w in self._workers if w.chunk is not None or not w.ready]:
                        if now > self._deadline(w):
                            self._overdue(w)
        except Exception as exc:  # never leave a caller waiting on a job that no thread serves
            with self._lock:
                self._break(f"the reward pool's dispatcher failed ({type(exc).__name__}: {exc})")
            raise

    def _deadline(self, w: _Worker) -> float:
        return w.started + self.timeout_s + (0.0 if w.ready else START_GRACE_S)

    def _dispatch(self) -> None:
        """Start workers while there is work (up to the pool's size); give idle ready workers a chunk each."""
        while self._queue and len(self._workers) < self.size and not self._broken:
            self._start_worker()
        for w in self._workers:
            if self._queue and w.ready and w.chunk is None:
                chunk = self._queue.popleft()
                w.chunk, w.position, w.started = chunk, 0, time.monotonic()
                try:
                    w.conn.send(chunk.payloads)
                except OSError:  # the worker died while idle: its end of file comes next; the chunk waits for another
                    w.chunk = None
                    self._queue.appendleft(chunk)

    def _start_worker(self) -> None:
        parent_end, child_end = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if isinstance(p, str) and p))
        try:
            process = subprocess.Popen([sys.executable, "-m", "phaserl.rewards.worker", str(child_end.fileno())],
                                       pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL, env=env,
                                       start_new_session=True)
        except OSError as exc:
            parent_end.close()
            self._break(f"a reward worker process could not be started ({exc}); set reward.workers=0")
            return
        finally:
            child_end.close()
        conn = Connection(parent_end.detach())
        conn.send((list(sys.path), os.getpid(), self.functions))
        self._workers.append(_Worker(process, conn))

    def _receive(self, w: _Worker) -> None:
        try:
            while w.conn.poll():
                self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            how = _ended(w.process)
            if not w.ready:
                self._retire(w, None)
                self._break(f"a reward worker process ended while starting ({how}); its error is printed above")
            else:
                self._retire(w, Outcome("crashed", detail=how))

    def _handle(self, w: _Worker, message: tuple) -> None:
        kind = message[0]
        if kind == "ready":
            w.ready, w.started = True, time.monotonic()
        elif kind == "failed":  # a function could not be loaded in the worker
            self._retire(w, None)
            self._break(f"a reward worker process could not load the reward functions: {message[1]}")
        else:
            position, chunk = message[1], w.chunk
            outcome = Outcome("ok", message[2]) if kind == "ok" else Outcome("raised", _rebuild(*message[2:]))
            chunk.job._file(chunk.indices[position], outcome)
            w.position, w.started = position + 1, time.monotonic()  # the next call starts now
            if w.position == len(chunk.indices):
                w.chunk = None

    def _overdue(self, w: _Worker) -> None:
        if not w.ready:
            self._retire(w, None)
            self._break(f"a reward worker process did not start within {self.timeout_s + START_GRACE_S:g} s "
                        "(importing the reward functions' modules?)")
        else:
            self._retire(w, Outcome("timeout", detail=f"worker stopped after {self.timeout_s:g} s"))

    def _retire(self, w: _Worker, outcome: Optional[Outcome]) -> None:
        """Kill `w` and forget it; its call in progress gets `outcome`, the rest of its chunk is queued again."""
        if w.process.poll() is None:
            w.process.kill()
            w.process.wait()
        w.conn.close()
        self._workers.remove(w)
        if w.chunk is not None and outcome is not None:
            w.chunk.job._file(w.chunk.indices[w.position], outcome)
            self._requeue(w, w.position + 1)
        elif w.chunk is not None:
            self._requeue(w, w.position)

    def _requeue(self, w: _Worker, start: int) -> None:
        if w.chunk is not None and start < len(w.chunk.indices):
            self._queue.appendleft(_Chunk(w.chunk.job, w.chunk.indices[start:], w.chunk.payloads[start:]))
        w.chunk = None

    def _break(self, why: str) -> None:
        """No worker can run calls any more: every call waiting or running ends as unavailable with `why`."""
        if not self._broken:
            log.error(f"[rewards] {why}")
        self._broken = self._broken or why
        for w in list(self._workers):
            self._retire(w, None)
        self._fail_queued(self._broken)

    def _fail_queued(self, why: str) -> None:
        while self._queue:
            chunk = self._queue.popleft()
            for index in chunk.indices:
                chunk.job._file(index, Outcome("unavailable", detail=why))


def _rebuild(data: Optional[bytes], type_name: str, message: str, trace: str) -> BaseException:
    """The exception a worker's call raised, with the worker's traceback as its cause."""
    exc = None
    if data is not None:
        try:
            exc = pickle.loads(data)
        except Exception:  # an exception class that does not unpickle here
            exc = None
    if not isinstance(exc, BaseException):
        exc = RemoteError(type_name, message)
    exc.__cause__ = RemoteTraceback(trace)
    return exc


def _ended(process: subprocess.Popen) -> str:
    """How a worker process ended: 'killed by SIGKILL', 'exit code 1'."""
    try:
        code = process.wait(timeout=5)
    except subprocess.TimeoutExpired:  # its connection broke but it lives on: end it
        process.kill()
        code = process.wait()
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
