"""Advantage estimators: GAE, GRPO (+ Dr.GRPO), pass@k, OPO, GPG, RLOO, REINFORCE++ (+ baseline), ReMax.

Each estimator takes one `AdvantageInputs` and returns `(advantages [B, T], returns [B, T])`, both 0
beyond the response mask. The trainer picks one from `ADVANTAGE_ESTIMATORS` when the run is built.
`returns` is the critic's regression target for GAE; the critic-free estimators return the
quantity their advantage was built from (see each docstring) so that it can be logged.

A response's *score* is the sum of its real token rewards: the reward placed on its last real
token, minus the per-token KL when the KL is shaped into the reward (`kl.apply_kl_to_rewards`).
Pure tensor math under no_grad; no I/O, no distributed.

Legend: B = responses, T = response tokens (right-padded), G = groups (prompts),
mask = response_mask [B, T] (1 = real token).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from phaserl.algo.masked import masked_sum, masked_whiten, upcast
from phaserl.errors import ConfigError


@dataclass
class AdvantageInputs:
    """Everything an advantage estimator may read; each estimator uses the fields it needs."""

    token_rewards: Tensor  # [B, T] reward per token (score on the last real token, minus KL if KL is in the reward)
    response_mask: Tensor  # [B, T] 1 = real response token
    group_ids: Tensor  # [B] int: responses of the same prompt share an id
    values: Optional[Tensor] = None  # [B, T] critic values (gae)
    baseline_scores: Optional[Tensor] = None  # [B] greedy-response scores (remax)
    gamma: float = 1.0  # discount per token (gae, reinforce_plus_plus)
    lam: float = 1.0  # GAE lambda
    norm_by_std: bool = True  # grpo: divide by the group std; False = Dr.GRPO
    eps: float = 1e-6  # grpo: added to the group std
    total: Optional[Callable[[Tensor], Tensor]] = None  # sums whitening statistics over ranks (None: one batch)


def _check(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """(rewards with 0 beyond the mask, mask), both in the rewards' dtype and at least float32, after shape checks
    (wiring mistakes). One dtype for both: float64 rewards with a float32 mask broke OPO's index_add_."""
    rewards, mask = inputs.token_rewards, inputs.response_mask
    if rewards.dim() != 2 or rewards.shape != mask.shape:
        raise ValueError(f"token_rewards {tuple(rewards.shape)} and response_mask {tuple(mask.shape)} "
                         "must both be [B, T]")
    if inputs.group_ids.shape != rewards.shape[:1]:
        raise ValueError(f"group_ids must be [B] = [{rewards.shape[0]}], got {tuple(inputs.group_ids.shape)}")
    rewards = _zero_padding(rewards, mask)
    return rewards, mask.to(rewards.dtype)


def _zero_padding(x: Tensor, mask: Tensor) -> Tensor:
    # where() rather than x * mask: padding holding inf/nan must not become nan.
    return torch.where(mask.bool(), upcast(x), torch.zeros((), device=x.device))


def _scores(rewards: Tensor, mask: Tensor) -> Tensor:
    return masked_sum(rewards, mask, dim=-1)  # [B] sum of the real token rewards


