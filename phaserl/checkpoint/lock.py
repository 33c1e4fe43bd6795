"""One run per checkpoint path: `{checkpoint_path}/.lock` names the run that holds it (host, pid, start time).

Taken with O_CREAT|O_EXCL (one atomic create, also on NFS v3+), so of two runs started together exactly one
gets it; the other stops with a message naming the holder. A lock whose process is gone (same host, the
pid not running, or running but started at another time: a reused pid) is stale: it is taken over with a
warning. A lock of another host cannot be checked from here: the message says how to remove it by hand.
Rank 0 takes it for the whole run (the Checkpointer); released when the run ends. Not here: what else
lives in checkpoint_path (store.py).
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import time
from typing import Optional

from ..errors import CheckpointError

log = logging.getLogger("phaserl")

LOCK_FILE = ".lock"


def _proc_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (Linux /proc), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process: it exists
        pass
    started = _proc_start(pid)
    return holder.get("proc_start") is None or started is None or started == holder["proc_start"]


def describe(holder: dict) -> str:
    return (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"
            + (f" ({holder['command']})" if holder.get("command") else ""))


class RunLock:
    """The lock file of one checkpoint path; `acquire()` or a CheckpointError, `release()` when done."""

    def __init__(self, root: str):
        self.root = root
        self.path = os.path.join(root, LOCK_FILE)
        self.held = False

    def _mine(self) -> dict:
        import sys

        return {"host": socket.gethostname(), "pid": os.getpid(), "proc_start": _proc_start(os.getpid()),
                "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "command": " ".join(sys.argv)[:300]}

    def acquire(self) -> None:
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise CheckpointError(f"trainer.checkpoint_path={self.root!r} is a file, not a directory; point it at "
                                  "a directory (it is created if missing)")
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"trainer.checkpoint_path={self.root!r} cannot be created ({exc.strerror}); "
                                  "choose a writable directory") from None
        for _ in range(3):
            if self._create():
                return
            holder = self._read_holder()
            if holder is None:
                continue                      # it vanished, or is being written: try again
            if holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid():
                self._take_over()             # this very process (an earlier fit() that did not release)
                return
            if holder.get("host") == socket.gethostname() and not _alive(holder):
                log.warning(f"checkpoint: taking over the stale lock {self.path} of a run that is gone "
                            f"({describe(holder)})")
                self._take_over()
                time.sleep(0.1)       # two runs taking over the same stale lock: the last replace wins
                now = self._read_holder() or {}
                if now.get("pid") == os.getpid() and now.get("host") == socket.gethostname():
                    return
                self.held = False
                continue
            raise CheckpointError(
                f"trainer.checkpoint_path={self.root!r} is in use by another run: {describe(holder)}. Two runs on "
                "one path would resume each other's checkpoints and mix their metrics. Wait for that run to "
                "finish, stop it, or use another trainer.checkpoint_path. If that run is gone (e.g. its host "
                f"crashed), delete {self.path}")
        raise CheckpointError(f"could not take the lock {self.path}: another run keeps taking and releasing it")

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as exc:
            raise CheckpointError(f"trainer.checkpoint_path={self.root!r} is not writable ({exc.strerror}); choose "
                                  "a directory this user can write") from None
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(self._mine(), f)
            f.flush()
            os.fsync(f.fileno())
        self.held = True
        return True

    def _read_holder(self) -> Optional[dict]:
        for _ in range(20):   # a lock created this instant may not hold its JSON yet
            try:
                with open(self.path, encoding="utf-8") as f:
                    holder = json.load(f)
                if isinstance(holder, dict):
                    return holder
            except FileNotFoundError:
                return None
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        return {"host": "?", "pid": None, "started": "?"}   # unreadable: treated as held by an unknown run

    def _take_over(self) -> None:
        tmp = f"{self.path}.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self._mine(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self.held = True

    def live_holder(self) -> Optional[dict]:
        """The holder of the lock when it is another run that is (or may be) alive; None otherwise. Takes nothing."""
        if not os.path.isfile(self.path):
            return None
        holder = self._read_holder()
        if holder is None or holder.get("host") == socket.gethostname() and (
                holder.get("pid") == os.getpid() or not _alive(holder)):
            return None
        return holder

    def release(self) -> None:
        """Remove the lock if it still names this process."""
        if not self.held:
            return
        self.held = False
        holder = self._read_holder()
        if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
