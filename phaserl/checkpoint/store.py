"""Checkpoint directories on disk: atomic publish, the `latest` pointer, scanning, rotation.

Layout under `trainer.checkpoint_path` (docs/checkpoints.md):

    step_4/            a complete checkpoint: its metadata.json says complete=true (manifest.py: is it good?)
    step_6/
    latest             one line, "step_6": the newest complete checkpoint (for people and scripts)
    .tmp_step_8_k3j2/  a save in progress, or one a crash interrupted (never read, removed on resume)
    .lock              the run that holds this path (lock.py); removal of leftovers happens only under it

A checkpoint is written into a `.tmp_step_*` directory, fsynced, renamed to `step_N` (one atomic
rename), and only then is `latest` replaced. Whatever moment a process dies, every `step_N` with a
complete metadata.json is whole. What counts is what is on disk: resume and rotation scan the
directory; the pointer is never trusted over the scan. Nothing here knows what a checkpoint holds
(state.py) or runs collectives (the Checkpointer in __init__.py).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("phaserl")

STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp_step_"
OLD_PREFIX = ".old_step_"
POINTER = "latest"
METADATA = "metadata.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    step: int
    metadata: dict


@dataclass(frozen=True)
class Scan:
    complete: list      # CheckpointInfo, oldest first
    incomplete: list    # (path, why) pairs: what resume skips


# ---------------------------------------------------------------------------------------------- writing

def fsync_path(path: str) -> None:
    """fsync one file or directory (directories: so that a rename inside them is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            fsync_path(os.path.join(directory, name))
        fsync_path(directory)


def write_text_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file and os.replace: readers see old or new, never half."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_path(directory)


def write_json(path: str, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def new_tmp_dir(root: str, step: int) -> str:
    os.makedirs(root, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{step}_", dir=root)


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"{STEP_PREFIX}{step}")


def publish(tmp: str, root: str, step: int) -> str:
    """fsync `tmp`, rename it to step_{step}, then point `latest` at it.  Returns the final path."""
    fsync_tree(tmp)
    final = step_dir(root, step)
    old = None
    if os.path.lexists(final):
        # An earlier run's step_N (trainer.resume=<older path>, or an incomplete leftover): move it aside
        # first, so that step_N is always either the old complete directory or the new one.
        old = tempfile.mkdtemp(prefix=f"{OLD_PREFIX}{step}_", dir=root)
        os.rename(final, os.path.join(old, "was"))
    os.rename(tmp, final)
    fsync_path(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    write_text_atomic(os.path.join(root, POINTER), f"{STEP_PREFIX}{step}\n")
    return final


def remove_leftovers(root: str, scan: Scan) -> None:
    """Delete the temporary directories of saves that never finished (they are never read)."""
    for path, _ in scan.incomplete:
        if os.path.basename(path).startswith((TMP_PREFIX, OLD_PREFIX)):
            shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- reading

def read_metadata(path: str) -> tuple[Optional[dict], str]:
    """(metadata, "") for a complete checkpoint directory, else (None, why it is not one)."""
    meta_file = os.path.join(path, METADATA)
    if not os.path.isfile(meta_file):
        return None, f"no {METADATA} (the save did not finish)"
    try:
        with open(meta_file, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"{METADATA} is unreadable ({exc})"
    if not isinstance(meta, dict) or meta.get("complete") is not True:
        return None, f"{METADATA} does not say complete=true"
    return meta, ""


def scan(root: str) -> Scan:
    """Complete checkpoints (oldest first) and the incomplete or temporary directories under `root`."""
    complete, incomplete = [], []
    if not os.path.isdir(root):
        return Scan([], [])
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.startswith((TMP_PREFIX, OLD_PREFIX)):
            incomplete.append((path, "temporary directory of a save that was interrupted"))
            continue
        match = _STEP_DIR.match(name)
        if not match or not os.path.isdir(path):
            continue
        meta, why = read_metadata(path)
        if meta is None:
            incomplete.append((path, why))
        elif meta.get("step") != int(match.group(1)):
            incomplete.append((path, f"{METADATA} says step {meta.get('step')}, the directory name another"))
        else:
            complete.append(CheckpointInfo(path=path, step=int(match.group(1)), metadata=meta))
    complete.sort(key=lambda info: info.step)
    return Scan(complete, incomplete)


def report_incomplete(found: Scan) -> None:
    for path, why in found.incomplete:
        log.warning(f"checkpoint: skipping incomplete {path}: {why}")


def latest_complete(root: str) -> Optional[CheckpointInfo]:
    """The newest complete checkpoint under `root` (None if there is none); logs what it skips."""
    found = scan(root)
    report_incomplete(found)
    return newest(root, found)


def newest(root: str, found: Scan) -> Optional[CheckpointInfo]:
    if not found.complete:
        return None
    check_pointer(root, found)
    return found.complete[-1]


def check_pointer(root: str, found: Scan) -> None:
    """Log where `latest` disagrees with the scan (a warning when it names a checkpoint that is gone)."""
    pointer = read_pointer(root)
    newest_name = os.path.basename(found.complete[-1].path) if found.complete else None
    if pointer is None or pointer == newest_name:
        return
    where = os.path.join(root, POINTER)
    instead = f"using {newest_name}, the newest complete one on disk" if newest_name else "starting fresh"
    if not os.path.isdir(os.path.join(root, pointer)):
        log.warning(f"checkpoint: {where} names {pointer}, which does not exist (deleted or never finished); {instead}")
    else:
        log.info(f"checkpoint: {where} names {pointer}; {instead}")


def read_pointer(root: str) -> Optional[str]:
    try:
        with open(os.path.join(root, POINTER), encoding="utf-8") as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def rotate(root: str, keep: int) -> list:
    """Delete all but the newest `keep` complete checkpoints (the newest is never deleted).  Returns the paths."""
    complete = scan(root).complete
    doomed = complete[:-max(keep, 1)]
    for info in doomed:
        # Rename first: a crash mid-delete must not leave a step_N that looks complete but is not.
        trash = tempfile.mkdtemp(prefix=f"{OLD_PREFIX}{info.step}_", dir=root)
        os.rename(info.path, os.path.join(trash, "was"))
        shutil.rmtree(trash, ignore_errors=True)
        log.info(f"checkpoint: removed {info.path} (trainer.keep_checkpoint_num={keep})")
    return [info.path for info in doomed]
