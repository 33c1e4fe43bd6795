"""The doctor's one-episode probe of the configured environment (agent.env; docs/agents.md), or of
the configured external harness (agent.harness).

It builds the environment as `train` would, runs `PROBE_EPISODES` episodes from the first training rows with
the policy (greedy, rollout.max_new_tokens per turn, the agent.* limits) and reports what the first one saw:
the reset, the first model turn, tool calls the environment counted, how the episode ended, and the mask of
its tokens (which the loss sees, which are observations). An environment that raises, hangs or returns a bad
value is judged as training would meet it: with agent.on_env_error=stop a FAIL with the message
that would stop the run; with `end` (the default) such episodes end and training goes on, so a WARN naming
the environment, the fault and how many probe episodes it hit; a FAIL only when it hit every one (nothing
would be left to learn from), with advice for that fault. For agent.harness it serves
the policy (greedy) on the localhost endpoint as training does, runs one harness conversation on the
first training row and reports its requests, turns, reward, prefix mismatches and token mask; a
harness that raises, times out or makes no request is a FAIL. Nothing is trained.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from contextlib import contextmanager

from ..agents.completion import GenerateBackend
from ..agents.episodes import AgentLimits, EpisodeRunner, EpisodeStart
from ..agents.harness import harness_row, quiet_client_logs, rules_reward, run_harness_samples
from ..agents.loader import EnvironmentFactory, load_harness_function
from ..agents.render import observation_vision
from ..agents.server import ChatServer
from ..data import build_prompt_dataset
from ..data.images import build_vision_dataset
from ..rollout import EngineConfig, RolloutEngine, SamplingParams, generate
from .checks import Context, check, short
from .report import FAIL, OK, WARN, CheckResult

NAME = "agent episode"
PROBE_EPISODES = 4  # one per training row (the first rows), run together as training runs them


@check(NAME, needs=("tokenizer", "policy", "train_rows"))
def check_agent(ctx: Context) -> CheckResult:
    cfg, tok = ctx.cfg, ctx.tokenizer
    if cfg.agent.harness == "verifiers":  # its episodes run inside the environment's own loop
        return CheckResult(NAME, WARN, f"agent.harness=verifiers ({cfg.agent.verifiers.env}): not probed before "
                                       "training; the first step runs its episodes, and an error there names the "
                                       "environment and the row",
                           fix="try the environment by hand first (docs/agents.md, verifiers)")
    if cfg.agent.harness:
        return check_harness(ctx)
    if not cfg.agent.env:
        return CheckResult(NAME, OK, "off: single-turn RL (agent.env and agent.harness are not set)")
    factory = EnvironmentFactory.from_spec(cfg.agent.env, dict(cfg.agent.kwargs))
    context = (getattr(getattr(ctx.policy, "config", None), "max_position_embeddings", None)
               or cfg.agent.max_episode_tokens)
    # on_env_error=end whatever the config: the probe counts the faulty episodes, then judges them by the config
    limits = dataclasses.replace(AgentLimits.from_config(cfg, context), on_env_error="end", workers=PROBE_EPISODES)
    d = cfg.data
    vision = observation_vision(ctx.policy, min_pixels=d.min_pixels, max_pixels=d.max_pixels)
    if vision is not None:  # a vision-language policy: its rows' images as training makes them (one processor call)
        items = build_vision_dataset(ctx.train_rows[:PROBE_EPISODES], tok, vision.processor,
                                     merge_size=vision.merge_size, max_prompt_length=d.max_prompt_length,
                                     overlong=d.overlong_prompts, apply_chat_template=d.apply_chat_template,
                                     image_key=d.image_key).items
    else:
        items = build_prompt_dataset(ctx.train_rows[:PROBE_EPISODES], tok, max_prompt_length=d.max_prompt_length,
                                     overlong=d.overlong_prompts, apply_chat_template=d.apply_chat_template).items
    starts = [EpisodeStart(items[i % len(items)], seed=cfg.trainer.seed + i,
                           label=f"{items[i % len(items)].row.source}, sample {i // len(items)}")
              for i in range(PROBE_EPISODES)]
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos or [0])[0]
    decoder = _decoder(ctx, limits.max_episode_tokens + params.max_new_tokens)
    decode = decoder.generate if isinstance(decoder, RolloutEngine) else functools.partial(generate, decoder)
    runner = EpisodeRunner(factory, tok, limits, vision=vision)
    with _episode_faults() as faults:
        if vision is not None and isinstance(decoder, RolloutEngine):  # images need the engine's session
            with decoder.session(params, slot_len=limits.max_episode_tokens + params.max_new_tokens,
                                 eos_token_ids=eos, num_slots=1) as session:
                episodes = runner.run_session(session, starts)
        else:
            episodes = runner.run_generate(lambda prompts: decode(prompts, params, eos_token_ids=eos,
                                                                  pad_token_id=pad), starts)
    hit = [e for e in episodes if e.finish_reason in ("env_error", "env_timeout")]
    if hit:
        return _faults_result(factory.name, hit, faults, cfg)
    episode, item = episodes[0], items[0]
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


@contextmanager
def _episode_faults():
    """The episode runner's fault lines ('... -> the episode ends') while the probe runs: kept for the check's
    message instead of printed in the middle of the report."""
    faults: list = []

    def keep(record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and "-> the episode ends" in record.getMessage():
            faults.append(record.getMessage().split(" -> the episode ends")[0])
            return False
        return True

    logger = logging.getLogger("phaserl")
    logger.addFilter(keep)
    try:
        yield faults
    finally:
        logger.removeFilter(keep)


def _faults_result(env: str, hit: list, faults: list, cfg) -> CheckResult:
    """Faulty probe episodes, judged by agent.on_env_error: `end` trains on without them (WARN) unless every
    episode had one; `stop` would stop the run at the first (FAIL). The advice fits the config and the fault."""
    faults = [f.removeprefix(f"environment {env} ") for f in faults]  # "(row ...): what went wrong"
    first = faults[0] if faults else f"the episode ended by {hit[0].finish_reason}"
    timeouts = sum(e.finish_reason == "env_timeout" for e in hit)
    message = (f"environment {env}: {len(hit)} of {PROBE_EPISODES} probe episodes hit a fault "
               f"({len(hit) - timeouts} error(s), {timeouts} timeout(s)); the first: {first}")
    details = tuple(faults[1:])
    some = len(hit) < PROBE_EPISODES
    if some and cfg.agent.on_env_error == "end":
        return CheckResult(NAME, WARN, message, details=details,
                           fix="agent.on_env_error=end: training ends such episodes (their turns so far kept) and "
                               "counts them in agent/ended/env_error and agent/ended/env_timeout; fix the environment "
                               "if they should not happen")
    if some:  # stop
        return CheckResult(NAME, FAIL, message, details=details,
                           fix="agent.on_env_error=stop: the run would stop at the first such episode; fix the "
                               "environment, or set agent.on_env_error=end to end such episodes and train on the rest")
    if timeouts == len(hit):
        fix = (f"every probe episode timed out: raise agent.step_timeout_s (now {cfg.agent.step_timeout_s:g} s) or "
               "make the environment answer sooner")
    else:
        fix = ("every probe episode hit it, so training would have nothing to learn from: fix the environment "
               "(run its reset and step by hand on the first training row: docs/agents.md)")
    return CheckResult(NAME, FAIL, message, fix=fix, details=details)


def _decoder(ctx: Context, longest: int):
    """What the probe decodes with, as training does: the rollout engine where it runs the policy (Qwen3.5 decodes
    only there) unless rollout.engine=hf, with one slot, no graphs, no compile (a probe decodes a few tokens);
    else the policy itself (rollout.generate's plain KV-cache path)."""
    if ctx.cfg.rollout.engine != "hf" and RolloutEngine.supports(ctx.policy):
        return RolloutEngine(ctx.policy, EngineConfig(max_slots=1, max_seq_tokens=longest, cuda_graphs=False,
                                                      compile=False))
    return ctx.policy


def check_harness(ctx: Context) -> CheckResult:
    """One conversation of agent.harness on the first training row, served greedily by the policy."""
    cfg, tok, a = ctx.cfg, ctx.tokenizer, ctx.cfg.agent
    harness = load_harness_function(a.harness)
    quiet_client_logs()
    reward = rules_reward([(f.name, f.weight, f.kwargs) for f in cfg.reward.functions], timeout_s=cfg.reward.timeout_s)
    row = build_prompt_dataset(ctx.train_rows[:1], tok, max_prompt_length=cfg.data.max_prompt_length,
                               overlong=cfg.data.overlong_prompts,
                               apply_chat_template=cfg.data.apply_chat_template).items[0].row
    context = getattr(getattr(ctx.policy, "config", None), "max_position_embeddings", None) or a.max_episode_tokens
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos or [0])[0]
    backend = GenerateBackend(_decoder(ctx, a.max_episode_tokens + cfg.rollout.max_new_tokens), eos_token_ids=eos,
                              pad_token_id=pad, max_batch=1)
    try:
        with ChatServer(backend, tok, parser=a.tool_parser, default_max_tokens=cfg.rollout.max_new_tokens,
                        max_context=min(a.max_episode_tokens, context), sampling=(0.0, 1.0, 0)) as server:
            pieces = run_harness_samples(harness, [harness_row(row)], server, max_workers=1,
                                         timeout_s=a.harness_timeout_s, reward=reward, episode_rows=[row])[0]
    except (RuntimeError, ValueError) as exc:
        return CheckResult(NAME, FAIL, f"harness {a.harness} on {row.source}: {exc}",
                           fix="run the harness by hand against phaserl's endpoint (docs/agents.md, the endpoint)")
    finally:
        backend.close()
    where = f"harness {a.harness} on {row.source}"
    if not pieces:
        return CheckResult(NAME, FAIL, f"{where}: the conversation made no request",
                           fix="the harness must call client.chat.completions.create with the base_url it is given")
    episode = pieces[-1]
    layout = " | ".join(f"{s.kind} {len(s.token_ids)}" + (" (masked)" if s.kind == "observation" else "")
                        for s in episode.segments)
    message = (f"{where}: {episode.metrics.get('requests', 0.0):g} request(s), {episode.num_turns} model turn(s) "
               f"recorded, ended by {episode.finish_reason}, reward {episode.reward:g}")
    details = (f"tokens: {layout}; the loss sees {sum(episode.loss_mask())} sampled of "
               f"{len(episode.response_ids())} response tokens",)
    if episode.finish_reason == "env_error":
        return CheckResult(NAME, FAIL, message, details=details, fix="the harness raised or timed out (logged above)")
    if len(pieces) > 1:
        return CheckResult(NAME, WARN, message + f"; {len(pieces) - 1} prefix mismatch(es)", details=details,
                           fix="a later request did not continue the earlier completion token for token (the "
                               "harness edits the history?); training keeps only the last piece")
    return CheckResult(NAME, OK, message, details=details)

