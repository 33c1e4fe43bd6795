"""Forward passes shared by the roles: response log-probs, entropies and values of a batch.

Every role runs the same model code; this module turns a `RolloutBatch` into response-aligned
tensors [B, R] micro-batch by micro-batch. Only the real response tokens are projected onto the
vocabulary (in chunks, by `algo.token_logprobs_from_hidden`), so padding costs no vocab matmul.
With `packing=True` (ppo.packing) a micro-batch is its rows' real tokens in one sequence
(phaserl.packing) attended with the varlen kernel on CUDA (a block-diagonal mask on CPU); results are the
same [b, R] tensors, padding-free. Every rank runs the same number of micro-batches (`split_rows`):
FSDP gathers parameters in each forward, so a rank with one forward more would wait forever.
A model compiled with `models.decoder.enable_compile` also gets the fused (compiled) log-prob kernels, and with
`keep_logits` (ppo.keep_head_logits) a training forward keeps the head's logits for its backward, and with `graphs`
(ppo.train_graphs, roles/train_graphs.py) a packed training micro-batch's body runs as CUDA graph replays.
Legend: b rows of a micro-batch, R its longest response, M its real response tokens.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..algo import token_logprobs_from_hidden
from ..algo.logprobs import can_save_logits
from ..batch import RolloutBatch, send
from ..batching import pad_response_tensor, split_by_tokens, trim_padding
from ..models import CausalLM, ValueModel, invariant, invariant_head
from ..models.moe import Routing
from ..packing import Packed, pack_rows, split_packed_by_tokens
from ..parallel import all_reduce_sum, rank_and_world
from .train_graphs import TrainGraphs


def _routing_kwargs(routing: Optional[Routing], replay: Optional[torch.Tensor], mask: Optional[torch.Tensor]) -> dict:
    """`routing=` for a MoE forward (replaying the rollout's experts when the batch has them), else nothing
    (transformers models take no such argument)."""
    if routing is None:
        return {}
    routing.replay, routing.mask = replay, mask
    return {"routing": routing}


def response_hidden(model, mb: RolloutBatch, routing: Optional[Routing] = None) -> torch.Tensor:
    """Hidden states that predict each response token.  [b, R, H]"""
    vision = {} if mb.images is None else {"images": mb.images}  # a vision-language batch: its pixels, every pass
    hidden = model(mb.input_ids, position_ids=mb.position_ids, attention_mask=mb.attention_mask, **vision,
                   **_routing_kwargs(routing, mb.routed_experts, mb.attention_mask))  # [b, S, H]
    P = mb.prompt_width
    return hidden[:, P - 1: -1]  # position t predicts token t + 1


KEPT_LOGITS_CHUNK = 4096  # tokens per head chunk when the logits are kept (the chunks are the kept memory itself)


def head_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float, chunk_size: int,
                  with_entropy: bool, keep_logits: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and entropies) of `targets` [N] from final hidden states [N, H]: the fused projection when the
    model's logits are exactly hidden @ output_weight.T, else the model's own head (transformers path:
    soft-capping, logit scaling), so log-probs are always the model's. keep_logits: under autograd with the
    Triton kernels, the logits stay from forward to backward (N x V in the weight's dtype) instead of being
    recomputed there; elsewhere it changes nothing. In the bitwise numerics mode: the engine sampler's numbers
    exactly (models/invariant_head.py)."""
    if invariant.enabled():
        return invariant_head.token_logprobs(hidden, model.output_weight, targets, temperature=temperature,
                                              cap=model.config.final_logit_softcapping, with_entropy=with_entropy)
    if getattr(model, "plain_head", True):
        fused = _fused(model)
        save = keep_logits and torch.is_grad_enabled() and can_save_logits(fused, hidden)
        return token_logprobs_from_hidden(hidden, model.output_weight, targets, temperature=temperature,
                                          chunk_size=KEPT_LOGITS_CHUNK if save else chunk_size,
                                          with_entropy=with_entropy, fused=fused, save_logits=save)
    return model.token_logprobs(hidden, targets, temperature=temperature, with_entropy=with_entropy,
                                chunk_size=chunk_size)


def sequence_parallel(model):
    """The decoder's sequence-parallel group (parallel/ulysses.py, actor.sequence_parallel), or None."""
    return getattr(getattr(model, "model", None), "sequence_parallel", None)


def own_head_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor, own: Optional[torch.Tensor],
                      **head) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """head_logprobs of hidden [N, H]; on sequence-parallel ranks (`own` [N]: this rank's tokens) the head runs on
    this rank's tokens only and the group's results are summed, so every rank holds all N."""
    if own is None:
        return head_logprobs(model, hidden, targets, **head)
    logp, ent = head_logprobs(model, hidden[own], targets[own], **head)  # [n], [n]
    sp = sequence_parallel(model)
    whole = [None if x is None else sp.combine(x.new_zeros(own.shape).masked_scatter(own, x)) for x in (logp, ent)]
    return whole[0], whole[1]


