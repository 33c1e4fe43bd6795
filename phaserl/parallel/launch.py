"""Running under torchrun: the process group, and failures that name their rank and phase.

`init_distributed()` reads what torchrun exports (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)
and starts the default process group: gloo on the CPU, NCCL on GPUs (each rank on GPU LOCAL_RANK), with a
collective timeout. Without WORLD_SIZE (no launcher) it does nothing: one process is the default.

A failure on one rank must not become a silent hang or an anonymous "connection closed" on the others:
- `rank_errors()` (a context manager, or a decorator) catches an exception, logs it as
  "rank R of W failed in phase P (step S): ...", posts that line to the process group's key-value store,
  and re-raises it as `RankFailure`. A rank whose collective then breaks or times out reads the store and
  raises with the failing rank's message first, so rank 0's console names the rank that failed.
- `set_phase(name, step)` records what this rank is doing (the trainer sets it per phase; `in_phase` for a
  block inside another phase). A collective timeout caught by `rank_errors()` says which phase was running
  and for how long; on NCCL, whose watchdog aborts the process instead of raising, a watchdog thread logs
  the same message once a phase outlives the collective timeout.
- `peer_failure(action, exc, ...)`: the one-line error of a transfer between named ranks (weight sync,
  sample channel) whose peer timed out or vanished.
Not here: FSDP (fsdp.py), shared-path checks (shared_storage.py), the launcher and peer watch (watch.py).
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .memory import mark_memory
from .watch import start_watch, stop_watch

log = logging.getLogger("phaserl")

DEFAULT_TIMEOUT_S = 1800.0
_STORE_PREFIX = "phaserl/rank_failure/"
_PEER_WAIT_S = 3.0            # how long a rank whose collective broke waits for the failing rank's line


class RankFailure(RuntimeError):
    """An exception on some rank, re-raised with the rank, the phase and the step named."""


@dataclass
class _Phase:
    name: str = "startup"
    step: Optional[int] = None
    since: float = field(default_factory=time.monotonic)

    def describe(self) -> str:
        return f"phase '{self.name}'" + (f" (step {self.step})" if self.step is not None else "")


_phase = _Phase()
_timeout_s: Optional[float] = None
_watchdog: Optional["_PhaseWatchdog"] = None


def set_phase(name: str, step: Optional[int] = None) -> None:
    """Record the phase this rank is in; error and timeout messages name it."""
    global _phase
    _phase = _Phase(name, step)
    mark_memory(name, step)


def collective_timeout_s() -> float:
    """The collective timeout the process group was started with (init_distributed), else the default."""
    return _timeout_s if _timeout_s is not None else DEFAULT_TIMEOUT_S


def current_phase() -> str:
    """e.g. "phase 'update' (step 3)"."""
    return _phase.describe()


@contextmanager
def in_phase(name: str, step: Optional[int] = None):
    """set_phase(name, step) for the block (step None: the interrupted phase's step), then back to the phase it
    interrupted (its start time kept)."""
    global _phase
    outer = _phase
    set_phase(name, outer.step if step is None else step)
    try:
        yield
    finally:
        _phase = outer


_TIMEOUT_HINT = ("Another rank is stuck, dead or in a different phase; the first rank to fail is named in its "
                 "own log (and in torchrun's summary). If this phase is legitimately slower than the timeout on "
                 "some ranks, raise the timeout given to init_distributed")


def _limit() -> str:
    return f"{_timeout_s:.0f} s" if _timeout_s is not None else "the configured timeout"


def phase_timeout_message(rank: int, world: int) -> str:
    """What a collective timeout means, naming the phase this rank was in and for how long."""
    ran = time.monotonic() - _phase.since
    return (f"rank {rank} of {world}: a collective timed out ({_limit()}) in {_phase.describe()}, running for "
            f"{ran:.0f} s. {_TIMEOUT_HINT}")


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = "auto") -> tuple[int, int]:
    """Start the default process group from torchrun's environment.  Returns (rank, world_size).

    backend: "auto" (NCCL when CUDA is available, else gloo), "nccl" or "gloo". Without WORLD_SIZE in the
    environment this returns (0, 1) and starts nothing. Calling it again returns the running group's values.
    """
    global _timeout_s, _watchdog
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(f"WORLD_SIZE is set but {', '.join(missing)} is not: start phaserl with torchrun "
                          "(torchrun --nproc-per-node N -m phaserl train cfg.yaml), which sets all of them")
    if backend not in ("auto", "nccl", "gloo"):
        raise ConfigError(f"backend={backend!r}: expected auto, nccl or gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl" and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count():
            # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): e.g. a trainer and a rollout rank sharing
            # one (rollout.ranks); gloo stages CUDA tensors through host memory
            log.warning(f"[rank {os.environ['RANK']}] {os.environ['LOCAL_WORLD_SIZE']} ranks on this host share "
                        f"{torch.cuda.device_count()} GPU(s): torch.distributed runs over gloo, not NCCL")
            backend = "gloo"
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("backend=nccl needs CUDA, but no GPU is visible; use backend=gloo on the CPU")
    kwargs, spec = {}, backend
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
        spec = "cpu:gloo,cuda:nccl"  # small CPU reductions (counts, metrics) go through gloo
    dist.init_process_group(spec, timeout=timedelta(seconds=timeout_s), **kwargs)
    _timeout_s = float(timeout_s)
    if backend == "nccl":
        _watchdog = _PhaseWatchdog(timeout_s)
        _watchdog.start()
    rank, world = dist.get_rank(), dist.get_world_size()
    start_watch(rank, world)  # no orphans: stop when the launcher or a peer on this host is gone (watch.py)
    log.info(f"[rank {rank}] torch.distributed: {backend}, world size {world}, collective timeout {timeout_s:.0f} s")
    return rank, world


def destroy() -> None:
    """Tear down the process group (and the watchdog); a no-op when none is running."""
    global _watchdog
    stop_watch()
    from .rank_split import end_rank_split

    end_rank_split()
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    fsdp = sys.modules.get(f"{__package__}.fsdp")
    if fsdp is not None:  # meshes hold the destroyed groups
        fsdp._MESHES.clear()


@contextmanager
def rank_errors():
    """Re-raise any exception in the block as RankFailure naming this rank, its phase and the failed peers."""
    try:
        yield
    except Exception as exc:
        if not (dist.is_available() and dist.is_initialized()) or isinstance(exc, RankFailure):
            raise
        rank, world = dist.get_rank(), dist.get_world_size()
        own = (f"rank {rank} of {world} ({socket.gethostname()}, pid {os.getpid()}) failed in "
               f"{_phase.describe()}: {type(exc).__name__}: {exc}")
        _post(rank, own)
        # A broken connection may race the dead rank's post; by the time a collective times out it is there.
        waits = _looks_collective(exc) and not _looks_like_timeout(exc)
        peers = _peer_failures(rank, world, wait_s=_PEER_WAIT_S if waits else 0.0)
        if peers:
            then = f"then rank {rank} stopped in {_phase.describe()}: {type(exc).__name__}: {exc}"
            message = " | ".join(peers + [then])
        elif _looks_like_timeout(exc):
            message = phase_timeout_message(rank, world) + f". Original error: {type(exc).__name__}: {exc}"
        else:
            message = own
        log.error(message)
        raise RankFailure(message) from exc


def peer_failure(action: str, exc: BaseException, *, timeout_s: float, role: str = "") -> RankFailure:
    """One line for a message or collective with named peers that broke, logged and returned to raise.

    `action` says what this rank was doing and with which ranks ("receiving weights from trainer rank 0").
    The line names this rank, its `role` and phase, and the cause: the peers gave no answer within
    `timeout_s` (stuck or gone), or their connection closed (their process is gone); a failure line a peer
    posted through rank_errors() comes first. Never more than one line: backend messages are cut to their
    first line.
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if text.startswith("[") and "] " in text:  # gloo's "[.../pair.cc:553] Connection closed by peer ..."
        text = text.split("] ", 1)[1]
    text = text.split(". ", 1)[0]          # gloo goes on with "This is typically caused by ..."
    if _looks_like_timeout(exc):
        cause = f"no answer within {timeout_s:g} s: the peer is stuck or gone"
    elif "closed" in text.lower() or "reset by peer" in text.lower() or "broken pipe" in text.lower():
        cause = f"the connection closed: the peer's process is gone ({text})"
    else:
        cause = f"{type(exc).__name__}: {text}"
    who = f" ({role})" if role else ""
    message = f"rank {rank} of {world}{who} in {_phase.describe()}: {action}: {cause}"
    posted = _peer_failures(rank, world, wait_s=0.0) if dist.is_initialized() else []
    message = " | ".join(line.replace("\n", " ") for line in posted + [message])
    log.error(message)
    return RankFailure(message)


def _looks_like_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _looks_collective(exc: BaseException) -> bool:
    dist_error = getattr(dist, "DistError", ())
    text = str(exc).lower()
    return (isinstance(exc, dist_error) or _looks_like_timeout(exc)
            or any(word in text for word in ("gloo", "nccl", "connection", "peer", "socket")))


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # no store to share failures through
        return None


def _post(rank: int, message: str) -> None:
    store = _store()
    if store is None:
        return
    try:
        store.set(f"{_STORE_PREFIX}{rank}", message)
    except RuntimeError as err:  # the store's host is gone: the log line is all we can leave
        log.error(f"[rank {rank}] could not post its failure to the other ranks: {err}")


def _peer_failures(rank: int, world: int, *, wait_s: float) -> list:
    """Failure lines other ranks posted, waiting up to `wait_s` for the first one."""
    store = _store()
    if store is None:
        return []
    keys = [f"{_STORE_PREFIX}{r}" for r in range(world) if r != rank]
    deadline = time.monotonic() + wait_s
    while True:
        try:
            found = [k for k in keys if store.check([k])]
            if found or time.monotonic() >= deadline:
                return [store.get(k).decode() for k in found]
        except RuntimeError:  # the store went away with its host rank
            return []
        time.sleep(0.1)


class _PhaseWatchdog(threading.Thread):
    """Logs the phase once it outlives the collective timeout (NCCL aborts the process without a Python error)."""

    def __init__(self, timeout_s: float):
        super().__init__(name="phaserl-phase-watchdog", daemon=True)
        self.timeout_s = timeout_s
        self._stop_event = threading.Event()
        self._reported: Optional[_Phase] = None

    def run(self) -> None:
        while not self._stop_event.wait(min(30.0, self.timeout_s / 10)):
            phase = _phase
            if phase is not self._reported and time.monotonic() - phase.since > self.timeout_s:
                self._reported = phase
                log.error(f"rank {dist.get_rank()} of {dist.get_world_size()}: {phase.describe()} has run "
                          f"{time.monotonic() - phase.since:.0f} s, longer than the collective timeout ({_limit()}); "
                          f"a collective in it has timed out or is about to (NCCL then ends the process). "
                          f"{_TIMEOUT_HINT}")

    def stop(self) -> None:
        self._stop_event.set()
