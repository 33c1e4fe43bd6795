"""The rank program of benchmarks/multi_gpu.py: one part of the several-GPU measurements, run on the
ranks torchrun starts (or in one plain process for the 1-rank references). Prints JSON lines and writes .pt files;
it compares nothing (multi_gpu.py does) and is not meant to be started by hand, though it can be:

    python benchmarks/multi_gpu_ranks.py world --root /tmp/mg --device cpu --smoke
    torchrun --standalone --nproc-per-node 2 benchmarks/multi_gpu_ranks.py steps --root /tmp/mg --device cpu --smoke

Jobs (several may run in one launch, in order):
  world   (one process) the synthetic worlds: a tiny Qwen2 (grpo_setup.py's word tokenizer and `sevens` reward),
          a reward model for it, Mistral, Gemma 3 and Qwen3-MoE tiny configs made by transformers (families.py),
          and grpo_step.py's world at the scaling shape and at the switch shape
  steps   one RL step per correctness scenario (GRPO, PPO with a critic and a FULL_SHARD reward model, GRPO with
          LoRA, GRPO on native Mistral, Gemma 3, and Qwen3-MoE with routing replay); rank 0 saves responses,
          metrics and the actor's (and critic's) full weights before and after the step to ROOT/steps-w{world}.pt
  ckpt:LEG:CHAIN:N  one leg of a checkpoint chain: `fit()` up to step N, resuming from ROOT/chain-CHAIN's
          newest checkpoint; rank 0 saves the weights right after the resume and at the end to ROOT/ckpt-LEG.pt
  scale   grpo_step.py's own GRPO step (run_ours) on this world size, 32 prompts x 8 per rank at --shape 1.5b;
          every rank's lines carry its rank
  switch  the actor's [HybridEngine] switches at the 0.5B shape, per step, for three settings (FULL_SHARD,
          FULL_SHARD + offload_optimizer, NO_SHARD + keep_awake), one switch pair of each under torch.profiler,
          and the engine's begin seconds and graph count per step
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import grpo_setup  # noqa: E402
import grpo_step  # noqa: E402
import step_probes  # noqa: E402
from memory_timeline import world_overrides  # noqa: E402
from phaserl.parallel.fsdp import full_state_dict  # noqa: E402
from phaserl.parallel.launch import destroy, init_distributed  # noqa: E402

# families.py's tiny shapes have prompts of 8 tokens
PROMPT_LEN = {"qwen2": 16, "mistral": 8, "gemma3": 8, "qwen3-moe": 8}
GRPO = ["algorithm.adv_estimator=grpo", "algorithm.kl_placement=loss", "algorithm.kl_coef=0.1",
        "ref.fsdp.sharding_strategy=NO_SHARD", "actor.gradient_checkpointing=true"]
PPO = ["algorithm.adv_estimator=gae", "algorithm.kl_placement=reward", "actor.fsdp.sharding_strategy=SHARD_GRAD_OP",
       "critic.fsdp.sharding_strategy=NO_SHARD", "critic.optim.lr=1e-3",
       "reward_model.enable=true", "reward_model.path={root}/rm", "reward_model.apply_chat_template=false",
       "reward_model.fsdp.sharding_strategy=FULL_SHARD", "reward.reward_model_weight=1.0"]
LORA = GRPO + ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.optim.lr=3e-2"]
# scenario -> (world directory under ROOT, extra overrides)
SCENARIOS = {"grpo": ("qwen2", GRPO), "ppo_rm": ("qwen2", PPO), "grpo_lora": ("qwen2", LORA),
             "grpo_mistral": ("mistral", GRPO + ["model.implementation=native"]),
             "grpo_gemma3": ("gemma3", GRPO + ["model.implementation=native"]),
             "grpo_moe_replay": ("qwen3-moe", GRPO + ["model.implementation=native", "actor.routing_replay=true"])}


def emit(**record) -> None:
    # one write per line: the ranks share torchrun's stdout, and print()'s two writes interleave between them
    sys.stdout.write(json.dumps({"bench": "multi_gpu", **record}) + "\n")
    sys.stdout.flush()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ----- world ------------------------------------------------------------------------------------
def build_worlds(args) -> None:
    """Every directory the other subcommands read, made once in one process (no rank races)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    import families

    device = "cuda" if args.device == "cuda" else "cpu"
    t0 = time.perf_counter()
    qwen = os.path.join(args.root, "qwen2")
    grpo_setup.write_model(qwen, "tiny")
    grpo_setup.write_prompt_file(qwen, grpo_setup.prompt_texts(64, PROMPT_LEN["qwen2"], 4096))
    # the reward model: transformers' Llama classifier on the same word vocabulary (phaserl's RM engine runs it)
    torch.manual_seed(1)
    rm = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, num_labels=1, pad_token_id=0))
    with torch.no_grad():
        rm.score.weight.mul_(50.0)  # random init gives scores ~1e-3 apart; spread them
    rm.save_pretrained(os.path.join(args.root, "rm"))
    grpo_setup.build_tokenizer(4096).save_pretrained(os.path.join(args.root, "rm"))
    for family in ("mistral", "gemma3", "qwen3-moe"):
        families.make_world(f"{family}-tiny", os.path.join(args.root, family), device)
    for part, a in (("scale", _grpo_args(args, "scale", prompts=args.prompts * args.max_world)),
                    ("switch", _grpo_args(args, "switch", prompts=args.prompts * args.max_world))):
        a.world = os.path.join(args.root, part)
        grpo_step.make_world(a)
    emit(part="world", measure="world", root=args.root, seconds=round(time.perf_counter() - t0, 2))


