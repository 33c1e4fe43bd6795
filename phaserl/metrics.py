"""Metric sinks: the console line, `{log_dir}/metrics.jsonl`, TensorBoard and (optionally) wandb.

Only rank 0 writes. Names are stable (see docs/metrics.md): `train/reward_mean`, `timing_s/step`,
`perf/tokens_per_s`, `val/score_mean`, ... One JSON object per line, with `step` first.
Also here: the perf/* arithmetic of a step (`StepPerf`: throughput, peak memory, MFU), the model-FLOP
count behind `perf/mfu` (`FlopModel`) and the peak bf16 rates it divides by.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .parallel import all_reduce_sum

log = logging.getLogger("phaserl")

CONSOLE_KEYS = (("train/reward_mean", "reward"), ("val/score_mean", "val"), ("actor/kl_loss", "kl_loss"),
                ("train/kl", "kl"), ("train/response_length_mean", "len"), ("actor/entropy", "entropy"),
                ("timing_s/step", "s/step"), ("perf/tokens_per_s", "tok/s"))


def _plain(value):
    """A JSON-safe scalar (NaN/inf become strings so the file stays valid JSON)."""
    value = float(value) if not isinstance(value, (int, str, bool)) else value
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLogger:
    def __init__(self, log_dir: str, loggers: list, *, rank: int = 0, run_name: Optional[str] = None,
                 config: Optional[dict] = None):
        self.enabled = rank == 0
        self.log_dir = log_dir
        self.loggers = set(loggers)
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not self.enabled:
            return
        if "wandb" in self.loggers:
            self._wandb = _start_wandb(run_name, config)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        if self._jsonl is None and "jsonl" in self.loggers:  # opened at the first step: a run that fails
            os.makedirs(self.log_dir, exist_ok=True)  # while it is being built leaves no files behind
            self._jsonl = open(os.path.join(self.log_dir, "metrics.jsonl"), "a", encoding="utf-8")
        record = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is None and "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            # Opened at the first logged step: events a killed run wrote from this step on are purged,
            # so a resumed run's curves match metrics.jsonl (which the resume cut the same way).
            self._tb = SummaryWriter(log_dir=self.log_dir, purge_step=step)
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if "console" in self.loggers:
            log.info(console_line(step, metrics))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def console_line(step: int, metrics: dict) -> str:
    parts = [f"step {step}"]
    for key, short in CONSOLE_KEYS:
        if key in metrics:
            parts.append(f"{short} {metrics[key]:.4g}")
    return " | ".join(parts)


def _start_wandb(run_name, config):
    try:
        import wandb
    except ImportError:
        log.warning("trainer.loggers has 'wandb' but wandb is not installed: `pip install wandb`; "
                    "continuing without it")
        return None
    return wandb.init(project="phaserl", name=run_name, config=config)


# ----- model FLOPs utilization (perf/mfu) -------------------------------------------------------
# Dense bf16 tensor-core peak of each device type, from the vendors' datasheets (no sparsity), in
# FLOP/s. MFU is always against this number, whatever the training dtype. Matched on the CUDA
# device name; a device not listed gets no perf/mfu.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "H20": 148e12, "A100": 312e12,
                   "A800": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12, "B200": 2250e12}


def device_peak_flops(device: torch.device) -> Optional[float]:
    """The datasheet bf16 peak of a CUDA device, or None (CPU, or a GPU not in PEAK_BF16_FLOPS)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):  # "H200" before "H20"
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


