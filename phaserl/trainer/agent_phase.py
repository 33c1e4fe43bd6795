"""Phases 2 and 3 of a multi-turn run: episodes of the configured environment → a `RolloutBatch`,
and their environment rewards → `Scores`.

Chosen once when the run is built (`with_agent`, called by build.py when `agent.env` is set; for
`agent.harness` it picks harness_phase.harness_rollout instead): the step then reads exactly as a
single-turn step. A row's response is the episode after the prompt,
model turns and observations in order, exactly the ids sampled and appended; `loss_mask` is 1 on the
sampled ids only. Each turn's reward lies on the last token of that turn, so GAE credits turns and
GRPO/RLOO compare whole trajectories (the sum) within a prompt's group.
Not here: running episodes (phaserl.agents.episodes), the engine's slots (phaserl.rollout.session).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from ..agents.episodes import FINISH_REASONS, AgentLimits, EpisodeRunner, EpisodeStart
from ..agents.loader import EnvironmentFactory, load_harness_function
from ..agents.workers import Workers
from ..batch import RolloutBatch, Scores
from ..errors import ConfigError
from .harness_phase import HarnessSettings, harness_rollout
from .rollout_phase import group_offset

log = logging.getLogger("phaserl")
TOOL_METRICS = ("tool_calls", "tool_errors", "tool_seconds")  # always logged (0 when the environment has no tools)


@dataclass(frozen=True)
class AgentSettings:
    factory: EnvironmentFactory
    limits: AgentLimits
    workers: Workers             # environment threads, kept across rollouts (started once, lazily)


def with_agent(run, cfg, model_context: int):
    """RunSettings for a multi-turn run when cfg.agent.env or cfg.agent.harness is set (else `run` unchanged)."""
    a = cfg.agent
    if not (a.env or a.harness):
        return run
    if cfg.reward_model.enable:
        log.warning("agent.%s is set: the score is the episode's rewards; reward_model.enable is ignored",
                    "env" if a.env else "harness")
    if a.harness:
        return dataclasses.replace(run, rollout_phase=harness_rollout, reward=EpisodeScores(),
                                   agent=harness_settings(cfg, model_context))
    return dataclasses.replace(run, rollout_phase=agent_rollout, reward=EpisodeScores(),
                               agent=AgentSettings(EnvironmentFactory.from_spec(a.env, dict(a.kwargs)),
                                                   AgentLimits.from_config(cfg, model_context), Workers(a.workers)))


def harness_settings(cfg, model_context: int) -> HarnessSettings:
    """agent.harness* and the reward.functions that score a harness returning None (read once, here)."""
    from ..agents.harness import quiet_client_logs, rules_reward
    from ..agents.tool_parsers import get_tool_parser

    a = cfg.agent
    try:
        get_tool_parser(a.tool_parser)
    except ValueError as exc:
        raise ConfigError(f"agent.tool_parser: {exc}") from None
    quiet_client_logs()
    if a.kwargs:
        log.warning("agent.kwargs %s are ignored with agent.harness (they go to an agent.env class); a harness "
                    "reads its settings itself", sorted(a.kwargs))
    reward = rules_reward([(f.name, f.weight, f.kwargs) for f in cfg.reward.functions], timeout_s=cfg.reward.timeout_s)
    return HarnessSettings(harness=load_harness_function(a.harness), reward=reward, workers=a.harness_workers,
                           timeout_s=a.harness_timeout_s, tool_parser=a.tool_parser,
                           max_episode_tokens=min(a.max_episode_tokens, model_context))


def agent_rollout(trainer, items: list, params, n: int) -> RolloutBatch:
    """Phase 2, multi-turn: n episodes per prompt, all of this rank's prompts in one decode session."""
    run, actor = trainer.run, trainer.actor
    limits = dataclasses.replace(run.agent.limits, max_turn_tokens=params.max_new_tokens)
    first = trainer.rank * len(items) * n  # global index of this rank's first episode
    starts = [EpisodeStart(item, seed=hash((run.seed, trainer.step_num, first + i)) & (2**31 - 1),
                           label=f"{item.row.source}, sample {k}")
              for i, (item, k) in enumerate((item, k) for item in items for k in range(n))]
    runner = EpisodeRunner(run.agent.factory, run.tokenizer, limits, workers=run.agent.workers)
    # ints only: a str in the tuple would hash differently in every process (PYTHONHASHSEED), breaking resume
    run.sampling_generator.manual_seed(hash((run.seed, trainer.step_num, first, n, 1)) & (2**63 - 1))
    eos = [] if run.ignore_eos else run.eos_token_ids
    session = actor.decode_session(params, slot_len=limits.max_episode_tokens, eos_token_ids=eos,
                                   num_slots=run.generate_batch_size * n, generator=run.sampling_generator)
    if session is not None:  # our decoder: slots continue after each observation, KV kept
        with session as s:
            episodes = runner.run_session(s, starts)
    else:  # transformers fallback: the conversation is re-prefilled every turn (still token-exact)
        episodes = runner.run_generate(lambda prompts: actor.generate(
            prompts, params, eos_token_ids=eos, pad_token_id=run.pad_token_id, batch_size=len(prompts),
            generator=run.sampling_generator), starts)
    return episodes_batch(episodes, n, tokenizer=run.tokenizer, pad_token_id=run.pad_token_id,
                          group_offset=group_offset(trainer), device=actor.device)


def episodes_batch(episodes: list, n: int, *, tokenizer, pad_token_id: int, group_offset: int,
                   device) -> RolloutBatch:
    """Episodes (n consecutive per prompt) as one padded batch with the loss mask of their sampled ids."""
    B = len(episodes)
    prompts = [ep.prompt_ids for ep in episodes]
    responses = [ep.response_ids() for ep in episodes]
    P, R = max(map(len, prompts)), max(1, max(map(len, responses)))
    input_ids = torch.full((B, P + R), pad_token_id, dtype=torch.long)  # [B, S]
    attention_mask = torch.zeros((B, P + R), dtype=torch.long)          # [B, S]
    loss_mask = torch.zeros((B, R), dtype=torch.long)                   # [B, R]
    logprobs = torch.zeros((B, R), dtype=torch.float32)                 # [B, R]
    for i, (ep, prompt, resp) in enumerate(zip(episodes, prompts, responses)):
        input_ids[i, P - len(prompt):P] = torch.tensor(prompt, dtype=torch.long)
        input_ids[i, P:P + len(resp)] = torch.tensor(resp, dtype=torch.long)
        attention_mask[i, P - len(prompt):P + len(resp)] = 1
        loss_mask[i, :len(resp)] = torch.tensor(ep.loss_mask(), dtype=torch.long)
        logprobs[i, :len(resp)] = torch.tensor(ep.response_logprobs(), dtype=torch.float32)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)     # [B, S]
    group_ids = torch.arange(B // n).repeat_interleave(n) + group_offset  # [B]
    return RolloutBatch(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
        position_ids=position_ids.to(device), response_mask=attention_mask[:, P:].to(device),
        prompt_width=P, group_ids=group_ids.to(device), rollout_logprobs=logprobs.to(device),
        prompts=[ep.row.prompt for ep in episodes],
        response_texts=tokenizer.batch_decode(responses, skip_special_tokens=True),
        rows=[ep.row for ep in episodes], finish_reasons=[ep.finish_reason for ep in episodes],
        loss_mask=loss_mask.to(device), episodes=list(episodes), rollout_metrics=episode_metrics(episodes))


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
