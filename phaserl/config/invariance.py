"""Which world sizes draw the same rollout samples: arithmetic on the config's sizes, for the doctor and a resume.

The rule follows from how `RLTrainer._generate` seeds its generate calls (trainer/core.py); this module only
states it. docs/distributed.md explains it in words.
"""
from __future__ import annotations


def same_samples_world_sizes(prompts_per_step: int, batch_size: int, *, up_to: int = 1024) -> list[int]:
    """The world sizes W (≤ up_to) on which every prompt's samples are the same as on any other of them.

    RLTrainer._generate seeds each generate call from (seed, step, global index of its first prompt) and a
    call holds ≤ batch_size prompts of one rank. When batch_size divides the prompts per rank P / W, the calls
    start at the same global prompts (multiples of batch_size) on every such W, so they sample alike; on
    another W a call starts elsewhere and its prompts are sampled with another seed.
    """
    return [w for w in range(1, min(prompts_per_step, up_to) + 1)
            if prompts_per_step % w == 0 and (prompts_per_step // w) % batch_size == 0]
