"""Turning a per-token loss [B, T] into the one number that is back-propagated.

The denominators are *global*: the real-token or response count of the whole mini-batch (all of
its micro-batches, on all ranks), handed in by the caller. Each micro-batch's loss is then its
exact share of the mini-batch loss, so summing `.backward()` over micro-batches gives the same
gradient however the mini-batch was split (and however unevenly). Averaging per-micro-batch means
instead would weight a token by the size of the micro-batch it happened to land in.

Across ranks: phaserl's FSDP *sums* gradients over the R ranks (`parallel/fsdp.py`), so the global
counts go in as they are; with a wrapper that averages (plain DDP/FSDP), pass the counts divided by R
(or multiply the loss by R) to keep the sum semantics.

Modes (verl's names; Dr.GRPO is Liu et al. 2025, "Understanding R1-Zero-Like Training"):
    token-mean               sum of real-token losses / global_tokens
    seq-mean-token-sum       sum over responses of their token sums / global_seqs
    seq-mean-token-mean      sum over responses of their token means / global_seqs (GRPO paper, GSPO)
    seq-mean-token-sum-norm  sum of real-token losses / (global_seqs * max_len) (Dr.GRPO)
    token-sum                sum of real-token losses, no denominator (verl's token-sum)

token-sum makes the gradient grow with the number of tokens in the mini-batch (a step on 2x the
tokens is 2x as large), so the learning rate must be sized for the batch; it is split-invariant by
construction (a sum of sums), and on R ranks the summed gradients add each rank's local sum.

Legend: B = responses, T = response tokens (right-padded), mask = response_mask [B, T].
"""
from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor

from phaserl.algo.masked import masked_mean, masked_sum
from phaserl.errors import ConfigError


def _token_mean(loss_mat: Tensor, mask: Tensor, global_tokens: float, global_seqs: float,
                max_len: Optional[int]) -> Tensor:
    return masked_sum(loss_mat, mask) / global_tokens


def _seq_mean_token_sum(loss_mat: Tensor, mask: Tensor, global_tokens: float, global_seqs: float,
                        max_len: Optional[int]) -> Tensor:
    return masked_sum(loss_mat, mask, dim=-1).sum() / global_seqs


def _seq_mean_token_mean(loss_mat: Tensor, mask: Tensor, global_tokens: float, global_seqs: float,
                         max_len: Optional[int]) -> Tensor:
    # A response is never split across micro-batches, so its own token mean is split-invariant.
    return masked_mean(loss_mat, mask, dim=-1).sum() / global_seqs


def _seq_mean_token_sum_norm(loss_mat: Tensor, mask: Tensor, global_tokens: float, global_seqs: float,
                             max_len: Optional[int]) -> Tensor:
    if max_len is None:
        raise ConfigError("loss_agg_mode 'seq-mean-token-sum-norm' needs max_len: pass a constant such as "
                          "rollout.max_new_tokens (not the padded width of the batch, which varies by split)")
    return masked_sum(loss_mat, mask) / (global_seqs * max_len)


def _token_sum(loss_mat: Tensor, mask: Tensor, global_tokens: float, global_seqs: float,
               max_len: Optional[int]) -> Tensor:
    return masked_sum(loss_mat, mask)


LOSS_AGG_MODES: dict[str, Callable[..., Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
    "token-sum": _token_sum,
}


def aggregate(loss_mat: Tensor, mask: Tensor, mode: str, *, global_tokens: float, global_seqs: float,
              max_len: Optional[int] = None) -> Tensor:
    """Reduce a per-token loss to this micro-batch's share of the mini-batch loss.

    Args:
        loss_mat: [B, T] per-token loss (padding may hold anything).
        mask: [B, T] response mask.
        mode: one of `LOSS_AGG_MODES` (see the module docstring).
        global_tokens: real tokens in the whole mini-batch (all micro-batches, all ranks).
        global_seqs: responses in the whole mini-batch.
        max_len: the constant length normaliser of "seq-mean-token-sum-norm" (e.g. max_new_tokens).

    Returns:
        A 0-dim tensor; summed over the micro-batches of a mini-batch it equals the loss of the
        whole mini-batch computed at once.
    """
    if mode not in LOSS_AGG_MODES:
        raise ConfigError(f"actor.loss_agg_mode={mode!r} is unknown; use one of {list(LOSS_AGG_MODES)}")
    if global_tokens <= 0 or global_seqs <= 0:
        raise ValueError(f"global_tokens ({global_tokens}) and global_seqs ({global_seqs}) must be > 0: "
                         "they count the whole mini-batch")
    return LOSS_AGG_MODES[mode](loss_mat, mask, float(global_tokens), float(global_seqs), max_len)
