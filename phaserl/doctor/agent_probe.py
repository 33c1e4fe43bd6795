"""The doctor's one-episode probe of the configured environment (agent.env; docs/agents.md).

It builds the environment as `train` would, runs one episode from the first training row with the
policy (greedy, rollout.max_new_tokens per turn, the agent.* limits) and reports what it saw: the
reset, the first model turn, tool calls the environment counted, how the episode ended, and the
mask of its tokens (which the loss sees, which are observations). An environment that raises, hangs
or returns a bad value is a FAIL with the message training would give. Nothing is trained.
"""
from __future__ import annotations

import dataclasses

from ..agents.episodes import AgentLimits, EpisodeRunner, EpisodeStart
from ..agents.loader import EnvironmentFactory
from ..data import build_prompt_dataset
from ..rollout import SamplingParams, generate
from .checks import Context, check, short
from .report import FAIL, OK, WARN, CheckResult

NAME = "agent episode"


@check(NAME, needs=("tokenizer", "policy", "train_rows"))
def check_agent(ctx: Context) -> CheckResult:
    cfg, tok = ctx.cfg, ctx.tokenizer
    if not cfg.agent.env:
        return CheckResult(NAME, OK, "off: single-turn RL (agent.env is not set)")
    factory = EnvironmentFactory.from_spec(cfg.agent.env, dict(cfg.agent.kwargs))
    context = getattr(getattr(ctx.policy, "config", None), "max_position_embeddings", None) or cfg.agent.max_episode_tokens
    limits = dataclasses.replace(AgentLimits.from_config(cfg, context), on_env_error="stop", workers=1)
    item = build_prompt_dataset(ctx.train_rows[:1], tok, max_prompt_length=cfg.data.max_prompt_length,
                                overlong=cfg.data.overlong_prompts,
                                apply_chat_template=cfg.data.apply_chat_template).items[0]
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos or [0])[0]
    episode = EpisodeRunner(factory, tok, limits).run_generate(
        lambda prompts: generate(ctx.policy, prompts, params, eos_token_ids=eos, pad_token_id=pad),
        [EpisodeStart(item, seed=cfg.trainer.seed, label=f"{item.row.source}, sample 0")])[0]
    layout = " | ".join(f"{s.kind} {len(s.token_ids)}" + (" (masked)" if s.kind == "observation" else "")
                        for s in episode.segments)
    model = [s for s in episode.segments if s.kind == "model"]
    first = tok.decode(model[0].token_ids, skip_special_tokens=True) if model else ""
    tools = episode.metrics.get("tool_calls", 0.0)
    message = (f"{factory.name} on {item.row.source}: {episode.num_turns} model turn(s), ended by "
               f"{episode.finish_reason}, reward {episode.reward:g}; first turn {short(first, 60)}"
               + (f"; {tools:g} tool call(s), {episode.metrics.get('tool_errors', 0.0):g} error(s)" if tools else ""))
    details = (f"tokens: {layout}; the loss sees {sum(episode.loss_mask())} sampled of "
               f"{len(episode.response_ids())} response tokens",)
    if episode.finish_reason in ("context", "max_tokens") and episode.num_turns <= 1:
        return CheckResult(NAME, WARN, message, details=details,
                           fix="the episode ran out of room after one turn: raise agent.max_episode_tokens or lower "
                               "rollout.max_new_tokens")
    if not model:
        return CheckResult(NAME, FAIL, message, details=details, fix="no room for a model turn after the prompt and "
                           "the reset observation: raise agent.max_episode_tokens")
    return CheckResult(NAME, OK, message, details=details)
