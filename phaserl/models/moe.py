"""Mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE; top-k routing), shared by the training decoder and the rollout engine.

A MoE layer replaces the gated MLP: a router (a linear map [E, H]) scores E experts per token, softmax in
float32, the top k are kept (their probabilities renormalized to sum 1 when `norm_topk_prob`), and the
token's output is the weighted sum of those k experts' SwiGLU MLPs. The experts are stacked weights:
gate_up [E, 2I, H] ([gate; up] per expert) and down [E, H, I], transformers 5's in-memory layout.
This is transformers' Qwen3MoeSparseMoeBlock, computed two ways:
  experts_loop     the readable one (CPU): for each expert, its tokens, its MLP, index_add into the output.
  experts_grouped  sort the (token, expert) pairs by expert, two grouped GEMMs (torch grouped_mm: one kernel
                   for all experts, no Python loop, no host sync, so CUDA graphs can capture it), unsort.
  experts_gathered each (token, expert) pair's weights gathered, one batched matmul: no sync either, but it
                   copies N*k experts' weights, so only for what the grouped kernel lacks, at small sizes
                   (fp32 on CUDA: tests) or under torch.compile.
pick_mixture: CUDA in bf16 on sm90/sm100 (where torch's grouped kernel runs; elsewhere torch falls back to a loop
with a host sync, which CUDA graphs cannot capture) takes the grouped path; otherwise CUDA takes the gathered path
while its copy stays under GATHER_LIMIT, and the loop beyond (then no CUDA graphs: fp32 MoE at real sizes is for
checking, not speed); the CPU takes the loop (gathered under torch.compile). torch >= 2.10 also runs grouped_mm on
the CPU, which the tests use to check the paths against each other.
Routing replay: `Route.replay` [N, k] holds expert ids to use instead of the router's top-k (-1: route this
token by the router); the gate weights are then the router's probabilities of those experts, recomputed
(and differentiable). Every call writes the experts it used to `Route.experts` and the router logits to
`Route.logits`, from which `load_balancing_loss` computes the router's auxiliary loss (Switch Transformer;
transformers' load_balancing_loss_func).
Checkpoint files hold one tensor per expert and projection (`mlp.experts.{e}.gate_proj.weight`, the format
of every transformers version and of released checkpoints): `file_expert` / `stack_experts` /
`unstack_experts` map between them and the stacked parameters.
Qwen2-MoE adds a shared expert (`SharedExpert`): a SwiGLU MLP every token goes through, scaled by a sigmoid gate.
Not here: expert parallelism (experts are sharded like any weight, by FSDP2),
capacity limits or token dropping (none: every token gets its k experts, as in transformers), LoRA on
experts (adapters go on the attention projections only).

Legend: N tokens (flattened), H hidden, E experts, k experts per token, I expert MLP width, L MoE layers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor

# torch >= 2.10 names it F.grouped_mm; torch 2.8-2.9 only torch._grouped_mm (same arguments).
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@dataclass(frozen=True)
class MoESpec:
    """The constants of one MoE layer (hashable, part of layers.LayerSpec)."""
    num_experts: int        # E
    top_k: int              # k
    norm_topk_prob: bool    # renormalize the k kept probabilities to sum 1


class SharedExpert(NamedTuple):
    """Qwen2-MoE's shared expert: a SwiGLU MLP every token goes through, scaled by sigmoid(score · x)."""
    gate: Union[Tensor, nn.Module]  # [Is, H] (a module where adapters may wrap it: the decoder passes its Linears)
    up: Union[Tensor, nn.Module]    # [Is, H]
    down: Union[Tensor, nn.Module]  # [H, Is]
    score: Tensor                   # [1, H]


class MoEWeights(NamedTuple):
    router: Tensor          # [E, H]
    gate_up: Tensor         # [E, 2I, H]
    down: Tensor            # [E, H, I]
    shared: Optional[SharedExpert] = None


@dataclass
class Route:
    """One MoE layer's routing for one forward: what to replay (in) and what was used (out)."""
    replay: Optional[Tensor] = None   # [N, k] long expert ids to use; -1: route by the router
    experts: Optional[Tensor] = None  # out [N, k] the experts used
    logits: Optional[Tensor] = None   # out [N, E] router logits (for the auxiliary loss)