def _grpo_args(args, part: str, *, prompts: int, extra: tuple = ()) -> argparse.Namespace:
    """grpo_step.py's parsed arguments for `part` (scale: --shape 1.5b; switch: 0.5b, short responses)."""
    argv = ["--only", "ours", "--steps", str(args.steps), "--warmup", str(args.warmup), "--prompts", str(prompts)]
    if args.smoke:
        argv += ["--tiny"]
    elif part == "scale":
        argv += ["--shape", "1.5b"]
    else:
        argv += ["--shape", "0.5b", "--n", "8", "--new-tokens", "64", "--micro-batch", "32"]
    for setting in extra:
        argv += ["--ours-set", setting]
    return grpo_step.parse_args(argv)


# ----- steps: 1 rank against N ------------------------------------------------------------------
def run_overrides(args, scenario: str, tag: str) -> list:
    """The scenario's config overrides: the world's files, 4 prompts x 4 samples, one step of 2 mini-batches."""
    family, extra = SCENARIOS[scenario]
    world = os.path.join(args.root, family)
    out = os.path.join(args.root, "runs", f"{scenario}-{tag}")
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    return world_overrides(world, PROMPT_LEN[family]) + [
        "data.val_files=[]", f"trainer.device={args.device}", f"model.dtype={dtype}", "trainer.loggers=[]",
        "trainer.total_steps=1", "trainer.save_interval=0", "trainer.val_interval=0", "trainer.resume=never",
        f"trainer.log_dir={out}/logs", f"trainer.checkpoint_path={out}/ckpt",
        # 1 prompt per generate call: the same sampling on every world size (docs/distributed.md, "Rollout")
        "rollout.prompts_per_step=4", "rollout.n=4", "rollout.batch_size=1", "rollout.max_new_tokens=8",
        "rollout.engine_compile=false", "actor.compile=false", "ppo.num_mini_batches=2", "actor.optim.lr=1e-3",
    ] + [e.format(root=args.root) for e in extra]


