"""One whole GRPO step (rollout + reference log-probs + update, KL on): phaserl's RLTrainer vs TRL's GRPOTrainer.

Shape (the reference shape of BENCHMARKS.md): Qwen2-0.5B architecture with random weights, bf16, 64 prompts x 8
samples = 512 responses, prompts of exactly 128 tokens, 256 new tokens, one GPU. Each side runs in its own process
(`--only both` starts both, one after the other, on one synthetic world made by `grpo_setup.py`) and
prints one JSON line per step and a summary line: seconds per step (median of the steps after
warm-up), tokens/s (prompt + response tokens of the step's 512 sequences / step seconds), peak GPU
memory (torch.cuda.max_memory_allocated / max_memory_reserved, reset before every step: the largest
timed step, and the warm-up steps apart). `--only both` ends with a comparison line.

    python benchmarks/grpo_step.py --warmup 2 --steps 3 --steps-trl 2   # phaserl's defaults (auto: compile, keep_awake)
    python benchmarks/grpo_step.py --only ours --ours-set actor.compile=false --ours-set rollout.engine_keep_awake=false
    python benchmarks/grpo_step.py --tiny                   # a CPU smoke run of both sides (seconds)
    python benchmarks/grpo_step.py --shape 7b --lora-rank 16  # LoRA on both sides (lora_step.py runs the set)
    python benchmarks/grpo_step.py --only ours --sweep-micro-batch 8064,12288,32640  # the host's cost per micro-batch
    python benchmarks/grpo_step.py --only ours --ours-micro-batch auto --ab keep_head_logits,pinned_copies  # on vs off

Ours is built the way `phaserl train ours.yaml KEY=VALUE ...` builds it: the YAML this script writes, plus
--ours-set overrides -> phaserl.config.load_config -> RLTrainer.from_config (phaserl.trainer.build); then
`trainer.train_step()` is called per step (what `fit()` calls; fit's validation, logging and final
checkpoint are left out of the timing). TRL: GRPOTrainer with transformers `generate` (no vLLM), timed
by a callback between optimizer steps. Needs trl and datasets (not phaserl dependencies).

Same on both sides:
- model files (one random-weight directory, bf16 weights), tokenizer, prompts, reward
  (`grpo_setup.sevens`: the share of '7' characters in the decoded response);
- sampling: temperature 1, no top-k/top-p; EOS is not ignored on either side (neither config has a key
  for it), but a random 152k-vocabulary model almost never samples it: the measured response lengths
  are printed (`response_length_mean`, `eos_finished`);
- 512 responses per step and ONE optimizer step per rollout batch (ours: ppo.num_mini_batches=1,
  epochs=1; TRL: gradient_accumulation_steps = steps_per_generation = 512 / micro_batch, num_iterations=1);
- micro-batches of --micro-batch sequences (default 32 = 12,288 tokens) for training (ours:
  ppo.micro_batch_tokens = 32 * 384, or phaserl's own auto choice with --ours-micro-batch auto; TRL:
  per_device_train_batch_size, which it also uses for its reference
  pass: it has no separate key). Ours runs its forward-only passes with its default
  ppo.forward_micro_batch_tokens (32,768) unless --forward-micro-batch sets sequences per forward micro-batch;
- KL in the loss, k3 estimator, coefficient --beta 0.001 (ours algorithm.kl_coef, TRL beta);
- PPO clip 0.2 both ways, no dual clip (ours actor.dual_clip_c=null); token-mean loss over the whole
  mini-batch (ours loss_agg_mode=token-mean, TRL loss_type=dapo); group-std advantages; entropy computed
  (not in the loss) on both;
- AdamW lr 1e-6 constant (TRL lr_scheduler_type=constant), betas (0.9, 0.999), weight decay 0, grad clip
  1.0, bf16 parameters and AdamW states (TRL: bf16=True on the bf16-loaded model);
- gradient checkpointing off on both (TRL's own default is on; --gradient-checkpointing turns it on for both).
Differences, by design of each library:
- ours computes old log-probs with one extra forward pass per step; TRL skips it when generation and
  optimizer steps are aligned (it uses the detached current log-probs);
- ours rolls out with its built-in engine: a preallocated KV pool of rollout.engine_memory_fraction of
  the free memory, capped at what the run can use (--kv-fraction 0.03; 2.25 GiB at this shape; 0.25 at
  --shape 7b, where 0.03 would hold fewer slots than sequences), CUDA
  graphs and torch.compile (the first step pays the compilation: warm-up). TRL rolls out with
  `model.generate` (dynamic cache) on the training model, no compile;
- ours trains with phaserl's defaults plus whatever --ours-set adds. With no --ours-set that is what
  `phaserl train` picks on this machine (the `speed` list of the build line: actor.compile, engine compile,
  rollout.engine_keep_awake and ppo.packing are auto, config/auto.py; on one H200 at this shape all on);
  TRL with its defaults (sdpa attention, its own fused chunked LM-head log-probs, torch_compile off).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpo_setup  # noqa: E402
from step_probes import (  # noqa: E402
    ab_counts_problem,
    dynamo_counters,
    engine_stats,
    json_or_none,
    memory_gib,
    metric_group,
    micro_batch_sweep,
    profile_one_step,
    reset_peak,
    rollout_probe,
    settings_ab,
    sync,
    timed_step,
)

BENCH = "grpo_step"


def emit(**record) -> None:
    print(json.dumps({"bench": BENCH, **record}), flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=["ours", "trl", "both"], default="both")
    p.add_argument("--tiny", action="store_true", help="CPU-sized model and batch (smoke test)")
    p.add_argument("--shape", choices=["0.5b", "1.5b", "7b"], default="0.5b",
                   help="0.5b: 64 x 8, 128 + 256, micro-batch 32; 1.5b: 32 x 8, 256 + 1024 (long responses), "
                        "micro-batch 8; 7b: 16 x 8, 256 + 512, micro-batch 8 (the project brief's shapes)")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA on both sides, every linear projection (ours "
                   "actor.lora, TRL peft_config=LoraConfig(target_modules='all-linear')); 0 = full fine-tuning")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 x rank)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per side after warm-up")
    p.add_argument("--steps-trl", type=int, default=None, help="timed TRL steps (default --steps)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps of ours (reported)")
    p.add_argument("--warmup-trl", type=int, default=1, help="untimed warm-up steps of TRL (reported)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (64; --tiny 4)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (8; --tiny 4)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (128; --tiny 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens (256; --tiny 8)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per training micro-batch (32; --tiny 8)")
    p.add_argument("--ours-micro-batch", choices=["match", "auto"], default="match",
                   help="match: ours trains on --micro-batch sequences too (ppo.micro_batch_tokens set, as TRL); "
                        "auto: phaserl's own choice (ppo.micro_batch_tokens=auto, what `phaserl train` does)")
    p.add_argument("--forward-micro-batch", type=int, default=None,
                   help="ours: sequences per forward-only micro-batch (reference, old log-probs); default: "
                        "phaserl's ppo.forward_micro_batch_tokens. TRL has no such key: its reference pass uses the "
                        "training micro-batch")
    p.add_argument("--beta", type=float, default=0.001, help="KL coefficient (ours kl_coef, TRL beta)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--gradient-checkpointing", action="store_true", help="on for both sides (default off)")
    p.add_argument("--kv-fraction", type=float, default=None,
                   help="ours: rollout.engine_memory_fraction (default 0.03 at 0.5b, 0.25 at 7b: either way the "
                        "cap, every sequence of the step in a slot, is what binds on an H200)")
    p.add_argument("--side-timeout", type=float, default=280.0, help="--only both: seconds per side process")
    p.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra phaserl config override (as on `phaserl train` command lines), repeatable")
    p.add_argument("--trl-set", action="append", default=[], metavar="KEY=JSON",
                   help="extra GRPOConfig keyword (value parsed as JSON, else a string), repeatable")
    p.add_argument("--profile", action="store_true", help="ours: one more step under torch.profiler (not timed): "
                   "kernel groups, top kernels, and the top kernels of each phase")
    p.add_argument("--profile-phases", default="all", metavar="all|rollout,forward,update",
                   help="--profile: the whole step (all), or only the calls of these phases, each under its own "
                        "profiler (a 7B rollout alone is ~300k kernels: summarizing the whole step takes minutes)")
    p.add_argument("--rollout-probe", type=_fractions, default=[], metavar="F[,F...]",
                   help="ours: after the timed steps, the rollout alone once per KV memory fraction (and with a "
                        "LoRA actor, once with the adapters merged and once off, i.e. the full fine-tune's engine "
                        "path): slots, decode steps, begin/refill seconds")
    p.add_argument("--sweep-micro-batch", default=None, metavar="T[,T...]",
                   help="ours: after the timed steps, the update at each of these ppo.micro_batch_tokens in this same "
                        "process (1 + --steps steps each), and the host's cost per micro-batch fitted from them")
    p.add_argument("--ab", default=None, metavar="NAME[,NAME...]",
                   help="ours: after the timed steps, each on/off setting alternated in this process, --ab-rounds x "
                        "(on, off) of --steps steps (step_probes.AB_SETTINGS: keep_head_logits, pinned_copies)")
    p.add_argument("--ab-rounds", type=int, default=2, help="--ab: rounds of (on, off) per setting")
    p.add_argument("--world", default=None, help="directory made by a previous run (model/, tokenizer/, train.parquet)")
    p.add_argument("--log-dir", default=None, help="where each side's logs go (default: inside the world dir)")
    a = p.parse_args(argv)
    if a.ab and ab_counts_problem(a.steps, a.ab_rounds):  # before anything is built
        p.error(ab_counts_problem(a.steps, a.ab_rounds))
    # kv_fraction: 0.03 of free memory holds the 0.5B step's 512 x 384 tokens (2.25 GiB); at 7B the 128 x 768
    # tokens take 5.25 GiB, more than 0.03 of what is free (a 7B LoRA actor: ~91 slots by the arithmetic, so
    # two decode waves); at 1.5B the 256 x 1280 tokens take 8.75 GiB.
    sizes = {"0.5b": dict(prompts=64, n=8, prompt_len=128, new_tokens=256, micro_batch=32, kv_fraction=0.03),
             "1.5b": dict(prompts=32, n=8, prompt_len=256, new_tokens=1024, micro_batch=8, kv_fraction=0.1),
             "7b": dict(prompts=16, n=8, prompt_len=256, new_tokens=512, micro_batch=8, kv_fraction=0.25),
             "tiny": dict(prompts=4, n=4, prompt_len=16, new_tokens=8, micro_batch=8, kv_fraction=0.03)}
    a.shape = "tiny" if a.tiny else a.shape
    for key, value in sizes[a.shape].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    a.steps_trl = a.steps if a.steps_trl is None else a.steps_trl
    if a.lora_rank:
        a.lora_alpha = 2.0 * a.lora_rank if a.lora_alpha is None else a.lora_alpha
        a.ours_set = a.ours_set + [f"actor.lora.rank={a.lora_rank}", f"actor.lora.alpha={a.lora_alpha}",
                                   "actor.lora.target_modules=[all-linear]"]
    a.device = "cuda" if torch.cuda.is_available() else "cpu"
    return a


def _fractions(text: str) -> list:
    values = [float(x) for x in text.split(",") if x.strip()]
    if not values or not all(0 < v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give memory fractions in (0, 1), comma-separated, e.g. 0.03,0.1")
    return values


# ----- the world both sides share ---------------------------------------------------------------
def make_world(a) -> str:
    root = a.world or tempfile.mkdtemp(prefix="grpo_step_")
    if not os.path.isfile(os.path.join(root, "train.parquet")):
        t0 = time.perf_counter()
        grpo_setup.write_model(root, a.shape, device=a.device)
        count = a.prompts * (max(a.warmup, a.warmup_trl) + max(a.steps, a.steps_trl) + 1)
        texts = grpo_setup.prompt_texts(count, a.prompt_len, grpo_setup.SHAPES[a.shape]["vocab_size"])
        grpo_setup.write_prompt_file(root, texts)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the model was made on the GPU; the side processes need the memory
        emit(measure="world", dir=root, seconds=round(time.perf_counter() - t0, 2), prompts=count, shape=a.shape)
    return root


def world_paths(root: str) -> tuple[str, str, str]:
    return os.path.join(root, "model"), os.path.join(root, "tokenizer"), os.path.join(root, "train.parquet")


def environment() -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    try:  # the device's copy of .git can lag the tree that was sent: BENCHMARKS.md names the commit sent
        env["git_head_seen"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["git_head_seen"] = None
    return env


def max_peak(steps: list) -> dict:
    """The largest per-step peaks (each step line holds the peak of that step alone)."""
    keys = ("peak_allocated_gib", "peak_reserved_gib")
    return {k: max((s[k] for s in steps if s.get(k) is not None), default=None) for k in keys}


def summarize(side: str, a, steps: list, extra: dict) -> dict:
    """The summary line: median seconds and largest peak memory of the timed steps; warm-up reported apart."""
    timed = [s for s in steps if not s["warmup"]]
    secs = [s["seconds"] for s in timed]
    median = statistics.median(secs) if secs else None
    tokens = statistics.median([s["tokens"] for s in timed]) if timed else None
    record = dict(measure="summary", side=side, steps_timed=len(secs), s_per_step_median=median,
                  s_per_step_all=[round(s["seconds"], 3) for s in steps],
                  warmup_seconds=[round(s["seconds"], 2) for s in steps if s["warmup"]],
                  tokens_per_step=tokens, tokens_per_s=(tokens / median) if median else None,
                  timed_peak=max_peak(timed), warmup_peak=max_peak([s for s in steps if s["warmup"]]), **extra)
    emit(**record)
    return record


# ----- ours -------------------------------------------------------------------------------------
def ours_config(a, root: str, log_dir: str) -> dict:
    model, tokenizer, data = world_paths(root)
    seq = a.prompt_len + a.new_tokens
    return {
        "model": {"path": model, "tokenizer_path": tokenizer, "dtype": "bfloat16" if a.device == "cuda" else "float32"},
        "data": {"train_files": [data], "val_files": [], "max_prompt_length": a.prompt_len,
                 "apply_chat_template": False, "shuffle": False},
        "rollout": {"prompts_per_step": a.prompts, "n": a.n, "batch_size": a.prompts, "max_new_tokens": a.new_tokens,
                    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "engine": "auto",
                    "engine_max_slots": a.prompts * a.n, "engine_memory_fraction": a.kv_fraction},
        "reward": {"functions": [{"name": f"{os.path.abspath(grpo_setup.__file__)}:sevens", "weight": 1.0}]},
        "algorithm": {"adv_estimator": "grpo", "norm_adv_by_std": True, "kl_placement": "loss",
                      "kl_estimator": "k3", "kl_coef": a.beta},
        "actor": {"optim": {"lr": a.lr, "weight_decay": 0.0, "betas": [0.9, 0.999], "grad_clip": 1.0,
                            "warmup_steps": 0, "lr_schedule": "constant"},
                  "policy_loss": "ppo", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "dual_clip_c": None,
                  "loss_agg_mode": "token-mean", "entropy_coef": 0.0,
                  "gradient_checkpointing": a.gradient_checkpointing},
        "ppo": {"num_mini_batches": 1, "epochs": 1,
                "micro_batch_tokens": a.micro_batch * seq if a.ours_micro_batch == "match" else "auto",
                # phaserl's own default forward budget unless --forward-micro-batch sets one
                **({"forward_micro_batch_tokens": a.forward_micro_batch * seq} if a.forward_micro_batch else {})},
        "trainer": {"total_steps": a.warmup + a.steps, "seed": 0, "device": a.device, "log_dir": log_dir,
                    "checkpoint_path": os.path.join(log_dir, "checkpoints"), "val_before_train": False,
                    "loggers": ["jsonl"], "resume": "never"},
    }


def run_ours(a, root: str, log_dir: str) -> dict:
    import logging

    import yaml

    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the [HybridEngine] switch lines, on stderr
    os.makedirs(log_dir, exist_ok=True)
    cfg_path = os.path.join(log_dir, "ours.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(ours_config(a, root, log_dir), f, sort_keys=False)
    t0 = time.perf_counter()
    cfg = load_config(cfg_path, a.ours_set)
    trainer = RLTrainer.from_config(cfg)  # what `phaserl train ours.yaml KEY=VALUE ...` builds
    emit(measure="build", side="ours", seconds=round(time.perf_counter() - t0, 2), config=cfg_path,
         overrides=a.ours_set, trainable_params=_trainable(trainer.actor.model),
         speed=[c.line() for c in trainer.run.speed.all()] if trainer.run.speed else None,
         forward_micro_batch_tokens=trainer.run.forward_tokens, **memory_gib())
    steps = []
    for i in range(a.warmup + a.steps):
        reset_peak()  # each step line holds that step's own peak
        metrics, seconds = timed_step(trainer)
        trainer.run.metrics_logger.log(trainer.step_num, metrics)
        resp = metrics["train/response_length_mean"]
        sequences = a.prompts * a.n
        step = dict(measure="step", side="ours", step=i, warmup=i < a.warmup, seconds=round(seconds, 3),
                    tokens=round(sequences * (a.prompt_len + resp)), response_length_mean=resp,
                    eos_finished=round(sequences * (1.0 - metrics["train/truncated_frac"])),
                    reward_mean=metrics["train/reward_mean"], kl=metrics.get("train/kl"),
                    kv_cache_gib=round(abs(trainer.actor.last_switch.get("kv_cache_gb", 0.0)), 2),
                    engine=engine_stats(trainer.actor), dynamo=dynamo_counters(),
                    timing_s=metric_group(metrics, "timing_s", 3), perf=metric_group(metrics, "perf", 4),
                    **memory_gib())
        steps.append(step)
        emit(**step)
    if a.rollout_probe:
        rollout_probe(trainer, a.rollout_probe, emit)
    if a.ab:
        settings_ab(trainer, [n.strip() for n in a.ab.split(",") if n.strip()], a.ab_rounds, a.steps, emit)
    if a.sweep_micro_batch:
        micro_batch_sweep(trainer, [int(t) for t in a.sweep_micro_batch.split(",")], a.steps,
                          a.prompt_len + a.new_tokens, emit)
    if a.profile:
        profile_one_step(trainer, emit, a.profile_phases)
    trainer.run.metrics_logger.close()
    timed = [s["timing_s"] for s in steps if not s["warmup"]] or [{}]
    phases = {k: round(statistics.median(t[k] for t in timed), 3) for k in timed[0]}
    watch = trainer.run.compile_watch
    return summarize("ours", a, steps, {"kv_fraction": a.kv_fraction, "timing_s_median": phases,
                                        "overrides": a.ours_set, "micro_batch": a.micro_batch,
                                        "lora_rank": a.lora_rank,
                                        "forward_micro_batch_tokens": trainer.run.forward_tokens,
                                        "compile": watch.report if watch is not None else None})


def _trainable(model) -> int:
    """Parameters that train (LoRA: the adapters alone; both sides must count the same)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ----- TRL --------------------------------------------------------------------------------------
