"""The Checkpointer: save a TrainingState atomically with a manifest; resume from the newest good checkpoint.

Both `save` and `resume` are collective under torch.distributed: every rank calls them and writes its
own shards and RNG file; rank 0 alone takes the run lock, writes the shared files and the manifest,
publishes, rotates and decides which checkpoints are candidates. Verification is shared: each rank hashes
its part of the files. A damaged newest checkpoint is reported and skipped for the previous good one
(`resume_fallback=False`: stop instead). Not here: when to save (the trainer's loop), the layout on disk
(store.py), what a checkpoint holds (state.py, rng.py), the checks themselves (manifest.py).
"""
from __future__ import annotations

import datetime
import errno
import fnmatch
import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import CheckpointException as _DCPException  # a BaseException

from .. import __version__
from ..errors import CheckpointError, ConfigError, PhaserlError
from ..models.lora import has_lora
from ..parallel import is_distributed, training_group
from . import manifest, store
from .export import export_role
from .lock import RunLock
from .rng import load_rng, rng_file, save_rng
from .state import (
    DCP_DIR,
    RNG_DIR,
    ROLES_FILE,
    STATE_FILE,
    TrainingState,
    load_json_state,
    load_roles,
    save_architecture,
    save_json_state,
    save_roles,
)

log = logging.getLogger("phaserl")

# Settings a resumed run changes on purpose: not worth a warning.
_EXPECTED_TO_CHANGE = ("trainer.resume", "trainer.total_steps", "trainer.checkpoint_path")