def _trainer(overrides: list):
    from phaserl.config import load_config
    from phaserl.parallel import rank_and_world
    from phaserl.trainer import RLTrainer

    torch.manual_seed(0)
    return RLTrainer.from_config(load_config(None, overrides, world_size=rank_and_world()[1]))


def _weights(trainer) -> dict:
    """Copies of the actor's and critic's full weights on the CPU (a collective: every rank calls it). Copies:
    full_state_dict hands back the live CPU tensors of an unsharded model."""
    roles = {"actor": trainer.actor, "critic": trainer.critic}
    return {name: {k: v.clone() for k, v in full_state_dict(role.model).items()}
            for name, role in roles.items() if role is not None}


def one_step(args, scenario: str, tag: str) -> dict:
    trainer = _trainer(run_overrides(args, scenario, tag))
    responses, generate = [], trainer._generate
    trainer._generate = lambda *a: (lambda batch: (responses.extend(batch.response_texts), batch)[1])(generate(*a))
    before = _weights(trainer)
    metrics = trainer.train_step()
    if torch.distributed.is_initialized():  # every rank's responses, in rank order (rank r holds block r)
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, responses)
        responses = [text for texts in everyone for text in texts]
    return {"responses": responses, "metrics": metrics, "before": before, "after": _weights(trainer)}


def steps(args, rank: int, world: int) -> None:
    out = {}
    for scenario in (args.scenarios or list(SCENARIOS)):
        t0 = time.perf_counter()
        try:
            out[scenario] = one_step(args, scenario, f"w{world}")
            emit(part="correctness", measure="ran", scenario=scenario, world=world, rank=rank,
                 seconds=round(time.perf_counter() - t0, 2))
        except Exception:  # noqa: BLE001 - reported, and the next scenario still runs
            out[scenario] = {"error": traceback.format_exc()[-3000:]}
            emit(part="correctness", measure="error", scenario=scenario, world=world, rank=rank,
                 error=out[scenario]["error"][-600:])
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if rank == 0:
        torch.save(out, os.path.join(args.root, f"steps-w{world}.pt"))


# ----- ckpt: save on N, resume on M -------------------------------------------------------------
def ckpt(args, rank: int, world: int, leg: str, chain: str, total_steps: int) -> None:
    """fit() to `total_steps` on the GRPO scenario, resuming from ROOT/chain-{chain}'s newest checkpoint."""
    where = os.path.join(args.root, f"chain-{chain}")
    trainer = _trainer(run_overrides(args, "grpo", f"chain-{chain}") + [
        f"trainer.total_steps={total_steps}", "trainer.resume=auto", f"trainer.checkpoint_path={where}/ckpt",
        f"trainer.log_dir={where}/logs"])
    snaps, resume = {}, trainer._resume

    def resume_and_keep() -> None:  # the weights exactly as the resume left them, before any step
        resume()
        snaps["resumed"] = _weights(trainer)["actor"]
        snaps["resumed_step"] = trainer.step_num

    trainer._resume = resume_and_keep
    trainer.fit()
    snaps["final"] = _weights(trainer)["actor"]
    snaps["final_step"] = trainer.step_num
    if rank == 0:
        torch.save(snaps, os.path.join(args.root, f"ckpt-{leg}.pt"))
    emit(part="checkpoint", measure="leg", leg=leg, world=world, rank=rank,
         resumed_step=snaps["resumed_step"], final_step=snaps["final_step"])


