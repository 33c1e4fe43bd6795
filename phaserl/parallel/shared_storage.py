"""Classic mistake 5: checkpoints and logs on a node-local path in a multi-node run.

Before training, with more than one rank, every rank writes a marker file (rank, host, a run nonce
broadcast from rank 0) under each path that must be shared (trainer.checkpoint_path, trainer.log_dir).
After a barrier rank 0 looks for every marker. Any one missing means that rank writes somewhere rank 0
cannot read: its checkpoint shards would be lost, and resume would fail with FileNotFoundError hours
later. Then every rank stops, before any GPU hour is spent, with the ranks and hosts at fault and the
fix. Markers are removed afterwards. Collective: every rank must call it.
"""
from __future__ import annotations

import json
import os
import socket
import uuid

import torch.distributed as dist

from ..errors import PreflightError
from .collectives import training_group

MARKER_PREFIX = ".phaserl_shared_check"


def _marker(path: str, nonce: str, rank: int) -> str:
    return os.path.join(path, f"{MARKER_PREFIX}_{nonce}_rank{rank}.json")


def _write_markers(paths: dict, nonce: str, rank: int, host: str) -> dict:
    """Write this rank's marker under each path; returns {key: why it failed} for paths it cannot write."""
    errors = {}
    for key, path in paths.items():
        try:
            os.makedirs(path, exist_ok=True)
            with open(_marker(path, nonce, rank), "w", encoding="utf-8") as f:
                json.dump({"rank": rank, "host": host, "nonce": nonce, "path": os.path.realpath(path)}, f)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            errors[key] = f"{type(exc).__name__}: {exc}"
    return errors


def _seen_by_rank0(path: str, nonce: str, rank: int) -> bool:
    try:
        with open(_marker(path, nonce, rank), encoding="utf-8") as f:
            return json.load(f).get("nonce") == nonce
    except (OSError, ValueError):
        return False


def _verdict(paths: dict, nonce: str, ranks: list) -> str:
    """Rank 0's message naming what is not shared ("" when all is well).  `ranks`: gathered per-rank facts."""
    problems = []
    for key, path in paths.items():
        unseen = [r for r in ranks if r["write_errors"].get(key) or not _seen_by_rank0(path, nonce, r["rank"])]
        if not unseen:
            continue
        who = "; ".join(
            f"rank {r['rank']} on host {r['host']} (its {key} resolves to {r['realpaths'][key]}"
            + (f", writing failed: {r['write_errors'][key]}" if r["write_errors"].get(key) else "") + ")"
            for r in unseen)
        problems.append(f"{key}={path!r} is not shared between ranks: rank 0 on host {ranks[0]['host']} "
                        f"(it resolves to {ranks[0]['realpaths'][key]}) cannot see the marker files of {who}")
    if not problems:
        return ""
    return ("stopping before training: " + ". ".join(problems) + ". Every rank must read and write the same "
            "directories, or checkpoint shards are lost and resume fails. Fix: mount shared storage (NFS, Lustre, "
            "a cloud filesystem) at the same path on every node, or point trainer.checkpoint_path and "
            "trainer.log_dir at a directory on it.")


def check_shared_paths(paths: dict, *, rank: int, world_size: int) -> None:
    """Raise PreflightError on every rank unless every rank's marker under each of `paths` is visible to rank 0.

    `paths` maps a config key (for the message) to the directory, e.g. {"trainer.log_dir": "/shared/tb"}.
    """
    if world_size <= 1:
        return
    box = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=training_group())
    nonce = box[0]
    host = socket.gethostname()
    errors = _write_markers(paths, nonce, rank, host)
    mine = {"rank": rank, "host": host, "write_errors": errors,
            "realpaths": {k: os.path.realpath(p) for k, p in paths.items()}}
    ranks = [None] * world_size
    # also the barrier: every marker is written before rank 0 looks
    dist.all_gather_object(ranks, mine, group=training_group())
    message = [_verdict(paths, nonce, ranks) if rank == 0 else None]
    dist.broadcast_object_list(message, src=0, group=training_group())
    for path in paths.values():
        try:
            os.remove(_marker(path, nonce, rank))
        except OSError:
            pass                          # never written (the error above says why) or already gone
    if message[0]:
        raise PreflightError(message[0])
