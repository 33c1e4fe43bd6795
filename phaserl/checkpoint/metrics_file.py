"""Cutting `metrics.jsonl` back to a resume point, so that a resumed run's file equals an uninterrupted one's.

Not here: writing metrics (phaserl.metrics), choosing the resume point (the Checkpointer).
"""
from __future__ import annotations

import json
import logging
import os

log = logging.getLogger("phaserl")


def drop_metrics_after(path: str, step: int) -> int:
    """Cut metrics.jsonl after the last line with `step` <= step (in place; the logger keeps appending).

    The lines after a resume point are recomputed by the resumed run, so the file ends up as an
    uninterrupted run's. A single truncate() is atomic: a crash leaves the old file or the cut one.
    Returns the number of lines dropped.
    """
    if not os.path.isfile(path):
        return 0
    with open(path, "rb") as f:
        lines = f.readlines()
    keep_bytes, dropped = 0, 0
    for i, line in enumerate(lines):
        try:
            line_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            line_step = None            # a line cut short by a kill: drop it and everything after
        if line_step is None or line_step > step:
            dropped = len(lines) - i
            break
        keep_bytes += len(line)
    if dropped:
        os.truncate(path, keep_bytes)
        after = (f"after step {step}, the resume point" if step >= 0
                 else "of a run that stopped before its first checkpoint")
        log.info(f"{path}: dropped {dropped} line(s) {after}; this run writes them again")
    return dropped