# ----- scale: grpo_step.py's step on N ranks ----------------------------------------------------
def scale(args, rank: int, world: int) -> None:
    per_rank = args.prompts
    shared = os.path.join(args.root, "runs", f"scale-w{world}-{args.label}")
    a = _grpo_args(args, "scale", prompts=per_rank * world, extra=tuple(args.set))
    # per rank: generate calls of its own prompts, KV slots for its own sequences; the shared run directory
    a.ours_set = [f"rollout.batch_size={per_rank}", f"rollout.engine_max_slots={per_rank * a.n}",
                  f"trainer.log_dir={shared}", f"trainer.checkpoint_path={shared}/ckpt"] + a.ours_set

    def tagged(**record) -> None:  # the other ranks: their build and summary lines (peak memory per GPU)
        if rank == 0 or record.get("measure") in ("build", "summary"):
            emit(part="scaling", rank=rank, world=world, label=args.label, **record)

    grpo_step.emit = tagged  # every rank's lines, with its rank (grpo_step.py prints them untagged)
    # each rank writes its own ours.yaml (the run's log_dir is the shared one, set above)
    grpo_step.run_ours(a, os.path.join(args.root, "scale"), os.path.join(shared, f"rank{rank}"))


# ----- switch: the hybrid switch, per step and profiled -----------------------------------------
SWITCH_VARIANTS = {
    "full_shard": ["actor.hybrid_engine.offload_optimizer=false"],
    "full_shard_offload": ["actor.hybrid_engine.offload_optimizer=true"],
    "no_shard_keep_awake": ["actor.fsdp.sharding_strategy=NO_SHARD", "rollout.engine_keep_awake=true",
                            "actor.hybrid_engine.offload_optimizer=false"],
}
PROFILE_KEYS = {  # what a switch spends, by profiler event name (host ops and device activity)
    "gather": ("all_gather", "allgather", "ncclDevKernel"),  # FSDP::all_gather* host ranges, NCCL kernels
    "copy_h2d": ("Memcpy HtoD",),                            # the optimizer state coming back (offload)
    "copy_d2h": ("Memcpy DtoH",),                            # ... and leaving
    "copy_d2d": ("Memcpy DtoD",),
    "copy_ops": ("aten::copy_",),                            # host side of every copy (engine weight refill too)
    "memcpy_calls": ("cudaMemcpy",),                         # cudaMemcpy / cudaMemcpyAsync runtime calls
    "alloc": ("cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaFreeHost", "empty_cache"),
    "sync": ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize"),
}


def _categories(prof) -> dict:
    """{category: {events, host_ms, device_ms}} of one profiled region (an event may fall in two: copy_ and H2D)."""
    out = {k: {"events": 0, "host_ms": 0.0, "device_ms": 0.0} for k in PROFILE_KEYS}
    for e in prof.key_averages():
        for category, words in PROFILE_KEYS.items():
            if any(w.lower() in e.key.lower() for w in words):
                c = out[category]
                c["events"] += e.count
                c["host_ms"] += e.self_cpu_time_total / 1000
                c["device_ms"] += e.self_device_time_total / 1000
    return {k: {m: round(v, 3) for m, v in c.items()} for k, c in out.items()}


def _top_host(prof, top: int = 8) -> list:
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [{"op": e.key[:80], "host_ms": round(e.self_cpu_time_total / 1000, 3), "count": e.count} for e in ops]


