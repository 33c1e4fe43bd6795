"""ModelRunner: the rollout engine's forward passes (prefill and decode) over the actor's own weights.

The runner does not call `CausalLM.forward`, but it runs the very same layer functions
(models/layers.py: pre_attention, post_attention, rms_norm, embed, with each layer's LayerSpec) in
token-flattened form around its own attention core, so that it can write into the slot KV pool and be
captured in CUDA graphs; a family added to layers.py is therefore right here too. It reads the module's
norms, o_proj, down_proj and embedding in place, and keeps its own concatenated [q; k; v] and
[gate; up] weights (one GEMM instead of three and two), refilled from the module at every call.
Sliding layers attend within their window in prefill (an explicit mask), in the torch decode path and in
the Triton kernel (which then reads only the window); their slots still hold the whole sequence.
MoE layers (models/moe.py) read their router and experts in place; with `record_routes` every pass also
writes the experts each MoE layer chose at each position into `routes` [slots, S, L, k] (routing replay).
Gemma 4 E2B/E4B: every pass computes its tokens' per-layer inputs from their ids (the model's own table, read in
place); a KV-sharing layer computes queries only and attends with its source layer's k/v of the same pass over the
source's slots (the pool gives it those views; its attention core's write puts the same values there again).
  prefill  the prompts of newly admitted sequences, each distinct prompt once: its KV is written into
           every slot of the sequences that share it, and each sequence draws its own first token.
  decode   one token for every slot in [0, b); b is a bucket size, and on CUDA each (bucket, sampling
           settings) pair is one CUDA graph, captured the first time decode needs it (that step runs
           eagerly, then is recorded) and replayed after. Sampling happens inside it.
On CUDA, every decode layer whose math fused.py implements runs as its 7 kernels (norms, bias + RoPE + KV
write + split-K attention, gated activation: kernels.py); other layers run layers.py's functions with the
Triton attention kernel; sampling is a Triton kernel too. An extend pass's attention (each layer: its new
KV written, then M queries per row over the row's slot) is extend_kernel.py's two kernels there. With
`compile=True` the torch pieces (prefill, unfused layers) go through torch.compile. The CPU path runs
layers.py's functions eagerly with pure-torch attention and sampling.
Not here: which sequence is in which slot (scheduler.py), memory sizing (kv_pool.py), kernels (kernels.py,
extend_kernel.py).

Legend: N tokens in the pass, b decode rows (slots), U distinct prompts, A admitted sequences,
P longest prompt, S slot_len, H hidden, Hq/Hkv heads, D head_dim, V vocab.
"""
from __future__ import annotations

import gc
from typing import Optional

import torch

from phaserl.models import invariant
from phaserl.models.decoder import CausalLM
from phaserl.models.heads import softcap
from phaserl.models.layers import LayerWeights, embed, linear
from phaserl.models.lora import engine_weight
from phaserl.models.moe import Route, SharedExpert, prepare_device
from phaserl.rollout import extend_kernel, kernels
from phaserl.rollout.fused import fusable, fused_decode_layer, fused_extend_layer
from phaserl.rollout.images import add_deepstack, extend_images, place_extend_images, place_images
from phaserl.rollout.kv_pool import KVPool, SlotState, exchange_index, slot_index
from phaserl.rollout.layer_fns import LayerFns, default_fns
from phaserl.rollout.sampling import SamplingParams
from phaserl.rollout.torch_path import extend_attention, extend_mask

Tensor = torch.Tensor
FUSED_DECODE = True  # decode layers through fused.py's kernels where Triton runs (benchmarks flip it to compare)
# Capture with CUDAGraph.capture_begin/end on our side stream: torch.cuda.graph() also runs gc.collect() and
# empty_cache() at every capture (tens of ms each in a trainer's process, and the cache is lost).
# Off by default until it has run on a GPU: the lean path was written after the last H200 run (2026-12-01), while
# torch.cuda.graph() with lazy per-bucket capture ran there (benchmarks and tests flip it to compare).
LEAN_CAPTURE = False
EXTEND_KERNEL = True  # extend passes' attention through extend_kernel.py where Triton runs (benchmarks flip it)


def module_tensors(layer) -> list[Tensor]:
    """The layer's parameters the engine reads (their addresses decide when the fused copies are rebuilt)."""
    return [p for p in layer.parameters()]