def attention_width(cfg) -> int:
    """Sum over the softmax-attention layers of num_attention_heads * head_dim (linear-attention layers have no
    quadratic term). Per layer where heads differ: a native DecoderConfig's `heads(i)`, a transformers config's
    `per_layer_config` (Gemma 4: its global layers' head_dim; reading `config.head_dim` there raises)."""
    L = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * L
    if hasattr(cfg, "heads"):
        return sum(cfg.heads(i)[0] * cfg.heads(i)[2] for i in range(L) if "linear" not in types[i])
    layers = getattr(cfg, "per_layer_config", None) or [cfg] * L
    width = 0
    for i in range(L):
        if "linear" not in types[i]:
            heads = layers[i].num_attention_heads
            width += heads * (getattr(layers[i], "head_dim", None) or cfg.hidden_size // heads)
    return width


@dataclass(frozen=True)
class FlopModel:
    """Model FLOPs of a decoder's passes, from its config and parameter count (recomputation not counted).

    A forward over rows of real lengths L_i with M scored response tokens costs
        2 * body_params * sum(L_i)  +  2 * head_params * M  +  2 * attn_width * sum(L_i^2)
    (matmuls; causal attention: QK^T and PV over about L^2 / 2 query-key pairs each, 2 FLOPs per
    multiply-add). Forward + backward is 3 times that: forward, input gradients, weight gradients; the last
    only for the trainable share of the parameters (a frozen LoRA base: about 2 times, `update_passes`).
    The embedding lookup costs nothing; the vocabulary projection runs on response tokens only, as
    phaserl's log-prob path does. In a mixture of experts a token multiplies only its k of E experts: the
    expert parameters count k / E of their number.
    """
    body_params: int   # parameters every token multiplies: all but the embedding and the LM head
    head_params: int   # V * H of the vocabulary projection (0 for a value model)
    attn_width: int    # sum over layers of num_attention_heads * head_dim
    update_passes: float = 3.0  # forward + backward in forward units: 2 + the trainable share of the parameters

    @classmethod
    def of(cls, model: torch.nn.Module, *, lm_head: bool = True) -> "FlopModel":
        cfg = model.config
        H, V = cfg.hidden_size, cfg.vocab_size
        total = sum(p.numel() for p in model.parameters())  # global numel, also for FSDP-sharded DTensors
        untied = getattr(model, "lm_head", None)
        untied_params = untied.weight.numel() if untied is not None and hasattr(untied, "weight") else 0
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        experts = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
        # None: dense
        chosen, of = getattr(cfg, "num_experts_per_tok", None) or 0, getattr(cfg, "num_experts", None) or 0
        idle = experts - experts * chosen // max(of, 1)
        return cls(body_params=total - V * H - untied_params - idle, head_params=V * H if lm_head else 0,
                   attn_width=attention_width(cfg),
                   update_passes=2.0 + trainable / max(total, 1))

    def forward_flops(self, lengths: torch.Tensor, response_tokens: float) -> float:
        """lengths [B]: real tokens of each row; response_tokens: how many the vocabulary projection scores."""
        lengths = lengths.double()
        return (2.0 * self.body_params * float(lengths.sum()) + 2.0 * self.head_params * float(response_tokens)
                + 2.0 * self.attn_width * float((lengths ** 2).sum()))


class StepPerf:
    """The perf/* metrics of one RL step: throughput, this rank's peak memory, and model-FLOP utilisation.

    perf/tokens_per_s counts every real token (prompt and response, all ranks) over the step's time;
    perf/rollout_tokens_per_s the sampled ones over the rollout phase's. perf/mfu is the model FLOPs of
    the forward-only and update phases (all ranks; `FlopModel`) over the time from the forward phase's start to the
    update's end (the advantage phase between them waits for the forward kernels) times the devices' bf16
    peak (GPUs in PEAK_BF16_FLOPS only). The FLOP models are made at the first step that needs them.
    """

    def __init__(self, actor: torch.nn.Module, ref: Optional[torch.nn.Module], critic: Optional[torch.nn.Module], *,
                 device: torch.device, world_size: int, held_bytes: Optional[Callable[[], int]] = None):
        self.models = {"actor": actor, "ref": ref, "critic": critic}
        self.device, self.world_size = device, world_size
        # memory the allocator's peak does not count: CUDA graphs' private pools (ppo.train_graphs), held all step
        self.held_bytes = held_bytes or (lambda: 0)
        self._flops: dict = {}  # role -> FlopModel

    def start_step(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # perf/peak_memory_gb is this step's

    def step_metrics(self, attention_mask: torch.Tensor, response_mask: torch.Tensor, timings: dict, *,
                     update_epochs: int, old_pass: bool) -> dict:
        """attention_mask [B, T], response_mask [B, R] of the step's batch; timings: seconds by phase;
        update_epochs: the epochs the update ran (0 when it was skipped); old_pass: whether the old
        log-prob forward ran."""
        out = {"perf/tokens_per_s": float(all_reduce_sum(attention_mask.sum().float())) / max(timings["step"], 1e-9),
               "perf/rollout_tokens_per_s": float(all_reduce_sum(response_mask.sum().float()))
               / max(timings["rollout"], 1e-9)}
        if self.device.type == "cuda":
            out["perf/peak_memory_gb"] = (torch.cuda.max_memory_allocated(self.device) + self.held_bytes()) / 2**30
        peak = device_peak_flops(self.device)
        if peak is None:
            return out
        if not self._flops:
            self._flops = {role: FlopModel.of(model, lm_head=role != "critic")
                           for role, model in self.models.items() if model is not None}
        lengths = attention_mask.sum(dim=1)  # [B] real tokens per row
        responses = float(response_mask.sum())
        actor = self._flops["actor"]  # update_passes: forward + backward, in forward-pass units
        flops = actor.forward_flops(lengths, responses) * (int(old_pass) + actor.update_passes * update_epochs)
        if "ref" in self._flops:
            flops += self._flops["ref"].forward_flops(lengths, responses)
        if "critic" in self._flops:  # its value pass always runs
            critic = self._flops["critic"]
            flops += critic.forward_flops(lengths, 0) * (1 + critic.update_passes * update_epochs)
        total = float(all_reduce_sum(torch.tensor(flops, dtype=torch.float64, device=self.device)))
        # The advantage phase too: the forward phase's clock can stop while its kernels still run (nothing in it
        # waits for them), and the advantage phase's first read of a result waits for the rest.
        seconds = max(timings["forward"] + timings.get("advantage", 0.0) + timings["update"], 1e-9)
        out["perf/mfu"] = total / (seconds * peak * self.world_size)
        return out