def switch(args, rank: int, world: int) -> None:
    import yaml
    from torch.profiler import ProfilerActivity, profile

    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer

    root = os.path.join(args.root, "switch")
    for variant in (args.variants or list(SWITCH_VARIANTS)):
        shared = os.path.join(args.root, "runs", f"switch-w{world}-{variant}")
        a = _grpo_args(args, "switch", prompts=args.prompts * world, extra=tuple(SWITCH_VARIANTS[variant]))
        a.ours_set = [f"rollout.batch_size={args.prompts}", f"rollout.engine_max_slots={args.prompts * a.n}",
                      f"trainer.log_dir={shared}", f"trainer.checkpoint_path={shared}/ckpt",
                      "trainer.loggers=[]"] + a.ours_set
        mine = os.path.join(shared, f"rank{rank}")
        os.makedirs(mine, exist_ok=True)
        with open(os.path.join(mine, "ours.yaml"), "w") as f:
            yaml.safe_dump(grpo_step.ours_config(a, root, mine), f, sort_keys=False)
        try:
            trainer = RLTrainer.from_config(load_config(os.path.join(mine, "ours.yaml"), a.ours_set, world_size=world))
        except Exception as exc:  # noqa: BLE001 - a setting this world size rejects: reported, next variant
            emit(part="switch", measure="error", variant=variant, world=world, rank=rank, error=str(exc)[-600:])
            continue
        actor, switches = trainer.actor, []
        plain_switch = actor._switch

        def recording(target: str, _plain=plain_switch, _actor=actor, _log=switches) -> None:
            moved = _actor.mode != target
            _plain(target)
            if moved:
                _log.append(dict(_actor.last_switch))

        actor._switch = recording
        for i in range(a.warmup + a.steps):
            metrics, seconds = step_probes.timed_step(trainer)
            pair = switches[-2:]
            stats = step_probes.engine_stats(actor)
            emit(part="switch", measure="step", variant=variant, world=world, rank=rank, step=i,
                 warmup=i < a.warmup, seconds=round(seconds, 3),
                 to_rollout_s=round(pair[0]["seconds"], 4), to_training_s=round(pair[1]["seconds"], 4),
                 kv_cache_gb=round(pair[0]["kv_cache_gb"], 3), begin_s=stats.get("begin_seconds"),
                 graphs=stats.get("graphs"), rollout_s=round(metrics.get("timing_s/rollout", 0.0), 3),
                 mismatch={k.split("/", 1)[1]: round(v, 6) for k, v in metrics.items() if k.startswith("mismatch/")})
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        sync()
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            with actor.rollout_mode():
                sync()
                middle = time.perf_counter()
            sync()
            wall = time.perf_counter() - t0
        if args.trace_dir and rank == 0:
            os.makedirs(args.trace_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.trace_dir, f"switch-{variant}.json"))
        emit(part="switch", measure="profile", variant=variant, world=world, rank=rank,
             to_rollout_s=round(switches[-2]["seconds"], 4), to_training_s=round(switches[-1]["seconds"], 4),
             wall_s=round(wall, 4), to_rollout_wall_s=round(middle - t0, 4), categories=_categories(prof),
             top_host=_top_host(prof))
        actor._switch = plain_switch
        if actor.engine is not None:
            actor.engine.release()
        del trainer, actor, metrics
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ----- entry ------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("jobs", nargs="+", metavar="JOB",
                   help="world | steps | ckpt:LEG:CHAIN:TOTAL_STEPS | scale | switch, "
                        "run in this order in one launch (world alone)")
    p.add_argument("--root", required=True, help="the directory `world` fills and every other command reads")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU)")
    p.add_argument("--scenarios", nargs="*", default=None, help=f"steps: a subset of {list(SCENARIOS)}")
    p.add_argument("--prompts", type=int, default=32, help="scale/switch: prompts per rank per step")
    p.add_argument("--max-world", type=int, default=2, help="world: prompts enough for this many ranks")
    p.add_argument("--steps", type=int, default=2, help="scale/switch: timed steps")
    p.add_argument("--warmup", type=int, default=1, help="scale/switch: warm-up steps")
    p.add_argument("--label", default="auto", help="scale: the name of these settings")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="scale: a config override")
    p.add_argument("--variants", nargs="*", default=None, help=f"switch: a subset of {list(SWITCH_VARIANTS)}")
    p.add_argument("--trace-dir", default=None, help="switch: write rank 0's chrome traces here")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    if args.jobs == ["world"]:
        build_worlds(args)
        return
    rank, world = init_distributed(backend="gloo" if args.device == "cpu" else "auto")
    try:
        for job in args.jobs:
            name, *params = job.split(":")
            if name == "ckpt":
                leg, chain, total = params
                ckpt(args, rank, world, leg, chain, int(total))
            else:
                {"steps": steps, "scale": scale, "switch": switch}[name](args, rank, world)
    finally:
        destroy()


if __name__ == "__main__":
    main()
