"""New weights from the trainer to the rollout ranks, in buckets, swapped in between two decode steps.

Trainer side: after each optimizer step every trainer rank calls `sender.send(version)`. The parameters that
train (all of them; with LoRA the adapters only, since the frozen base never changes) are gathered one at a
time, in model order, to full tensors (an FSDP2 parameter's `full_tensor()`, an all-gather over the trainer
ranks; plain parameters as they are), and trainer rank 0 packs them into buckets and broadcasts each to the
rollout ranks. A bucket is one flat byte buffer of one dtype, up to `bucket_bytes` (a parameter larger than
that travels alone); while one bucket is on the wire the next is filled. A header (version, bucket count)
goes first, over gloo.

Rollout side: `receiver.poll()` says, without blocking, whether a header has arrived (the rollout loop asks
between two decode steps); `receiver.receive()` then takes every bucket and copies it into the rollout
model's own parameters in place, so the engine, which reads those tensors, decodes its next step with the
new weights. The engine's derived copies ([q; k; v], [gate; up], LoRA-merged projections) are refilled by
the caller after receive(). `receive()` also blocks for the next version when the loop must wait (its
staleness bound); it returns None once the trainer has closed the sync (`sender.close()`).

Construction is a collective of trainer rank 0 and the rollout ranks: the trainer lists what it will send
(names, shapes), each rollout rank finds those parameters in its model and reports their dtype, and that is
the dtype they travel in (the trainer casts once, e.g. float32 master weights to the rollout's bfloat16). A
missing parameter, another shape or rollout ranks that disagree is a ConfigError on every one of these ranks
before any weight moves.

Every transfer waits at most `groups.timeout_s`: a rollout rank that does not take a bucket, a trainer that
sends no version within that time after the previous one, or a peer whose process is gone raises a one-line
RankFailure naming this rank, the peers, the phase and the cause (launch.peer_failure), never a hang.
Not here: when to send or take weights (the trainer and the rollout loop, by version and staleness), which
ranks do what (rank_split.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from .launch import in_phase, peer_failure
from .rank_split import RankGroups

DEFAULT_BUCKET_BYTES = 256 * 2**20
_HEADER = 3          # [version, buckets, total bytes]; version -1 = the sync is closed
_CLOSED = -1


@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple
    offset: int      # elements into the bucket
    numel: int


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    numel: int
    slots: tuple

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_buckets(entries: list, bucket_bytes: int) -> list[Bucket]:
    """Buckets for `entries` [(name, shape, dtype)] in their order: a bucket closes when the next entry has
    another dtype or would pass `bucket_bytes` (an entry larger than that is a bucket of its own)."""
    buckets, slots, numel, dtype = [], [], 0, None

    def close():
        if slots:
            buckets.append(Bucket(dtype, numel, tuple(slots)))

    for name, shape, entry_dtype in entries:
        n = 1
        for size in shape:
            n *= size
        if slots and (entry_dtype != dtype or (numel + n) * entry_dtype.itemsize > bucket_bytes):
            close()
            slots, numel = [], 0
        dtype = entry_dtype
        slots.append(Slot(name, tuple(shape), numel, n))
        numel += n
    close()
    return buckets


def _selected(model: nn.Module, trainable_only: bool) -> list:
    """(name, parameter) that travel, in model order: the trainable ones, or all."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad or not trainable_only]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_model(model: nn.Module, wanted: list) -> tuple[list, list]:
    """This rank's dtypes for the trainer's (name, shape) list, and what does not match."""
    own = dict(model.named_parameters())
    problems, dtypes = [], []
    for name, shape in wanted:
        p = own.get(name)
        if p is None:
            problems.append(f"no parameter {name!r}")
        elif tuple(p.shape) != tuple(shape):
            problems.append(f"{name!r} has shape {list(p.shape)}, the trainer's {list(shape)}")
        dtypes.append(None if p is None else _dtype_name(p.dtype))
    return dtypes, problems