def group_rows(model, batch, idx: torch.Tensor) -> list[tuple[object, torch.Tensor, bool]]:
    """The micro-batches to run for rows `idx` of `batch` (a RolloutBatch or TrainBatch): (rows, index into them,
    this rank's own?). One process, or a model without a sequence-parallel group: [(batch, idx, True)]. With one
    (actor.sequence_parallel = k): every member's rows `idx` of its own batch, in rank order, each as a batch of
    its own (texts left out), since each micro-batch's tokens are spread over the group's k ranks: every rank runs
    all k, keeps its own results, and its loss of another member's rows adds that member's gradient through this
    rank's tokens. A collective over the group: every member calls it for each micro-batch."""
    sp = sequence_parallel(model)
    if sp is None or sp.k == 1:
        return [(batch, idx, True)]
    rows = batch.select(idx)
    rollout = getattr(rows, "rollout", rows)
    B = rollout.num_responses
    bare = dataclasses.replace(rollout, prompts=[None] * B, response_texts=[None] * B, rows=[None] * B,
                               episodes=None, rollout_metrics={})
    rows = dataclasses.replace(rows, rollout=bare) if rows is not rollout else bare
    members = sp.members(rows)
    return [(m, torch.arange(getattr(m, "rollout", m).num_responses), j == sp.rank) for j, m in enumerate(members)]


