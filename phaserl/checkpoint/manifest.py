"""manifest.json: every file of a checkpoint with its size and SHA-256, written last; and its verification.

A checkpoint counts as good when its manifest exists, every file it lists is there with the listed size
(and, with full verification, the listed digest), no listed JSON file fails to parse, and no file is
missing from it. The checks cost one `stat` per file for `size`, and one read of every byte for `full`
(about 1-2 GB/s per process with SHA-256). At save time each rank hashes the files it wrote itself
(its DCP shards `dcp/__{rank}_*` and its RNG file) right after writing them, so the cost is spread over
the ranks; at resume the files are split over the ranks the same way (`verify(..., rank, world)`).
Not here: what the files hold (state.py) or what to do with a damaged checkpoint (the Checkpointer).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable

from .store import write_json

MANIFEST = "manifest.json"
_CHUNK = 16 << 20


def digest(path: str) -> dict:
    """{"size": bytes, "sha256": hex} of one file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def files_of(ckpt_dir: str) -> list:
    """Every file under `ckpt_dir` (relative paths, sorted), the manifest itself aside."""
    out = []
    for directory, _, names in os.walk(ckpt_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(directory, name), ckpt_dir)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def digests(ckpt_dir: str, rel_paths: Iterable[str]) -> dict:
    return {rel: digest(os.path.join(ckpt_dir, rel)) for rel in rel_paths}


def write_manifest(ckpt_dir: str, known: dict) -> dict:
    """Write manifest.json for every file under ckpt_dir; `known` holds digests computed already (by rank)."""
    entries = {rel: known[rel] if rel in known else digest(os.path.join(ckpt_dir, rel)) for rel in files_of(ckpt_dir)}
    write_json(os.path.join(ckpt_dir, MANIFEST), {"algorithm": "sha256", "files": entries})
    return entries


def read_manifest(ckpt_dir: str) -> tuple[dict, str]:
    """(files, "") or ({}, why the manifest cannot be used)."""
    path = os.path.join(ckpt_dir, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        files = data["files"]
        if not isinstance(files, dict) or not all(isinstance(v, dict) and "size" in v for v in files.values()):
            raise ValueError("no list of files with sizes")
    except FileNotFoundError:
        return {}, f"no {MANIFEST} (written by an older phaserl, or the save did not finish)"
    except (OSError, ValueError, KeyError, TypeError) as exc:  # UnicodeDecodeError is a ValueError
        return {}, f"{MANIFEST} is unreadable ({exc})"
    return files, ""


def verify(ckpt_dir: str, *, full: bool, rank: int = 0, world: int = 1) -> list:
    """What is wrong with the checkpoint (an empty list when it is good), checking this rank's share of files.

    Sizes, missing and unlisted files are checked on every rank (cheap); with `full`, rank r hashes every
    world-th listed file starting at r, so the ranks together read each byte once.
    """
    files, why = read_manifest(ckpt_dir)
    if why:
        return [why]
    problems = []
    on_disk = set(files_of(ckpt_dir))
    for rel in sorted(on_disk - set(files)):
        problems.append(f"{rel} is not in {MANIFEST} (added after the save)")
    for i, (rel, want) in enumerate(sorted(files.items())):
        path = os.path.join(ckpt_dir, rel)
        if rel not in on_disk:
            problems.append(f"{rel} is missing")
            continue
        size = os.path.getsize(path)
        if size != want["size"]:
            problems.append(f"{rel} is {size} bytes, the manifest says {want['size']} (truncated or replaced)")
            continue
        if full and i % world == rank and digest(path)["sha256"] != want.get("sha256"):
            problems.append(f"{rel} has another SHA-256 than the manifest's (corrupted or replaced)")
            continue
        if rel.endswith(".json") and rank == 0:
            try:
                with open(path, encoding="utf-8") as f:
                    json.load(f)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                problems.append(f"{rel} is not valid JSON ({exc})")
    return problems
