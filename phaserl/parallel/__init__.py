"""torch.distributed helpers: rank/world size, and reductions that are no-ops in one process.

One process (no launcher) is the default; under torchrun every rank runs the same program (SPMD).
    collectives.py     rank_and_world, all_reduce_sum, max_over_ranks, reduce_metrics, gather/reshard; the training
                       group (the trainer ranks, when rollout ranks are split off)
    launch.py          init_distributed / destroy, rank_errors, set_phase (failures name rank and phase)
    fsdp.py            apply_fsdp per role, gather/reshard around the actor's rollout (imported lazily:
                       torch.distributed.fsdp costs seconds to import and one process never needs it)
    shared_storage.py  checkpoint/log paths every rank must share (classic mistake 5)
    memory.py          the memory timeline of a step (GPU memory at every phase boundary and switch)
    watch.py           ranks stop at once when their launcher or a peer on their host is gone
    rank_split.py      rollout.ranks: which ranks train and which generate, and their process groups
    weight_sync.py     new weights from the trainer ranks to the rollout ranks, in buckets, between decode steps
    sample_channel.py  completed sample groups from the rollout ranks to the trainer ranks
"""
from __future__ import annotations

from .collectives import (
                          all_reduce_sum,
                          is_distributed,
                          launch_rank_and_world,
                          max_over_ranks,
                          rank_and_world,
                          reduce_metrics,
                          set_training_group,
                          training_group,
)
from .gather import gather_full_params, reshard_params
from .launch import RankFailure, current_phase, destroy, init_distributed, rank_errors, set_phase
from .memory import mark_memory, record_memory, stop_recording

__all__ = ["is_distributed", "rank_and_world", "launch_rank_and_world", "training_group", "set_training_group",
           "all_reduce_sum", "max_over_ranks", "reduce_metrics", "gather_full_params", "reshard_params", "mark_memory",
           "record_memory", "stop_recording", "init_distributed", "destroy", "rank_errors", "set_phase",
           "current_phase", "RankFailure"]
