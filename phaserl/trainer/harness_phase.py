"""Phase 2 of a harness run: an external agent harness drives the episodes through phaserl's
OpenAI-compatible endpoint, and the recorded completions become a `RolloutBatch`.

Chosen once when the run is built (`rollout_choice` in agent_phase.py, when `agent.harness` is set). Per
call, inside the actor's rollout mode: a `GenerateBackend` on the actor (batching the harness's
concurrent requests) and a `ChatServer` on 127.0.0.1 (context = the episode token budget, default
max_tokens = rollout.max_new_tokens) start; `run_harness_samples` runs the harness n times per prompt
row of this rank; server and backend stop (always, also when the harness or the decode fails).

Limits: the server refuses a conversation's request past agent.max_turns completions or past the
episode token budget (HTTP 400, which the openai client raises), caps each completion at
rollout.max_new_tokens, and the episode ends with that limit as its finish reason (agent/ended/*).

Sampling: the run's settings win. The server samples every request with this phase's temperature /
top_p / top_k (rollout.* for training, rollout.val_* for validation) from the run's seeded
`sampling_generator`; a request asking for another temperature or top_p is answered with the run's
and a one-time warning, because training computes the old log-probs at rollout.temperature. A
request's `seed` still fixes its own sample; `max_tokens` may differ per request (capped by the room
left in the episode budget). Which requests meet in one batched generate call depends on thread
timing, so a seeded harness run is not repeated bit for bit (agent.env runs with agent.overlap=false are).

Groups stay exact: each prompt contributes exactly n rows, in order. Per (row, sample):
- one recorded piece: that episode;
- several pieces (a prompt that did not continue the previous completion token for token; see
  recorder.py): the last piece is kept (it holds the final reply the reward judges), the earlier ones
  are dropped and counted in `agent/harness_dropped_pieces_mean`;
- no request at all (the harness raised or timed out first): an empty episode (the prompt's ids, no
  response, loss mask 0, reward 0, finish reason env_error), counted in `agent/harness_missing_mean`.
Rewards: the harness's return value, or for None the run's reward.functions on the last reply
(`EpisodeScores` places it on the last sampled token).

`agent.harness: verifiers` (`verifiers_choice`, `verifiers_rollout`): the same endpoint, limits and exact
groups, with a verifiers environment's own rollouts in place of a harness function
(agents/adapters/verifiers.py): its rewards are the episode's, and its tasks the prompt rows unless
agent.verifiers.prompts is `files` (each data row then read as one of its tasks); agent.verifiers.eval_kwargs
loads the environment that validation runs.
Not here: HTTP (agents/server.py), recording (agents/recorder.py), running the harness threads
(agents/harness.py).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from ..agents.completion import GenerateBackend
from ..agents.env import Episode, Segment
from ..agents.harness import harness_row, run_harness_samples
from ..agents.server import ChatServer
from ..batch import RolloutBatch
from ..data import build_prompt_dataset
from ..data.rows import parse_prompt_row
from ..parallel import rank_and_world
from .episode_batch import EpisodeScores, episodes_batch
from .prompt_stream import PromptStream
from .rollout_context import RolloutChoice
from .rollout_phase import group_offset

if TYPE_CHECKING:
    from .rollout_context import RolloutContext

log = logging.getLogger("phaserl")


@dataclass(frozen=True)
class HarnessSettings:
    harness: Callable                 # harness(base_url, row) -> reward | None
    reward: Callable                  # (prompt, response, ground_truth, **row) -> float: for a harness returning None
    workers: int                      # conversations at once, per rank
    timeout_s: float                  # one conversation, at most
    tool_parser: str                  # agents.tool_parsers name
    max_episode_tokens: int           # the server's context: prompt + every turn, at most
    max_turns: int                    # completions per conversation (agent.max_turns); then HTTP 400
    context_reason: str               # what max_episode_tokens stands for: "max_tokens" | "context" (the model's)


def harness_rollout(ctx: "RolloutContext", items: list, params, n: int) -> RolloutBatch:
    """Phase 2, harness: n harness conversations per prompt through a localhost endpoint (module docstring)."""
    h = ctx.run.harness
    with endpoint(ctx, items, params, n) as (server, backend):
        per_sample = run_harness_samples(h.harness, [harness_row(item.row) for item in items], server,
                                         samples_per_row=n, max_workers=h.workers, timeout_s=h.timeout_s,
                                         reward=h.reward, episode_rows=[item.row for item in items])
    return _batch(ctx, per_sample, items, n, backend)


@contextlib.contextmanager
def endpoint(ctx: "RolloutContext", items: list, params, n: int):
    """(ChatServer, GenerateBackend) on the actor for one rollout call, with the run's episode limits and this
    phase's sampling; both stop on the way out (also when the episodes or the decode fail)."""
    run, actor, h = ctx.run, ctx.actor, ctx.run.harness
    run.sampling_generator.manual_seed(ctx.seeds.harness_endpoint(ctx.rank * len(items) * n, n))
    eos = [] if run.ignore_eos else run.eos_token_ids
    backend = GenerateBackend(actor, eos_token_ids=eos, pad_token_id=run.pad_token_id,
                              max_batch=run.generate_batch_size * n, generator=run.sampling_generator)
    try:
        server = ChatServer(backend, run.tokenizer, parser=h.tool_parser, default_max_tokens=params.max_new_tokens,
                            max_context=h.max_episode_tokens, sampling=(params.temperature, params.top_p, params.top_k),
                            max_turns=h.max_turns, max_turn_tokens=params.max_new_tokens,
                            context_reason=h.context_reason)
        try:
            server.start()
            yield server, backend
        finally:
            server.close()
    finally:
        backend.close()