def trl_config(a, GRPOConfig, out_dir: str) -> tuple:
    """GRPOConfig kwargs matched to ours; keys this TRL version does not know are dropped (and reported)."""
    sequences = a.prompts * a.n
    accumulation = sequences // a.micro_batch
    wanted = dict(
        output_dir=out_dir, per_device_train_batch_size=a.micro_batch, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation, num_generations=a.n, num_iterations=1,
        max_completion_length=a.new_tokens, max_prompt_length=a.prompt_len, temperature=1.0, top_p=1.0, top_k=0,
        beta=a.beta, epsilon=0.2, loss_type="dapo", scale_rewards="group", learning_rate=a.lr,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, bf16=a.device == "cuda", gradient_checkpointing=a.gradient_checkpointing,
        max_steps=a.warmup_trl + a.steps_trl, logging_steps=10**6, save_strategy="no", report_to="none", seed=0,
        use_vllm=False, shuffle_dataset=False, disable_dropout=True, log_completions=False,
        dataloader_num_workers=0, use_cpu=a.device == "cpu", disable_tqdm=True)
    for item in a.trl_set:
        key, _, text = item.partition("=")
        try:
            wanted[key] = json.loads(text)
        except json.JSONDecodeError:
            wanted[key] = text
    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    dropped = sorted(k for k in wanted if k not in known)
    return {k: v for k, v in wanted.items() if k in known}, dropped