def _handshake(groups: RankGroups, offer: Optional[tuple], model: Optional[nn.Module]) -> list[Bucket]:
    """Trainer rank 0 passes `offer` ([(name, shape)], bucket bytes), rollout ranks their `model`; returns the
    buckets on every member, or raises the same ConfigError on every member."""
    box = [offer]
    try:
        dist.broadcast_object_list(box, src=groups.sender_rank, group=groups.control)
    except RuntimeError as exc:
        raise peer_failure(f"agreeing on the weights to sync with {_peers(groups.sync_ranks)}", exc,
                           timeout_s=groups.timeout_s, role=groups.role) from exc
    wanted, bucket_bytes = box[0]
    report = (groups.rank, None, []) if model is None else (groups.rank, *_check_model(model, wanted))
    reports = [None] * len(groups.sync_ranks)
    try:
        dist.all_gather_object(reports, report, group=groups.control)
    except RuntimeError as exc:
        raise peer_failure(f"agreeing on the weights to sync with {_peers(groups.sync_ranks)}", exc,
                           timeout_s=groups.timeout_s, role=groups.role) from exc
    problems = [f"rank {rank}: {p}" for rank, _, found in reports for p in found]
    dtypes = [d for _, d, _ in reports if d is not None]
    if not problems and any(d != dtypes[0] for d in dtypes):
        first = next(i for i, d in enumerate(dtypes[1:], 1) if d != dtypes[0])
        name = next(i for i, (a, b) in enumerate(zip(dtypes[0], dtypes[first])) if a != b)
        problems.append(f"the rollout ranks hold {wanted[name][0]!r} in different dtypes "
                        f"({dtypes[0][name]} and {dtypes[first][name]})")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ConfigError("weight sync: the rollout model differs from the trainer's: " + "; ".join(problems[:3])
                          + more + ". Build the rollout ranks' model from the same model.path and LoRA settings "
                          "as the actor")
    entries = [(name, tuple(shape), getattr(torch, d)) for (name, shape), d in zip(wanted, dtypes[0])]
    return plan_buckets(entries, bucket_bytes)


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole parameter: an FSDP2 DTensor all-gathered over the trainer ranks, a plain tensor as it is."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _peers(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


class WeightSender:
    """The trainer side; every trainer rank makes one (trainer rank 0 also takes part in the handshake)."""

    def __init__(self, model: nn.Module, groups: RankGroups, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 trainable_only: bool = True):
        if groups.trainer is None:
            raise ValueError(f"rank {groups.rank} is a rollout rank: it makes a WeightReceiver, not a sender")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes = {bucket_bytes}: expected >= 1")
        self.model, self.groups, self.bucket_bytes = model, groups, bucket_bytes
        self.params = _selected(model, trainable_only)
        if not self.params:
            raise ConfigError("weight sync: the actor has no trainable parameter to send")
        self.is_root = groups.rank == groups.sender_rank
        self.buckets: list[Bucket] = []
        self.last_version: Optional[int] = None
        self.last_seconds = 0.0
        if self.is_root:
            wanted = [(name, tuple(p.shape)) for name, p in self.params]
            self.buckets = _handshake(groups, (wanted, bucket_bytes), None)
            self._device = self.params[0][1].device
            largest = max(b.nbytes for b in self.buckets)
            self._buffers = [torch.empty(largest, dtype=torch.uint8, device=self._device) for _ in range(2)]

    @property
    def nbytes(self) -> int:
        """Bytes one version puts on the wire (known on trainer rank 0; 0 on the other trainer ranks)."""
        return sum(b.nbytes for b in self.buckets)

    def send(self, version: int) -> None:
        """Send the model's current weights as `version` (larger than the last one). Every trainer rank calls it
        (the FSDP gathers are collectives over them); it returns on trainer rank 0 once every rollout rank has
        taken every bucket."""
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(f"weight version {version} after {self.last_version}: versions must increase")
        start = time.perf_counter()
        with in_phase("weight sync"), torch.no_grad():
            if self.is_root:
                self._header([version, len(self.buckets), self.nbytes])
                self._send_buckets(version)
            else:
                for name, p in self.params:  # this rank's part of each gather; rank 0 keeps the results
                    self._gather(p, name, version)
        self.last_version, self.last_seconds = version, time.perf_counter() - start

    def close(self) -> None:
        """Tell the rollout ranks no version follows (their receive() returns None); trainer rank 0 only sends."""
        if self.is_root:
            with in_phase("weight sync"):
                self._header([_CLOSED, 0, 0])

    def _header(self, values: list[int]) -> None:
        header = torch.tensor(values, dtype=torch.int64)
        try:
            work = dist.broadcast(header, src=self.groups.sender_rank, group=self.groups.control, async_op=True)
            work.wait(timeout=timedelta(seconds=self.groups.timeout_s))
        except RuntimeError as exc:
            raise peer_failure(f"sending weight version {values[0]}'s header to rollout "
                               f"{_peers(self.groups.split.rollouts)}", exc, timeout_s=self.groups.timeout_s,
                               role="trainer") from exc

    def _gather(self, p: torch.Tensor, name: str, version: int) -> torch.Tensor:
        try:
            return _full(p)
        except RuntimeError as exc:
            raise peer_failure(f"gathering {name!r} of weight version {version} over trainer "
                               f"{_peers(self.groups.split.trainers)}", exc, timeout_s=self.groups.timeout_s,
                               role="trainer") from exc

    def _send_buckets(self, version: int) -> None:
        params = iter(self.params)
        pending: list = [None, None]  # the broadcast in flight from each buffer
        for i, bucket in enumerate(self.buckets):
            slot = i % 2
            self._wait(pending[slot], version, i - 2)
            flat = self._buffers[slot][:bucket.nbytes].view(bucket.dtype)
            for s in bucket.slots:
                name, p = next(params)
                assert name == s.name, (name, s.name)
                flat[s.offset:s.offset + s.numel].copy_(self._gather(p, name, version).reshape(-1))
            try:
                pending[slot] = (dist.broadcast(self._buffers[slot][:bucket.nbytes], src=self.groups.sender_rank,
                                                group=self.groups.sync, async_op=True), i)
            except RuntimeError as exc:
                raise self._failure(exc, version, i) from exc
        for item in pending:
            self._wait(item, version, None)

    def _wait(self, item, version: int, index) -> None:
        if item is None:
            return
        work, i = item
        try:
            work.wait(timeout=timedelta(seconds=self.groups.timeout_s))
        except RuntimeError as exc:
            raise self._failure(exc, version, i) from exc

    def _failure(self, exc: RuntimeError, version: int, index: int):
        return peer_failure(f"sending bucket {index + 1} of {len(self.buckets)} of weight version {version} to "
                            f"rollout {_peers(self.groups.split.rollouts)}", exc, timeout_s=self.groups.timeout_s,
                            role="trainer")


