"""ReferencePolicy: the frozen policy that KL is measured against.

Frozen by construction (classic mistake 3): parameters get `requires_grad_(False)`, the module is put in
eval mode, and every forward runs under `torch.inference_mode()`. `check_frozen()` runs every step;
a parameter that became trainable is an error naming it, never a warning.
With a LoRA actor the reference is the actor's own model with its adapters off (`ReferencePolicy.base_of`):
no second copy of the weights; the frozen base is what both read. `stream_weights(device)` (ref.stream_weights, the
memory plan) keeps its decoder layers in CPU memory and streams them to the device layer by layer during each
forward (roles/streaming.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import PreflightError
from ..models import linear_attention
from ..models.lora import adapters_disabled, has_lora, is_adapter_parameter
from ..parallel import reshard_params
from .forward import batch_logprobs
from .models import as_causal_lm
from .parallel_settings import FSDPSettings, reject_hybrid_config
from .streaming import StreamedLayers


class ReferencePolicy:
    role = "ref"

    def __init__(self, model: torch.nn.Module, *, fsdp_config=None, hybrid_engine_config=None):
        reject_hybrid_config("ReferencePolicy", hybrid_engine_config)
        self.model = as_causal_lm(model)
        self.model.requires_grad_(False)
        self.model.eval()
        self.fsdp = FSDPSettings.from_any(fsdp_config, role="ref")
        self.packing = False  # ppo.packing: padding-free micro-batches (set by the builder)
        self.shares_actor_base = False  # base_of(): the actor's model with its LoRA adapters off
        self.streamed: Optional[StreamedLayers] = None  # ref.stream_weights: layers in CPU memory between passes

    @classmethod
    def base_of(cls, actor_model: torch.nn.Module, fsdp: Optional[FSDPSettings] = None) -> "ReferencePolicy":
        """The reference of a LoRA actor: the actor's own model run with its adapters off (no second copy).

        Its base weights are frozen by the adapters (models/lora.py), and check_frozen() still proves it
        every step; the forward runs under no_grad (not inference_mode: these are the actor's tensors, and
        FSDP2 buffers made under inference mode could not be saved for the actor's backward later).
        """
        if not has_lora(actor_model):
            raise PreflightError("ReferencePolicy.base_of(model) needs a model with LoRA adapters "
                                 "(models.lora.apply_lora); a full-parameter actor needs its own reference copy")
        ref = cls.__new__(cls)
        # fsdp: the actor's settings (its model is sharded once, as the actor); they decide packing alike
        ref.model, ref.fsdp, ref.packing, ref.shares_actor_base = actor_model, fsdp or FSDPSettings(), False, True
        ref.streamed = None
        return ref

    def stream_weights(self, device: torch.device) -> int:
        """Keep the decoder layers in CPU memory, streamed to `device` one layer ahead of each forward; returns the
        bytes taken off the device. Not for a reference that is the actor's own base (there is no copy to move)."""
        if self.shares_actor_base:
            raise PreflightError("ref.stream_weights: the reference is the LoRA actor's own base (no copy of its "
                                 "own to keep on the CPU); set ref.stream_weights=false")
        if self.streamed is None:
            self.streamed = StreamedLayers(self.model, device)
        return self.streamed.layer_bytes

    def check_frozen(self) -> None:
        trainable = [name for name, p in self.model.named_parameters()
                     if p.requires_grad and not (self.shares_actor_base and is_adapter_parameter(name))]
        if trainable:
            shown = ", ".join(trainable[:5]) + (f" and {len(trainable) - 5} more" if len(trainable) > 5 else "")
            raise PreflightError(
                f"ReferencePolicy has {len(trainable)} trainable parameter(s) ({shown}). The reference must stay "
                "frozen: a trainable reference drifts with the actor (KL collapses to 0) and its graph gets "
                "back-propagated twice ('Trying to backward through the graph a second time'). Something "
                "called requires_grad_(True) on it, or the same module is shared with the actor: give the "
                "reference its own copy of the weights.")
        if self.model.training and not self.shares_actor_base:
            self.model.eval()

    def check_separate_from(self, actor_model: torch.nn.Module) -> None:
        """The reference must own its weights: one shared with the actor would freeze the actor too."""
        if self.shares_actor_base and self.model is actor_model:
            return  # by design: the base is frozen for both, the adapters are switched off here
        actor_params = {id(p) for p in actor_model.parameters()}  # identity: also right for sharded DTensors
        shared = [name for name, p in self.model.named_parameters() if id(p) in actor_params]
        if shared:
            raise PreflightError(
                f"ReferencePolicy shares {len(shared)} parameter(s) with the actor ({', '.join(shared[:3])}...): "
                "freezing the reference froze the actor, and the KL would always be 0. Give the reference its own "
                "copy, e.g. ReferencePolicy(model=AutoModelForCausalLM.from_pretrained(path)) or "
                "copy.deepcopy(policy).")

    def compute_logprobs(self, batch, *, temperature: float, token_budget: int) -> torch.Tensor:
        """Reference log-probs of the responses.  [B, R]"""
        self.check_frozen()
        if self.shares_actor_base:
            return self._base_logprobs(batch, temperature=temperature, token_budget=token_budget)
        try:
            with torch.inference_mode(), linear_attention.reference_pass():
                logprobs = batch_logprobs(self.model, batch, temperature=temperature, token_budget=token_budget,
                                          packing=self.packing)
        finally:
            if self.streamed is not None:  # a pass that raised midway leaves no layer on the device
                self.streamed.release()
        # FSDP2 keeps a root unit (embeddings, head) gathered after forward and frees it in backward; a
        # frozen role has no backward, so without this a full copy would stay until the process ends.
        reshard_params(self.model)
        return logprobs.clone()  # a normal tensor: inference tensors cannot be saved for the actor's backward

    def _base_logprobs(self, batch, *, temperature: float, token_budget: int) -> torch.Tensor:
        """The actor's model in eval mode (no adapter dropout) with its adapters off; its mode restored after."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), adapters_disabled(self.model), linear_attention.reference_pass():
                return batch_logprobs(self.model, batch, temperature=temperature, token_budget=token_budget,
                                      packing=self.packing)
        finally:
            self.model.train(was_training)
