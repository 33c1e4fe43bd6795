"""Reading and writing record files: `.jsonl` (one JSON object per line) and `.parquet` (pyarrow).

A record is one plain `dict` per row, exactly as stored; this module knows nothing of prompts or
of verl's schema (that is `rows.py`). Every error names the file and the place in it: the 1-based
line of a `.jsonl` file, the 0-based row of a `.parquet` file. Writes are atomic (a temp file in
the same directory, then `os.replace`), so a reader never sees half a file.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from phaserl.errors import DataError

SUPPORTED_EXTENSIONS = (".jsonl", ".parquet")


@dataclass(frozen=True)
class LocatedRecord:
    """One record with where it came from, for error messages further down."""

    record: dict
    index: int  # 0-based row among the file's records (blank jsonl lines are not rows)
    where: str  # "train.jsonl:row 3 (line 5)" or "train.parquet:row 3"


def _extension(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in SUPPORTED_EXTENSIONS:
        raise DataError(
            f"{path}: unsupported file extension {ext or '(none)'!r}; supported: "
            f"{', '.join(SUPPORTED_EXTENSIONS)}. Convert the file, or rename it if it already is one of these."
        )
    return ext


def read_located_records(path: str | os.PathLike) -> list[LocatedRecord]:
    """Read every record of a `.jsonl` or `.parquet` file, each with its row index and location."""
    path = os.fspath(path)
    ext = _extension(path)
    if not os.path.isfile(path):
        what = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
        raise DataError(f"{path}: {what} (working directory: {os.getcwd()}). Check the path in data.*_files.")
    if ext == ".jsonl":
        return _read_jsonl(path)
    return _read_parquet(path)


def read_records(path: str | os.PathLike) -> list[dict]:
    """Read every record of a `.jsonl` or `.parquet` file as a list of dicts."""
    return [located.record for located in read_located_records(path)]


def _read_jsonl(path: str) -> list[LocatedRecord]:
    out: list[LocatedRecord] = []
    # Bytes, decoded line by line, so that a bad byte is reported on its own line.
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                # utf-8-sig on line 1: a byte-order mark written by some editors is not part of the JSON.
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}: line {line_no}: not valid UTF-8 ({e.reason}). Re-save the file as UTF-8."
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}: line {line_no}: invalid JSON ({e.msg}, column {e.colno}). "
                    "A .jsonl file holds one complete JSON object per line; fix or remove this line."
                ) from None
            if not isinstance(record, dict):
                raise DataError(
                    f"{path}: line {line_no}: expected a JSON object ({{...}}), got {type(record).__name__}. "
                    "Each line must be one object such as {\"prompt\": \"...\"}."
                )
            index = len(out)
            out.append(LocatedRecord(record, index, f"{path}:row {index} (line {line_no})"))
    return out


def _read_parquet(path: str) -> list[LocatedRecord]:
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(
            f"{path}: cannot be read as parquet ({e}). Check that the file is complete and really is "
            "parquet; re-export it if it was cut short."
        ) from None
    # to_pylist turns list and struct columns into plain lists and dicts (never numpy arrays).
    return [LocatedRecord(record, i, f"{path}:row {i}") for i, record in enumerate(table.to_pylist())]


def write_records(path: str | os.PathLike, records: list[dict]) -> None:
    """Write `records` to a `.jsonl` or `.parquet` file atomically, creating the parent directory."""
    path = os.fspath(path)
    ext = _extension(path)
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise DataError(f"{path}: record {i} is a {type(record).__name__}, not a dict; nothing was written.")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=ext)
    try:
        with os.fdopen(fd, "w" if ext == ".jsonl" else "wb") as f:
            if ext == ".jsonl":
                for record in records:
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
            else:
                pq.write_table(pa.Table.from_pylist(records), f)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; other users of a shared run dir must read it
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