def micro_logprobs(model, mb: RolloutBatch, *, temperature: float, with_entropy: bool, chunk_size: int = 1024,
                   routing: Optional[Routing] = None, keep_logits: bool = False
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and entropies) of the response tokens of one trimmed micro-batch.  [b, R] each."""
    h = response_hidden(model, mb, routing)             # [b, R, H]
    mask = mb.response_mask.bool()                       # [b, R]
    targets = mb.response_ids[mask]                      # [N]
    sp = sequence_parallel(model)
    own = None if sp is None else sp.owned(mb.input_ids.shape[1], h.device)[mb.prompt_width - 1:-1].expand_as(
        mask)[mask]                                      # [N] this rank's tokens
    logp, ent = own_head_logprobs(model, h[mask], targets, own, temperature=temperature, chunk_size=chunk_size,
                                  with_entropy=with_entropy, keep_logits=keep_logits)  # [N], [N]
    logprobs = torch.zeros(mask.shape, dtype=torch.float32, device=h.device)
    logprobs = logprobs.masked_scatter(mask, logp.float())  # [b, R]
    entropy = None
    if with_entropy:
        entropy = torch.zeros_like(logprobs).masked_scatter(mask, ent.float())
    return logprobs, entropy


@torch.no_grad()
def batch_logprobs(model, batch: RolloutBatch, *, temperature: float, token_budget: int,
                   packing: bool = False, replay: bool = False) -> torch.Tensor:
    """Forward-only log-probs of every response token of `batch`.  [B, R] float32
    replay: a MoE model uses the experts the rollout recorded (batch.routed_experts; routing replay)."""
    R = batch.response_mask.shape[1]
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=batch.input_ids.device)
    for idx in split_rows(batch, token_budget, packing=packing):
        for rows, index, own in group_rows(model, batch, idx):  # this rank's rows, or each group member's in turn
            routing = Routing() if replay and batch.routed_experts is not None else None
            logp, _, _ = rows_logprobs(model, rows, index, packing=packing, temperature=temperature,
                                       with_entropy=False, routing=routing)
            if own:
                out[send(idx, out.device)] = pad_response_tensor(logp, R)  # a CPU index would sync
    return out


def micro_values(value_model, mb: RolloutBatch) -> torch.Tensor:
    """Critic values at the positions that predict each response token.  [b, R] float32"""
    values = value_model(mb.input_ids, position_ids=mb.position_ids, attention_mask=mb.attention_mask)  # [b, S]
    P = mb.prompt_width
    return values[:, P - 1: -1].float() * mb.response_mask


@torch.no_grad()
def batch_values(value_model, batch: RolloutBatch, *, token_budget: int, packing: bool = False) -> torch.Tensor:
    """Forward-only values for every response token of `batch`.  [B, R] float32"""
    R = batch.response_mask.shape[1]
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=batch.input_ids.device)
    for idx in split_rows(batch, token_budget, packing=packing):
        values, _ = rows_values(value_model, batch, idx, packing=packing)
        out[send(idx, out.device)] = pad_response_tensor(values, R)
    return out


# ----- packed micro-batches -------------------------------------------------------------------
def supports_packing(model) -> bool:
    """Only our decoder takes `seq_ids=`; transformers models go through the padded path."""
    return isinstance(model, (CausalLM, ValueModel))


def split_rows(batch: RolloutBatch, token_budget: int, *, packing: bool) -> list[torch.Tensor]:
    """Micro-batch row groups: by real tokens when packing, by trimmed padded size otherwise.

    The group count is the largest any rank needs for its own rows, so all ranks make the same number
    of forward (and backward) calls; each rank balances its tokens over that many groups. Which rows a
    rank holds never changes. A collective under torchrun: every rank must call it.
    """
    split = split_packed_by_tokens if packing else split_by_tokens
    groups = split(batch, token_budget)
    rank, world = rank_and_world()
    if world > 1:
        counts = torch.zeros(world, device=batch.input_ids.device)
        counts[rank] = len(groups)
        most = int(all_reduce_sum(counts).max())  # [world] -> the largest count
        if most != len(groups):
            groups = split(batch, token_budget, num_groups=most)
    return groups


def _fused(model) -> str | bool:
    """Compiled decoders (enable_compile) also take the fused log-prob kernels: the best there are (Triton
    on CUDA) for the inductor backend, the same torch.compile backend otherwise (tests: eager, aot_eager)."""
    backend = getattr(model, "compiled", None)
    return True if backend == "inductor" else (backend or False)


def packed_micro_logprobs(model, packed: Packed, *, temperature: float, with_entropy: bool, chunk_size: int = 1024,
                          routing: Optional[Routing] = None, keep_logits: bool = False,
                          graphs: Optional[TrainGraphs] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and entropies) of the response tokens of one packed micro-batch.  [b, R] each.
    graphs (ppo.train_graphs): the body's forward and backward as CUDA graph replays, where they can run."""
    # The graphs replay the text decoder: rows with images take the model's own forward (their pixels, in row order).
    vision = {} if packed.images is None else {"images": packed.images}
    hidden = graphs.hidden(packed) if graphs is not None and routing is None and not vision else None  # [1, T >= N, H]
    if hidden is None:
        hidden = model(packed.input_ids, position_ids=packed.position_ids, seq_ids=packed.seq_ids,  # [1, N, H]
                       boundaries=packed.boundaries, **vision, **_routing_kwargs(routing, packed.routed_experts, None))
    sp = sequence_parallel(model)
    own = None if sp is None else sp.owned(hidden.shape[1], hidden.device)[packed.predict_index]  # [M]
    logp, ent = own_head_logprobs(model, hidden[0, packed.predict_index], packed.target_ids, own,
                                  temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
                                  keep_logits=keep_logits)  # [M], [M]
    entropy = packed.unpack(ent.float()) if with_entropy else None
    return packed.unpack(logp.float()), entropy


def packed_micro_values(value_model, packed: Packed) -> torch.Tensor:
    """Critic values at the positions that predict each response token of one packed micro-batch.  [b, R]"""
    values = value_model(packed.input_ids, position_ids=packed.position_ids, seq_ids=packed.seq_ids,
                         boundaries=packed.boundaries)  # [1, N]
    return packed.unpack(values[0, packed.predict_index].float())


