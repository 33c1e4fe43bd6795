"""The actor's FSDP units gathered for rollout and back to shards after it: a no-op without torch.distributed.

Apart from collectives.py so that fsdp.py (seconds to import) loads only where a model is sharded, and fsdp.py,
which takes the training group from collectives.py, is never imported back by it.
"""
from __future__ import annotations

from .collectives import is_distributed


def gather_full_params(model) -> bool:
    """FSDP units of `model` gathered (and kept gathered) for rollout; False when `model` is not sharded."""
    if not is_distributed():
        return False
    from .fsdp import gather_full_params as gather

    return gather(model)


def reshard_params(model) -> bool:
    """Back to shards after rollout; False when `model` is not sharded."""
    if not is_distributed():
        return False
    from .fsdp import reshard_params as reshard

    return reshard(model)
