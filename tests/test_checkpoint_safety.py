"""Checkpoints that cannot run code, that name their damage, and that one run at a time writes.

Bugs reproduced here:
- a dcp/.metadata replaced by a crafted pickle ran its payload on resume and on export (DCP reads it with
  plain pickle, and its non-tensor items with torch.load(weights_only=False));
- a deleted or truncated shard, or an invalid trainer_state.json, failed every restart with a traceback
  instead of resuming from the previous good checkpoint; a `latest` naming a deleted step likewise;
- two runs on one checkpoint_path both ran, and one's start-up cleanup deleted the other's save in progress;
- a full disk surfaced as "unexpected pos 704 vs 598" with no word about space.
"""
import errno
import json
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from _tiny_run import make_run_dir
from phaserl.checkpoint import export_checkpoint, manifest
from phaserl.checkpoint.lock import LOCK_FILE, _proc_start
from phaserl.config import load_config
from phaserl.errors import CheckpointError, PhaserlError
from phaserl.trainer import RLTrainer

RUN = ["trainer.total_steps=3", "trainer.save_interval=1", "trainer.keep_checkpoint_num=3",
       "trainer.loggers=[jsonl]", "trainer.val_before_train=false"]


# Files that resume / export never open (resume takes the tokenizer from the model directory; export needs
# neither the run's config nor its RNG).
NOT_READ_BY = {"resume": ("config.yaml", "tokenizer/"), "export": ("config.yaml", "rng/")}


