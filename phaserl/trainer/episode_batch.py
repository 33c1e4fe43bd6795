"""Episodes (of agent.env or agent.harness runs) → a `RolloutBatch`, their metrics, and their rewards → `Scores`.

A row's response is the episode after the prompt, model turns and observations in order, exactly the
ids sampled and appended; `loss_mask` is 1 on the sampled ids only. A vision-language policy's row carries the
episode's images (its prompt's and its observations', in order: Episode.images) to every training pass, each with
its start in the row's ids counted from the prompt's first token (padding and packing leave it right).
Each turn's reward lies on the last token of that turn, so GAE credits turns and GRPO/RLOO compare whole
trajectories (the sum) within a prompt's group. Used by agent_phase.py and harness_phase.py alike.
Not here: running episodes (phaserl.agents), choosing the phase (agent_phase.rollout_choice).
"""
from __future__ import annotations

import torch

from ..agents.episodes import FINISH_REASONS
from ..batch import RolloutBatch, Scores, layout_ids, layout_routes, right_padded
from ..data.prompts import decode_responses

TOOL_METRICS = ("tool_calls", "tool_errors", "tool_seconds")  # always logged (0 when the environment has no tools)


def episodes_batch(episodes: list, n: int, *, tokenizer, pad_token_id: int, group_offset: int,
                   device) -> RolloutBatch:
    """Episodes (n consecutive per prompt) as one padded batch with the loss mask of their sampled ids."""
    B = len(episodes)
    prompts = [ep.prompt_ids for ep in episodes]
    responses = [ep.response_ids() for ep in episodes]
    input_ids, attention_mask, P = layout_ids(prompts, responses, pad_token_id)  # [B, S] each
    R = input_ids.shape[1] - P
    loss_mask = right_padded([ep.loss_mask() for ep in episodes], R, torch.long)              # [B, R]
    logprobs = right_padded([ep.response_logprobs() for ep in episodes], R, torch.float32)    # [B, R]
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, S] on the device: no CPU kernels
    group_ids = torch.arange(B // n).repeat_interleave(n) + group_offset  # [B]
    versions = [ep.response_versions() for ep in episodes]
    token_versions = None  # [B, R] the asynchronous stream's episodes: each sampled id's policy version, -1 elsewhere
    if any(v is not None for v in versions):
        token_versions = (right_padded([[t + 1 for t in v] for v in versions], R, torch.long) - 1).to(device)
    return RolloutBatch(
        input_ids=input_ids, attention_mask=attention_mask,
        position_ids=position_ids, response_mask=attention_mask[:, P:].contiguous(),
        prompt_width=P, group_ids=group_ids.to(device), rollout_logprobs=logprobs.to(device),
        prompts=[ep.row.prompt for ep in episodes],
        response_texts=decode_responses(tokenizer, responses),
        rows=[ep.row for ep in episodes], finish_reasons=[ep.finish_reason for ep in episodes],
        loss_mask=loss_mask.to(device), episodes=list(episodes), rollout_metrics=episode_metrics(episodes),
        routed_experts=episode_routes(episodes, prompts, responses, P, R, device), token_versions=token_versions,
        images=episode_images(episodes))


def episode_images(episodes: list):
    """Each episode's ImageInputs (all its images in order) for the batch's `images`, or None when none has any."""
    images = [ep.images() for ep in episodes]
    return images if any(im is not None for im in images) else None


def episode_routes(episodes: list, prompts: list, responses: list, P: int, R: int, device):
    """Routing replay: each episode's expert record laid out like its ids ([B, P + R, L, k], -1 where nothing was
    recorded: an episode that never reached a slot, or a final observation that was never fed); None when no
    episode has one (replay off, or the transformers fallback)."""
    template = next((ep.routes for ep in episodes if ep.routes is not None), None)
    if template is None:
        return None
    routes = []
    for ep, prompt, resp in zip(episodes, prompts, responses):
        route = template.new_full((0, *template.shape[1:]), -1) if ep.routes is None else ep.routes
        assert route.shape[0] <= len(prompt) + len(resp), "a slot holds the episode's ids, never more"
        routes.append(route)
    return layout_routes([len(p) for p in prompts], routes, P, R).to(device)


def episode_metrics(episodes: list) -> dict:
    """agent/*: turns, observation tokens, environment and tool time, and the share ended by each reason."""
    count = max(1, len(episodes))
    mean = lambda values: float(sum(values)) / count  # noqa: E731
    turns = [ep.num_turns for ep in episodes]
    observed = [sum(len(s.token_ids) for s in ep.segments[1:] if s.kind == "observation") for ep in episodes]
    m = {"agent/turns_mean": mean(turns), "agent/turns_max": float(max(turns, default=0)),
         "agent/observation_tokens_mean": mean(observed),
         "agent/env_seconds_mean": mean(ep.metrics.get("env_seconds", 0.0) for ep in episodes)}
    keys = set(TOOL_METRICS) | {k for ep in episodes for k in ep.metrics if k != "env_seconds"}
    m.update({f"agent/{k}_mean": mean(ep.metrics.get(k, 0.0) for ep in episodes) for k in sorted(keys)})
    reasons = list(FINISH_REASONS) + sorted({ep.finish_reason for ep in episodes} - set(FINISH_REASONS))
    m.update({f"agent/ended/{r}": mean(ep.finish_reason == r for ep in episodes) for r in reasons})
    return m


class EpisodeScores:
    """Phase 3, multi-turn: the environment's rewards (the sum of an episode's turn rewards), each turn's
    reward placed on the last sampled token of that turn."""

    def close(self) -> None:
        """Nothing to stop: the environments scored in the rollout (RewardSources.close's counterpart)."""

    def score(self, batch: RolloutBatch) -> Scores:
        device = batch.input_ids.device
        totals = torch.tensor([ep.reward for ep in batch.episodes], dtype=torch.float32)  # [B]
        placed = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)               # [B, R]
        for i, ep in enumerate(batch.episodes):
            for column, reward in zip(turn_ends(ep), ep.turn_rewards):
                placed[i, column] += reward
        return Scores(total=totals.to(device), by_source={"env": totals.to(device)}, token_rewards=placed.to(device))


def turn_ends(episode) -> list:
    """Response column of the last sampled token of each model turn, in turn order."""
    ends, column = [], 0
    for seg in episode.segments[1:]:
        column += len(seg.token_ids)
        if seg.kind == "model":
            ends.append(column - 1)
    return ends