@dataclass
class Routing:
    """The routes of every MoE layer of one forward, in layer order (filled by the decoder)."""
    replay: Optional[Tensor] = None           # [..., L, k] ids aligned with the forward's tokens, -1 = none
    mask: Optional[Tensor] = None             # [...] 1 = a real token (what the aux loss counts); None = all
    routes: list[Route] = field(default_factory=list)

    def route(self, moe_index: int) -> Route:
        """A fresh Route for the moe_index-th MoE layer, with its slice of `replay` (tokens flattened)."""
        replay = None if self.replay is None else self.replay[..., moe_index, :].reshape(-1, self.replay.shape[-1])
        r = Route(replay=replay)
        self.routes.append(r)
        return r

    def experts(self) -> Tensor:
        """[N, L, k] the experts every layer used."""
        return torch.stack([r.experts for r in self.routes], dim=1)

    def aux_loss(self, top_k: int) -> Tensor:
        """load_balancing_loss over this forward's MoE layers and real tokens."""
        return load_balancing_loss([r.logits for r in self.routes], top_k, self.mask)


def route_tokens(x: Tensor, router: Tensor, spec: MoESpec, replay: Optional[Tensor] = None
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """x [N, H] -> (expert ids [N, k] long, gate weights [N, k] in x's dtype, router logits [N, E])."""
    logits = F.linear(x, router)  # [N, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, spec.top_k, dim=-1)  # [N, k]
    if replay is not None:  # the rollout's choices where it recorded them; the probabilities are ours
        ids = torch.where(replay >= 0, replay.long(), ids)
        top = probs.gather(-1, ids)
    if spec.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return ids, top.to(logits.dtype), logits


def experts_loop(x: Tensor, ids: Tensor, weights: Tensor, w: MoEWeights) -> Tensor:
    """The readable expert mixture: x [N, H], ids/weights [N, k] -> [N, H] (one expert at a time)."""
    out = torch.zeros_like(x)
    for e in range(w.gate_up.shape[0]):
        token, slot = torch.where(ids == e)  # the tokens routed to e, and which of their k choices it is
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], w.gate_up[e]).chunk(2, dim=-1)  # [n_e, I] each
        y = F.linear(F.silu(gate) * up, w.down[e])  # [n_e, H]
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


def grouped_mm_available() -> bool:
    return _GROUPED_MM is not None