def rows_logprobs(model, batch: RolloutBatch, idx: torch.Tensor, *, packing: bool, temperature: float,
                  with_entropy: bool, routing: Optional[Routing] = None, keep_logits: bool = False,
                  graphs: Optional[TrainGraphs] = None, exact: bool = True
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Log-probs, entropies (or None) and response mask of rows `idx`, packed or trimmed.  [b, R] each.
    routing (MoE models, moe.Routing): filled with every MoE layer's router logits and experts; it replays the
    batch's routed_experts where the batch has them (routing replay). graphs: see packed_micro_logprobs.
    In the bitwise numerics mode a forward with autograd runs twice: the batch-invariant kernels without a graph
    give the log-probs' values (the engine's bits, and their fused, grouped launches), the default kernels give the
    graph (`exact_values`): one plain forward and backward instead of an exact forward whose every op recomputes its
    default self in the backward. The entropy, which nothing compares with the engine, is the default forward's,
    values and graph: the exact pass skips it (a softmax over the vocabulary per token). exact=False: the default
    forward only (the caller has the exact values)."""
    args = dict(packing=packing, temperature=temperature, with_entropy=with_entropy, routing=routing,
                keep_logits=keep_logits, graphs=graphs)
    if bitwise_training(model):
        if not exact:
            with invariant.bitwise(False):
                return _rows_logprobs(model, batch, idx, **args)
        values, default = values_and_graph(lambda: _rows_logprobs(model, batch, idx, **{**args, "with_entropy": False}),
                                           lambda: _rows_logprobs(model, batch, idx, **args))
        return exact_values(default[0], values[0]), default[1], values[2]
    return _rows_logprobs(model, batch, idx, **args)


def bitwise_training(model) -> bool:
    """A forward with autograd of a model with trainable parameters, in the bitwise numerics mode."""
    return invariant.enabled() and torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())


def values_and_graph(exact_forward, default_forward=None):
    """(exact, default): exact_forward() without autograd on the batch-invariant kernels (the values), and
    default_forward() (the same function if None) on the default kernels (the graph); `exact_values` joins them."""
    with torch.no_grad():
        exact = exact_forward()
    with invariant.bitwise(False):
        default = (default_forward or exact_forward)()
    return exact, default


class _ExactValues(torch.autograd.Function):
    """forward: the exact tensor, as it is; backward: the gradient goes to the default tensor unchanged."""

    @staticmethod
    def forward(ctx, default: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
        return exact.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def exact_values(default: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """`exact`'s values bit for bit (d + (e - d).detach() would round), differentiable as `default`: the bitwise
    mode's loss sees the engine's numbers and takes the default kernels' gradient at them."""
    return _ExactValues.apply(default, exact.detach())


def _rows_logprobs(model, batch: RolloutBatch, idx: torch.Tensor, *, packing: bool, temperature: float,
                   with_entropy: bool, routing: Optional[Routing], keep_logits: bool,
                   graphs: Optional[TrainGraphs]) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    if getattr(model, "takes_images", False):  # sampled markers are text; lost pixels are not (models/qwen_vl.py)
        rows = batch.select(idx)
        model.check_pixels(rows.input_ids, rows.attention_mask, rows.loss_mask, rows.images)
    if packing:
        packed = pack_rows(batch, idx)
        logp, ent = packed_micro_logprobs(model, packed, temperature=temperature, with_entropy=with_entropy,
                                          routing=routing, keep_logits=keep_logits, graphs=graphs)
        return logp, ent, packed.response_mask
    mb = trim_padding(batch.select(idx))
    logp, ent = micro_logprobs(model, mb, temperature=temperature, with_entropy=with_entropy, routing=routing,
                               keep_logits=keep_logits)
    return logp, ent, mb.response_mask.bool()


def rows_values(value_model, batch: RolloutBatch, idx: torch.Tensor, *,
                packing: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Values and response mask of rows `idx`, packed or trimmed.  [b, R] each. In the bitwise mode with autograd,
    as rows_logprobs: the exact kernels' values, the default forward's graph."""
    if bitwise_training(value_model):
        (values, mask), (default, _) = values_and_graph(lambda: _rows_values(value_model, batch, idx, packing=packing))
        return exact_values(default, values), mask
    return _rows_values(value_model, batch, idx, packing=packing)


def _rows_values(value_model, batch: RolloutBatch, idx: torch.Tensor, *,
                 packing: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if packing:
        packed = pack_rows(batch, idx)
        return packed_micro_values(value_model, packed), packed.response_mask
    mb = trim_padding(batch.select(idx))
    return micro_values(value_model, mb), mb.response_mask.bool()