class WeightReceiver:
    """The rollout side: `poll()` between decode steps, `receive()` to copy a version into `model` in place."""

    def __init__(self, model: nn.Module, groups: RankGroups):
        if groups.control is None or groups.trainer is not None:
            raise ValueError(f"rank {groups.rank} is a trainer rank: it makes a WeightSender, not a receiver")
        self.model, self.groups = model, groups
        self.buckets = _handshake(groups, None, model)  # the sender's buckets, in its order
        self._params = dict(model.named_parameters())
        device = next(iter(self._params.values())).device
        self._buffer = torch.empty(max(b.nbytes for b in self.buckets), dtype=torch.uint8, device=device)
        self.version: Optional[int] = None  # the version the model holds (None: the weights it was built with)
        self.closed = False
        self.last_seconds = 0.0
        self._header = torch.zeros(_HEADER, dtype=torch.int64)
        self._work = None
        self._post()

    def _post(self) -> None:
        """Wait (in the background) for the next header."""
        try:
            self._work = dist.broadcast(self._header, src=self.groups.sender_rank, group=self.groups.control,
                                        async_op=True)
        except RuntimeError as exc:
            raise self._waiting_failure(exc) from exc

    def _waiting_failure(self, exc: BaseException):
        after = "the first version" if self.version is None else f"version {self.version}"
        return peer_failure(f"waiting for weights after {after} from trainer rank {self.groups.sender_rank}",
                            exc, timeout_s=self.groups.timeout_s, role="rollout")

    def poll(self) -> bool:
        """True when a version (or the end of the sync) is waiting to be received. Never blocks; raises a
        RankFailure when the trainer's side failed or sent nothing within the timeout."""
        if self.closed:
            return True
        if not self._work.is_completed():
            return False
        try:
            self._work.wait()  # at once: done, or failed (then it raises)
        except RuntimeError as exc:
            raise self._waiting_failure(exc) from exc
        return True

    def receive(self) -> Optional[int]:
        """Copy the next version into the model's parameters (blocking until it comes, at most the timeout) and
        return its number; None when the trainer has closed the sync."""
        if self.closed:
            return None
        try:
            self._work.wait(timeout=timedelta(seconds=self.groups.timeout_s))
        except RuntimeError as exc:
            raise self._waiting_failure(exc) from exc
        version, count, nbytes = self._header.tolist()
        if version == _CLOSED:
            self.closed = True
            return None
        if (count, nbytes) != (len(self.buckets), self.nbytes):
            raise RuntimeError(f"weight version {version}: the trainer sends {count} buckets of {nbytes} bytes in "
                               f"all, this rank planned {len(self.buckets)} of {self.nbytes}")
        start = time.perf_counter()
        with in_phase("weight sync"), torch.no_grad():
            for i, bucket in enumerate(self.buckets):
                raw = self._buffer[:bucket.nbytes]
                try:  # async + wait: a timeout raises here on NCCL too (instead of its watchdog ending the process)
                    dist.broadcast(raw, src=self.groups.sender_rank, group=self.groups.sync, async_op=True).wait(
                        timeout=timedelta(seconds=self.groups.timeout_s))
                except RuntimeError as exc:
                    raise peer_failure(f"receiving bucket {i + 1} of {count} of weight version {version} from "
                                       f"trainer rank {self.groups.sender_rank}", exc,
                                       timeout_s=self.groups.timeout_s, role="rollout") from exc
                flat = raw.view(bucket.dtype)
                for s in bucket.slots:
                    self._params[s.name].copy_(flat[s.offset:s.offset + s.numel].view(s.shape))
        self.version, self.last_seconds = version, time.perf_counter() - start
        self._post()
        return version

    @property
    def nbytes(self) -> int:
        """Bytes one version brings."""
        return sum(b.nbytes for b in self.buckets)