def _group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-response view of its group: (group index [B], size [B], mean [B], unbiased std [B])."""
    uniq, index = torch.unique(group_ids, return_inverse=True)  # index: [B] values in [0, G)
    size = torch.zeros(uniq.numel(), dtype=scores.dtype, device=scores.device)
    size.index_add_(0, index, torch.ones_like(scores))  # [G] responses per group
    total = torch.zeros_like(size).index_add_(0, index, scores)  # [G]
    mean = (total / size)[index]  # [B]
    sq_dev = torch.zeros_like(size).index_add_(0, index, (scores - mean) ** 2)  # [G]
    std = (sq_dev / (size - 1).clamp(min=1)).sqrt()[index]  # [B]; 0 for a group of one
    return index, size[index], mean, std


def group_has_variance(scores: Tensor, group_ids: Tensor) -> Tensor:
    """[B] bool: True where the response's group holds at least two different scores.

    A group whose scores are all equal (all right, all wrong) has zero variance: every group-baseline
    estimator gives its responses advantage 0, so it teaches nothing. Exact comparison (max == min),
    as DAPO's filter (std == 0). A group of one has no variance.
    """
    _, index = torch.unique(group_ids, return_inverse=True)  # [B] in [0, G)
    G = int(index.max()) + 1 if index.numel() else 0
    high = torch.full((G,), float("-inf"), dtype=scores.dtype, device=scores.device)
    low = torch.full((G,), float("inf"), dtype=scores.dtype, device=scores.device)
    high = high.scatter_reduce(0, index, scores, reduce="amax")  # [G]
    low = low.scatter_reduce(0, index, scores, reduce="amin")  # [G]
    return (high > low)[index]


def _broadcast(per_response: Tensor, mask: Tensor) -> Tensor:
    return per_response.unsqueeze(-1) * mask  # [B] -> [B, T], 0 beyond the mask


def _reverse_scan(rewards: Tensor, mask: Tensor, gamma: float, values: Optional[Tensor], lam: float) -> Tensor:
    """Backward recursion over tokens shared by GAE and the discounted return-to-go.

    With `values`: A_t = delta_t + gamma * lam * A_{t+1}, delta_t = r_t + gamma * V_{t+1} - V_t.
    Without: G_t = r_t + gamma * G_{t+1}. Tokens with mask 0 are skipped (the running value is
    carried across them), so right padding contributes nothing and V after the last token is 0.
    """
    running = torch.zeros_like(rewards[:, 0])  # [B] A_{t+1} or G_{t+1}
    next_value = torch.zeros_like(running)  # [B] V_{t+1}
    out = torch.zeros_like(rewards)  # [B, T]
    for t in reversed(range(rewards.shape[1])):
        real = mask[:, t] > 0
        if values is None:
            step = rewards[:, t] + gamma * running
        else:
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            step = delta + gamma * lam * running
            next_value = torch.where(real, values[:, t], next_value)
        running = torch.where(real, step, running)
        out[:, t] = torch.where(real, step, torch.zeros_like(step))
    return out


@torch.no_grad()
def compute_gae_advantages(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016), as used by PPO for RLHF.

    returns = A_GAE + V (the critic's target, before whitening); advantages = A_GAE whitened over
    every real token of the batch (`masked_whiten`, unbiased variance).
    Needs `values` [B, T]. Returns ([B, T], [B, T]).
    """
    rewards, mask = _check(inputs)
    if inputs.values is None:
        raise ConfigError("algorithm.adv_estimator=gae needs critic values; enable the critic "
                          "(critic.enable: true) or pick a critic-free estimator such as grpo")
    if inputs.values.shape != rewards.shape:
        raise ValueError(f"values must be [B, T] = {tuple(rewards.shape)}, got {tuple(inputs.values.shape)}")
    values = _zero_padding(inputs.values, mask)  # [B, T]; padding may hold anything
    raw = _reverse_scan(rewards, mask, inputs.gamma, values, inputs.lam)  # [B, T]
    returns = (raw + values) * mask
    return masked_whiten(raw, mask, total=inputs.total), returns