def _batch(ctx: "RolloutContext", per_sample: list, items: list, n: int, backend) -> RolloutBatch:
    run = ctx.run
    episodes = exact_groups(per_sample, [item for item in items for _ in range(n)])
    batch = episodes_batch(episodes, n, tokenizer=run.tokenizer, pad_token_id=run.pad_token_id,
                           group_offset=group_offset(ctx), device=ctx.actor.device)
    batch.rollout_metrics["agent/harness_generate_calls"] = float(backend.calls)
    return batch


def exact_groups(per_sample: list, items: list) -> list:
    """One Episode per (row, sample), in order: the last piece, or an empty env_error episode (module docstring).

    per_sample: [[Episode]] per (row, sample); items: the PromptItem of each (row, sample)."""
    assert len(per_sample) == len(items), (len(per_sample), len(items))
    out = []
    for pieces, item in zip(per_sample, items):
        if pieces:
            episode = pieces[-1]
        else:
            episode = Episode(row=item.row, segments=[Segment("prompt", list(item.prompt_ids))], turn_rewards=[0.0],
                              finish_reason="env_error", num_turns=0)
        episode.metrics.update({"harness_missing": float(not pieces),
                                "harness_dropped_pieces": float(max(0, len(pieces) - 1))})
        out.append(episode)
    missing = sum(not p for p in per_sample)
    if missing:
        log.warning("harness: %d of %d conversations made no request; each is an empty episode (reward 0, "
                    "nothing trained; agent/harness_missing_mean)", missing, len(per_sample))
    return out


# ----- agent.harness: verifiers -------------------------------------------------------------------
@dataclass(frozen=True)
class VerifiersSettings:
    tasks: dict                       # id(PromptRow) -> (VerifiersSource, task): what each prompt row runs
    workers: int                      # episodes at once, per rank (agent.harness_workers)
    timeout_s: float                  # one episode, at most (agent.harness_timeout_s)
    on_env_error: str                 # end | stop
    tool_parser: str
    max_episode_tokens: int
    max_turns: int
    context_reason: str


