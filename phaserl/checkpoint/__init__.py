"""Checkpoints: atomic, verified, locked, rotating, and resumable exactly (docs/checkpoints.md).

    checkpointer.py  the Checkpointer: save (collective, atomic, manifest last) and resume (lock, newest good)
    store.py         directories on disk: atomic publish, the `latest` pointer, scanning, rotation
    state.py         what a checkpoint holds: the roles' tensors (DCP) and plain state (JSON), architecture
    safe_dcp.py      DCP with tensors only, its metadata read through a restricted unpickler
    rng.py           per-rank RNG states as safetensors
    manifest.py      manifest.json: sizes and SHA-256 of every file; verification
    lock.py          one run per checkpoint path
    metrics_file.py  metrics.jsonl cut back to the resume point
    export.py        a checkpoint -> a Hugging Face model directory

The trainer holds one `Checkpointer` (built from `trainer.*` by trainer/build.py) and calls
`resume(state)` once, `save(state)` at each save and `close()` at the end, with a `TrainingState` of
live objects. Nothing in a checkpoint is unpickled: loading runs no code from the files. Not here: when
to save (the trainer's loop), the shared-storage check (parallel/shared_storage.py).
"""
from . import store
from .checkpointer import Checkpointer
from .export import cli_export, export_checkpoint
from .metrics_file import drop_metrics_after
from .state import TrainingState

__all__ = ["Checkpointer", "TrainingState", "export_checkpoint", "cli_export", "drop_metrics_after", "store"]
