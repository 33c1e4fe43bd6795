"""A frozen model's decoder layers kept in CPU memory and streamed to the device layer by layer during a forward.

`StreamedLayers(model, device)` moves the weights of every decoder layer (parallel.fsdp.decoder_layers: ours, or a
transformers model's) into host memory, pinned on a CUDA machine, and leaves the rest (embeddings, final norm, head)
where they are. During a forward, hooks copy layer i + 1 to the device on a side stream while layer i computes, and
give layer i's copy back as soon as it is done: at most two layers' weights are on the device at once. Between
forwards each parameter is its host tensor again, so nothing of the layers stays on the device.

What it costs: each forward copies every layer over PCIe once (a 7B model's 13 GiB of bf16 layers at ~25 GB/s is
~0.5 s), overlapped with the previous layer's compute; the reference policy's forward-only pass is where it pays
(memory/plan.py chooses it). Frozen models only: a parameter's data is swapped, so gradients could not flow to it.
Off CUDA the same hooks copy within host memory (what the CPU tests check: the results equal the resident model's).
Not here: deciding to stream (memory/plan.py), FSDP's own CPU offload for sharded roles (parallel/fsdp.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..parallel.fsdp import decoder_layers


class StreamedLayers:
    """Hooks that bring each decoder layer's weights to `device` one layer ahead of its forward."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.device = torch.device(device)
        self.layers = decoder_layers(model)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no decoder layers to stream")
        if any(p.requires_grad for layer in self.layers for p in layer.parameters()):
            raise ValueError("only a frozen model's layers can be streamed: its parameters are swapped in and out")
        pin = self.device.type == "cuda"
        self.params = [list(layer.parameters()) for layer in self.layers]
        self.host = [[self._to_host(p.data, pin) for p in params] for params in self.params]  # pinned on CUDA
        for params, host in zip(self.params, self.host):
            for p, h in zip(params, host):
                p.data = h
        if pin:
            torch.cuda.empty_cache()  # the layers' device memory goes back to the device
        self.copy_stream = torch.cuda.Stream(self.device) if pin else None
        self.copies: dict[int, tuple[list[torch.Tensor], Optional[torch.cuda.Event]]] = {}  # layer -> in flight
        self.most_on_device = 0  # the most layers held on the device at once (a check for tests and benchmarks)
        self.handles = [model.register_forward_pre_hook(lambda module, args: self._fetch(0))]
        for i, layer in enumerate(self.layers):
            self.handles.append(layer.register_forward_pre_hook(lambda module, args, i=i: self._enter(i)))
            self.handles.append(layer.register_forward_hook(lambda module, args, out, i=i: self._leave(i)))

    @staticmethod
    def _to_host(data: torch.Tensor, pin: bool) -> torch.Tensor:
        host = torch.empty(data.shape, dtype=data.dtype, device="cpu", pin_memory=pin)
        host.copy_(data)
        return host

    @property
    def layer_bytes(self) -> int:
        """The streamed weights, in bytes (what the device no longer holds)."""
        return sum(h.numel() * h.element_size() for host in self.host for h in host)

    def _fetch(self, i: int) -> None:
        """Start copying layer i to the device (a no-op when it is in flight or past the last layer)."""
        if i >= len(self.layers) or i in self.copies:
            return
        with torch.inference_mode(False):  # the copies are ordinary tensors, like the parameters they stand in for
            if self.copy_stream is None:
                self.copies[i] = ([h.to(self.device, copy=True) for h in self.host[i]], None)
            else:
                self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.copy_stream):
                    copies = [h.to(self.device, non_blocking=True) for h in self.host[i]]
                self.copies[i] = (copies, self.copy_stream.record_event())
        self.most_on_device = max(self.most_on_device, len(self.copies))

    def _enter(self, i: int) -> None:
        self._fetch(i)  # the first layer of a forward that did not go through the model's own hook
        copies, ready = self.copies[i]
        if ready is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(ready)
            for c in copies:  # freed when layer i is done: the allocator waits for the compute stream's use
                c.record_stream(compute)
        for p, c in zip(self.params[i], copies):
            p.data = c
        self._fetch(i + 1)  # the next layer crosses while this one computes

    def _leave(self, i: int) -> None:
        for p, h in zip(self.params[i], self.host[i]):
            p.data = h
        self.copies.pop(i, None)

    def release(self) -> None:
        """Every layer back to its host weights, nothing in flight (after a forward that raised midway)."""
        for i in list(self.copies):
            self._leave(i)
        for i, (params, host) in enumerate(zip(self.params, self.host)):
            for p, h in zip(params, host):
                p.data = h

    def remove(self) -> None:
        """Stop streaming: the layers' weights go back to the device for good."""
        self.release()
        for handle in self.handles:
            handle.remove()
        for params in self.params:
            for p in params:
                p.data = p.data.to(self.device)
