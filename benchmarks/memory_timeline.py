"""GPU memory across the phases of a GRPO step, and through the actor's hybrid switch, on 1 or N GPUs.

Builds benchmarks/grpo_step.py's synthetic world (grpo_setup.py: a random-weight model of a Qwen2 shape,
a word-level tokenizer of the same vocabulary, prompts of --prompt-len words, a rule reward), then runs
--steps GRPO steps through the normal public path (load_config -> RLTrainer.from_config -> train_step)
with the memory timeline on (phaserl.parallel.record_memory). One JSON line per measurement:

    {"kind": "sample", "rank": r, "step": s, "label": <phase or switch>, "allocated_gb": ..., "peak_gb": ...}
        (label = the phase starting there; peak_gb = the peak over the segment that ends there)
    {"kind": "switch", "rank": r, ...the actor's last switch: seconds, memory before/after, KV cache}
    {"kind": "step", "rank": 0, "step": s, "timing_s/...": ..., "perf/...": ...}

    torchrun --nproc-per-node 2 benchmarks/memory_timeline.py --shape 0.5b --steps 2
    python benchmarks/memory_timeline.py --shape tiny --steps 1 --device cpu     # a smoke test on CPU

Defaults follow docs/distributed.md's example: actor FULL_SHARD with bf16 compute and float32 master
weights, optimizer state offloaded during rollout, reference FULL_SHARD bf16.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_setup  # noqa: E402  (the synthetic world of benchmarks/grpo_step.py)
from phaserl.config import load_config  # noqa: E402
from phaserl.parallel import mark_memory, record_memory, stop_recording  # noqa: E402
from phaserl.parallel.launch import destroy, init_distributed  # noqa: E402
from phaserl.trainer import RLTrainer  # noqa: E402
from qwen2_shapes import SHAPES  # noqa: E402


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def build_world(root: str, shape: str, prompt_len: int, num_prompts: int) -> None:
    """grpo_step.py's world under root: model, tokenizer, prompt file (its reward is grpo_setup.sevens)."""
    grpo_setup.write_model(root, shape)
    texts = grpo_setup.prompt_texts(num_prompts, prompt_len, SHAPES[shape]["vocab_size"])
    grpo_setup.write_prompt_file(root, texts)


def world_overrides(root: str, prompt_len: int) -> list:
    """Config overrides that point a run at build_world's files."""
    reward = f"{os.path.abspath(grpo_setup.__file__)}:sevens"
    return [f"model.path={root}/model", f"model.tokenizer_path={root}/tokenizer",
            f"data.train_files=[{root}/train.parquet]", f"data.val_files=[{root}/train.parquet]",
            "data.apply_chat_template=false", f"data.max_prompt_length={prompt_len}",
            f"reward.functions=[{{name: '{reward}'}}]"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=64, help="prompts per step, all ranks together")
    ap.add_argument("--samples", type=int, default=8, help="responses per prompt (rollout.n)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--root", default=None, help="where the world is written (default: a temp dir)")
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = ap.parse_args()

    rank, world = init_distributed()
    root = args.root or os.path.join(tempfile.gettempdir(), f"phaserl_memory_{args.shape}")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        build_world(root, args.shape, args.prompt_len, args.prompts * (args.steps + 1))
    if world > 1:
        torch.distributed.barrier()  # the files exist before any rank reads them
    overrides = world_overrides(root, args.prompt_len) + [
        f"trainer.device={args.device}", f"trainer.total_steps={args.steps}", "trainer.val_interval=0",
        f"trainer.log_dir={root}/logs", f"trainer.checkpoint_path={root}/ckpt", "trainer.save_interval=0",
        "algorithm.adv_estimator=grpo", "algorithm.kl_placement=loss", "algorithm.kl_coef=0.001",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.n={args.samples}",
        f"rollout.batch_size={args.prompts // world}",
        f"rollout.max_new_tokens={args.new_tokens}", "ppo.num_mini_batches=1", "ppo.epochs=1",
        "ppo.micro_batch_tokens=16384", "ppo.forward_micro_batch_tokens=32768",
        "actor.fsdp.param_dtype=bfloat16", "ref.fsdp.param_dtype=bfloat16",
        "actor.hybrid_engine.offload_optimizer=true", "actor.gradient_checkpointing=true",
    ] + list(args.overrides)
    cfg = load_config(None, overrides, world_size=world)
    trainer = RLTrainer.from_config(cfg)
    device = trainer.actor.device
    for step in range(args.steps):
        record_memory(device)
        metrics = trainer.train_step()
        mark_memory("step done", step)
        trainer.step_num += 1
        for sample in stop_recording():
            emit(kind="sample", rank=rank, world=world, shape=args.shape, **sample.as_dict())
        emit(kind="switch", rank=rank, step=step, **trainer.actor.last_switch)
        if rank == 0:
            emit(kind="step", rank=rank, world=world, shape=args.shape, step=step,
                 **{k: v for k, v in metrics.items() if k.startswith(("timing_s/", "perf/", "train/kl", "score/"))})
    destroy()


if __name__ == "__main__":
    main()