def run_trl(a, root: str, log_dir: str) -> dict:
    import pyarrow.parquet as pq
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model_dir, tokenizer_dir, data = world_paths(root)
    texts = pq.read_table(data, columns=["prompt"]).column("prompt").to_pylist()
    dataset = Dataset.from_dict({"prompt": texts})
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    t0 = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype)
    kwargs, dropped = trl_config(a, GRPOConfig, os.path.join(log_dir, "trl"))
    lengths: list = []  # completion lengths (tokens) per step, as the reward function sees them
    sequences = a.prompts * a.n

    def reward(prompts, completions, **kw):
        ids = kw.get("completion_ids")
        if ids is not None:
            lengths.append([len(x) for x in ids])
        return grpo_setup.trl_sevens(prompts, completions)

    reward.__name__ = "sevens"

    class StepTimer(TrainerCallback):
        """Seconds between optimizer steps (generation happens inside the first micro-step of each)."""

        def __init__(self):
            self.last, self.times, self.steps = None, [], []

        def on_train_begin(self, args, state, control, **kw):
            sync()
            reset_peak()  # each step line holds that step's own peak
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            now = time.perf_counter()
            i, seconds = len(self.times), now - self.last
            self.times.append(seconds)
            self.last = now
            done = lengths[i] if i < len(lengths) else None  # the reward saw this step's completions
            step = dict(measure="step", side="trl", step=i, warmup=i < a.warmup_trl, seconds=round(seconds, 3),
                        tokens=round(sequences * a.prompt_len + (sum(done) if done else sequences * a.new_tokens)),
                        response_length_mean=sum(done) / len(done) if done else None,
                        eos_finished=sum(n < a.new_tokens for n in done) if done else None, **memory_gib())
            self.steps.append(step)
            emit(**step)
            reset_peak()

    timer = StepTimer()
    trainer_kwargs = dict(model=model, reward_funcs=[reward], args=GRPOConfig(**kwargs), train_dataset=dataset,
                          callbacks=[timer])
    if a.lora_rank:  # TRL + PEFT: its reference is then the base with the adapter disabled, like ours
        from peft import LoraConfig

        trainer_kwargs["peft_config"] = LoraConfig(r=a.lora_rank, lora_alpha=a.lora_alpha, lora_dropout=0.0,
                                                   target_modules="all-linear", task_type="CAUSAL_LM")
    try:
        trainer = GRPOTrainer(processing_class=tokenizer, **trainer_kwargs)
    except TypeError:  # TRL < 0.12 names it tokenizer
        trainer = GRPOTrainer(tokenizer=tokenizer, **trainer_kwargs)
    import accelerate
    import datasets

    emit(measure="build", side="trl", trl=trl.__version__, datasets=datasets.__version__,
         accelerate=accelerate.__version__, lora_rank=a.lora_rank, trainable_params=_trainable(trainer.model),
         seconds=round(time.perf_counter() - t0, 2),
         config_dropped=dropped, gradient_checkpointing=trainer.args.gradient_checkpointing, **memory_gib())
    trainer.train()
    return summarize("trl", a, timer.steps,
                     {"trl": trl.__version__, "micro_batch": a.micro_batch, "lora_rank": a.lora_rank})



