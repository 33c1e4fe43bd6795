"""Completed sample groups from the rollout ranks to the trainer ranks, as tensors.

A rollout rank sends each batch of completed groups (the n responses to one prompt: token ids, per-token
behaviour log-probs and policy versions, finish reasons, the prompt's row) to trainer rank 0 without waiting
for it to be taken (`SampleSender.send`). Trainer rank 0 receives from whichever rollout rank sends next
(`SampleReceiver.poll` / `receive`) and, once it has formed a batch, hands every trainer rank its share
(`scatter_groups`, point to point over the trainer ranks' gloo group): one rank decides which groups train
together and where, the others only receive.

Each batch is three broadcasts over the gloo group of its rollout rank and trainer rank 0 (`groups.samples[r]`,
rank_split.py; collectives rather than point-to-point messages, because a poll sees a collective fail when its
peer dies, while a point-to-point receive only times out), length-prefixed:
    header  int64 [2]    the sizes I and F of the two below; [-1, -1]: this rollout rank sends no more
    ints    int64 [I]    M, then M numbers of metadata: G, and per group prompt_index, n, and per response
                         its length T and finish code; then every response's token ids, then every
                         response's versions, in the same order (sum of T each)
    floats  float32 [F]  every response's log-probs, in the same order (F = sum of T)
Log-probs travel as float32 (the engine's dtype; a float64 value is rounded once), token ids and versions as
int64, finish reasons as codes into FINISH_REASONS.

Every wait is bounded by `groups.timeout_s`: a message that trainer rank 0 does not take, no message from any
rollout rank, or a peer that is gone raises a one-line RankFailure (launch.peer_failure).
Ending: the trainer closes the weight sync (weight_sync.py); each rollout rank, seeing it closed, calls
`SampleSender.close()`; trainer rank 0 calls `SampleReceiver.drain()`, which takes (and drops) what is still
in flight until every rollout rank has closed. Not here: which groups form a batch, or when (the trainer).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .launch import peer_failure
from .rank_split import RankGroups

FINISH_REASONS = ("stop", "length", "abort")  # EOS or a stop token; max_new_tokens; cut off unfinished
_CODES = {reason: code for code, reason in enumerate(FINISH_REASONS)}
_TO_SHARE = (1, 2, 3)        # message tags (header, ints, floats): trainer rank 0 -> another trainer rank
_DONE = -1


@dataclass
class SampleGroup:
    """The n responses to one prompt. Legend: T_i the i-th response's sampled tokens."""

    prompt_index: int                  # the prompt's row (global index in the run's prompt order)
    token_ids: list[torch.Tensor]      # per response [T_i] int64
    logprobs: list[torch.Tensor]       # per response [T_i] float32: the behaviour policy's log-prob of each token
    versions: list[torch.Tensor]       # per response [T_i] int64: the policy version that sampled each token
    finish_reasons: list[str]          # per response, one of FINISH_REASONS

    def __post_init__(self):
        self.token_ids = [torch.as_tensor(t, dtype=torch.int64) for t in self.token_ids]
        self.logprobs = [torch.as_tensor(t, dtype=torch.float32) for t in self.logprobs]
        self.versions = [torch.as_tensor(t, dtype=torch.int64) for t in self.versions]
        n = len(self.token_ids)
        if not (len(self.logprobs) == len(self.versions) == len(self.finish_reasons) == n):
            raise ValueError(f"sample group of prompt {self.prompt_index}: {n} token lists, {len(self.logprobs)} "
                             f"log-prob lists, {len(self.versions)} version lists, {len(self.finish_reasons)} "
                             "finish reasons; expected one of each per response")
        for i, (ids, lp, ver, reason) in enumerate(zip(self.token_ids, self.logprobs, self.versions,
                                                        self.finish_reasons)):
            if not (ids.dim() == lp.dim() == ver.dim() == 1 and ids.numel() == lp.numel() == ver.numel()):
                raise ValueError(f"sample group of prompt {self.prompt_index}, response {i}: token ids "
                                 f"{list(ids.shape)}, log-probs {list(lp.shape)}, versions {list(ver.shape)}; "
                                 "expected three 1-D tensors of the same length")
            if reason not in _CODES:
                raise ValueError(f"sample group of prompt {self.prompt_index}, response {i}: finish reason "
                                 f"{reason!r}; expected one of {', '.join(FINISH_REASONS)}")


