"""Classic mistake 5: on several ranks, checkpoint_path and log_dir must be one shared directory.

Two gloo ranks run in different working directories, so the same relative paths (`ckpt`, `logs`)
resolve to two node-local directories, as on two machines without shared storage. The check stops
both ranks before training with the paths, ranks, hosts and the fix; on a shared path it passes and
leaves no marker behind. RLTrainer.fit runs the check before anything else when world_size > 1.
"""
import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from _multiproc import free_port, start_method
from _tiny_run import make_run_dir
from phaserl.errors import PreflightError


def _ranks(rank: int, world: int, port: int, root: str) -> None:
    import torch.distributed as dist

    from phaserl.parallel.shared_storage import check_shared_paths

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    node = os.path.join(root, f"node{rank}")
    os.makedirs(node, exist_ok=True)
    os.chdir(node)
    results = {}
    cases = {"node_local": {"trainer.checkpoint_path": "ckpt", "trainer.log_dir": "logs"},
             "only_logs_local": {"trainer.checkpoint_path": os.path.join(root, "shared_ckpt"),
                                 "trainer.log_dir": "logs"},
             "shared": {"trainer.checkpoint_path": os.path.join(root, "shared_ckpt"),
                        "trainer.log_dir": os.path.join(root, "shared_logs")}}
    try:
        for name, paths in cases.items():
            try:
                check_shared_paths(paths, rank=rank, world_size=world)
                results[name] = "passed"
            except PreflightError as exc:
                results[name] = str(exc)
    finally:
        with open(os.path.join(root, f"results_{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()




@pytest.mark.slow
def test_node_local_paths_stop_every_rank_before_training(tmp_path):
    root = str(tmp_path)
    mp.start_processes(_ranks, args=(2, free_port(), root), nprocs=2, join=True, start_method=start_method())
    results = [json.load(open(tmp_path / f"results_{r}.json")) for r in range(2)]
    host = socket.gethostname()

    for r in results:                        # every rank stops with rank 0's message
        assert r["node_local"] == results[0]["node_local"] != "passed"
    message = results[0]["node_local"]
    assert message.startswith("stopping before training: trainer.checkpoint_path='ckpt' is not shared between ranks")
    assert f"rank 0 on host {host} (it resolves to {tmp_path / 'node0' / 'ckpt'})" in message
    assert f"rank 1 on host {host} (its trainer.checkpoint_path resolves to {tmp_path / 'node1' / 'ckpt'})" in message
    assert "trainer.log_dir='logs' is not shared" in message
    assert "mount shared storage" in message and "point trainer.checkpoint_path and trainer.log_dir at" in message

    only_logs = results[0]["only_logs_local"]
    problems = only_logs.split(". Every rank")[0]
    assert "trainer.log_dir='logs' is not shared" in problems and "checkpoint_path" not in problems

    assert [r["shared"] for r in results] == ["passed", "passed"]
    for d in ("shared_ckpt", "shared_logs", "node0/ckpt", "node1/logs"):
        assert os.listdir(tmp_path / d) == [], f"markers left in {d}"



@pytest.mark.slow
def test_fit_runs_the_check_first_on_several_ranks(tmp_path, monkeypatch):
    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer

    torch.set_num_threads(1)
    trainer = RLTrainer.from_config(load_config(None, make_run_dir(str(tmp_path)) + ["trainer.loggers=[jsonl]"]))
    calls = []

    def check(paths, *, rank, world_size):
        calls.append((paths, rank, world_size))
        raise PreflightError("stopping before training: not shared")
    monkeypatch.setattr("phaserl.parallel.shared_storage.check_shared_paths", check)
    trainer.world_size = 2                  # as under torchrun; the check is the first thing fit does
    with pytest.raises(PreflightError, match="not shared"):
        trainer.fit()
    assert calls == [({"trainer.checkpoint_path": str(tmp_path / "ckpt"), "trainer.log_dir": str(tmp_path / "logs")},
                      0, 2)]
    assert trainer.step == 0 and not (tmp_path / "ckpt").exists()
    assert not (tmp_path / "logs" / "metrics.jsonl").exists()  # metrics.jsonl opens at the first logged step
