"""The loop of one reward worker process: `python -m phaserl.rewards.worker FD`, started by pool.py.

Over the connection FD it receives (sys.path, the parent's pid, the functions as (worker_address, verl)),
loads every function and answers ("ready",) or ("failed", why). Then, per chunk of pickled calls
(slot, args, kwargs), it calls each function in this process's main thread (so math-verify's own
signal-based timeouts work here) and sends one message per call as it ends: ("ok", position, value) with
the value as `registry.reward_value` reads it, or ("raised", position, pickled exception or None, type name,
message, traceback). None, or the connection closing, ends the loop; so does the parent's death, which a
watcher thread notices within a second. Ctrl-C and the time limit are the parent's business.

This module imports no torch: a worker costs what its reward functions import.
"""
from __future__ import annotations

import importlib
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection


def main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # in case a Ctrl-C reaches it anyway: the trainer decides
    conn = Connection(fd)
    path, parent, functions = conn.recv()
    sys.path[:] = path
    _exit_with(parent)
    try:
        table = [(_load(address), verl) for address, verl in functions]
    except BaseException as exc:  # reported to the parent, which stops the pool with it
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready",))
    from phaserl.rewards.registry import reward_value

    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for position, payload in enumerate(chunk):
            slot, args, kwargs = pickle.loads(payload)
            fn, verl = table[slot]
            try:
                message = ("ok", position, reward_value(fn(*args, **kwargs), verl))
            except BaseException as exc:  # a SystemExit too: the parent names the function and the row
                message = ("raised", position, *_portable(exc))
            try:
                conn.send(message)
            except (EOFError, OSError):
                return


def _load(address: tuple):
    kind, where, name = address
    if kind == "file":
        from phaserl.userfiles import load_file

        module = load_file(where, f"reward function '{where}:{name}'")
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def _portable(exc: BaseException) -> tuple:
    """(pickled exception or None when it does not round-trip, type name, message, traceback text)."""
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
    except Exception:  # an exception with unpicklable state, or a class whose __init__ needs other arguments
        data = None
    return data, type(exc).__name__, str(exc), trace


def _exit_with(parent: int) -> None:
    """Exit when the parent dies (its pid stops being ours), even in the middle of a call."""
    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="phaserl-reward-parent", daemon=True).start()


if __name__ == "__main__":
    main(int(sys.argv[1]))
