"""Checkpoints: atomic, rotating, and resumable exactly (docs/checkpoints.md).

    store.py   directories on disk: atomic publish, the `latest` pointer, scanning, rotation
    state.py   what a checkpoint holds: DCP for the roles, per-rank RNG, JSON states, architecture
    export.py  a checkpoint → a Hugging Face model directory

The trainer holds one `Checkpointer` (built from `trainer.*` by trainer/build.py) and calls
`save(state)` and `resume(state)` with a `TrainingState` of live objects. Both are collective under
torch.distributed: every rank calls them and writes its own shards and RNG; rank 0 alone writes the
shared files, publishes, rotates and decides which checkpoint to resume. Not here: when to save (the
trainer's loop), the shared-storage check (parallel/shared_storage.py).
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import __version__
from ..errors import ConfigError, PhaserlError
from ..parallel import is_distributed
from . import store
from .export import cli_export, export_checkpoint, export_role
from .state import (DCP_DIR, RNG_DIR, STATE_FILE, TrainingState, load_json_state, load_roles, load_rng,
                    save_architecture, save_json_state, save_roles, save_rng)

log = logging.getLogger("phaserl")

# Settings a resumed run changes on purpose: not worth a warning.
_EXPECTED_TO_CHANGE = ("trainer.resume", "trainer.total_steps", "trainer.checkpoint_path")

__all__ = ["Checkpointer", "TrainingState", "export_checkpoint", "cli_export", "drop_metrics_after", "store"]


@dataclass
class Checkpointer:
    root: str                   # trainer.checkpoint_path
    keep: int                   # trainer.keep_checkpoint_num
    resume_mode: str            # trainer.resume: "auto", "never" or a checkpoint directory
    export_hf: bool             # trainer.export_hf: also write step_N/hf/
    config: Any = None          # the resolved Config, saved as config.yaml
    rank: int = 0
    world_size: int = 1
    last_saved: Optional[str] = None

    # ------------------------------------------------------------------------------------------ save
    def save(self, state: TrainingState) -> str:
        """Write step_{state.step}/ atomically, point `latest` at it, rotate.  Returns its path."""
        t0 = time.perf_counter()
        tmp = self._from_rank0(lambda: store.new_tmp_dir(self.root, state.step))
        published = False
        try:
            save_roles(state.roles, os.path.join(tmp, DCP_DIR))
            save_rng(state.generators, os.path.join(tmp, RNG_DIR), self.rank)
            _barrier()
            if self.rank == 0:
                self._write_shared_files(tmp, state)
                store.publish(tmp, self.root, state.step)
                store.rotate(self.root, self.keep)
            published = True
        finally:
            if not published and self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        self.last_saved = store.step_dir(self.root, state.step)
        if self.rank == 0:
            log.info(f"checkpoint: saved step {state.step} to {self.last_saved} ({time.perf_counter() - t0:.1f} s)")
        return self.last_saved

    def _write_shared_files(self, tmp: str, state: TrainingState) -> None:
        from ..config import dump_yaml

        save_json_state(state, os.path.join(tmp, STATE_FILE))
        if self.config is not None:
            dump_yaml(self.config, os.path.join(tmp, "config.yaml"))
        save_architecture(state, tmp)
        if self.export_hf:
            export_role(tmp, os.path.join(tmp, "hf"), role="actor")
        # Written last: a directory without it (or with complete=false) is never resumed from.
        store.write_json(os.path.join(tmp, store.METADATA), {
            "step": state.step, "world_size": self.world_size, "roles": sorted(state.roles),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "phaserl_version": __version__, "torch_version": torch.__version__, "complete": True})

    # ------------------------------------------------------------------------------------------ resume
    def resume(self, state: TrainingState) -> Optional[store.CheckpointInfo]:
        """Restore `state` from the checkpoint trainer.resume picks; None when the run starts fresh."""
        info = self._from_rank0(self._choose)
        if info is None:
            return None
        saved_roles, wanted = info.metadata.get("roles", []), sorted(state.roles)
        if saved_roles != wanted:
            raise ConfigError(f"checkpoint {info.path} holds roles {saved_roles}, this run trains {wanted} "
                              "(critic.enable / algorithm.adv_estimator changed?); resume with the same "
                              "setup, or start fresh with trainer.resume=never and a new trainer.checkpoint_path")
        load_roles(state.roles, os.path.join(info.path, DCP_DIR))
        load_json_state(state, os.path.join(info.path, STATE_FILE))
        load_rng(state.generators, os.path.join(info.path, RNG_DIR), self.rank, seed_hint="seeded")
        saved_world = info.metadata.get("world_size")
        if self.rank == 0:
            self._warn_config_changes(info.path)
            where = f"saved by {saved_world} rank(s), resumed on {self.world_size}"
            log.info(f"checkpoint: resumed from {info.path} (step {info.step}; {where})")
        self.last_saved = info.path
        return info

    def _choose(self) -> Optional[store.CheckpointInfo]:
        if self.resume_mode == "never":
            found = store.scan(self.root)
            if found.complete:
                raise ConfigError(
                    f"trainer.resume=never but trainer.checkpoint_path={self.root!r} already holds checkpoints "
                    f"({', '.join(os.path.basename(c.path) for c in found.complete)}) of an earlier run; rotation "
                    "would mix them with this run's. Use a new trainer.checkpoint_path, delete them, or resume "
                    "(trainer.resume=auto)")
            return None
        if self.resume_mode == "auto":
            found = store.scan(self.root)
            store.report_incomplete(found)
            store.remove_leftovers(self.root, found)
            return store.newest(self.root, found)
        meta, why = store.read_metadata(self.resume_mode)
        if meta is None:
            raise ConfigError(f"trainer.resume={self.resume_mode!r} is not a complete checkpoint: {why}. Use a "
                              f"step_N directory with {store.METADATA}, or auto / never")
        later = [os.path.basename(c.path) for c in store.scan(self.root).complete if c.step > meta["step"]]
        if later:
            # After a crash, resume=auto would pick those up and silently continue the other timeline.
            raise ConfigError(
                f"trainer.resume={self.resume_mode!r} is step {meta['step']}, but trainer.checkpoint_path="
                f"{self.root!r} holds later checkpoints ({', '.join(later)}) that a restart would resume "
                "instead. To branch off, point trainer.checkpoint_path at a new directory; to redo those "
                "steps, delete them first")
        return store.CheckpointInfo(path=self.resume_mode, step=int(meta["step"]), metadata=meta)

    def _warn_config_changes(self, ckpt_dir: str) -> None:
        saved_file = os.path.join(ckpt_dir, "config.yaml")
        if self.config is None or not os.path.isfile(saved_file):
            return
        import yaml

        from ..config import to_dict

        with open(saved_file, encoding="utf-8") as f:
            before = _flat(yaml.safe_load(f) or {})
        after = _flat(to_dict(self.config))
        changed = [f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in sorted(set(before) | set(after))
                   if before.get(k) != after.get(k) and k not in _EXPECTED_TO_CHANGE]
        if changed:
            log.warning(f"checkpoint: resuming with settings that differ from {saved_file}: " + "; ".join(changed[:12])
                        + (f" (and {len(changed) - 12} more)" if len(changed) > 12 else ""))

    # ------------------------------------------------------------------------------------------ helpers
    def _from_rank0(self, fn):
        """fn() on rank 0, its result (or its PhaserlError) on every rank."""
        if not is_distributed():
            return fn()
        import torch.distributed as dist

        box = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", fn())
            except PhaserlError as exc:
                box[0] = ("error", exc)
        dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise value
        return value


def _barrier() -> None:
    if is_distributed():
        import torch.distributed as dist

        dist.barrier()


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


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
