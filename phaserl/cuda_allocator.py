"""torch's CUDA caching allocator, as phaserl sets it up for a run on a GPU: expandable segments, unless the user
configured the allocator.

    line = configure_cuda_allocator()   # once, before the models load onto the GPU; the run summary prints `line`

Why. A step alternates phases whose temporaries differ in size (the rollout's KV cache and graphs, the update's
micro-batches of activations, the log-prob chunks), and with fixed-size segments the allocator keeps freed blocks
it cannot reuse for the next shape: at the 0.5B reference shape with 32,640-token micro-batches the H200 reserved
62.8 GiB for a 35.8 GiB allocated peak, with expandable segments 36.2 GiB (BENCHMARKS.md, H200,
2026-12-04, where the same-call timing with and without is recorded). torchtitan's launch scripts set the same.
The engine's CUDA graphs keep their own pool, which expandable segments leave alone (the engine ran with it there:
graphs captured and replayed, the same rewards). With two GPUs (NCCL, FSDP2) the multi-GPU correctness, checkpoint and
switch runs passed with it on (BENCHMARKS.md, 2026-12-04).

A user's PYTORCH_CUDA_ALLOC_CONF (or torch's newer spelling PYTORCH_ALLOC_CONF) always wins, whatever it says.
Not here: how much memory the run needs (memory/budget.py) or when the engine frees its cache (rollout/).
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

log = logging.getLogger("phaserl")
ACTIVE: Optional[str] = None  # what configure_cuda_allocator did in this process (the run summary's words)

ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads either; the first set one is the user's
DEFAULT = "expandable_segments:True"
_DEFAULT_WORDS = f"{DEFAULT} (phaserl's default: less memory held but unused; set PYTORCH_CUDA_ALLOC_CONF to choose)"


def configure_cuda_allocator() -> str:
    """Turn on expandable segments unless an allocator variable is set; -> the run summary's words for it (also
    kept in ACTIVE). Safe before or after CUDA is initialized: segments allocated from now on expand."""
    global ACTIVE
    ACTIVE = _configure()
    log.debug("CUDA allocator: %s", ACTIVE)
    return ACTIVE


def planned() -> str:
    """What configure_cuda_allocator will do in a process with this environment, in the run summary's words; it
    changes nothing (the doctor reports it before the run)."""
    user = _user_setting()
    return _user_words(*user) if user else _DEFAULT_WORDS


def _user_setting() -> Optional[tuple[str, str]]:
    return next(((name, os.environ[name]) for name in ENVS if os.environ.get(name)), None)


def _user_words(name: str, value: str) -> str:
    words = f"{name}={value} (set in the environment: phaserl leaves it as it is)"
    if "expandable_segments:true" not in value.replace(" ", "").lower():
        words += ("; without expandable segments the allocator can hold far more than the peak (0.5B, 32,640-token "
                  "micro-batches: 62.8 GiB reserved for 35.8 allocated)")
    return words


def _configure() -> str:
    if _user_setting():
        return planned()
    # torch's runtime switch (2.9+ spells it on torch._C; torch.cuda.memory's older name now warns and forwards)
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or \
        getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if set_settings is None:  # a torch without the runtime switch: the variable, read when CUDA initializes
        if torch.cuda.is_initialized():
            return "torch's defaults (CUDA was initialized before phaserl could set expandable segments)"
        os.environ[ENVS[0]] = DEFAULT
    else:
        set_settings(DEFAULT)
    return _DEFAULT_WORDS
