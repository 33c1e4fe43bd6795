"""Phases 2 and 3 of a multi-turn run: episodes of the configured environment → a `RolloutBatch`,
and their environment rewards → `Scores`.

Chosen once when the run is built (`with_agent`, called by build.py when `agent.env` is set; for
`agent.harness` it picks harness_phase.harness_rollout instead): the step then reads exactly as a
single-turn step. Episodes become the batch, and their rewards the scores, in episode_batch.py
(shared with harness_phase.py).
Not here: running episodes (phaserl.agents.episodes), the engine's slots (phaserl.rollout.session).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from ..agents.episodes import AgentLimits, EpisodeRunner, EpisodeStart
from ..agents.loader import EnvironmentFactory, load_harness_function
from ..agents.workers import Workers
from ..batch import RolloutBatch
from ..errors import ConfigError
from .episode_batch import EpisodeScores, episodes_batch
from .harness_phase import HarnessSettings, harness_rollout, with_verifiers
from .rollout_phase import group_offset

log = logging.getLogger("phaserl")


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
    if a.harness == "verifiers":  # a verifiers environment runs its own episodes against the endpoint
        return with_verifiers(run, cfg, model_context)
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
                           max_episode_tokens=min(a.max_episode_tokens, model_context), max_turns=a.max_turns,
                           context_reason="context" if model_context < a.max_episode_tokens else "max_tokens")


def agent_rollout(trainer, items: list, params, n: int) -> RolloutBatch:
    """Phase 2, multi-turn: n episodes per prompt, all of this rank's prompts in one decode session."""
    run, actor = trainer.run, trainer.actor
    limits = dataclasses.replace(run.agent.limits, max_turn_tokens=params.max_new_tokens)
    first = trainer.rank * len(items) * n  # global index of this rank's first episode
    starts = [EpisodeStart(item, seed=hash((run.seed, trainer.step_num, first + i)) & (2**31 - 1),
                           label=f"{item.row.source}, sample {k}", noise_key=first + i)
              for i, (item, k) in enumerate((item, k) for item in items for k in range(n))]
    runner = EpisodeRunner(run.agent.factory, run.tokenizer, limits, workers=run.agent.workers)
    # ints only: a str in the tuple would hash differently in every process (PYTHONHASHSEED), breaking resume.
    # Not the rank's first episode: the session's noise seed is the step's on every rank, and each episode's
    # noise is keyed by its global index (noise_key), so an episode samples alike on 1 and N ranks.
    run.sampling_generator.manual_seed(hash((run.seed, trainer.step_num, n, 1)) & (2**63 - 1))
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
