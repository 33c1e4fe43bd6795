"""ModelRunner: the rollout engine's forward passes (prefill and decode) over the actor's own weights.

The runner does not call `CausalLM.forward`: it runs the same math (decoder.py) in token-flattened
form, so that it can write into the slot KV pool and be captured in CUDA graphs. It reads the module's
norms, o_proj, down_proj and embedding in place, and keeps its own concatenated [q; k; v] and
[gate; up] weights (one GEMM instead of three and two), refilled from the module at every call.
  prefill  the prompts of newly admitted sequences, each distinct prompt once: its KV is written into
           every slot of the sequences that share it, and each sequence draws its own first token.
  decode   one token for every slot in [0, b); b is a bucket size, and on CUDA each (bucket, sampling
           settings) pair is one captured graph, replayed every step. Sampling happens inside it.
On CUDA, decode attention (over each row's used context) and sampling are Triton kernels (kernels.py);
with `compile=True` the norm/projection/MLP pieces go through torch.compile. The CPU path runs the very
same functions eagerly with pure-torch attention and sampling.
Not here: which sequence is in which slot (scheduler.py), memory sizing (kv_pool.py), kernels (kernels.py).

Legend: N tokens in the pass, b decode rows (slots), U distinct prompts, A admitted sequences,
P longest prompt, S slot_len, H hidden, Hq/Hkv heads, D head_dim, V vocab.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from phaserl.models.decoder import CausalLM
from phaserl.rollout import kernels
from phaserl.rollout.kv_pool import KVPool, SlotState
from phaserl.rollout.sampling import SamplingParams, filter_top_k, filter_top_p

Tensor = torch.Tensor


class LayerWeights(NamedTuple):
    """One decoder layer's parameters as the engine uses them (None where the architecture has none).

    qkv = [q; k; v] and gate_up = [gate; up] are engine-owned concatenations (one GEMM each instead of
    three and two); the norms, o and down are the module's own tensors, read in place. The copies cost
    (q + k + v + gate + up) parameters once more: 0.47 GB for Qwen2-0.5B, 8.5 GB for Qwen2-7B in bf16;
    ModelRunner.release() (engine.sleep()) frees them.
    """
    in_norm: Tensor
    qkv: Tensor                   # [(Hq + 2 Hkv) D, H]
    qkv_bias: Optional[Tensor]    # [(Hq + 2 Hkv) D]
    q_norm: Optional[Tensor]
    k_norm: Optional[Tensor]
    o: Tensor
    o_bias: Optional[Tensor]
    post_norm: Tensor
    gate_up: Tensor               # [2 I, H]
    down: Tensor


def module_tensors(layer) -> list[Tensor]:
    """The layer's parameters the engine reads (their addresses decide when the fused copies are rebuilt)."""
    a, m = layer.self_attn, layer.mlp
    return [t for t in (layer.input_layernorm.weight, a.q_proj.weight, a.q_proj.bias, a.k_proj.weight,
                        a.k_proj.bias, a.v_proj.weight, a.v_proj.bias, a.o_proj.weight, a.o_proj.bias,
                        layer.post_attention_layernorm.weight, m.gate_proj.weight, m.up_proj.weight,
                        m.down_proj.weight) if t is not None]


def fused_weights(layer, previous: Optional[LayerWeights] = None) -> LayerWeights:
    """The layer's LayerWeights; with `previous`, its fused buffers are refilled in place (captured graphs
    keep pointing at them) instead of allocated again."""
    a, m = layer.self_attn, layer.mlp

    def cat(parts: list[Tensor], into: Optional[Tensor]) -> Tensor:
        return torch.cat(parts) if into is None else torch.cat(parts, out=into)

    qkv_bias = None
    if a.q_proj.bias is not None:
        qkv_bias = cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], previous and previous.qkv_bias)
    return LayerWeights(layer.input_layernorm.weight,
                        cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], previous and previous.qkv),
                        qkv_bias, a.q_norm.weight if a.qk_norm else None, a.k_norm.weight if a.qk_norm else None,
                        a.o_proj.weight, a.o_proj.bias, layer.post_attention_layernorm.weight,
                        cat([m.gate_proj.weight, m.up_proj.weight], previous and previous.gate_up),
                        m.down_proj.weight)


