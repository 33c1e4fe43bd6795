"""What a trainable role (actor, critic) puts in a checkpoint: its trainable state, chosen by the role.

`checkpoint_state_dicts()` is {model, optim, scheduler}. A model with LoRA adapters saves only what trains
(the adapters, and a critic's value head) and their optimizer state: its frozen base is the model
directory the run started from, which architecture/{role}.json names. A full-parameter role saves every
weight, as before. phaserl.checkpoint calls these two methods on every role that has them (duck-typed
roles without them get the same full-parameter state). Not here: where and when checkpoints are written.
"""
from __future__ import annotations

from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from ..models.lora import state_dict_options


class CheckpointedRole:
    """Mixin of HybridActor and Critic: `.model` and `.optimizer` (roles.optim.Optimizer) are the role's."""

    def checkpoint_state_dicts(self) -> dict:
        options = state_dict_options(self.model)
        return {"model": get_model_state_dict(self.model, options=options),
                "optim": get_optimizer_state_dict(self.model, self.optimizer.opt),
                "scheduler": self.optimizer.sched.state_dict()}

    def load_checkpoint_state_dicts(self, state: dict) -> None:
        set_model_state_dict(self.model, state["model"], options=state_dict_options(self.model))
        set_optimizer_state_dict(self.model, self.optimizer.opt, state["optim"])
        self.optimizer.sched.load_state_dict(state["scheduler"])
