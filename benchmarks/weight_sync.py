"""Weight sync to a rollout rank: seconds and GB/s of one version, per model shape and bucket size.

Two ranks: rank 0 is the trainer (a plain model: one trainer rank, no FSDP gather), rank 1 the rollout rank
(its own copy). For each shape and bucket size both build the sync (phaserl.parallel.weight_sync), send one
warm-up version and then --repeats versions; the trainer times `send()` (header, cast and copy into the
buckets, broadcast of every bucket), the rollout rank `receive()` (every bucket, copied into its
parameters), each up to torch.cuda.synchronize(). Also one LoRA line per shape (adapters only, --lora rank).

On one GPU both ranks share it: NCCL refuses two ranks on one device, so the buckets go over gloo, staged
through host memory (what the sync does when trainer and rollout share a GPU). With a GPU per rank they go
over NCCL. Prints one JSON line per measurement (rank 0: the trainer's and the rollout rank's numbers).

    torchrun --standalone --nproc-per-node 2 benchmarks/weight_sync.py            # 0.5b and 1.5b, bf16
    torchrun --standalone --nproc-per-node 2 benchmarks/weight_sync.py --smoke    # CPU, tiny shape
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from phaserl.models import CausalLM  # noqa: E402
from phaserl.models.lora import LoRASettings, apply_lora  # noqa: E402
from phaserl.parallel.rank_split import RankSplit, build_groups  # noqa: E402
from phaserl.parallel.weight_sync import WeightReceiver, WeightSender  # noqa: E402
from qwen2_shapes import decoder_config  # noqa: E402


def start(device_type: str) -> torch.device:
    """The process group from torchrun's environment: NCCL where each rank has a GPU of its own, else gloo."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 2:
        raise SystemExit(f"weight_sync.py runs on 2 ranks (a trainer and a rollout rank), not {world}")
    if device_type == "cpu":
        dist.init_process_group("gloo", timeout=timedelta(seconds=600))
        return torch.device("cpu")
    if torch.cuda.device_count() >= world:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timedelta(seconds=600), device_id=device)
        return device
    torch.cuda.set_device(0)  # both ranks on the one GPU
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    return torch.device("cuda", 0)


def build(shape: str, device: torch.device, dtype: torch.dtype, lora: int, seed: int) -> CausalLM:
    torch.manual_seed(seed)
    with torch.device(device):
        model = CausalLM(decoder_config(shape)).to(dtype)
    if lora:
        apply_lora(model, LoRASettings(rank=lora, alpha=2.0 * lora))
    return model


def synced(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(groups, model, device, bucket_mb: float, repeats: int) -> dict:
    """Both ranks: one warm-up version, then `repeats`; returns this rank's seconds per version."""
    seconds = []
    if groups.rank == 0:
        sender = WeightSender(model, groups, bucket_bytes=int(bucket_mb * 2**20))
        for version in range(repeats + 1):
            synced(device)
            start_s = time.perf_counter()
            sender.send(version)
            synced(device)
            seconds.append(time.perf_counter() - start_s)
        sender.close()
        nbytes, buckets = sender.nbytes, len(sender.buckets)
    else:
        receiver = WeightReceiver(model, groups)
        for _ in range(repeats + 1):
            synced(device)
            start_s = time.perf_counter()
            receiver.receive()
            synced(device)
            seconds.append(time.perf_counter() - start_s)
        assert receiver.receive() is None  # the trainer closed this round
        nbytes, buckets = receiver.nbytes, len(receiver.buckets)
    return {"seconds": seconds[1:], "bytes": nbytes, "buckets": buckets}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"])
    parser.add_argument("--bucket-mb", nargs="+", type=float, default=[16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="both sides' parameter dtype")
    parser.add_argument("--lora", type=int, default=16, help="LoRA rank of the adapter-only line (0: none)")
    parser.add_argument("--smoke", action="store_true", help="CPU, the tiny shape, small buckets")
    args = parser.parse_args()
    if args.smoke:
        args.shapes, args.bucket_mb, args.repeats = ["tiny"], [0.0625, 1], 2
    device = start("cpu" if args.smoke else "cuda")
    groups = build_groups(RankSplit(2, 1), timeout_s=600.0)
    dtype = getattr(torch, args.dtype)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    shared = device.type == "cuda" and groups.sync_backend == "gloo"  # both ranks on one GPU
    for shape in args.shapes:
        for lora, buckets in [(0, args.bucket_mb)] + ([(args.lora, [args.bucket_mb[-1]])] if args.lora else []):
            model = build(shape, device, dtype, lora, seed=groups.rank)
            for bucket_mb in buckets:
                mine = measure(groups, model, device, bucket_mb, args.repeats)
                both = [None, None]
                dist.all_gather_object(both, mine)
                if groups.rank == 0:
                    for side, result in zip(("trainer_send", "rollout_receive"), both):
                        median = statistics.median(result["seconds"])
                        print(json.dumps({
                            "bench": "weight_sync", "side": side, "shape": shape, "dtype": args.dtype,
                            "lora_rank": lora, "bucket_mb": bucket_mb, "bytes": result["bytes"],
                            "buckets": result["buckets"], "seconds_median": round(median, 5),
                            "seconds": [round(s, 5) for s in result["seconds"]],
                            "gb_per_s": round(result["bytes"] / median / 1e9, 3), "backend": groups.sync_backend,
                            "device": card, "ranks_share_a_gpu": shared}), flush=True)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