# ----- the per-layer math: pure functions of tensors, the same as decoder.py -------------------------
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """decoder.RMSNorm: statistics in float32, rounded to x's dtype, then times the weight."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rope_tables(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """(cos, signed sin) [S, D] so that RoPE is x * cos + roll(x, D/2) * signed_sin (see rotate)."""
    half = cos.shape[-1] // 2
    return cos, sin * torch.cat([-torch.ones(half), torch.ones(half)]).to(sin)


def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """RoPE on x [N, heads, D] with tables [N, D]: rotate_half(x) * sin == roll(x, D/2) * signed_sin, exactly."""
    return torch.addcmul(x * cos[:, None], x.roll(x.shape[-1] // 2, dims=-1), signed_sin[:, None])


def pre_attention(h: Tensor, w: LayerWeights, cos: Tensor, sin: Tensor, eps: float,
                  heads: tuple[int, int, int]) -> tuple[Tensor, Tensor, Tensor]:
    """h [N, H] -> q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D], RoPE applied to q and k."""
    Hq, Hkv, D = heads
    x = rms_norm(h, w.in_norm, eps)
    q, k, v = F.linear(x, w.qkv, w.qkv_bias).split([Hq * D, Hkv * D, Hkv * D], dim=-1)  # [N, heads * D] each
    q, k, v = q.unflatten(-1, (Hq, D)), k.unflatten(-1, (Hkv, D)), v.unflatten(-1, (Hkv, D))
    if w.q_norm is not None:  # Qwen3
        q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def post_attention(h: Tensor, attn: Tensor, w: LayerWeights, eps: float) -> Tensor:
    """Residual + o_proj, then SwiGLU: h [N, H], attn [N, Hq * D] -> h [N, H]; residual adds ride in addmm."""
    if w.o_bias is None:
        h = torch.addmm(h, attn, w.o.t())
    else:
        h = h + F.linear(attn, w.o, w.o_bias)
    gate, up = F.linear(rms_norm(h, w.post_norm, eps), w.gate_up).chunk(2, dim=-1)  # [N, I] each
    return torch.addmm(h, F.silu(gate) * up, w.down.t())


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, hidden: Tensor) -> Tensor:
    """One query per row over its slot: q [b, Hq, D], keys/values [b, Hkv, S, D] -> [b, Hq * D].

    hidden [b, S] is True at positions the row must not see (after its own). Grouped-query heads are
    folded into the matmul (q viewed as [b, Hkv, Hq/Hkv, D]), so each key/value byte is read once.
    The softmax runs in float32 inside the kernel whatever the dtype of the scores.
    """
    b, Hq, D = q.shape
    qg = (q * D ** -0.5).view(b, keys.shape[1], Hq // keys.shape[1], D)
    scores = torch.matmul(qg, keys.transpose(-1, -2))  # [b, Hkv, G, S]
    probs = scores.masked_fill(hidden[:, None, None, :], float("-inf")).softmax(dim=-1)
    return torch.matmul(probs, values).reshape(b, Hq * D)  # [b, Hkv, G, D] -> [b, Hq * D]


def cached_attention(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, pos: Tensor) -> Tensor:
    """Write the new k/v [b, Hkv, D] at each row's position pos [b], then attend: -> [b, Hq * D].

    The pure-torch twin of kernels.decode_attention (the CPU path): it reads the whole slot, masked.
    """
    b = q.shape[0]
    keys[torch.arange(b, device=q.device), :, pos] = k
    values[torch.arange(b, device=q.device), :, pos] = v
    hidden = torch.arange(keys.shape[2], device=q.device) > pos[:, None]  # [b, S] after each row's position
    return decode_attention(q, keys[:b], values[:b], hidden)


def sample_tokens(logits: Tensor, noise: Optional[Tensor], greedy: bool, temperature: float, top_k: int,
                  top_p: float) -> tuple[Tensor, Tensor]:
    """logits [b, V] -> (tokens [b], logprobs [b] under log_softmax(logits / T); T = 1 when greedy).

    Sampling is Gumbel-max: argmax(z - log E), E ~ Exp(1) in `noise` [b, V], draws from softmax(z)
    without a host sync, so it can live inside a CUDA graph. Filters decide the draw only (sampling.py).
    """
    z = logits.float()  # [b, V]
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)  # [b]
    if greedy:
        tokens = z.argmax(dim=-1)
    elif top_k == 0 and top_p >= 1.0:
        tokens = (z - noise.log()).argmax(dim=-1)  # E = 0 gives +inf: that token wins, as it should
    else:  # filtered tokens are -inf, which must stay below every finite score: no infinite noise
        kept = filter_top_p(filter_top_k(z, top_k), top_p)
        tokens = (kept - noise.clamp_min(1e-30).log()).argmax(dim=-1)
    return tokens, z.gather(-1, tokens[:, None]).squeeze(-1) - lse


class LayerFns(NamedTuple):
    pre: callable
    post: callable
    norm: callable
    attend: callable    # (q, k, v, keys, values, pos) -> [b, Hq * D], writes k/v into the cache
    sample: callable    # sample_tokens (every setting; needs noise)
    fast_sample: Optional[callable]  # kernels.sample (no top-k/top-p): one pass, in-kernel noise


EAGER = LayerFns(pre_attention, post_attention, rms_norm, cached_attention, sample_tokens, None)


@functools.cache
def compiled_fns() -> LayerFns:
    """torch.compile'd twins of the layer functions; dynamic shapes, so one compile serves every bucket
    (and the prefill). cached_attention writes into the cache, so it stays eager (layer_fns swaps in
    the Triton kernel where it runs)."""
    def c(fn):
        return torch.compile(fn, dynamic=True, fullgraph=True)
    return LayerFns(c(pre_attention), c(post_attention), c(rms_norm), cached_attention, c(sample_tokens), None)


def layer_fns(device: torch.device, compile: bool) -> LayerFns:
    """The functions a runner uses: compiled or eager, with the Triton kernels wherever they run."""
    fns = compiled_fns() if compile else EAGER
    if kernels.available(device):
        fns = fns._replace(attend=kernels.decode_attention, fast_sample=kernels.sample)
    return fns


def decode_buckets(num_slots: int) -> list[int]:
    """Batch sizes that get a graph: powers of two from 2 up to 64, then every 64, then num_slots itself.

    No bucket 1 (unless num_slots is 1): compiled functions specialize on size 1, a recompile for one row.
    """
    small = [b for b in (2, 4, 8, 16, 32, 64) if b < num_slots]
    return small + list(range(128, num_slots, 64)) + [num_slots]


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, *, cuda_graphs: bool, compile: bool, prefill_tokens: int):
        self.model, self.pool, self.cfg = model, pool, model.config
        self.device = model.output_weight.device
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        self.fns = layer_fns(self.device, compile)
        self.prefill_tokens = prefill_tokens
        self.heads = (self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim)
        self.layout: Optional[tuple[int, int, int]] = None  # (num_slots, slot_len, max_new)
        self.graphs: dict = {}
        self.graph_pool = None
        self.weights: Optional[list[LayerWeights]] = None
        self.pointers: Optional[list[int]] = None
        self.seed = torch.zeros(1, dtype=torch.long, device=self.device)  # fast_sample's noise key, advanced per draw

    def release(self) -> None:
        """Drop graphs, views (they pin the pool's memory) and the fused weight copies. The graph memory
        pool dies with its last graph, so its handle goes too: capturing into a dead pool asserts in
        torch 2.11's allocator."""
        self.graphs, self.layout, self.keys, self.values, self.state = {}, None, None, None, None
        self.graph_pool, self.weights, self.pointers = None, None, None

    # ----- per call -------------------------------------------------------------------------------
    def begin(self, num_slots: int, slot_len: int, max_new: int, params: SamplingParams,
              stop_ids: list[int]) -> None:
        """Lay out slots (reusing the previous layout when it is large enough), refresh the fused weights,
        reset state, capture graphs."""
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
            self.positions = torch.arange(grown[1], device=self.device)  # [S]
            cos, sin = self.model.model.rotary_emb(self.positions[None], self.model.output_weight.dtype)
            self.cos, self.sin = rope_tables(cos[0], sin[0])  # [S, D]
        # Refilled every call: training updates the parameters in place, at the same addresses.
        previous = self.weights or [None] * len(layers)
        self.weights = [fused_weights(layer, old) for layer, old in zip(layers, previous)]
        self.sampling = (params.greedy, 1.0 if params.greedy else params.temperature, params.top_k, params.top_p)
        self.seed.copy_(torch.randint(2**62, (1,), device=self.device))  # from the (seeded) default generator
        self.state.reset(stop_ids)
        if self.use_graphs:
            self._capture_all()

    def bucket_for(self, span: int) -> int:
        """Decode rows for slots [0, span): the smallest captured bucket, or exactly span without graphs."""
        return next(b for b in decode_buckets(self.layout[0]) if b >= span) if self.use_graphs else span

    # ----- prefill --------------------------------------------------------------------------------
    def prefill(self, groups: list[tuple[tuple[int, ...], list[int], list[int]]]) -> None:
        """groups: (prompt, slots of its sequences, their caps); split into passes of <= prefill_tokens."""
        chunk = []
        for group in groups:
            longest = max([len(group[0])] + [len(g[0]) for g in chunk])
            if chunk and longest * (len(chunk) + 1) > self.prefill_tokens:
                self._prefill_pass(chunk)
                chunk = []
            chunk.append(group)
        self._prefill_pass(chunk)

    def _prefill_pass(self, groups) -> None:
        U, Hq, Hkv, D = len(groups), *self.heads
        lengths = [len(prompt) for prompt, _, _ in groups]
        P = max(lengths)
        ids = torch.zeros(U, P, dtype=torch.long)  # right-padded: causal attention keeps real tokens clean
        for row, (prompt, _, _) in enumerate(groups):
            ids[row, :len(prompt)] = torch.tensor(prompt)
        group_of = [row for row, (_, slots, _) in enumerate(groups) for _ in slots]
        host = [ids, torch.tensor(lengths), torch.tensor(group_of),
                torch.tensor([s for _, slots, _ in groups for s in slots]),
                torch.tensor([c for _, _, caps in groups for c in caps])]
        ids, lengths, group_of, slots, caps = (t.to(self.device, non_blocking=True) for t in host)
        cos, sin = self.cos[:P].repeat(U, 1), self.sin[:P].repeat(U, 1)  # [U * P, D]
        h = F.embedding(ids.view(-1), self.model.model.embed_tokens.weight)  # [U * P, H]
        for keys, values, w in zip(self.keys, self.values, self.weights):
            q, k, v = self.fns.pre(h, w, cos, sin, self.cfg.rms_norm_eps, self.heads)
            k, v = k.view(U, P, Hkv, D).transpose(1, 2), v.view(U, P, Hkv, D).transpose(1, 2)  # [U, Hkv, P, D]
            keys[slots, :, :P], values[slots, :, :P] = k[group_of], v[group_of]  # shared prompt KV -> every slot
            attn = F.scaled_dot_product_attention(q.view(U, P, Hq, D).transpose(1, 2), k, v, is_causal=True,
                                                  enable_gqa=True)  # [U, Hq, P, D]
            h = self.fns.post(h, attn.transpose(1, 2).reshape(U * P, Hq * D), w, self.cfg.rms_norm_eps)
        last = h.view(U, P, -1)[torch.arange(U, device=self.device), lengths - 1]  # [U, H]
        tokens, logprobs = self._sample(self.fns.norm(last, self.model.model.norm.weight, self.cfg.rms_norm_eps)
                                        [group_of])  # one draw per sequence, from its prompt's distribution
        self.state.start(slots, tokens, logprobs, lengths[group_of], caps)

    # ----- decode ---------------------------------------------------------------------------------
    def _sample(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        logits = F.linear(hidden, self.model.output_weight)  # [b, V]
        greedy, temperature, top_k, top_p = self.sampling
        if self.fns.fast_sample is not None and top_k == 0 and top_p >= 1.0:
            drawn = self.fns.fast_sample(logits, self.seed, greedy, temperature)
            self.seed += 1  # in the graph too: every replay draws fresh noise
            return drawn
        noise = None if greedy else torch.empty_like(logits, dtype=torch.float32).exponential_()
        return self.fns.sample(logits, noise, *self.sampling)

    def _decode_step(self, b: int) -> None:
        st, eps = self.state, self.cfg.rms_norm_eps
        tokens, pos = st.tokens[:b], st.pos[:b]
        cos, sin = self.cos[pos], self.sin[pos]  # [b, D]
        h = F.embedding(tokens, self.model.model.embed_tokens.weight)  # [b, H]
        for keys, values, w in zip(self.keys, self.values, self.weights):
            q, k, v = self.fns.pre(h, w, cos, sin, eps, self.heads)
            h = self.fns.post(h, self.fns.attend(q, k, v, keys, values, pos), w, eps)
        st.record(b, *self._sample(self.fns.norm(h, self.model.model.norm.weight, eps)))

    def decode(self, b: int) -> None:
        """One step for slots [0, b): b must come from bucket_for()."""
        if self.use_graphs:
            self.graphs[(b, self.sampling)].replay()
        else:
            self._decode_step(b)

    def _capture_all(self) -> None:
        """Capture every bucket, largest first, into one memory pool (all slots are free: warm-ups are harmless)."""
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        for b in reversed(decode_buckets(self.layout[0])):
            if (b, self.sampling) in self.graphs:
                continue
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._decode_step(b)  # warm-up: compiles, picks kernels, allocates workspaces
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                self._decode_step(b)
            self.graphs[(b, self.sampling)] = graph

    # ----- slot bookkeeping -----------------------------------------------------------------------
    def move(self, moves: list[tuple[int, int]]) -> None:
        """Move running sequences between slots (KV and state): compaction lets a smaller bucket run."""
        src, dst = torch.tensor(moves, device=self.device).T  # [k] each
        rows = self.pool.slot_rows(self.layout[0], self.layout[1])  # [L, 2, slots, Hkv * S * D]
        rows[:, :, dst] = rows[:, :, src]
        self.state.move(src, dst)

    def collect(self, slots: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """(tokens [k, N+1], logprobs [k, N+1], lengths [k]) of finished slots, gathered on the device."""
        idx, st = torch.tensor(slots, device=self.device), self.state
        return st.out_tokens[idx], st.out_logprobs[idx], st.n_gen[idx]
