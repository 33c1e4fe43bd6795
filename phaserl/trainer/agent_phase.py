"""Phases 2 and 3 of a multi-turn run: episodes of the configured environment → a `RolloutBatch`,
and their environment rewards → `Scores`.

Chosen once when the run is built (`rollout_choice`, called by build.py; for `agent.harness` it picks
harness_phase.harness_rollout instead): the step then reads exactly as a
single-turn step. Episodes become the batch, and their rewards the scores, in episode_batch.py
(shared with harness_phase.py).
Not here: running episodes (phaserl.agents.episodes), the engine's slots (phaserl.rollout.session).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..agents.episodes import AgentLimits, EpisodeRunner, EpisodeStart
from ..agents.loader import EnvironmentFactory, load_harness_function
from ..agents.workers import Workers
from ..batch import RolloutBatch
from ..errors import ConfigError
from .episode_batch import EpisodeScores, episodes_batch
from .harness_phase import HarnessSettings, harness_rollout, verifiers_choice
from .rollout_context import RolloutChoice
from .rollout_phase import group_offset, single_turn_rollout

if TYPE_CHECKING:
    from .rollout_context import RolloutContext

log = logging.getLogger("phaserl")


@dataclass(frozen=True)
class AgentSettings:
    factory: EnvironmentFactory
    limits: AgentLimits
    workers: Workers             # environment threads, kept across rollouts (started once, lazily)
    vision: object = None        # agents.render.ObservationVision of a vision-language policy, else None


def rollout_choice(cfg, *, model_context: int, tokenizer, reward, train_prompts, val_prompts,
                   vision=None) -> RolloutChoice:
    """Phases 1-3 of the run: single-turn generation scored by `reward` (the run's reward sources), or with
    cfg.agent.env / cfg.agent.harness the multi-turn phase whose episodes bring their own rewards. vision: a
    vision-language policy's agents.render.ObservationVision (its episodes' prompts and observations hold images)."""
    a = cfg.agent
    if not (a.env or a.harness):
        return RolloutChoice(single_turn_rollout, reward, train_prompts, val_prompts)
    if cfg.reward_model.enable:
        log.warning("agent.%s is set: the score is the episode's rewards; reward_model.enable is ignored",
                    "env" if a.env else "harness")
    if a.harness == "verifiers":  # a verifiers environment runs its own episodes against the endpoint
        return verifiers_choice(cfg, model_context, tokenizer=tokenizer, train_prompts=train_prompts,
                                val_prompts=val_prompts)
    if a.harness:
        return RolloutChoice(harness_rollout, EpisodeScores(), train_prompts, val_prompts,
                             harness=harness_settings(cfg, model_context))
    return RolloutChoice(agent_rollout, EpisodeScores(), train_prompts, val_prompts,
                         agent=AgentSettings(EnvironmentFactory.from_spec(a.env, dict(a.kwargs)),
                                             AgentLimits.from_config(cfg, model_context), Workers(a.workers),
                                             vision))


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
                           max_episode_tokens=min(a.max_episode_tokens, model_context), max_turns=a.max_turns,
                           context_reason="context" if model_context < a.max_episode_tokens else "max_tokens")


def agent_rollout(ctx: "RolloutContext", items: list, params, n: int) -> RolloutBatch:
    """Phase 2, multi-turn: n episodes per prompt, all of this rank's prompts in one decode session."""
    run, actor, agent = ctx.run, ctx.actor, ctx.run.agent
    limits = dataclasses.replace(agent.limits, max_turn_tokens=params.max_new_tokens)
    first = ctx.rank * len(items) * n  # global index of this rank's first episode
    starts = [EpisodeStart(item, seed=ctx.seeds.episode(first + i), label=f"{item.row.source}, sample {k}",
                           noise_key=first + i)
              for i, (item, k) in enumerate((item, k) for item in items for k in range(n))]
    runner = EpisodeRunner(agent.factory, run.tokenizer, limits, workers=agent.workers, vision=agent.vision)
    # Not the rank's first episode: the session's noise seed is the step's on every rank, and each episode's
    # noise is keyed by its global index (noise_key), so an episode samples alike on 1 and N ranks.
    run.sampling_generator.manual_seed(ctx.seeds.agent_session(n))
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
                          group_offset=group_offset(ctx), device=actor.device)