def fused_weights(layer, previous: Optional[LayerWeights] = None) -> LayerWeights:
    """The layer's layers.LayerWeights for the engine: [q; k; v] and [gate; up] as engine-owned concatenations
    (one GEMM each instead of three and two), every other tensor the module's own, read in place (with LoRA
    adapters on o / down, engine copies of them too, the adapters merged: models/lora.engine_weight). The copies
    cost (q + k + v + gate + up) parameters once more: 0.47 GB for Qwen2-0.5B, 8.5 GB for Qwen2-7B in bf16;
    ModelRunner.release() (engine.sleep()) frees them. With `previous`, the fused buffers are refilled in
    place (captured graphs keep pointing at them) instead of allocated again. In the bitwise numerics mode the
    engine computes with the module's own projections, as the trainer does (models/invariant.py; LoRA adapters
    merged as the trainer's forward merges them: rollout/bitwise.engine_weights)."""
    if invariant.enabled():
        from phaserl.rollout.bitwise import engine_weights

        return engine_weights(layer, previous)
    m = layer.weights()  # projections as modules

    def cat(parts: list[Tensor], into: Optional[Tensor]) -> Tensor:
        return torch.cat(parts) if into is None else torch.cat(parts, out=into)

    # engine_weight: the module's tensor, or with LoRA adapters W + s·BA merged into the engine's own copy
    # (o and down then get one too); the actor's base weights are never written.
    w = engine_weight
    v = m.k if m.v is None else m.v  # Gemma 4's k_eq_v layers: the value rows repeat the key rows
    qkv = [m.q] if m.k is None else [m.q, m.k, v]  # Gemma 4's KV-sharing layers: queries only
    qkv_bias = None
    if m.q.bias is not None:
        qkv_bias = cat([p.bias for p in qkv], previous and previous.qkv_bias)
    # A MoE layer's router and stacked experts are read in place (m.moe): no copy of the expert weights.
    if m.moe is not None:
        mlp = dict(moe=m.moe if m.moe.shared is None else m.moe._replace(
            shared=shared_expert_weights(m.moe.shared, previous and previous.moe.shared)))
    else:
        mlp = dict(gate=None, up=None, down=w(m.down, previous and previous.down),
                   gate_up=cat([w(m.gate), w(m.up)], previous and previous.gate_up))
    if m.ple_gate is not None:  # Gemma 4's per-layer input projections, as tensors
        mlp.update(ple_gate=w(m.ple_gate, previous and previous.ple_gate),
                   ple_proj=w(m.ple_proj, previous and previous.ple_proj))
    return m._replace(q=None, k=None, v=None, qkv=cat([w(p) for p in qkv], previous and previous.qkv),
                      qkv_bias=qkv_bias, o=w(m.o, previous and previous.o), o_bias=m.o.bias, **mlp)


def shared_expert_weights(s: SharedExpert, previous: Optional[SharedExpert]) -> SharedExpert:
    """Qwen2-MoE's shared expert for the engine: its projections as tensors (LoRA adapters merged, engine_weight)."""
    return s._replace(gate=engine_weight(s.gate, previous and previous.gate),
                      up=engine_weight(s.up, previous and previous.up),
                      down=engine_weight(s.down, previous and previous.down))


def layer_fns(device: torch.device, compile: bool) -> LayerFns:
    """The functions a runner uses: compiled or eager, with the Triton kernels wherever they run (layer_fns.py); in
    the bitwise numerics mode the batch-invariant ones (rollout/bitwise.py), whatever `compile` says."""
    if invariant.enabled():
        from phaserl.rollout.bitwise import on_device

        return on_device(device)
    return default_fns(device, compile)


def column(per_layer: Optional[Tensor], layer: int) -> Optional[Tensor]:
    """Layer `layer`'s own input [N, P] from a pass's per-layer inputs [N, L, P] (Gemma 4), or None."""
    return None if per_layer is None else per_layer[:, layer]


def prefill_mask(P: int, window: Optional[int], device: torch.device) -> Optional[Tensor]:
    """[P, P] causal mask within `window` for a sliding layer's prefill (right padding stays harmless);
    None for full layers (SDPA's is_causal)."""
    if window is None:
        return None
    i = torch.arange(P, device=device)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)


ROUTE_DTYPE = torch.int16  # routing replay's expert ids (-1 = not forwarded)


def route_columns(specs) -> tuple[int, int]:
    """(MoE layers, k) of the routing-replay record [slots, S, MoE layers, k] for these layers.LayerSpec's;
    (0, 0) without MoE layers. The doctor's memory count calls this (rollout/slot_memory.py)."""
    moe = [spec.moe for spec in specs if spec.moe is not None]
    return (len(moe), moe[0].top_k) if moe else (0, 0)


