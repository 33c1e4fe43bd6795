"""A small pool of daemon worker threads for environment calls, which may block or never return.

`concurrent.futures.ThreadPoolExecutor` joins its threads at interpreter exit, so one environment
call that hangs forever would hang the process after training. These workers are daemon threads:
a call that times out is abandoned (its thread left to finish or not), `replace()` starts a new
thread so the pool keeps its size, and nothing waits for the lost one.
Not here: deciding what a timeout means for the episode (episodes.py).
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable


class Workers:
    def __init__(self, size: int, name: str = "phaserl-env"):
        self.name, self._queue = name, queue.Queue()
        self._threads: list = []
        for _ in range(max(1, size)):
            self.replace()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def replace(self) -> None:
        """Start one more worker (in place of one stuck in a call that timed out)."""
        thread = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def shutdown(self) -> None:
        """Ask idle workers to stop; a worker stuck in a call is not waited for."""
        for _ in self._threads:
            self._queue.put(None)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who names the environment
                future.set_exception(exc)