@dataclass
class Checkpointer:
    root: str                   # trainer.checkpoint_path
    keep: int                   # trainer.keep_checkpoint_num
    resume_mode: str            # trainer.resume: "auto", "never" or a checkpoint directory
    export_hf: bool             # trainer.export_hf: also write step_N/hf/
    config: Any = None          # the resolved Config, saved as config.yaml
    rank: int = 0
    world_size: int = 1
    verify_full: bool = True    # trainer.checkpoint_verify == "full": digests too, not only sizes
    fallback: bool = True       # trainer.resume_fallback: skip a damaged newest checkpoint
    last_saved: Optional[str] = None
    _lock: Optional[RunLock] = None

    # ------------------------------------------------------------------------------------------ save
    def save(self, state: TrainingState) -> str:
        """Write step_{state.step}/ atomically, point `latest` at it, rotate.  Returns its path."""
        t0 = time.perf_counter()
        tmp = self._from_rank0(lambda: store.new_tmp_dir(self.root, state.step))
        published = False
        try:
            plain = save_roles(state.roles, tmp)
            save_rng(state.generators, os.path.join(tmp, RNG_DIR), self.rank)
            known = _gather_to_rank0(manifest.digests(tmp, self._own_files(tmp)))
            if self.rank == 0:
                store.write_json(os.path.join(tmp, ROLES_FILE), plain)
                self._write_shared_files(tmp, state)
                manifest.write_manifest(tmp, known)       # last: lists every file above
                store.publish(tmp, self.root, state.step)
                store.rotate(self.root, self.keep)
            published = True
        except (Exception, _DCPException) as exc:
            if _out_of_space(exc) or _free_bytes(self.root) < (64 << 20):
                kept = (f"the previous checkpoint {self.last_saved} is intact" if self.last_saved
                        else "no earlier checkpoint")
                raise CheckpointError(
                    f"saving step {state.step} to {self.root} failed: no space left on the device "
                    f"({_free_bytes(self.root) / 2**30:.2f} GiB free); {kept}. Free space (or lower "
                    "trainer.keep_checkpoint_num), then run the same command again: it resumes from the last "
                    "good checkpoint. `phaserl doctor` estimates what a checkpoint needs") from None
            raise
        finally:
            if not published and self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        self.last_saved = store.step_dir(self.root, state.step)
        if self.rank == 0:
            held = _roles_held(state.roles, os.path.join(self.last_saved, DCP_DIR))
            log.info(f"checkpoint: saved step {state.step} to {self.last_saved} ({time.perf_counter() - t0:.1f} s; "
                     f"{held})")
        return self.last_saved

    def _own_files(self, tmp: str) -> list:
        """The files this rank wrote: its DCP shards (DCP names them __{rank}_*) and its RNG file."""
        dcp_dir = os.path.join(tmp, DCP_DIR)
        shards = [os.path.join(DCP_DIR, n) for n in sorted(os.listdir(dcp_dir))
                  if fnmatch.fnmatch(n, f"__{self.rank}_*.distcp")]
        return shards + [os.path.relpath(rng_file(os.path.join(tmp, RNG_DIR), self.rank), tmp)]

    def _write_shared_files(self, tmp: str, state: TrainingState) -> None:
        from ..config import dump_yaml

        save_json_state(state, os.path.join(tmp, STATE_FILE))
        if self.config is not None:
            dump_yaml(self.config, os.path.join(tmp, "config.yaml"))
        save_architecture(state, tmp)
        if self.export_hf:
            export_role(tmp, os.path.join(tmp, "hf"), role="actor")
        store.write_json(os.path.join(tmp, store.METADATA), {
            "step": state.step, "world_size": self.world_size, "roles": sorted(state.roles),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "phaserl_version": __version__, "torch_version": torch.__version__, "complete": True})

    # ------------------------------------------------------------------------------------------ resume
    def resume(self, state: TrainingState) -> Optional[store.CheckpointInfo]:
        """Take the run lock, then restore `state` from the checkpoint trainer.resume picks (None: start fresh)."""
        candidates = self._from_rank0(self._candidates)
        info = self._first_good(candidates)
        if info is None:
            return None
        saved_roles, wanted = info.metadata.get("roles", []), sorted(state.roles)
        if saved_roles != wanted:
            raise ConfigError(f"checkpoint {info.path} holds roles {saved_roles}, this run trains {wanted} "
                              "(critic.enable / algorithm.adv_estimator changed?); resume with the same "
                              "setup, or start fresh with trainer.resume=never and a new trainer.checkpoint_path")
        try:
            load_roles(state.roles, info.path)
            load_json_state(state, os.path.join(info.path, STATE_FILE))
            load_rng(state.generators, os.path.join(info.path, RNG_DIR), self.rank, seed_hint="seeded")
        except CheckpointError as exc:
            raise CheckpointError(f"resuming from {info.path} failed: {exc}. To resume from an earlier checkpoint, "
                                  "set trainer.resume to its step_N directory (or delete this one)") from None
        saved_world = info.metadata.get("world_size")
        if self.rank == 0:
            self._warn_config_changes(info.path)
            where = f"saved by {saved_world} rank(s), resumed on {self.world_size}"
            log.info(f"checkpoint: resumed from {info.path} (step {info.step}; {where})")
        self.last_saved = info.path
        return info

    def close(self) -> None:
        """Release the run lock (rank 0); the run's files stay."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _take_lock(self) -> None:
        if self._lock is None:
            lock = RunLock(self.root)
            lock.acquire()
            self._lock = lock

    def _candidates(self) -> list:
        """Rank 0: the lock, the start-up cleanup, and the checkpoints to try, newest first."""
        self._take_lock()   # before anything below touches the directory: never another live run's files
        if self.resume_mode == "never":
            found = store.scan(self.root)
            if found.complete:
                raise ConfigError(
                    f"trainer.resume=never but trainer.checkpoint_path={self.root!r} already holds checkpoints "
                    f"({', '.join(os.path.basename(c.path) for c in found.complete)}) of an earlier run; rotation "
                    "would mix them with this run's. Use a new trainer.checkpoint_path, delete them, or resume "
                    "(trainer.resume=auto)")
            return []
        if self.resume_mode == "auto":
            found = store.scan(self.root)
            store.report_incomplete(found)
            store.remove_leftovers(self.root, found)
            store.check_pointer(self.root, found)
            return list(reversed(found.complete))
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
        return [store.CheckpointInfo(path=self.resume_mode, step=int(meta["step"]), metadata=meta)]

    def _first_good(self, candidates: list) -> Optional[store.CheckpointInfo]:
        """Collective: the first candidate whose manifest verifies; damaged ones are reported (or stop the run)."""
        damaged = []
        for info in candidates:
            mine = manifest.verify(info.path, full=self.verify_full, rank=self.rank, world=self.world_size)
            problems = _union_over_ranks(mine)
            if not problems:
                if damaged and self.rank == 0:
                    log.warning(f"checkpoint: resuming from {info.path} instead of the damaged "
                                f"{', '.join(os.path.basename(p) for p, _ in damaged)}")
                return info
            damaged.append((info.path, problems))
            if self.rank == 0:
                log.warning(f"checkpoint: {info.path} is damaged: {_listing(problems)}")
            explicit = self.resume_mode not in ("auto", "never")
            if explicit or not self.fallback:
                why = ("trainer.resume names it" if explicit else "trainer.resume_fallback=false")
                raise CheckpointError(
                    f"checkpoint {info.path} is damaged: {_listing(problems)}. Not resuming from an earlier one "
                    f"because {why}. Restore the files, delete the directory, or "
                    + ("name another step_N" if explicit else "set trainer.resume_fallback=true"))
        if damaged:
            raise CheckpointError(
                f"every checkpoint under {self.root} is damaged: "
                + "; ".join(f"{os.path.basename(p)}: {_listing(pr)}" for p, pr in damaged)
                + ". Restore them from a copy, or start over with a new trainer.checkpoint_path")
        return None

    def _warn_config_changes(self, ckpt_dir: str) -> None:
        saved_file = os.path.join(ckpt_dir, "config.yaml")
        if self.config is None or not os.path.isfile(saved_file):
            return
        import yaml

        from ..config import to_dict

        try:
            with open(saved_file, encoding="utf-8") as f:
                before = _flat(yaml.safe_load(f) or {})
        except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError) as exc:
            log.warning(f"checkpoint: {saved_file} is unreadable ({type(exc).__name__}), so this run's settings are "
                        "not compared with the saved run's")
            return
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
        dist.broadcast_object_list(box, src=0, group=training_group())  # trainer rank 0 is global rank 0
        kind, value = box[0]
        if kind == "error":
            raise value
        return value


def _listing(problems: list, limit: int = 4) -> str:
    return "; ".join(problems[:limit]) + (f" (and {len(problems) - limit} more)" if len(problems) > limit else "")


def _out_of_space(exc: BaseException) -> bool:
    seen, todo = set(), [exc]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno == errno.ENOSPC or "No space left" in str(err):
            return True
        if isinstance(err, _DCPException):
            todo.extend(pair[0] if isinstance(pair, tuple) else pair for pair in err.failures.values())
        todo.extend([err.__cause__, err.__context__])
    return False


def _free_bytes(path: str) -> int:
    while path and not os.path.isdir(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return 1 << 62


def _gather_to_rank0(mine: dict) -> dict:
    if not is_distributed():
        return mine
    import torch.distributed as dist

    parts = [None] * dist.get_world_size(training_group())
    dist.all_gather_object(parts, mine, group=training_group())
    return {k: v for part in parts for k, v in part.items()}


def _union_over_ranks(problems: list) -> list:
    if not is_distributed():
        return problems
    import torch.distributed as dist

    parts = [None] * dist.get_world_size(training_group())
    dist.all_gather_object(parts, problems, group=training_group())
    return sorted({p for part in parts for p in part})


def _roles_held(roles: dict, dcp_dir: str) -> str:
    """'dcp/ 0.7 MB: actor adapters + optimizer state only' (LoRA roles save their trainable state alone)."""
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(dcp_dir) for f in files)
    lora = [name for name, role in roles.items() if has_lora(role.model)]
    what = f": {', '.join(lora)} adapters + optimizer state only" if lora else ""
    return f"dcp/ {size / 2**20:.1f} MB{what}"


def _barrier() -> None:
    if is_distributed():
        import torch.distributed as dist

        dist.barrier(group=training_group())


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