def experts_grouped(x: Tensor, ids: Tensor, weights: Tensor, w: MoEWeights) -> Tensor:
    """The same mixture with two grouped GEMMs: x [N, H], ids/weights [N, k] -> [N, H].

    The N*k (token, expert) pairs are sorted by expert so that each expert's rows are contiguous; `offs` [E]
    (cumulative row counts) tells grouped_mm where each expert's rows end. Counting uses scatter_add (fixed
    size [E]), not bincount, so that nothing waits on the host.
    """
    if _GROUPED_MM is None:
        raise RuntimeError(f"torch {torch.__version__} has no grouped_mm (torch >= 2.8 has it); MoE layers need it "
                           "on CUDA")
    N, k = ids.shape
    E = w.gate_up.shape[0]
    flat = ids.reshape(-1)  # [N k]
    order = flat.argsort(stable=True)  # [N k] pairs by expert
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)  # [E]
    xs = x[order // k]  # [N k, H] each pair's token, grouped by expert
    gate, up = _GROUPED_MM(xs, w.gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)  # [N k, I] each
    ys = _GROUPED_MM(F.silu(gate) * up, w.down.transpose(1, 2), offs=offs)  # [N k, H]
    pairs = torch.empty_like(ys).index_copy_(0, order, ys).view(N, k, -1)  # back in (token, choice) order
    return (pairs * weights[..., None]).sum(dim=1)  # [N, H]


def experts_gathered(x: Tensor, ids: Tensor, weights: Tensor, w: MoEWeights) -> Tensor:
    """The mixture as one batched matmul over gathered expert weights: x [N, H], ids/weights [N, k] -> [N, H]."""
    N, k = ids.shape
    gate_up, down = w.gate_up[ids.reshape(-1)], w.down[ids.reshape(-1)]  # [N k, 2I, H], [N k, H, I]
    xs = x.repeat_interleave(k, dim=0)[:, :, None]  # [N k, H, 1]
    gate, up = torch.bmm(gate_up, xs)[..., 0].chunk(2, dim=-1)  # [N k, I] each
    ys = torch.bmm(down, (F.silu(gate) * up)[:, :, None])[..., 0]  # [N k, H]
    return (ys.view(N, k, -1) * weights[..., None]).sum(dim=1)


_GROUPED_KERNEL: dict[int, bool] = {}  # CUDA device index -> torch's grouped GEMM kernel runs there


def prepare_device(device: torch.device) -> None:
    """Look up (once, outside any torch.compile trace) whether torch's grouped GEMM kernel runs on `device`
    (sm90 / sm100; elsewhere grouped_mm loops over groups with a host sync). Callers: the decoder's forward and
    the engine's runner, before their (possibly compiled) layers run."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _GROUPED_KERNEL:
            major = torch.cuda.get_device_capability(index)[0]
            _GROUPED_KERNEL[index] = _GROUPED_MM is not None and major in (9, 10)


GATHER_LIMIT = 2**28  # most expert-weight elements experts_gathered may copy (1 GiB in fp32); beyond: the loop


def pick_mixture(x: Tensor, w: MoEWeights, k: int):
    """The expert-mixture function for x [N, H] (its device, dtype and size; see the module docstring)."""
    if x.is_cuda and x.dtype == torch.bfloat16 and _GROUPED_KERNEL.get(x.device.index, False):
        return experts_grouped
    gathered = x.shape[0] * k * (w.gate_up[0].numel() + w.down[0].numel())  # elements experts_gathered copies
    # The loop syncs with the host (CUDA graphs cannot capture it) and its shapes depend on the routing (compile
    # cannot trace it): the gathered form wherever it fits, and wherever compile traces.
    if (x.is_cuda and gathered <= GATHER_LIMIT) or torch.compiler.is_compiling():
        return experts_gathered
    return experts_loop


def moe_mlp(x: Tensor, w: MoEWeights, spec: MoESpec, route: Optional[Route] = None) -> Tensor:
    """x [..., H] -> [..., H]: route, then mix the experts (pick_mixture: grouped GEMMs on CUDA, a loop on CPU)."""
    flat = x.reshape(-1, x.shape[-1])  # [N, H]
    ids, weights, logits = route_tokens(flat, w.router, spec, None if route is None else route.replay)
    out = pick_mixture(flat, w, spec.top_k)(flat, ids, weights, w)
    if w.shared is not None:
        s = w.shared
        out = out + torch.sigmoid(F.linear(flat, s.score)) * _apply(F.silu(_apply(flat, s.gate)) * _apply(flat, s.up),
                                                                     s.down)
    if route is not None:
        route.experts, route.logits = ids, logits
    return out.view(x.shape)


def _apply(x: Tensor, w: Union[Tensor, nn.Module]) -> Tensor:
    return w(x) if isinstance(w, nn.Module) else F.linear(x, w)


def load_balancing_loss(logits: list[Tensor], top_k: int, mask: Optional[Tensor] = None) -> Tensor:
    """Switch Transformer's auxiliary loss over MoE layers: E * sum_e f_e * P_e, where over all layers' tokens
    f_e is the fraction of top-k assignments that go to expert e and P_e its mean router probability.
    logits: per layer [N, E]; mask [N] (1 = counts). Uses the router's own top-k (as transformers does), not
    replayed ids. Equals transformers' load_balancing_loss_func."""
    E = logits[0].shape[-1]
    weight = torch.ones(logits[0].shape[0], device=logits[0].device) if mask is None else mask.reshape(-1).float()
    assigned = torch.zeros(E, dtype=torch.float32, device=logits[0].device)
    prob_sum = torch.zeros(E, dtype=torch.float32, device=logits[0].device)
    for layer_logits in logits:
        probs = torch.softmax(layer_logits.float(), dim=-1)  # [N, E]
        chosen = probs.topk(top_k, dim=-1).indices  # [N, k]
        assigned = assigned.scatter_add(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * weight[:, None]).sum(dim=0)
    rows = weight.sum() * len(logits)
    return E * torch.sum((assigned / rows) * (prob_sum / rows))


# ----- checkpoint files: one tensor per expert <-> stacked parameters --------------------------------------
_FILE_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def file_expert(name: str) -> Optional[tuple[str, int, str]]:
    """'…mlp.experts.3.up_proj.weight' -> ('…mlp.experts.gate_up_proj', 3, 'up_proj'); None for other names."""
    m = _FILE_EXPERT.match(name)
    if m is None:
        return None
    stacked = "gate_up_proj" if m.group(3) in ("gate_proj", "up_proj") else "down_proj"
    return f"{m.group(1)}.{stacked}", int(m.group(2)), m.group(3)


def stack_experts(name: str, parts: dict[tuple[int, str], Tensor], num_experts: int) -> Tensor:
    """The stacked parameter `name` from its per-expert file tensors {(expert, projection): tensor}."""
    projections = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
    missing = [f"{e}.{p}" for e in range(num_experts) for p in projections if (e, p) not in parts]
    extra = sorted({e for e, _ in parts if e >= num_experts})
    if missing or extra:
        raise ValueError(f"{name}: config.json says {num_experts} experts; the files lack experts "
                         f"{missing[:4]} / hold experts beyond them {extra[:4]}")
    return torch.stack([torch.cat([parts[(e, p)] for p in projections]) for e in range(num_experts)])


def unstack_experts(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our state dict -> the file layout: each stacked expert parameter as one tensor per expert."""
    out = {}
    for name, t in state.items():
        prefix, _, stacked = name.rpartition(".")
        if not prefix.endswith(".mlp.experts") or stacked not in ("gate_up_proj", "down_proj"):
            out[name] = t
            continue
        for e in range(t.shape[0]):
            if stacked == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
            else:
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
    return out
