"""The doctor's write preflight: checkpoint_path and log_dir are writable directories with room for checkpoints.

Before this check a `checkpoint_path` that is an existing file, an unwritable directory or a nearly full
disk passed the preflight, trained, and failed at the first save. Here, before any GPU time:
- each path is a directory, or can be created (its nearest existing parent is a directory we can write:
  tested by creating and removing a temporary file, not by permission bits);
- no other live run holds checkpoint_path's lock (phaserl.checkpoint.lock);
- the free space under checkpoint_path covers two checkpoints, estimated from the policy's parameter count:
  per trainable role, weights and AdamW's two moments in the parameter dtype (3 copies), plus the HF
  export of the actor when trainer.export_hf. A critic is counted at the policy's size. Two, because a
  save is published before rotation deletes the oldest one.
Not here: sharing the paths across nodes (checks.py's shared-path check).
"""
from __future__ import annotations

import os
import shutil
import tempfile

from ..checkpoint.lock import RunLock, describe
from ..config import derive
from ..memory.budget import fmt_bytes
from .checks import Context, check
from .report import FAIL, OK, CheckResult

_NAME = "write paths"


def checkpoint_bytes(params: int, bytes_per_param: int, *, roles: int, export_hf: bool) -> int:
    """Estimated size of one checkpoint: 3 copies (weights, exp_avg, exp_avg_sq) per trainable role."""
    return params * bytes_per_param * (3 * roles + int(export_hf))


def _writable_problem(key: str, path: str) -> tuple[str, str]:
    """("", "") when `path` is (or can become) a writable directory, else (problem, the existing directory)."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        return f"{key} = {path!r} is an existing file, not a directory", ""
    parent = full
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{key} = {path!r} cannot be created: {parent} is a file", ""
    try:
        fd, probe = tempfile.mkstemp(prefix=".phaserl-doctor-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"{key} = {path!r} is not writable ({parent}: {exc.strerror})", parent
    return "", parent


@check(_NAME, needs=("policy",))
def check_write_paths(ctx: Context) -> CheckResult:
    t = ctx.cfg.trainer
    fix = "point trainer.checkpoint_path and trainer.log_dir at directories this user can write, with room"
    where = {}
    for key, path in (("trainer.checkpoint_path", t.checkpoint_path), ("trainer.log_dir", t.log_dir)):
        problem, where[key] = _writable_problem(key, path)
        if problem:
            return CheckResult(_NAME, FAIL, problem, fix=fix)
    lock = RunLock(t.checkpoint_path)
    holder = lock.live_holder()
    if holder is not None:
        return CheckResult(_NAME, FAIL, f"trainer.checkpoint_path is in use by another run: {describe(holder)}",
                           fix="wait for it or stop it, or use another trainer.checkpoint_path")
    first = next(ctx.policy.parameters())
    params = sum(p.numel() for p in ctx.policy.parameters())
    roles = 1 + int(derive(ctx.cfg, ctx.world_size).critic_enabled)
    need = checkpoint_bytes(params, first.element_size(), roles=roles, export_hf=t.export_hf)
    free = shutil.disk_usage(where["trainer.checkpoint_path"]).free
    summary = f"one checkpoint is about {fmt_bytes(need)} ({roles} role(s): weights + AdamW moments)"
    if free < 2 * need:
        return CheckResult(_NAME, FAIL, f"{fmt_bytes(free)} free under trainer.checkpoint_path, less than two "
                                        f"checkpoints; {summary}", fix="free space, or choose a larger disk")
    return CheckResult(_NAME, OK, f"checkpoint_path and log_dir writable; {fmt_bytes(free)} free, {summary}")
