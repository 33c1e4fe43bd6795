"""No orphaned ranks: killing torchrun (SIGKILL to its process group) stops every rank, and nothing is
written after; a rank on the same host that vanished is noticed by its peers.

torchrun starts each worker in a session of its own, so SIGKILL to the launcher's group does not reach
them: before phaserl.parallel.watch they went on training and writing step_N directories.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from _multiproc import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _children(pid: int) -> list:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", encoding="utf-8") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(name))
    return out


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _steps(ckpt: str) -> list:
    return sorted(n for n in os.listdir(ckpt) if n.startswith("step_")) if os.path.isdir(ckpt) else []


@pytest.mark.slow
def test_killing_the_launcher_stops_every_rank_and_nothing_is_written_after(tmp_path):
    from _tiny_run import make_run_dir
    from phaserl.config import dump_yaml, load_config

    overrides = make_run_dir(str(tmp_path)) + ["trainer.total_steps=500", "trainer.save_interval=1",
                                               "trainer.keep_checkpoint_num=500", "trainer.loggers=[jsonl]",
                                               "reward.functions=[format]"]
    cfg = str(tmp_path / "run.yaml")
    dump_yaml(load_config(None, overrides), cfg)
    ckpt = str(tmp_path / "ckpt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ROOT}
    workers = []
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "phaserl", "train", cfg, "--skip-doctor"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not _steps(ckpt) and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _steps(ckpt), ("no checkpoint appeared:\n"
                              f"{launcher.stdout.read()[-3000:] if launcher.poll() is not None else ''}")
        workers = _children(launcher.pid)
        assert len(workers) == 2, workers
        # the launcher and its group; the ranks have sessions of their own
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 20
        while any(_running(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_running(w) for w in workers), "the ranks kept running after their launcher was killed"
        after = _steps(ckpt)
        time.sleep(3)
        assert _steps(ckpt) == after, "checkpoints were written after the ranks should have stopped"
        out = launcher.stdout.read()                    # the ranks' own lines came through the inherited pipe
        assert "its launcher (pid" in out and "is gone; stopping this rank now" in out, out[-3000:]
    finally:  # never leave ranks behind, whatever failed above
        if launcher.poll() is None:
            workers = _children(launcher.pid)
            os.killpg(launcher.pid, signal.SIGKILL)
        for w in workers:
            if _running(w):
                os.kill(w, signal.SIGKILL)
        launcher.stdout.close()


def test_a_rank_that_vanished_from_this_host_is_noticed_and_one_that_finished_is_not(tmp_path, monkeypatch):
    from phaserl.parallel import watch

    monkeypatch.setattr(watch.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    w = watch._Watch(rank=0, world=2, interval_s=60)
    assert w._problem() is None
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    peer = os.path.join(w.directory, "1.pid")
    with open(peer, "w") as f:
        f.write(str(dead.pid))
    assert w._problem() == f"rank 1 (pid {dead.pid}) on this host is gone"
    os.unlink(peer)                                      # what stop_watch() does when a rank finishes
    assert w._problem() is None
    w.stop()
    assert not os.path.exists(w.directory)