@torch.no_grad()
def compute_grpo_advantages(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GRPO (Shao et al. 2024, DeepSeekMath) outcome advantage, and Dr.GRPO (Liu et al. 2025).

    A_i = (s_i - mean_group(s)) / (std_group(s) + eps), with the *unbiased* group std (torch.std's
    default, as verl); `norm_by_std=False` gives Dr.GRPO's A_i = s_i - mean_group(s). A_i is
    broadcast to every real token. A group of one response is its own mean, so its advantage is 0
    (verl instead passes its raw score through). returns = advantages. Returns ([B, T], [B, T]).
    """
    rewards, mask = _check(inputs)
    scores = _scores(rewards, mask)  # [B]
    _, _, mean, std = _group_stats(scores, inputs.group_ids)
    adv = scores - mean  # [B]
    if inputs.norm_by_std:
        adv = adv / (std + inputs.eps)
    adv = _broadcast(adv, mask)
    return adv, adv


@torch.no_grad()
def compute_rloo_advantages(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """RLOO, REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024).

    A_i = s_i - mean of the other responses' scores in its group = (s_i - mean) * n / (n - 1),
    broadcast to tokens. Every group needs at least 2 responses. returns = advantages.
    Returns ([B, T], [B, T]).
    """
    rewards, mask = _check(inputs)
    scores = _scores(rewards, mask)  # [B]
    _, size, mean, _ = _group_stats(scores, inputs.group_ids)
    _require_pairs(size, inputs.group_ids, "rloo")
    adv = _broadcast((scores - mean) * size / (size - 1), mask)
    return adv, adv


@torch.no_grad()
def compute_reinforce_plus_plus_advantages(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go, whitened over the batch.

    G_t = sum_{k >= t} gamma^(k - t) r_k over real tokens; advantages = G whitened over every real
    token of the batch; returns = G. Returns ([B, T], [B, T]).
    """
    rewards, mask = _check(inputs)
    returns = _reverse_scan(rewards, mask, inputs.gamma, None, 1.0)  # [B, T]
    return masked_whiten(returns, mask, total=inputs.total), returns


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_advantages(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (Hu 2025): group-mean baseline, then whitened over the batch.

    A_i = s_i - mean_group(s), broadcast to tokens, then whitened over every real token of the
    batch (the batch std replaces GRPO's group std). returns = the broadcast A_i before whitening.
    Returns ([B, T], [B, T]).
    """
    rewards, mask = _check(inputs)
    scores = _scores(rewards, mask)  # [B]
    _, _, mean, _ = _group_stats(scores, inputs.group_ids)
    centered = _broadcast(scores - mean, mask)  # [B, T]
    return masked_whiten(centered, mask, total=inputs.total), centered


@torch.no_grad()
def compute_remax_advantages(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2024): the greedy response's score is the baseline.

    Per token, as verl: returns G_t = sum_{k >= t} r_k (the reward-to-go, undiscounted) and
    A_t = G_t - baseline_scores_i. With all reward on the last token G_t is the response's score s_i
    at every token; with the KL shaped into the reward a token's return counts only the KL that
    follows it. Needs `baseline_scores` [B] (the score of the greedy response to the same prompt,
    without KL, as verl). Returns ([B, T], [B, T]).
    """
    rewards, mask = _check(inputs)
    if inputs.baseline_scores is None:
        raise ConfigError("algorithm.adv_estimator=remax needs the greedy responses' scores "
                          "(baseline_scores); the trainer must run the greedy rollout")
    if inputs.baseline_scores.shape != rewards.shape[:1]:
        raise ValueError(f"baseline_scores must be [B] = [{rewards.shape[0]}], "
                         f"got {tuple(inputs.baseline_scores.shape)}")
    returns = _reverse_scan(rewards, mask, 1.0, None, 1.0)  # [B, T] reward-to-go
    adv = (returns - upcast(inputs.baseline_scores).unsqueeze(-1)) * mask
    return adv, returns


@torch.no_grad()
def compute_passk_advantages(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GRPO with the pass@k objective, as verl's `grpo_passk` (after Tang et al. 2025, arXiv 2503.19595).

    Only the best response of each group is credited: A_best = s_max - s_second (divided by the
    unbiased group std + eps when `norm_by_std`), every other response gets 0, so the policy is
    pushed to make its best of k better rather than its average. Ties for the best go to the first
    response of the group (verl: whichever torch.topk returns); a tie gives A = 0. Every group needs
    at least 2 responses. returns = advantages. Returns ([B, T], [B, T]).
    """
    rewards, mask = _check(inputs)
    scores = _scores(rewards, mask)  # [B]
    index, size, _, std = _group_stats(scores, inputs.group_ids)
    _require_pairs(size, inputs.group_ids, "grpo_passk")
    G = int(index.max()) + 1
    best = torch.full((G,), float("-inf"), dtype=scores.dtype, device=scores.device)
    best = best.scatter_reduce(0, index, scores, reduce="amax")  # [G]
    rows = torch.arange(len(scores), device=scores.device)
    candidate = torch.where(scores == best[index], rows, len(scores))  # [B] row number where it is a best
    first_best = torch.full((G,), len(scores), device=scores.device).scatter_reduce(
        0, index, candidate, reduce="amin")  # [G]
    is_best = rows == first_best[index]  # [B] one per group
    others = torch.where(is_best, torch.full_like(scores, float("-inf")), scores)
    second = torch.full((G,), float("-inf"), dtype=scores.dtype, device=scores.device)
    second = second.scatter_reduce(0, index, others, reduce="amax")  # [G]
    adv = torch.where(is_best, scores - second[index], torch.zeros_like(scores))  # [B]
    if inputs.norm_by_std:
        adv = adv / (std + inputs.eps)
    adv = _broadcast(adv, mask)
    return adv, adv


@torch.no_grad()
def compute_opo_advantages(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal reward baseline", arXiv 2505.23585).

    The baseline is the length-weighted group mean, b = sum_j L_j s_j / sum_j L_j (L = response
    length in tokens), the variance-minimising baseline when the gradient norm grows with length;
    A_i = s_i - b, broadcast to tokens. Difference from verl: a group of one is its own baseline
    (A = 0, as our GRPO), where verl uses baseline 0 (A = s). returns = advantages.
    Returns ([B, T], [B, T]).
    """
    rewards, mask = _check(inputs)
    scores = _scores(rewards, mask)  # [B]
    lengths = mask.sum(dim=-1)  # [B]
    index, _, _, _ = _group_stats(scores, inputs.group_ids)
    G = int(index.max()) + 1
    weighted = torch.zeros(G, dtype=scores.dtype, device=scores.device).index_add_(0, index, lengths * scores)
    total_len = torch.zeros(G, dtype=scores.dtype, device=scores.device).index_add_(0, index, lengths)
    baseline = (weighted / total_len.clamp(min=1))[index]  # [B]
    adv = _broadcast(scores - baseline, mask)
    return adv, adv


@torch.no_grad()
def compute_gpg_advantages(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline", arXiv 2504.02546).

    A_i = alpha * (s_i - mean_group(s)), alpha = B / (B - M), with B the responses of the batch and M
    those in zero-variance groups (advantage 0): the gradient is rescaled as if only the informative
    responses were in the batch. Pair it with `actor.policy_loss=gpg` (the plain -A log p loss).
    B and M are counted over every rank (`total`). Difference from verl: verl's alpha is
    B / (number of non-zero scores), which equals the paper's only for some 0/1 rewards; phaserl
    follows the paper. returns = advantages. Returns ([B, T], [B, T]).
    """
    rewards, mask = _check(inputs)
    scores = _scores(rewards, mask)  # [B]
    _, _, mean, _ = _group_stats(scores, inputs.group_ids)
    informative = group_has_variance(scores, inputs.group_ids)  # [B]
    total = inputs.total or (lambda t: t)
    counts = total(torch.stack([torch.tensor(float(len(scores)), dtype=scores.dtype, device=scores.device),
                                informative.to(scores.dtype).sum()]))  # [2] = (B, B - M)
    alpha = counts[0] / counts[1].clamp(min=1)
    adv = _broadcast(alpha * (scores - mean), mask)
    return adv, adv


def _require_pairs(size: Tensor, group_ids: Tensor, name: str) -> None:
    if bool((size < 2).any()):
        lonely = group_ids[size < 2].tolist()
        raise ConfigError(f"{name} needs at least 2 responses per prompt, but group id(s) {lonely[:5]} "
                          "have 1; set rollout.n >= 2 (or pick algorithm.adv_estimator=grpo)")


AdvantageEstimator = Callable[[AdvantageInputs], "tuple[Tensor, Tensor]"]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": compute_gae_advantages,
    "grpo": compute_grpo_advantages,
    "rloo": compute_rloo_advantages,
    "reinforce_plus_plus": compute_reinforce_plus_plus_advantages,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_advantages,
    "remax": compute_remax_advantages,
    "grpo_passk": compute_passk_advantages,
    "opo": compute_opo_advantages,
    "gpg": compute_gpg_advantages,
}
