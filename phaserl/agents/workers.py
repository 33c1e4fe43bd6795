"""A pool of daemon worker threads for environment calls, which may block or never return.

`concurrent.futures.ThreadPoolExecutor` joins its threads at interpreter exit, so one environment
call that hangs forever would hang the process after training. These workers are daemon threads:
a call that times out is abandoned (`abandon(future)`: its thread exits when the call returns, if it
ever does, and no longer counts against the pool's size), and nothing waits for the lost one.
Threads start lazily, when a call finds no idle worker and the pool is below `size`, and stay for
the pool's life: a pool kept across rollouts (the trainer's AgentSettings, a benchmark) starts its
threads once, not at every rollout (256 thread starts cost 0.1-0.4 s on a busy host). When the run
ends (`RLTrainer.fit` returns or raises) `stop_idle()` lets the idle ones exit; the pool stays usable
and starts threads again if another `fit()` submits.
Not here: deciding what a timeout means for the episode (episodes.py).
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable


class Workers:
    def __init__(self, size: int, name: str = "phaserl-env"):
        self.size, self.name = max(1, size), name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)   # one permit per worker waiting for a job that nobody has claimed
        self._backlog = 0                     # jobs queued with no worker claimed for them (pool at its size)
        self._lock = threading.Lock()
        self._live = 0                        # started and not abandoned: what counts against `size`
        self._started = 0
        self._abandoned: set = set()          # futures whose thread must exit once the call returns
        self._closed = False

    @property
    def threads(self) -> int:
        """Workers started and not abandoned."""
        return self._live

    def submit(self, fn: Callable, *args) -> Future:
        if self._closed:
            raise RuntimeError(f"Workers {self.name}: submit() after shutdown()")
        future: Future = Future()
        self._queue.put((future, fn, args))
        if not self._idle.acquire(blocking=False):
            with self._lock:
                if self._live < self.size:
                    self._start_locked()
                else:
                    self._backlog += 1  # the next worker to finish takes it (and does not count itself idle)
        return future

    def abandon(self, future: Future) -> None:
        """A call that timed out: cancel it if it has not started; else its thread stops counting against the
        pool's size (a new one starts when needed) and exits when the call returns."""
        if future.cancel():
            return
        with self._lock:
            if not future.done() and future not in self._abandoned:
                self._abandoned.add(future)
                self._live -= 1
                if self._backlog:  # a queued job was waiting for a worker: it gets the freed place now
                    self._backlog -= 1
                    self._start_locked()

    def _start_locked(self) -> None:
        self._live += 1
        self._started += 1
        threading.Thread(target=self._work, name=f"{self.name}-{self._started}", daemon=True).start()

    def stop_idle(self) -> int:
        """Let every idle worker exit (the end of a run); the pool stays usable and starts threads again on
        demand. Busy workers finish their call and stay. Call it while nothing is being submitted (a
        concurrent submit could be served by a worker counted as stopped). Returns how many were told to stop."""
        with self._lock:
            stopped = 0
            while self._idle.acquire(blocking=False):  # an idle worker's permit: it is blocked in queue.get()
                stopped += 1
            self._live -= stopped
            for _ in range(stopped):
                self._queue.put(None)
            return stopped

    def shutdown(self) -> None:
        """Ask the workers to stop once idle; a worker stuck in a call is not waited for."""
        with self._lock:
            self._closed = True
            for _ in range(self._live):
                self._queue.put(None)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller, who names the environment
                    future.set_exception(exc)
            with self._lock:
                if future in self._abandoned:
                    self._abandoned.discard(future)
                    return
                if self._backlog:  # a queued job nobody claimed: this worker's next get() is it
                    self._backlog -= 1
                    continue
            self._idle.release()