def pack_groups(groups: Sequence[SampleGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """The groups as (ints [I] int64, floats [F] float32), the layout of this module's docstring."""
    meta, tokens, versions, logprobs = [len(groups)], [], [], []
    for g in groups:
        meta += [g.prompt_index, len(g.token_ids)]
        for ids, lp, ver, reason in zip(g.token_ids, g.logprobs, g.versions, g.finish_reasons):
            meta += [ids.numel(), _CODES[reason]]
            tokens.append(ids)
            versions.append(ver)
            logprobs.append(lp)
    ints = torch.cat([torch.tensor([len(meta)] + meta, dtype=torch.int64), *tokens, *versions])
    floats = torch.cat(logprobs) if logprobs else torch.zeros(0, dtype=torch.float32)
    return ints, floats


def unpack_groups(ints: torch.Tensor, floats: torch.Tensor) -> list[SampleGroup]:
    """pack_groups' inverse; the tensors of the result are views into `ints` and `floats`."""
    m = int(ints[0])
    meta = ints[1:1 + m].tolist()
    shapes, pos = [], 1                 # per group: (prompt_index, [(length, code)] per response)
    for _ in range(meta[0]):
        prompt, n = meta[pos], meta[pos + 1]
        shapes.append((prompt, [(meta[pos + 2 + 2 * j], meta[pos + 3 + 2 * j]) for j in range(n)]))
        pos += 2 + 2 * n
    lengths = [length for _, responses in shapes for length, _ in responses]
    total = sum(lengths)
    if ints.numel() != 1 + m + 2 * total or floats.numel() != total:
        raise ValueError(f"a sample message of {ints.numel()} ints and {floats.numel()} floats does not match its "
                         f"own metadata ({total} tokens): the sender and receiver disagree on the layout")
    tokens = torch.split(ints[1 + m:1 + m + total], lengths)
    versions = torch.split(ints[1 + m + total:], lengths)
    logprobs = torch.split(floats, lengths)
    out, k = [], 0
    for prompt, responses in shapes:
        n = len(responses)
        out.append(SampleGroup(prompt, list(tokens[k:k + n]), list(logprobs[k:k + n]), list(versions[k:k + n]),
                               [FINISH_REASONS[code] for _, code in responses]))
        k += n
    return out


def _nonempty(tensors: list) -> list:
    """The messages that carry something (the header always does; an empty payload is not sent)."""
    return [t for t in tensors if t.numel()]


def _peers(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


class SampleSender:
    """A rollout rank's end: send() queues a batch for trainer rank 0 and returns at once."""

    def __init__(self, groups: RankGroups):
        if groups.role != "rollout":
            raise ValueError(f"rank {groups.rank} is a trainer rank: only rollout ranks send samples")
        self.groups = groups
        self._group = groups.samples[groups.rank]   # gloo [trainer rank 0, this rank]
        self._pending: list = []                    # (works, tensors kept alive until taken, what)
        self._sent = 0

    @property
    def pending(self) -> int:
        """Batches sent but not yet taken by trainer rank 0."""
        self._reap()
        return len(self._pending)

    def send(self, groups: Sequence[SampleGroup]) -> None:
        """Queue these completed groups for trainer rank 0 (never blocks; raises when an earlier batch failed)."""
        self._reap()
        ints, floats = pack_groups(groups)
        plural = "" if len(groups) == 1 else "s"
        self._post([ints, floats], f"sample batch {self._sent + 1} ({len(groups)} group{plural})")
        self._sent += 1

    def flush(self) -> None:
        """Wait until trainer rank 0 has taken every batch sent (at most the timeout for each)."""
        timeout = timedelta(seconds=self.groups.timeout_s)
        while self._pending:
            works, _, what = self._pending.pop(0)
            for work in works:
                try:
                    work.wait(timeout=timeout)
                except RuntimeError as exc:
                    raise self._failure(what, exc) from exc

    def close(self) -> None:
        """No more samples from this rank: tell trainer rank 0, and wait until it took everything."""
        self._post([], "the end of its samples")
        self.flush()

    def _post(self, payload: list, what: str) -> None:
        sizes = [t.numel() for t in payload] if payload else [_DONE, _DONE]
        messages = _nonempty([torch.tensor(sizes, dtype=torch.int64)] + payload)
        try:
            works = [dist.broadcast(t, src=self.groups.rank, group=self._group, async_op=True) for t in messages]
        except RuntimeError as exc:
            raise self._failure(what, exc) from exc
        self._pending.append((works, messages, what))

    def _reap(self) -> None:
        """Drop the batches already taken; raise for one that failed (timed out, or the trainer is gone)."""
        while self._pending and any(w.is_completed() for w in self._pending[0][0]):
            works, _, what = self._pending[0]
            for work in works:
                if work.is_completed():
                    try:
                        work.wait()
                    except RuntimeError as exc:
                        raise self._failure(what, exc) from exc
            if not all(w.is_completed() for w in works):
                return
            self._pending.pop(0)

    def _failure(self, what: str, exc: BaseException):
        return peer_failure(f"sending {what} to trainer rank {self.groups.sender_rank}", exc,
                            timeout_s=self.groups.timeout_s, role="rollout")


class SampleReceiver:
    """Trainer rank 0's end: batches from whichever rollout rank sends next.

    One header receive stays posted per open rollout rank, each over the group of that rank and trainer rank 0
    (a collective's progress is what a poll can see fail: a point-to-point receive from a peer that died stays
    "not completed" until its timeout)."""

    def __init__(self, groups: RankGroups):
        if groups.rank != groups.sender_rank:
            raise ValueError(f"rank {groups.rank}: only trainer rank {groups.sender_rank} receives samples "
                             "(the others get their share from scatter_groups)")
        self.groups = groups
        self.open = list(groups.split.rollouts)  # rollout ranks that have not closed, in the order served next
        self._headers = {rank: torch.zeros(2, dtype=torch.int64) for rank in self.open}
        self._works: dict = {}
        for rank in self.open:
            self._post(rank)

    def _post(self, rank: int) -> None:
        try:
            self._works[rank] = dist.broadcast(self._headers[rank], src=rank, group=self.groups.samples[rank],
                                               async_op=True)
        except RuntimeError as exc:
            raise self._failure(exc, [rank]) from exc

    def _failure(self, exc: BaseException, ranks: list):
        return peer_failure(f"waiting for samples from rollout {_peers(ranks)}", exc,
                            timeout_s=self.groups.timeout_s, role="trainer")

    @property
    def closed(self) -> bool:
        """True once every rollout rank has said it sends no more."""
        return not self.open

    def _ready(self) -> Optional[int]:
        """The first open rank (round robin) whose header has come; raises for one whose receive failed."""
        for rank in self.open:
            work = self._works[rank]
            if work.is_completed():
                try:
                    work.wait()  # at once: done, or failed (then it raises)
                except RuntimeError as exc:
                    raise self._failure(exc, [rank]) from exc
                return rank
        return None

    def poll(self) -> bool:
        """True when a batch (or a rollout rank's end) is waiting; never blocks."""
        return self.closed or self._ready() is not None

    def receive(self) -> Optional[tuple[int, list[SampleGroup]]]:
        """The next batch as (rollout rank, groups), blocking at most the timeout for it; None once every rollout
        rank has closed. A rollout rank's end is taken in passing (the wait goes on for the others)."""
        timeout = timedelta(seconds=self.groups.timeout_s)
        deadline = time.monotonic() + self.groups.timeout_s
        while not self.closed:
            src = self._ready()
            if src is None:
                if time.monotonic() > deadline:
                    raise self._failure(TimeoutError("timed out"), self.open)
                time.sleep(0.001)
                continue
            self.open.remove(src)
            n_ints, n_floats = self._headers[src].tolist()
            if n_ints == _DONE:
                continue
            ints = torch.empty(n_ints, dtype=torch.int64)
            floats = torch.empty(n_floats, dtype=torch.float32)
            for tensor in _nonempty([ints, floats]):
                try:
                    dist.broadcast(tensor, src=src, group=self.groups.samples[src], async_op=True).wait(timeout=timeout)
                except RuntimeError as exc:
                    raise self._failure(exc, [src]) from exc
            self.open.append(src)  # served last next time: no rollout rank waits behind a busier one
            self._post(src)
            return src, unpack_groups(ints, floats)
        return None

    def drain(self) -> int:
        """Take and drop whatever is still in flight until every rollout rank has closed; returns the groups dropped."""
        dropped = 0
        while (batch := self.receive()) is not None:
            dropped += len(batch[1])
        return dropped


def scatter_groups(groups: RankGroups, shares: Optional[list]) -> list[SampleGroup]:
    """Every trainer rank's share of a batch: trainer rank 0 passes `shares` (one list of SampleGroup per
    trainer rank, in trainer-rank order), the others None; each returns its own list. Every trainer rank calls it."""
    if groups.trainer_cpu is None:
        raise ValueError(f"rank {groups.rank} is a rollout rank: scatter_groups runs on the trainer ranks")
    trainers, timeout = groups.split.trainers, timedelta(seconds=groups.timeout_s)
    root, group = groups.sender_rank, groups.trainer_cpu
    if groups.rank == root:
        if shares is None or len(shares) != len(trainers):
            raise ValueError(f"scatter_groups: trainer rank 0 must pass one share per trainer rank "
                             f"({len(trainers)}), got {None if shares is None else len(shares)}")
        sends = []
        for rank, share in zip(trainers[1:], shares[1:]):
            ints, floats = pack_groups(share)
            header = torch.tensor([ints.numel(), floats.numel()], dtype=torch.int64)
            for tensor, tag in zip(_nonempty([header, ints, floats]), _TO_SHARE):
                sends.append((dist.isend(tensor, dst=rank, group=group, tag=tag), tensor, rank))
        for work, _, rank in sends:
            try:
                work.wait(timeout=timeout)
            except RuntimeError as exc:
                raise peer_failure(f"handing trainer rank {rank} its share of the samples", exc,
                                   timeout_s=groups.timeout_s, role="trainer") from exc
        return list(shares[0])
    header = torch.zeros(2, dtype=torch.int64)
    try:
        dist.irecv(header, src=root, group=group, tag=_TO_SHARE[0]).wait(timeout=timeout)
        ints = torch.empty(int(header[0]), dtype=torch.int64)
        floats = torch.empty(int(header[1]), dtype=torch.float32)
        for tensor, tag in zip(_nonempty([ints, floats]), _TO_SHARE[1:]):
            dist.irecv(tensor, src=root, group=group, tag=tag).wait(timeout=timeout)
    except RuntimeError as exc:
        raise peer_failure(f"waiting for its share of the samples from trainer rank {root}", exc,
                           timeout_s=groups.timeout_s, role="trainer") from exc
    return unpack_groups(ints, floats)