def verifiers_choice(cfg, model_context: int, *, tokenizer, train_prompts, val_prompts) -> RolloutChoice:
    """Phases 1-3 for agent.harness = verifiers: the environment's rollouts as phase 2, its rewards as phase 3,
    and its tasks as the prompt rows unless agent.verifiers.prompts = files (module docstring)."""
    from ..agents.adapters.verifiers import VerifiersSource, load_environment
    from ..agents.tool_parsers import get_tool_parser
    from ..errors import ConfigError

    a, v = cfg.agent, cfg.agent.verifiers
    try:
        get_tool_parser(a.tool_parser)
    except ValueError as exc:
        raise ConfigError(f"agent.tool_parser: {exc}") from None

    def source(kwargs: dict):
        env = load_environment(v.env, kwargs, max_turns=a.max_turns, timeout_s=a.harness_timeout_s)
        return VerifiersSource(v.env, env)

    train = source(v.kwargs)
    val = source(_laid_over(v.kwargs, v.eval_kwargs)) if v.eval_kwargs is not None else None
    if v.prompts == "env":
        rank, world = rank_and_world()
        if cfg.data.train_files != ["tiny"] or cfg.data.val_files != ["tiny"]:
            log.warning("agent.verifiers.prompts = env: the prompts are the environment's tasks; data.train_files "
                        "and data.val_files are not used (agent.verifiers.prompts = files reads them as its tasks)")
        train_prompts = PromptStream(_env_dataset(train, cfg, tokenizer), cfg.rollout.prompts_per_step,
                                     seed=cfg.trainer.seed, shuffle=cfg.data.shuffle, rank=rank, world_size=world)
        val_prompts = None
        if val is not None:
            items = _env_dataset(val, cfg, tokenizer).items[:cfg.data.val_max_prompts]
            val_prompts = items[rank::world]
    tasks = {id(item.row): (train, train.task_for(item.row)) for item in train_prompts.dataset.items}
    for item in val_prompts or []:
        tasks[id(item.row)] = (val or train, (val or train).task_for(item.row))
    settings = VerifiersSettings(tasks=tasks, workers=a.harness_workers, timeout_s=a.harness_timeout_s,
                                 on_env_error=a.on_env_error, tool_parser=a.tool_parser,
                                 max_episode_tokens=min(a.max_episode_tokens, model_context), max_turns=a.max_turns,
                                 context_reason="context" if model_context < a.max_episode_tokens else "max_tokens")
    return RolloutChoice(verifiers_rollout, EpisodeScores(), train_prompts, val_prompts, harness=settings)


def verifiers_rollout(ctx: "RolloutContext", items: list, params, n: int) -> RolloutBatch:
    """Phase 2, verifiers: n of the environment's own episodes per prompt row through the localhost endpoint."""
    from ..agents.adapters.verifiers import run_samples

    v = ctx.run.harness
    sources = {id(v.tasks[id(item.row)][0]) for item in items}
    assert len(sources) == 1, "one call's prompts come from one split (train or validation)"
    source = v.tasks[id(items[0].row)][0]
    with endpoint(ctx, items, params, n) as (server, backend):
        per_sample = run_samples(source, [v.tasks[id(item.row)][1] for item in items], [item.row for item in items],
                                 server, samples_per_row=n, max_workers=v.workers, on_env_error=v.on_env_error,
                                 timeout_s=v.timeout_s)
    return _batch(ctx, per_sample, items, n, backend)


def _env_dataset(source, cfg, tokenizer):
    """The environment's tasks as a tokenized prompt dataset (rows named by the environment and task index)."""
    rows = [parse_prompt_row(record, prompt_key="prompt", source=source.row_source(i), index=i)
            for i, record in enumerate(source.records())]
    return build_prompt_dataset(rows, tokenizer, max_prompt_length=cfg.data.max_prompt_length,
                                overlong=cfg.data.overlong_prompts, apply_chat_template=cfg.data.apply_chat_template)


def _laid_over(base: dict, top: Optional[dict]) -> dict:
    """`top` laid over `base`, mapping by mapping."""
    out = dict(base)
    for key, value in (top or {}).items():
        out[key] = _laid_over(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
