"""Activation offload: the checkpointed decoder layers' saved inputs kept in host memory between forward and backward.

A checkpointed layer (actor.checkpoint_layers) keeps only its input, h [b, T, H], for the backward, which recomputes
the layer from it; with every layer checkpointed those inputs are L x h x b bytes per token, the largest thing the
update holds beside one recomputed layer. `ActivationOffload` (actor.offload_activations) moves them to pinned host
memory: the decoder enters `layer(i)` around its checkpointed call of layer i, and autograd's saved-tensor hooks
(torch.autograd.graph.saved_tensors_hooks) hand each saved input here.

  forward   the input is copied to a pinned host buffer on a side stream, after an event says it is computed. At
            most `in_flight` copies are outstanding: before the next one starts, the compute stream waits for the
            oldest copy's event and its device tensor is let go (its memory is reused in stream order, never before
            the copy has read it). The host is never blocked.
  backward  the backward reaches the layers last to first. Taking layer i's input back starts the copies of the next
            `in_flight - 1` layers it will reach (i - 1, i - 2, ...) onto the device on the side stream, into memory
            allocated on the compute stream, which waits for each copy's event before using it. Inputs still held
            on the device at the end of the forward (the last ones copied) are used as they are.
  CPU       the same hooks, with a plain copy in host memory and no streams: the mechanism runs and its gradients
            can be compared with the resident ones (tests/test_activation_offload.py: equal, float32, exactly).

Only floating tensors that require grad are moved (a layer's hidden-state input; Gemma 4's per-layer input slice);
what every layer shares (the RoPE tables, the attention mask) stays where it is. What a kept (not checkpointed)
layer saves is not touched: moving 30-60 times a layer's input per token over PCIe would cost more than recomputing.
What it saves: (k - in_flight) x h x b bytes per token of k checkpointed layers (memory/budget.py counts it). What
it costs: each checkpointed layer's input over PCIe twice (h x b per token each way; estimated at a quarter of the
time the layer's own forward takes at a 7B shape, 25 GB/s against 400 TFLOP/s), overlapped with the compute.
Not here: deciding to offload (memory/plan.py), the checkpointing itself (models/decoder.py).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Optional

import torch


class _Saved:
    """One saved input: its host copy, the device tensor while a copy still reads it (or a prefetched one), and
    the events that order the copies against the compute stream."""

    __slots__ = ("record", "index", "source", "host", "device", "copied", "fetched", "fetch_done")

    def __init__(self, record: list, index: int):
        self.record, self.index = record, index  # its forward's inputs, in forward order, and its place there
        self.source: Optional[weakref.ref] = None         # the tensor packed (weakly: the copy must not keep it)
        self.host: Optional[torch.Tensor] = None
        self.device: Optional[torch.Tensor] = None        # the original, until its copy is known to be done
        self.copied: Optional[torch.cuda.Event] = None    # the host copy is complete
        self.fetched: Optional[torch.Tensor] = None       # the copy back, in flight or done
        self.fetch_done: Optional[torch.cuda.Event] = None


class ActivationOffload:
    """Saved-tensor hooks that keep the checkpointed layers' inputs in host memory, at most `in_flight` copies
    outstanding each way. One object per model; each training forward starts a new record at layer 0."""

    def __init__(self, device: torch.device, in_flight: int):
        if in_flight < 1:
            raise ValueError(f"ActivationOffload(in_flight={in_flight}): at least one copy must be allowed")
        self.device = torch.device(device)
        self.in_flight = in_flight
        self.cuda = self.device.type == "cuda"
        self.pin = self.cuda  # host buffers in pinned memory (what makes the copies asynchronous)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.saved: list[_Saved] = []      # this forward's inputs, in forward order
        self.pending: list[_Saved] = []    # copies to host not yet waited for (at most in_flight)
        self.offloaded = 0                 # inputs moved in the last forward (a check for tests and benchmarks)
        self.offloaded_bytes = 0
        self.layer_start = 0               # where the current layer's inputs start in `saved`

    @contextmanager
    def layer(self, index: int):
        """Around checkpointed layer `index`'s call: its saved inputs go through the hooks (index 0 starts a
        new forward's record)."""
        if index == 0:
            self.saved, self.pending, self.offloaded, self.offloaded_bytes = [], [], 0, 0
        self.layer_start = len(self.saved)  # this layer's inputs start here in the record
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    # ----- forward -----------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        if not (t.requires_grad and t.is_floating_point()) or t.numel() == 0:
            # shared by every layer (RoPE tables, masks), not an activation, or empty (the non-reentrant checkpoint
            # of some torch versions saves an empty grad-requiring placeholder beside the inputs): left where it is
            return t
        for s in self.saved[self.layer_start:]:  # the same tensor saved twice by one layer: one copy
            if s.source is not None and s.source() is t:
                return s
        s = _Saved(self.saved, len(self.saved))
        s.source = weakref.ref(t)
        self.saved.append(s)
        self.offloaded += 1
        self.offloaded_bytes += t.numel() * t.element_size()
        if not self.cuda:
            s.host = t.detach().clone()
            return s
        while len(self.pending) >= self.in_flight:
            self._release(self.pending.pop(0))
        s.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
        s.device = t
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # t is computed before the copy reads it
        with torch.cuda.stream(self.stream):
            s.host.copy_(t.detach(), non_blocking=True)
            s.copied = torch.cuda.Event()
            s.copied.record(self.stream)
        self.pending.append(s)
        return s

    def _release(self, s: _Saved) -> None:
        """Let go of `s`'s device tensor: the compute stream waits for its copy, so its memory is reused after."""
        torch.cuda.current_stream(self.device).wait_event(s.copied)
        s.device = None

    # ----- backward ----------------------------------------------------------------------------
    def _unpack(self, s) -> torch.Tensor:
        if not isinstance(s, _Saved):
            return s
        if not self.cuda:
            return s.host
        if s.device is not None:  # still on the device (among the last copied): used as it is
            t, s.device = s.device, None
            if s in self.pending:
                self.pending.remove(s)
        else:
            if s.fetched is None:
                self._fetch(s)
            torch.cuda.current_stream(self.device).wait_event(s.fetch_done)
            t, s.fetched = s.fetched, None
        for j in range(s.index - 1, max(-1, s.index - self.in_flight), -1):  # the layers backward reaches next
            ahead = s.record[j]
            if ahead.device is None and ahead.fetched is None:
                self._fetch(ahead)
        return t

    def _fetch(self, s: _Saved) -> None:
        """Start `s`'s copy back to the device on the side stream, into memory of the compute stream."""
        compute = torch.cuda.current_stream(self.device)
        s.fetched = torch.empty(s.host.shape, dtype=s.host.dtype, device=self.device)
        self.stream.wait_stream(compute)  # the memory's previous use on the compute stream is over
        with torch.cuda.stream(self.stream):
            s.fetched.copy_(s.host, non_blocking=True)
            s.fetch_done = torch.cuda.Event()
            s.fetch_done.record(self.stream)
