"""How far a run on 2 ranks drifts from the same run in 1 process, step by step (docs/distributed.md).

    python benchmarks/world_size_drift.py --steps 6          # the quickstart recipe, CPU, 2 gloo ranks
    python benchmarks/world_size_drift.py --steps 2 --smoke  # a few seconds (the tests' tiny random model)

Runs the quickstart's GRPO recipe (rollout.batch_size 16, so that it divides the 16 prompts per rank and
both runs draw the same samples) for --steps steps in one process and on 2 gloo ranks with FSDP2, and
prints one JSON line per step: the largest absolute difference of any actor weight, the parameter it is
in, and whether the two runs' responses were identical. Rounding differs between the runs (gradients are
summed across ranks in another order), and Adam divides by the root of the second moment, so a parameter
whose gradients are tiny (a bias) can turn that rounding into full-size steps: the gap grows over a run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def overrides(args, tag: str, tmp: str) -> list:
    common = [f"trainer.total_steps={args.steps}", "trainer.loggers=[]", "trainer.save_interval=0",
              "trainer.val_interval=0", "trainer.device=cpu", "rollout.batch_size=16",
              f"trainer.log_dir={tmp}/{tag}", f"trainer.checkpoint_path={tmp}/{tag}/ckpt"]
    if args.smoke:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from _tiny_run import make_run_dir

        tiny = os.path.join(tmp, "tiny")
        if not os.path.isdir(tiny):
            os.makedirs(tiny)
            make_run_dir(tiny)  # written once, by the single-process run, before the ranks start
        files = [f"model.path={tiny}/model", f"data.train_files=[{tiny}/train.jsonl]", "data.val_files=[]",
                 "data.max_prompt_length=32", "rollout.max_new_tokens=4", "rollout.prompts_per_step=4", "rollout.n=2",
                 "ppo.micro_batch_tokens=64", "ppo.forward_micro_batch_tokens=128", "actor.optim.lr=1e-3"]
        return files + common + ["rollout.batch_size=1"]  # 1 divides the 2 prompts per rank
    return common


def trajectory(args, tag: str, tmp: str) -> list:
    """[(full actor weights, response texts)] after each step of this process's run (rank 0's view)."""
    from phaserl.cli import QUICKSTART_CONFIG
    from phaserl.config import load_config
    from phaserl.parallel import rank_and_world
    from phaserl.parallel.fsdp import full_state_dict
    from phaserl.trainer import RLTrainer

    torch.manual_seed(0)
    config = None if args.smoke else QUICKSTART_CONFIG
    trainer = RLTrainer.from_config(load_config(config, overrides(args, tag, tmp), world_size=rank_and_world()[1]))
    responses, generate = [], trainer._generate
    trainer._generate = lambda *a: (lambda batch: (responses.append(batch.response_texts), batch)[1])(generate(*a))
    out = []
    for _ in range(args.steps):
        trainer.train_step()
        trainer.step_num += 1
        out.append(({k: v.float().clone() for k, v in full_state_dict(trainer.actor.model).items()}, responses[-1]))
    return out


def worker(rank: int, args, port: int, tmp: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    from phaserl.parallel import init_distributed

    init_distributed(timeout_s=300, backend="gloo")
    result = trajectory(args, "ranks2", tmp)
    torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--smoke", action="store_true", help="the tests' tiny random model instead of the tiny world")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from _multiproc import free_port

    with tempfile.TemporaryDirectory(prefix="phaserl-drift-") as tmp:
        single = trajectory(args, "ranks1", tmp)
        mp.start_processes(worker, args=(args, free_port(), tmp), nprocs=2, start_method="spawn")
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    for step, ((one, one_resp), (two, two_resp_0), (_, two_resp_1)) in enumerate(zip(single, *ranks), start=1):
        name, gap = max(((k, (one[k] - two[k]).abs().max().item()) for k in one), key=lambda kv: kv[1])
        print(json.dumps({"step": step, "max_abs_weight_diff": gap, "in": name,
                          "same_responses": one_resp == two_resp_0 + two_resp_1}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