class _Payload:
    """A pickle that, when loaded, writes a marker file: what an attacker's code would do instead."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('code ran')",))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("safety")
    overrides = make_run_dir(str(root)) + RUN
    torch.set_num_threads(1)
    trainer = RLTrainer.from_config(load_config(None, overrides))
    trainer.fit()
    return dict(root=root, overrides=overrides, trainer=trainer)


def _copy(run, tmp_path) -> str:
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(run["root"] / "ckpt", ckpt)
    return ckpt


def _checkpointer(run, ckpt: str, **changes):
    from phaserl.trainer.build import build_checkpointer

    overrides = run["overrides"] + [f"trainer.checkpoint_path={ckpt}"] + [f"{k}={v}" for k, v in changes.items()]
    return build_checkpointer(load_config(None, overrides), 0, 1)


def _resume(run, ckpt: str, **changes):
    checkpointer = _checkpointer(run, ckpt, **changes)
    try:
        return checkpointer.resume(run["trainer"].checkpoint_state())
    finally:
        checkpointer.close()


# ---------------------------------------------------------------------------------------------- no code runs

def test_every_checkpoint_file_is_read_without_pickle(run, tmp_path):
    """A code-running pickle planted in each file (with the manifest rewritten to match, so that the loaders
    themselves are what stands in the way): resume and export refuse, with the file named, and nothing runs."""
    files = manifest.files_of(str(run["root"] / "ckpt" / "step_3"))
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "rng/rank_0.safetensors", "roles.json",
            "trainer_state.json"} <= set(files)
    for i, rel in enumerate(files + [manifest.MANIFEST]):
        ckpt = str(tmp_path / f"c{i}")
        shutil.copytree(run["root"] / "ckpt", ckpt)
        step = os.path.join(ckpt, "step_3")
        marker = str(tmp_path / f"ran_{i}")
        with open(os.path.join(step, rel), "wb") as f:
            pickle.dump(_Payload(marker), f)
        if rel != manifest.MANIFEST:
            manifest.write_manifest(step, {})
        for attempt in ("resume", "export"):
            try:
                if attempt == "resume":
                    _resume(run, ckpt, **{"trainer.resume": step})
                else:
                    export_checkpoint(step, str(tmp_path / f"hf_{i}"))
            except PhaserlError as exc:
                message = str(exc)
            else:
                message = ""     # a file this path never reads: fine, as long as nothing ran
                assert rel.startswith(NOT_READ_BY[attempt]), f"the planted {rel} went unnoticed by {attempt}"
            assert not os.path.exists(marker), f"the pickle planted in {rel} ran on {attempt}"
            if message:
                assert rel.split("/")[0] in message, f"{attempt} with a planted {rel} did not name it: {message}"


def test_a_crafted_dcp_metadata_is_refused_by_name(run, tmp_path):
    ckpt = _copy(run, tmp_path)
    step = os.path.join(ckpt, "step_3")
    marker = str(tmp_path / "ran")
    with open(os.path.join(step, "dcp", ".metadata"), "wb") as f:
        pickle.dump(_Payload(marker), f)
    manifest.write_manifest(step, {})
    with pytest.raises(CheckpointError, match=r"dcp/\.metadata asks to load builtins\.exec, which is not part of a "
                                              r"checkpoint's metadata.*refuses to run code"):
        _resume(run, ckpt, **{"trainer.resume": step})
    assert not os.path.exists(marker)


def test_the_metadata_this_torch_writes_needs_only_admitted_classes(run):
    """What torch (2.13 here, 2.11 on the lent GPU) pickles into .metadata is exactly what the unpickler admits."""
    from phaserl.checkpoint import safe_dcp

    class Recording(pickle.Unpickler):
        seen = set()

        def find_class(self, module, name):
            self.seen.add((module, name))
            return super().find_class(module, name)
    with open(run["root"] / "ckpt" / "step_3" / "dcp" / ".metadata", "rb") as f:
        Recording(f).load()
    dtypes = {(m, n) for m, n in Recording.seen if m == "torch" and isinstance(getattr(torch, n), torch.dtype)}
    assert Recording.seen - dtypes <= safe_dcp._ALLOWED, Recording.seen - dtypes - safe_dcp._ALLOWED
    meta = safe_dcp.read_metadata_safely(str(run["root"] / "ckpt" / "step_3" / "dcp" / ".metadata"))
    assert "actor/model/model.embed_tokens.weight" in meta.state_dict_metadata


@pytest.mark.gpu
def test_a_cuda_run_saves_resumes_and_exports_through_the_safe_loaders(tmp_path):
    overrides = make_run_dir(str(tmp_path)) + RUN + ["trainer.device=cuda", "trainer.total_steps=2"]
    trainer = RLTrainer.from_config(load_config(None, overrides))
    trainer.fit()
    again = RLTrainer.from_config(load_config(None, overrides + ["trainer.total_steps=3"]))
    again.fit()
    assert again.step_num == 3
    assert os.path.isfile(export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "hf")) / "model.safetensors")


# ---------------------------------------------------------------------------------------------- recovery

def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _same_size_garbage(path: str) -> None:
    with open(path, "r+b") as f:
        f.write(b"x")          # the first byte: '{' becomes 'x', still the same size


DAMAGE = {
    "a truncated shard": (lambda s: _truncate(os.path.join(s, "dcp", "__0_0.distcp")),
                          r"dcp/__0_0.distcp is \d+ bytes, the manifest says \d+"),
    "a deleted shard": (lambda s: os.unlink(os.path.join(s, "dcp", "__0_0.distcp")), r"dcp/__0_0.distcp is missing"),
    "an invalid trainer_state.json": (lambda s: _same_size_garbage(os.path.join(s, "trainer_state.json")),
                                      r"trainer_state.json (has another SHA-256|is not valid JSON)"),
    "a truncated rng file": (lambda s: _truncate(os.path.join(s, "rng", "rank_0.safetensors")),
                             r"rng/rank_0.safetensors is \d+ bytes"),
    "no manifest": (lambda s: os.unlink(os.path.join(s, manifest.MANIFEST)), r"no manifest.json"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_reported_and_resume_falls_back(run, tmp_path, caplog, damage):
    ckpt = _copy(run, tmp_path)
    harm, reported = DAMAGE[damage]
    harm(os.path.join(ckpt, "step_3"))
    with caplog.at_level(logging.WARNING, logger="phaserl"):
        info = _resume(run, ckpt)
    assert info.step == 2
    text = caplog.text
    assert f"{os.path.join(ckpt, 'step_3')} is damaged: " in text
    assert any(__import__("re").search(reported, line) for line in text.splitlines()), text
    assert f"resuming from {os.path.join(ckpt, 'step_2')} instead of the damaged step_3" in text


def test_size_only_verification_still_catches_an_invalid_json_file(run, tmp_path):
    ckpt = _copy(run, tmp_path)
    _same_size_garbage(os.path.join(ckpt, "step_3", "trainer_state.json"))
    assert _resume(run, ckpt, **{"trainer.checkpoint_verify": "size"}).step == 2


def test_resume_fallback_false_stops_naming_the_damage(run, tmp_path):
    ckpt = _copy(run, tmp_path)
    _truncate(os.path.join(ckpt, "step_3", "dcp", "__0_0.distcp"))
    with pytest.raises(CheckpointError, match=r"step_3 is damaged: dcp/__0_0.distcp is \d+ bytes.*"
                                              r"trainer.resume_fallback=false"):
        _resume(run, ckpt, **{"trainer.resume_fallback": "false"})


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(run, tmp_path):
    ckpt = _copy(run, tmp_path)
    for step in (1, 2, 3):
        os.unlink(os.path.join(ckpt, f"step_{step}", "dcp", "__0_0.distcp"))
    with pytest.raises(CheckpointError, match=r"every checkpoint under .* is damaged: step_3: .*step_1: "):
        _resume(run, ckpt)


def test_latest_naming_a_deleted_step_is_reported_and_the_newest_on_disk_used(run, tmp_path, caplog):
    ckpt = _copy(run, tmp_path)
    shutil.rmtree(os.path.join(ckpt, "step_3"))          # latest still says step_3
    with caplog.at_level(logging.WARNING, logger="phaserl"):
        assert _resume(run, ckpt).step == 2
    assert "latest names step_3, which does not exist (deleted or never finished); using step_2" in caplog.text


def test_export_refuses_a_damaged_step_and_takes_the_newest_good_from_a_root(run, tmp_path):
    ckpt = _copy(run, tmp_path)
    _truncate(os.path.join(ckpt, "step_3", "dcp", "__0_0.distcp"))
    with pytest.raises(CheckpointError, match=r"step_3' is damaged: dcp/__0_0.distcp is \d+ bytes"):
        export_checkpoint(os.path.join(ckpt, "step_3"), str(tmp_path / "hf"))
    assert os.path.isfile(export_checkpoint(ckpt, str(tmp_path / "hf")) / "model.safetensors")


# ---------------------------------------------------------------------------------------------- the lock

def _write_lock(ckpt: str, pid: int, host: str = None) -> None:
    with open(os.path.join(ckpt, LOCK_FILE), "w") as f:
        json.dump({"host": host or socket.gethostname(), "pid": pid, "proc_start": _proc_start(pid),
                   "started": "2026-12-01T10:00:00+00:00", "command": "phaserl train other.yaml"}, f)


def test_a_second_run_on_a_locked_path_stops_naming_the_holder_and_touches_nothing(run, tmp_path):
    ckpt = _copy(run, tmp_path)
    in_progress = os.path.join(ckpt, ".tmp_step_4_abcd")      # the other run's save in progress
    os.makedirs(os.path.join(in_progress, "dcp"))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(ckpt, other.pid)
        with pytest.raises(CheckpointError, match=rf"is in use by another run: pid {other.pid} on host "
                                                  rf"{socket.gethostname()}, started 2026-12-01T10:00:00\+00:00 "
                                                  r"\(phaserl train other.yaml\)"):
            _resume(run, ckpt)
        assert os.path.isdir(in_progress), "start-up cleanup deleted another live run's save in progress"
    finally:
        other.kill()
        other.wait()


def test_a_stale_lock_is_taken_over_with_a_warning_and_released_at_the_end(run, tmp_path, caplog):
    ckpt = _copy(run, tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _write_lock(ckpt, gone.pid)
    checkpointer = _checkpointer(run, ckpt)
    with caplog.at_level(logging.WARNING, logger="phaserl"):
        assert checkpointer.resume(run["trainer"].checkpoint_state()).step == 3
    assert (f"taking over the stale lock {os.path.join(ckpt, LOCK_FILE)} of a run that is gone (pid {gone.pid}"
            in caplog.text)
    with open(os.path.join(ckpt, LOCK_FILE)) as f:
        assert json.load(f)["pid"] == os.getpid()
    checkpointer.close()
    assert not os.path.exists(os.path.join(ckpt, LOCK_FILE))


def test_a_lock_held_on_another_host_says_how_to_remove_it(run, tmp_path):
    ckpt = _copy(run, tmp_path)
    _write_lock(ckpt, 12345, host="node-b")
    with pytest.raises(CheckpointError, match=rf"pid 12345 on host node-b.*delete {os.path.join(ckpt, LOCK_FILE)}"):
        _resume(run, ckpt)


# ---------------------------------------------------------------------------------------------- full disk

def test_a_save_that_runs_out_of_space_says_so_and_keeps_the_previous_checkpoint(run, tmp_path, monkeypatch):
    from phaserl.checkpoint import checkpointer as module

    ckpt = _copy(run, tmp_path)
    checkpointer = _checkpointer(run, ckpt)
    state = run["trainer"].checkpoint_state()
    checkpointer.resume(state)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(module, "save_rng", full_disk)
    state.step = 4
    with pytest.raises(CheckpointError, match=rf"saving step 4 to {ckpt} failed: no space left on the device "
                                              r"\(.* GiB free\); the previous checkpoint "
                                              rf"{os.path.join(ckpt, 'step_3')} is intact"):
        checkpointer.save(state)
    checkpointer.close()
    assert sorted(n for n in os.listdir(ckpt)) == ["latest", "step_1", "step_2", "step_3"]   # no leftovers
    assert manifest.verify(os.path.join(ckpt, "step_3"), full=True) == []
