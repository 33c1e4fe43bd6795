"""No orphaned ranks: a rank stops at once when its launcher dies or a rank on its host vanishes.

torchrun starts each worker in a session of its own, so killing the launcher (even its whole process
group) leaves the ranks running: they would go on training and writing checkpoints for nobody. A
daemon thread (`start_watch`, called by `init_distributed`) checks once a second that
- the parent process is still the one that started this rank (a dead parent reparents us), and
- every rank on this host that registered itself is still alive.
Ranks register by writing `{rank}.pid` into a directory keyed by the launcher's pid and the rendezvous
port (under the system's temp directory) and unregister in `stop_watch` (from `destroy()`, and at interpreter
exit), so a rank that finished cleanly is never mistaken for a dead one. When either check fails, the rank logs one
line and exits with code 1 through `os._exit`, at once: a checkpoint being written stays an unpublished
`.tmp_step_*` directory (never resumed from). Ranks on other hosts are covered by the collectives
themselves: gloo raises when a peer's connection closes, NCCL after the collective timeout
(launch.py names the phase). Not here: the process group, failures that raise (launch.py).
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import sys
import tempfile
import threading
from typing import Optional

log = logging.getLogger("phaserl")

EXIT_CODE = 1
_watch: Optional["_Watch"] = None


def _registry_dir(parent: int) -> str:
    # One directory per launch: the launcher's pid, the port, and torchrun's run id and restart count.
    key = "-".join(os.environ.get(k, "0") for k in ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"))
    return os.path.join(tempfile.gettempdir(), f"phaserl-ranks-{parent}-{key}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed, not yet reaped by a launcher that is itself gone) is not alive
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class _Watch(threading.Thread):
    def __init__(self, rank: int, world: int, interval_s: float):
        super().__init__(name="phaserl-launcher-watch", daemon=True)
        self.rank, self.world, self.interval_s = rank, world, interval_s
        self.parent = os.getppid()
        self.directory = _registry_dir(self.parent)
        os.makedirs(self.directory, exist_ok=True)
        self.own_file = os.path.join(self.directory, f"{rank}.pid")
        with open(self.own_file, "w", encoding="utf-8") as f:
            f.write(str(os.getpid()))
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            reason = self._problem()
            if reason is not None and not self._stop_event.is_set():
                line = (f"rank {self.rank} of {self.world} (pid {os.getpid()}): {reason}; stopping this rank now, "
                        "without publishing a checkpoint (the same command resumes from the last complete one)")
                log.error(line)
                print(line, file=sys.stderr, flush=True)
                self.stop()             # its registry entry: the peers are stopping too, and the directory goes
                os._exit(EXIT_CODE)

    def _problem(self) -> Optional[str]:
        if os.getppid() != self.parent:
            return f"its launcher (pid {self.parent}) is gone"
        try:
            names = os.listdir(self.directory)
        except OSError:
            return None
        for name in names:
            if not name.endswith(".pid") or name == f"{self.rank}.pid":
                continue
            path = os.path.join(self.directory, name)
            try:
                with open(path, encoding="utf-8") as f:
                    pid = int(f.read().strip())
            except (OSError, ValueError):
                continue
            if not _alive(pid) and os.path.exists(path):   # still registered: it did not finish cleanly
                return f"rank {name[:-4]} (pid {pid}) on this host is gone"
        return None

    def stop(self) -> None:
        self._stop_event.set()
        try:
            os.unlink(self.own_file)
            os.rmdir(self.directory)      # the last rank out removes the directory
        except OSError:
            pass


def start_watch(rank: int, world: int, interval_s: float = 1.0) -> None:
    """Watch the launcher and this host's peers until stop_watch(); a no-op when already watching."""
    global _watch
    if _watch is None:
        _watch = _Watch(rank, world, interval_s)
        _watch.start()
        # A script that ends without destroy() finishes cleanly, not dies: unregister at interpreter exit, and
        # at the end of a multiprocessing child (fork children leave through os._exit, past atexit).
        atexit.register(stop_watch)
        multiprocessing.util.Finalize(None, stop_watch, exitpriority=100)


def stop_watch() -> None:
    """This rank is done (cleanly or not): unregister, so that peers do not take its exit for a death."""
    global _watch
    if _watch is not None:
        _watch.stop()
        _watch = None