def decode_buckets(num_slots: int) -> list[int]:
    """Batch sizes that get a graph: powers of two from 2 up to 64, then every 64, then num_slots itself.

    No bucket 1 (unless num_slots is 1): compiled functions specialize on size 1, a recompile for one row.
    """
    small = [b for b in (2, 4, 8, 16, 32, 64) if b < num_slots]
    return small + list(range(128, num_slots, 64)) + [num_slots]


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, *, cuda_graphs: bool, compile: bool, prefill_tokens: int,
                 record_routes: bool = False):
        self.model, self.pool, self.cfg = model, pool, model.config
        self.device = model.output_weight.device
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        self.fns = layer_fns(self.device, compile)
        self.prefill_tokens = prefill_tokens
        self.specs = [layer.spec for layer in model.model.layers]  # layers.LayerSpec: the same as training's
        self.heads = (self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim)  # every layer's
        # but Gemma 4's global ones (they read spec.heads); Qwen3.5's HybridRunner reads these
        self.final_norm = (self.cfg.rms_norm_eps, self.cfg.norm_style)
        # Gemma 4 E2B/E4B: the layer whose keys/values each layer attends over, and the layers later ones read
        self.kv_source = [self.cfg.kv_source(i) for i in range(self.cfg.num_hidden_layers)]
        self.kv_store = {j for i, j in enumerate(self.kv_source) if i != j}
        self.layout: Optional[tuple[int, int, int]] = None  # (num_slots, slot_len, max_new)
        self.graphs: dict = {}
        self.graph_pool = None
        self.weights: Optional[list[LayerWeights]] = None
        self.pointers: Optional[list[int]] = None
        # The call's noise seed: every draw's noise is a function of (seed, the slot's SlotState.key, the position
        # drawn after) alone (sampling.keyed_noise; kernels.sample), so it stays fixed for the whole call.
        self.seed = torch.zeros(1, dtype=torch.long, device=self.device)
        self.fused: list[bool] = []  # per layer: decode through fused.py (set at begin(), from the weights)
        self.fused_record = False    # SlotState.record as kernels.record
        # Routing replay: the experts every MoE layer chose at every position of every slot (moe.py).
        moe = [i for i, spec in enumerate(self.specs) if spec.moe is not None]
        self.moe_index = {layer: j for j, layer in enumerate(moe)}  # layer -> its column in `routes`
        self.record_routes = record_routes and bool(moe)
        self.routes: Optional[Tensor] = None  # [slots, S, L, k] int16 expert ids, -1 = not forwarded
        # Vision-language models (rollout/images.py): the call's image prompts by sequence index (the engine sets
        # them), and per slot the shift decoding adds to its RoPE position (M-RoPE); None for text models.
        self.vision: dict = {}
        self.rope_shift: Optional[Tensor] = None  # [slots]
        self.extending: list = []  # an extend pass's appended images (images.extend_images)
        self.epoch = 0  # counts begin() and release() calls: a decode session knows its slots are still its own
        self.captures = 0  # decode graphs captured so far (each one also ran its step eagerly first)
        prepare_device(self.device)

    def release(self) -> None:
        """Drop graphs, views (they pin the pool's memory) and the fused weight copies. The graph memory
        pool dies with its last graph, so its handle goes too: capturing into a dead pool asserts in
        torch 2.11's allocator."""
        self.graphs, self.layout, self.keys, self.values, self.state = {}, None, None, None, None
        self.graph_pool, self.weights, self.pointers, self.routes = None, None, None, None
        self.epoch += 1

    # ----- per call -------------------------------------------------------------------------------
    def begin(self, num_slots: int, slot_len: int, max_new: int, params: SamplingParams,
              stop_ids: list[int]) -> None:
        """Lay out slots (reusing the previous layout when it is large enough), refresh the fused weights,
        reset state. Graphs of the same layout and weight addresses stay valid; new ones are captured lazily."""
        self.epoch += 1  # a session begun before reads state this call resets: it is lost (DecodeSession.lost)
        want = (num_slots, slot_len, max_new)
        grown = want if self.layout is None else tuple(map(max, self.layout, want))
        fit = self.pool.slots_that_fit(grown[1])
        if fit is not None and fit < grown[0]:
            grown = want
        layers = self.model.model.layers
        pointers = [t.data_ptr() for layer in layers for t in module_tensors(layer)]
        if grown != self.layout or pointers != self.pointers:
            self.release()
            self.layout, self.pointers = grown, pointers
            self.keys, self.values = self.pool.layout(grown[0], grown[1])
            self.state = SlotState(grown[0], grown[2], self.device)
            if self.record_routes:
                self.routes = torch.full((grown[0], grown[1], *route_columns(self.specs)), -1, dtype=ROUTE_DTYPE,
                                         device=self.device)
            self.positions = torch.arange(grown[1], device=self.device)  # [S]
            tables = self.model.model.rope(self.positions[None], self.model.output_weight.dtype)
            self.rope = [(cos[0], sin[0]) for cos, sin in tables]  # [global, local] layers.rope_tables [S, D]
            if getattr(self.model, "takes_images", False):
                self.rope_shift = torch.zeros(grown[0], dtype=torch.long, device=self.device)
        # Refilled every call: training updates the parameters in place, at the same addresses.
        previous = self.weights or [None] * len(layers)
        self.weights = [self.engine_weights(layer, old) for layer, old in zip(layers, previous)]
        use = FUSED_DECODE and kernels.available(self.device)
        # The fused kernels index RoPE by slot position: M-RoPE's shifted positions take the table-reading path.
        self.fused = [use and fusable(w, spec) and self.rope_shift is None for w, spec in zip(self.weights, self.specs)]
        self.fused_record = use
        self.sampling = (params.greedy, 1.0 if params.greedy else params.temperature, params.top_k, params.top_p)
        self.seed.copy_(torch.randint(2**62, (1,), device=self.device))  # from the (seeded) default generator
        self.state.reset(stop_ids)

    engine_weights = staticmethod(fused_weights)  # a layer's LayerWeights for the engine (hybrid runners differ)

    def refresh_weights(self) -> None:
        """Refill the engine's own copies ([q; k; v], [gate; up], LoRA-merged projections) from the module's
        parameters, in place, in the middle of a call: for weights copied into those parameters at the same
        addresses (a rollout rank's in-flight update, parallel/weight_sync.py). Captured graphs stay valid: they
        read the same buffers. Nothing to do before begin() (it fills them) or after release()."""
        if self.weights is None:
            return
        layers = self.model.model.layers
        if [t.data_ptr() for layer in layers for t in module_tensors(layer)] != self.pointers:
            raise RuntimeError("refresh_weights: the model's parameters moved since begin(); copy new weights into "
                               "them in place (Tensor.copy_), or begin a new call")
        with torch.inference_mode():
            self.weights = [self.engine_weights(layer, old) for layer, old in zip(layers, self.weights)]

    def bucket_for(self, span: int) -> int:
        """Decode rows for slots [0, span): the smallest captured bucket, or exactly span without graphs."""
        return next(b for b in decode_buckets(self.layout[0]) if b >= span) if self.use_graphs else span

    def _post(self, h: Tensor, attn: Tensor, w: LayerWeights, spec,
              per_layer_input: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
        """layers.post_attention; with routes recorded, also the experts a MoE layer chose ([N, k], else None).
        per_layer_input: the layer's own input [N, P] (Gemma 4 E2B/E4B), else None."""
        if self.routes is None or spec.moe is None:
            return self.fns.post(h, attn, w, spec, None, per_layer_input), None
        route = Route()
        return self.fns.post(h, attn, w, spec, route), route.experts.to(torch.int16)

    # ----- prefill --------------------------------------------------------------------------------
    def prefill(self, groups: list[tuple[tuple[int, ...], list[int], list[int], list[int]]]) -> None:
        """groups: (prompt, slots of its sequences, their caps, their noise keys); split into passes of <=
        prefill_tokens. A sequence's noise key (an int64) goes with its slot (SlotState.key): its draws depend on
        (the call's seed, the key, the position) only, not on its slot, its batch or the step."""
        chunk, longest = [], 0  # the running longest prompt of the chunk (rescanning it was O(groups^2))
        for group in groups:
            if chunk and max(longest, len(group[0])) * (len(chunk) + 1) > self.prefill_tokens:
                self._prefill_pass(chunk)
                chunk, longest = [], 0
            chunk.append(group)
            longest = max(longest, len(group[0]))
        self._prefill_pass(chunk)

    def _prefill_inputs(self, groups):
        """A prefill pass's inputs on the device: U prompts right-padded to P (causal attention keeps real tokens
        clean), their lengths [U], the prompt row of each sequence [n], its slot [n] and cap [n], the RoPE tables
        [U * P, D] per table, the embedded tokens h [U * P, H] and their per-layer inputs (_embed). The sequences'
        noise keys go into their slots' SlotState.key here."""
        U = len(groups)
        lengths = [len(prompt) for prompt, _, _, _ in groups]
        P = max(lengths)
        # one tensor from padded lists (not one per row)
        ids = torch.tensor([list(prompt) + [0] * (P - len(prompt)) for prompt, _, _, _ in groups], dtype=torch.long)
        group_of = [row for row, (_, slots, _, _) in enumerate(groups) for _ in slots]
        host = [ids, torch.tensor(lengths), torch.tensor(group_of),
                torch.tensor([s for _, slots, _, _ in groups for s in slots]),
                torch.tensor([c for _, _, caps, _ in groups for c in caps]),
                torch.tensor([k for _, _, _, keys in groups for k in keys], dtype=torch.long)]
        ids, lengths, group_of, slots, caps, keys = (t.to(self.device, non_blocking=True) for t in host)
        self.state.key[slots] = keys
        rope = [(cos[:P].repeat(U, 1), sin[:P].repeat(U, 1)) for cos, sin in self.rope]  # [U * P, D] each
        h, per_layer = self._embed(ids.view(-1))  # [U * P, H], [U * P, L, P'] or None
        place_images(self, groups, P, h, rope)  # vision prompts: image features and M-RoPE tables (images.py)
        return U, P, lengths, group_of, slots, caps, rope, h, per_layer

    def _embed(self, ids: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """ids [N] -> (h [N, H], Gemma 4's per-layer inputs [N, L, P] or None)."""
        h = embed(ids, self.model.model.embed_tokens.weight, self.cfg.embed_scale)
        return h, self.model.model.per_layer_inputs(ids, h)

    def _shared_kv(self, layer: int, k: Tensor, v: Tensor, fresh: dict) -> tuple[Tensor, Tensor]:
        """The (k, v) of this pass that `layer` attends with: its own (kept in `fresh` when a later layer reads them),
        or for a KV-sharing layer (Gemma 4) its source layer's. The caches a KV-sharing layer gets are its source's
        (KVPool.layout), so the attention cores' write of these k, v puts the same values where they already are."""
        if self.specs[layer].kv_shared:
            return fresh[self.kv_source[layer]]
        if layer in self.kv_store:
            fresh[layer] = k, v
        return k, v

    def _prefill_pass(self, groups) -> None:
        U, P, lengths, group_of, slots, caps, rope, h, per_layer = self._prefill_inputs(groups)
        masks = {spec.window: prefill_mask(P, spec.window, self.device) for spec in self.specs}
        fresh: dict = {}  # layer -> its (k, v) [U, Hkv, P, D], for the layers that share them (_shared_kv)
        for layer, (keys, values, w, spec) in enumerate(zip(self.keys, self.values, self.weights, self.specs)):
            Hq, Hkv, D = spec.heads  # per layer: Gemma 4's global layers have their own
            q, k, v = self.fns.pre(h, w, spec, *rope[spec.local_rope])
            if not spec.kv_shared:
                k, v = k.view(U, P, Hkv, D).transpose(1, 2), v.view(U, P, Hkv, D).transpose(1, 2)  # [U, Hkv, P, D]
                keys[slots, :, :P], values[slots, :, :P] = k[group_of], v[group_of]  # shared prompt KV -> every slot
            k, v = self._shared_kv(layer, k, v, fresh)
            mask = masks[spec.window]
            attn = self.fns.prefill(q.view(U, P, Hq, D).transpose(1, 2), k, v, attn_mask=mask,
                                    is_causal=mask is None, scale=spec.scale, enable_gqa=True)  # [U, Hq, P, D]
            h, experts = self._post(h, attn.transpose(1, 2).reshape(U * P, Hq * D), w, spec, column(per_layer, layer))
            if experts is not None:  # the prompt's routing, into every slot that shares it (right padding too)
                self.routes[slots, :P, self.moe_index[layer]] = experts.view(U, P, -1)[group_of]
            if self.rope_shift is not None:  # Qwen3-VL: deepstack features after the first layers (images.py)
                h = add_deepstack(self, layer, h)
        last = h.view(U, P, -1)[torch.arange(U, device=self.device), lengths - 1]  # [U, H]
        tokens, logprobs = self._sample(self.fns.norm(last, self.model.model.norm.weight, *self.final_norm)
                                        [group_of], slots, lengths[group_of] - 1)  # one draw per sequence
        self.state.start(slots, tokens, logprobs, lengths[group_of], caps)

    # ----- prefill at an offset (multi-turn continuation) -----------------------------------------
    def extend(self, items: list[tuple]) -> None:
        """Append tokens to parked slots and start their next turn: items are (slot, tokens, start, cap[, images]),
        images the ImageInputs of the image tokens among `tokens` (a vision-language model; images.extend_images).

        `tokens` go at positions start, start + 1, ... of the slot; the KV before `start` is kept and
        attended (no re-prefill of the conversation so far). The last token's distribution draws the
        next turn's first token. Split into passes of <= prefill_tokens (rows x longest).
        """
        chunk, longest = [], 0
        for item in items:
            if chunk and max(longest, len(item[1])) * (len(chunk) + 1) > self.prefill_tokens:
                self._extend_pass(chunk)
                chunk, longest = [], 0
            chunk.append(item)
            longest = max(longest, len(item[1]))
        if chunk:
            self._extend_pass(chunk)

    def _extend_pass(self, items) -> None:
        items = [(*item, None)[:5] for item in items]  # (slot, tokens, start, cap, images or None)
        lengths = [len(tokens) for _, tokens, _, _, _ in items]
        M = max(lengths)
        self.extending = extend_images(self, items, M)  # vision: the appended images, placed by _extend_forward
        # right-padded (pad rows write KV past their end, hidden); one tensor from padded lists
        ids = torch.tensor([list(tokens) + [0] * (M - len(tokens)) for _, tokens, _, _, _ in items], dtype=torch.long)
        host = [ids, torch.tensor([start for _, _, start, _, _ in items]), torch.tensor(lengths),
                torch.tensor([slot for slot, *_ in items]), torch.tensor([cap for _, _, _, cap, _ in items])]
        context = max(start + len(tokens) for _, tokens, start, _, _ in items)  # key positions any row sees
        self._extend_forward(*(t.to(self.device, non_blocking=True) for t in host), context)

    def _extend_forward(self, ids: Tensor, starts: Tensor, lengths: Tensor, slots: Tensor, caps: Tensor,
                        context: int) -> None:
        """The extend pass on device tensors, no host sync: ids [C, M] right-padded, starts/lengths/slots/caps [C];
        keys at positions [0, context) are attended (each token's up to its own: _extend_attention). A padding
        token writes KV (and routes) past its row's end, where decode writes before it reads."""
        (C, M), S = ids.shape, self.layout[1]
        pos = (starts[:, None] + torch.arange(M, device=self.device)).clamp(max=S - 1)  # [C, M]
        masks: dict = {}  # window -> extend_mask [C, M, ctx], for the layers on the torch path only
        # fused.fused_extend_layer where the decode step fuses the layer (its kernels index RoPE themselves)
        fused = [f and EXTEND_KERNEL and extend_kernel.supports(spec.heads[2])
                 for f, spec in zip(self.fused, self.specs)]
        flat = (pos if self.rope_shift is None else pos + self.rope_shift[slots][:, None]).view(-1)  # RoPE positions
        rope = None if all(fused) else [(cos[flat], sin[flat]) for cos, sin in self.rope]  # [C * M, D] each
        h, per_layer = self._embed(ids.view(-1))  # [C * M, H], [C * M, L, P] or None
        if self.rope_shift is not None:  # vision: appended images' features, M-RoPE tables, new shifts (images.py)
            place_extend_images(self, self.extending, h, rope)
        carry = None  # a fused layer's MLP output not yet added to h (as in _decode_step)
        fresh: dict = {}  # layer -> its (k, v) [C * M, Hkv, D], for the layers that share them (_shared_kv)
        for layer, (keys, values, w, spec) in enumerate(zip(self.keys, self.values, self.weights, self.specs)):
            if fused[layer]:
                h, carry = fused_extend_layer(h, carry, w, spec, keys, values, slots, pos, lengths, context,
                                              *self.rope[spec.local_rope])
                continue
            h, carry = h if carry is None else h + carry, None
            q, k, v = self.fns.pre(h, w, spec, *rope[spec.local_rope])
            k, v = self._shared_kv(layer, k, v, fresh)
            attn = self._extend_attention(q, k, v, keys, values, slots, pos, lengths, context, spec.heads,
                                          spec.scale, spec.window, masks)  # [C * M, Hq * D]
            h, experts = self._post(h, attn, w, spec, column(per_layer, layer))
            if experts is not None:
                self.routes[slots[:, None], pos, self.moe_index[layer]] = experts.view(C, M, -1)
            if self.rope_shift is not None:  # Qwen3-VL: deepstack features of appended images (images.py)
                h = add_deepstack(self, layer, h)
        at = (torch.arange(C, device=self.device), lengths - 1)
        last = h.view(C, M, -1)[at]  # [C, H]
        weight = self.model.model.norm.weight
        if carry is not None:  # the last rows only: add_rms_norm rounds each row alone
            x = kernels.add_rms_norm(carry.view(C, M, -1)[at], last, weight, *self.final_norm)[0]
        else:
            x = (kernels.rms_norm if any(self.fused) else self.fns.norm)(last, weight, *self.final_norm)
        ends = starts + lengths
        tokens, logprobs = self._sample(x, slots, ends - 1)
        self.state.start(slots, tokens, logprobs, ends, caps)

    def _extend_attention(self, q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, slots: Tensor,
                          pos: Tensor, lengths: Tensor, context: int, heads: tuple[int, int, int],
                          scale: Optional[float], window: Optional[int], masks: dict) -> Tensor:
        """One layer's attention in the extend pass: the new k/v [C * M, Hkv, D] into the cache at (slots[r], :,
        pos[r, j]), then q [C * M, Hq, D] over each row's slot -> [C * M, Hq * D]. Where Triton runs, two kernels
        (extend_kernel.py: the cache read in place); else (and for head_dim > extend_kernel.MAX_HEAD_DIM) index
        writes and extend_attention over a gathered copy of the slots, with extend_mask's mask (built once per
        window into `masks`)."""
        (C, M), (Hq, Hkv, D) = pos.shape, heads
        if invariant.enabled():  # the bitwise numerics mode (rollout/bitwise.py)
            from phaserl.rollout import bitwise

            return bitwise.extend_attention(q, k, v, keys, values, slots, pos, context, heads, scale, window)
        if EXTEND_KERNEL and kernels.available(self.device) and extend_kernel.supports(D):
            extend_kernel.write_kv(k, v, keys, values, slots, pos)
            return extend_kernel.extend_attention(q, keys, values, slots, pos, lengths, context, scale, window)
        keys[slots[:, None], :, pos] = k.view(C, M, Hkv, D)  # the new tokens' KV at their positions
        values[slots[:, None], :, pos] = v.view(C, M, Hkv, D)
        if window not in masks:
            masks[window] = extend_mask(pos, lengths, context, window)
        return extend_attention(q.view(C, M, Hq, D), keys[slots, :, :context], values[slots, :, :context],
                                masks[window], scale)

    # ----- decode ---------------------------------------------------------------------------------
    def _sample(self, hidden: Tensor, slots: Optional[Tensor], at: Tensor) -> tuple[Tensor, Tensor]:
        """Draw each row's next token from hidden [b, H]: the row is slot slots[i] (None: slot i, the decode step's
        rows [0, b)) and draws the token after position at[i] [b] of its sequence; its noise is keyed by
        (self.seed, that slot's SlotState.key, at[i]) alone (sampling.keyed_noise, kernels.sample)."""
        logits = softcap(linear(hidden, self.model.output_weight), self.cfg.final_logit_softcapping)  # [b, V]
        keys = self.state.key[:hidden.shape[0]] if slots is None else self.state.key[slots]  # [b]
        greedy, temperature, top_k, top_p = self.sampling
        if self.fns.fast_sample is not None and top_k == 0 and top_p >= 1.0:
            return self.fns.fast_sample(logits, self.seed, keys, at, greedy, temperature)
        noise = None if greedy else self.fns.noise(self.seed, keys, at, logits.shape[-1])
        return self.fns.sample(logits, noise, *self.sampling)

    def _decode_step(self, b: int) -> None:
        st = self.state
        tokens, pos = st.tokens[:b], st.pos[:b]
        at = pos if self.rope_shift is None else pos + self.rope_shift[:b]  # RoPE positions (M-RoPE: shifted)
        rope = None if all(self.fused) else [(cos[at], sin[at]) for cos, sin in self.rope]  # [b, D] each
        h, per_layer = self._embed(tokens)  # [b, H], [b, L, P] or None
        fresh: dict = {}  # layer -> its (k, v) [b, Hkv, D], for the layers that share them (_shared_kv)
        carry = None  # a fused layer's MLP output not yet added to h (fused.RESIDUAL_IN_GEMM)
        rows = torch.arange(b, device=self.device)
        for layer, (keys, values, w, spec, fused) in enumerate(zip(self.keys, self.values, self.weights, self.specs,
                                                                   self.fused)):
            if fused:
                h, carry = fused_decode_layer(h, carry, w, spec, keys, values, pos, *self.rope[spec.local_rope])
                continue
            h, carry = h if carry is None else h + carry, None
            q, k, v = self.fns.pre(h, w, spec, *rope[spec.local_rope])
            k, v = self._shared_kv(layer, k, v, fresh)
            attn = self.fns.attend(q, k, v, keys, values, pos, spec.scale, spec.window)  # [b, Hq * D]
            h, experts = self._post(h, attn, w, spec, column(per_layer, layer))
            if experts is not None:  # at the fed token's position (idle rows: their own frozen one)
                self.routes[rows, pos, self.moe_index[layer]] = experts
        weight = self.model.model.norm.weight
        if carry is not None:
            h = kernels.add_rms_norm(carry, h, weight, *self.final_norm)[0]
        else:
            h = (kernels.rms_norm if any(self.fused) else self.fns.norm)(h, weight, *self.final_norm)
        if self.fused_record:
            kernels.record(st, b, *self._sample(h, None, pos))  # SlotState.record's ~15 small kernels as one
        else:
            st.record(b, *self._sample(h, None, pos))

    def decode(self, b: int) -> None:
        """One step for slots [0, b): b must come from bucket_for()."""
        graph = self.graphs.get((b, self.sampling)) if self.use_graphs else None
        if graph is not None:
            graph.replay()
        elif self.use_graphs:
            self._capture((b, self.sampling), lambda: self._decode_step(b))
        else:
            self._decode_step(b)

    def _capture(self, key, step: callable) -> None:
        """This step (`step()`: a decode step), eagerly (it doubles as the
        warm-up: compiles, picks kernels, allocates workspaces), then recorded as the bucket's graph (capture runs
        nothing) into the one memory pool all buckets share. Lazy:
        a fixed-length call captures one bucket, not all 13 (0.35-0.6 s per call without keep_awake). Stored
        as graphs[key]: every graph goes when the layout or the weights' addresses change (begin/release).

        After a capture, gc.freeze(): what exists now (the model, compiled code, graphs: hundreds of thousands
        of objects that live for the run) moves out of the collector's generations, so that a full collection
        during the host's decode loop (0.3-0.5 s for 300k objects) scans only what came later. As vLLM does
        after its capture. Objects that were already garbage in a reference cycle then are never freed."""
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if LEAN_CAPTURE:
            side.synchronize()  # the eager step's memory is settled before the capture reuses the allocator
            with torch.cuda.stream(side):
                graph.capture_begin(self.graph_pool)
                try:
                    step()
                finally:
                    graph.capture_end()
        else:
            with torch.cuda.graph(graph, pool=self.graph_pool):
                step()
        self.graphs[key] = graph
        self.captures += 1
        gc.freeze()

    # ----- slot bookkeeping -----------------------------------------------------------------------
    def move(self, moves: list[tuple[int, int]]) -> None:
        """Move running sequences between slots (KV and state): compaction lets a smaller bucket run."""
        src, dst = slot_index(self.device, moves).T  # [k] each
        self._copy_slots(src, dst, max(1, len(moves)))
        self.state.move(src, dst)  # the noise key too: a sequence draws the same noise in its new slot

    def swap_slots(self, pairs: list[tuple[int, int]], chunk: int = 16) -> None:
        """Exchange the KV (and MoE route records) and the decode state of slot pairs (a, b), disjoint: each
        sequence takes everything of its slot along, its noise key (SlotState.key) too. The state must go with the
        KV: a finished slot's decode steps write its last token's KV at its own position, which must be the
        position of the sequence whose KV sits there (else a parked sequence's context is overwritten)."""
        src, dst = exchange_index(pairs, chunk, self.device)  # [2k] each
        self._copy_slots(src, dst, 2 * chunk)
        self.state.exchange(src, dst)

    def _copy_slots(self, src: Tensor, dst: Tensor, chunk: int) -> None:
        """Slots dst [k] take the KV, MoE routes and RoPE shift of slots src [k] (the right side is gathered first:
        a permutation exchanges them), `chunk` slots at a time so that the gathered copy stays small."""
        groups = self.pool.slot_rows(self.layout[0], self.layout[1])  # per width group [Lg, 2, slots, S * width]
        for i in range(0, len(src), chunk):
            into, take = dst[i:i + chunk], src[i:i + chunk]
            for rows in groups:
                rows[:, :, into] = rows[:, :, take]
            if self.routes is not None:  # MoE: the experts recorded at each position travel with the KV
                self.routes[into] = self.routes[take]
        if self.rope_shift is not None:
            self.rope_shift[dst] = self.rope_shift[src]

    def collect(self, slots: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """(tokens [k, N+1], logprobs [k, N+1], lengths [k]) of finished slots, gathered on the device."""
        idx, st = slot_index(self.device, slots), self.state
        return st.out_tokens[idx], st.out_logprobs[idx], st.n_gen[idx]

    def collect_routes(self, slots: list[int]) -> Tensor:
        """[k, S, L, top_k] the experts recorded at every position of finished slots (record_routes)."""
        return self.routes[slot_index(self.device, slots)]
