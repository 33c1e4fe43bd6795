"""Out of memory in any phase: the run stops with one screen, never a traceback.

`out_of_memory_screen(trainer)` wraps the training loop (RLTrainer.fit). When a phase runs out of memory
(torch.OutOfMemoryError on CUDA, the allocator's RuntimeError on the CPU) it frees what the failed phase held and
raises `OutOfMemoryStop`, a phaserl error whose message is the screen:

    phaserl: out of memory in phase 'update' (step 3) on cuda:0
      measured   77.6 GiB allocated at the peak (2.0 GiB more was asked) of the card's 79.1 GiB
      predicted  66.8 GiB: memory plan: reference streamed, 21 layer(s) checkpointed; micro-batch 4608 tokens; ...
      would fit  ref.stream_weights=true actor.checkpoint_layers=28 actor.optimizer_offload=false
                 ppo.micro_batch_tokens=3072  (the plan, with the count off by what this run measured)
      checkpoint runs/x/checkpoints/step_2 is intact: the same command with these settings resumes from it

The command line prints it and exits non-zero. Nothing is saved after the failure: the checkpointer writes a
step into a temporary directory and publishes it whole, so the newest published step stays the one to resume
from. Under torchrun the failing rank posts the screen through parallel.rank_errors, the ranks waiting for it in
a collective stop naming it, and the launcher stops the rest.
Not here: the plan itself (memory/plan.py), choosing it at build time (trainer/speed.py).
"""
from __future__ import annotations

import gc
import re
import resource
import traceback
from contextlib import contextmanager
from typing import Optional

import torch

from ..errors import PhaserlError
from ..memory.budget import GB
from ..memory.plan import tighter_plan
from ..parallel import current_phase

SCREEN_TITLE = "phaserl: out of memory in"  # the first words of the screen (the command line looks for them)
_PHASE_HINTS = {  # what else bounds a phase that the update's plan does not cover
    "rollout": "rollout holds the KV cache: lower rollout.engine_memory_fraction or rollout.batch_size, or set "
               "actor.hybrid_engine.offload_optimizer=true (AdamW on the CPU while sampling)",
    "score": "scoring: lower reward_model.micro_batch_tokens (phaserl engine) or reward_model.batch_size",
    "forward": "the forward-only passes: lower ppo.forward_micro_batch_tokens, or set ref.stream_weights=true",
}


class OutOfMemoryStop(PhaserlError, RuntimeError):
    """A phase ran out of device (or host) memory; the message is the screen that says what would fit."""


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


@contextmanager
def out_of_memory_screen(trainer):  # an RLTrainer
    """Turn an out-of-memory error inside the block into OutOfMemoryStop with the screen."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - anything else goes on unchanged
        if not is_out_of_memory(exc) or isinstance(exc, OutOfMemoryStop):
            raise
        traceback.clear_frames(exc.__traceback__)  # the failed phase's tensors go with its frames' locals
        _free_device(trainer)
        raise OutOfMemoryStop(oom_screen(trainer, str(exc))) from None


def _free_device(trainer) -> None:
    gc.collect()
    device = trainer.actor.device
    if device.type == "cuda":
        torch.cuda.empty_cache()


def oom_screen(trainer, error: str) -> str:
    """The screen for an out-of-memory `error` in the phase this rank is in."""
    device = trainer.actor.device
    peak, card = measured_peak(device)
    asked = _asked_bytes(error)
    lines = [f"{SCREEN_TITLE} {current_phase()} on {device}",
             f"  measured   {peak / GB:.1f} GiB {'allocated' if device.type == 'cuda' else 'resident'} at the peak"
             + (f" ({asked / GB:.2f} GiB more was asked)" if asked else "") + f" of the {_card_name(device)}'s "
             f"{card / GB:.1f} GiB"]
    speed = trainer.run.speed
    facts, plan = speed.memory if speed is not None and speed.memory is not None else (None, None)
    if plan is not None and plan.peak_bytes:
        lines.append(f"  predicted  {plan.summary()}")
        tighter = tighter_plan(facts, predicted_bytes=plan.peak_bytes, measured_bytes=max(peak + asked, card))
        lines.append(f"  would fit  {' '.join(tighter.overrides())}")
        lines.append("             (the memory plan again, with the count off by what this run measured"
                     + (f"; even so: {tighter.problem}" if tighter.problem else "") + ")")
    else:
        lines.append("  would fit  no memory count for this model: lower ppo.micro_batch_tokens and "
                     "ppo.forward_micro_batch_tokens, set actor.checkpoint_layers to the model's layer count")
    hint = next((h for phase, h in _PHASE_HINTS.items() if f"'{phase}'" in current_phase()), "")
    if hint:
        lines.append(f"  also       {hint}")
    last = trainer.last_checkpoint
    lines.append(f"  checkpoint {last} is intact: the same command with these settings resumes from it" if last else
                 "  checkpoint none written yet (trainer.save_interval); nothing was saved after the failure")
    lines.append("  (docs/memory.md: the budget, the plan's measures and recipes per card)")
    return "\n".join(lines)


def measured_peak(device: torch.device) -> tuple[int, int]:
    """(the peak this process reached, the device's total): CUDA allocated memory, or the CPU's resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.mem_get_info(device)[1]
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    return peak_kb * 1024, _host_total()


def _host_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _card_name(device: torch.device) -> str:
    return "card" if device.type == "cuda" else "host"


def _asked_bytes(error: str) -> int:
    """What the failed allocation asked for ("Tried to allocate 2.00 GiB"), 0 when the message does not say."""
    found: Optional[re.Match] = re.search(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB|B)", error)
    if not found:
        return 0
    return int(float(found.group(1)) * {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}[found.group(2)])
