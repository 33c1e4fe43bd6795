"""What a trainable role (actor, critic) puts in a checkpoint: its trainable state, chosen by the role.

`checkpoint_state_dicts()` is {model, optim, scheduler}. A model with LoRA adapters saves only what trains
(the adapters, and a critic's value head) and their optimizer state: its frozen base is the model
directory the run started from, which architecture/{role}.json names. A full-parameter role saves every
weight, as before. An optimizer offloaded to the CPU (actor.optimizer_offload) saves the same state under the
same names (its host weights stand for the model's parameters), so a checkpoint resumes with it on or off.
A role with float16 weights also saves its loss scale (`loss_scale`: the scale, the clean steps since its last
change and the steps skipped over the run, roles/loss_scale.py) beside the optimizer state, so a resumed run
scales its next loss as the uninterrupted one would; a checkpoint without it (an older one) starts from the
initial scale and says so in the log.
phaserl.checkpoint calls these two methods on every role that has them (duck-typed roles without them get the
same full-parameter state). Not here: where and when checkpoints are written.
"""
from __future__ import annotations

import logging

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..models.lora import state_dict_options

log = logging.getLogger("phaserl")


class CheckpointedRole:
    """Mixin of HybridActor and Critic: `.model` and `.optimizer` (roles.optim.Optimizer) are the role's, `.role`
    its name in messages ("actor", "critic")."""

    def checkpoint_state_dicts(self) -> dict:
        options = state_dict_options(self.model)
        optim = (_host_optimizer_state(self.model, self.optimizer) if self.optimizer.offloaded
                 else get_optimizer_state_dict(self.model, self.optimizer.opt))
        scale = {} if self.optimizer.half is None else {"loss_scale": self.optimizer.half.scaler.state_dict()}
        return {"model": get_model_state_dict(self.model, options=options), "optim": optim,
                "scheduler": self.optimizer.sched.state_dict(), **scale}

    def load_checkpoint_state_dicts(self, state: dict) -> None:
        set_model_state_dict(self.model, state["model"], options=state_dict_options(self.model))
        if self.optimizer.offloaded:
            _load_host_optimizer_state(self.model, self.optimizer, state["optim"])
            self.optimizer.host.refresh()  # the host weights from the device weights just loaded
        else:
            set_optimizer_state_dict(self.model, self.optimizer.opt, state["optim"])
        self.optimizer.sched.load_state_dict(state["scheduler"])
        _load_loss_scale(self.optimizer, state, self.role)


_KERNEL_KEYS = ("foreach", "fused", "capturable")


def _load_loss_scale(optimizer, state: dict, role: str) -> None:
    """The saved loss scale into a float16 role's scaler; none saved (an older checkpoint): the initial scale,
    logged. A saved scale for weights that are no longer float16 has nothing to scale."""
    if optimizer.half is None:
        if "loss_scale" in state:
            log.info(f"{role}: the checkpoint's float16 loss scale is not used (this run's weights are not float16)")
        return
    if "loss_scale" not in state:
        log.info(f"{role}: the checkpoint has no float16 loss scale; the loss scale starts again from its initial "
                 f"{optimizer.half.scaler.scale:g}")
        return
    optimizer.half.scaler.load_state_dict(state["loss_scale"])


def _trained_names(model, optimizer) -> list[str]:
    """The model's name of each parameter the optimizer steps, in its order."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for p in optimizer.params]


def _host_optimizer_state(model, optimizer) -> dict:
    """An offloaded AdamW's state in get_optimizer_state_dict's layout: {state: {name: ...}, param_groups: [...]},
    each moment initialized (zeros, step 0) before the first step, as that function does, so that a resume has
    tensors to fill."""
    opt, names = optimizer.opt, _trained_names(model, optimizer)
    for w in optimizer.host.weights:
        if not opt.state[w]:
            opt.state[w].update(step=torch.tensor(0.0),
                                exp_avg=torch.zeros_like(w, memory_format=torch.preserve_format),
                                exp_avg_sq=torch.zeros_like(w, memory_format=torch.preserve_format))
    plain = opt.state_dict()  # state keyed by position in the optimizer, the live tensors
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
              for g in plain["param_groups"]]
    return {"state": {names[i]: st for i, st in plain["state"].items()}, "param_groups": groups}


def _load_host_optimizer_state(model, optimizer, state: dict) -> None:
    position = {name: i for i, name in enumerate(_trained_names(model, optimizer))}
    own = optimizer.opt.param_groups[0]  # which kernel runs is this optimizer's, not the one that saved the state
    groups = [{**{k: v for k, v in g.items() if k != "params"}, **{k: own[k] for k in _KERNEL_KEYS if k in own},
               "params": [position[n] for n in g["params"]]} for g in state["param_groups"]]
    optimizer.opt.load_state_dict({"state": {position[n]: st for n, st in state["state"].items()},
                                   "param_groups": groups})