# ----- driver -----------------------------------------------------------------------------------
def run_both(a, root: str) -> None:
    """Each side in its own process (clean peak-memory numbers), then one comparison line."""
    summaries = {}
    for side in ("ours", "trl"):
        argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--only", side, "--world", root]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        watchdog = threading.Timer(a.side_timeout, proc.kill)  # a hung side must not eat the other's time
        watchdog.start()
        try:
            for line in proc.stdout:
                print(line, end="", flush=True)
                rec = json_or_none(line)
                if rec is not None and rec.get("measure") == "summary":
                    summaries[side] = rec
            proc.wait()
        finally:
            watchdog.cancel()
        if proc.returncode != 0:
            emit(measure="error", side=side, returncode=proc.returncode,
                 note=f"killed after --side-timeout {a.side_timeout:.0f} s" if proc.returncode == -9 else None)
    ours, trl = summaries.get("ours"), summaries.get("trl")
    if ours and trl and ours["s_per_step_median"] and trl["s_per_step_median"]:
        emit(measure="compare", speedup=round(trl["s_per_step_median"] / ours["s_per_step_median"], 2),
             ours_s_per_step=ours["s_per_step_median"], trl_s_per_step=trl["s_per_step_median"],
             ours_tokens_per_s=ours["tokens_per_s"], trl_tokens_per_s=trl["tokens_per_s"],
             ours_peak_reserved_gib=ours["timed_peak"]["peak_reserved_gib"],
             trl_peak_reserved_gib=trl["timed_peak"]["peak_reserved_gib"],
             ours_peak_allocated_gib=ours["timed_peak"]["peak_allocated_gib"],
             trl_peak_allocated_gib=trl["timed_peak"]["peak_allocated_gib"],
             targets={"ours_le_3s": ours["s_per_step_median"] <= 3.0,
                      "speedup_ge_3x": trl["s_per_step_median"] >= 3 * ours["s_per_step_median"],
                      "lower_peak": (ours["timed_peak"]["peak_allocated_gib"] or 0)
                      < (trl["timed_peak"]["peak_allocated_gib"] or 0)})


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.device == "cpu":
        torch.set_num_threads(1)
    root = make_world(a)
    log_dir = a.log_dir or os.path.join(root, "logs")
    if a.only == "both":
        emit(measure="env", **environment(), ours_set=a.ours_set, trl_set=a.trl_set, shape=a.shape,
             prompts=a.prompts, n=a.n, prompt_len=a.prompt_len,
             new_tokens=a.new_tokens, micro_batch=a.micro_batch, beta=a.beta, lr=a.lr,
             gradient_checkpointing=a.gradient_checkpointing, kv_fraction=a.kv_fraction)
        run_both(a, root)
    elif a.only == "ours":
        run_ours(a, root, os.path.join(log_dir, "ours"))
    else:
        run_trl(a, root, os.path.join(log_dir, "trl"))


if __name__ == "__main__":
    main()
