"""The asynchronous stream for multi-turn episodes (agent.env with rollout.max_staleness >= 1).

The same contract as stream.AsyncStream (read its docstring first): up to (k + 1) steps' worth of groups in
flight, a rollout phase runs until the step's groups (the oldest in flight) are complete, what is unfinished
carries on. Here a group is a prompt's n *episodes* (agents.episodes: EpisodeRunner.begin_runs / run_phase), and an
episode outlives a phase whole: a turn cut mid-decode continues from its ids, an episode waiting for its
environment keeps waiting (its call runs on while the trainer trains), and the answer is used in the next phase.
With rollout.partial_kv=keep both keep their slot and KV in the stream's kept session (the cut turn decodes on, the
answer is appended with extend); with prefill, their slots are freed and their ids prefilled again next phase.
So a tool's latency never holds the GPU: other episodes decode meanwhile, in this
phase or the next. Every sampled id records its policy version (Segment.versions).

The lookahead and the pace are the token stream's: a phase begins the episodes of the groups due within
max(1, k - 1) steps, and decodes at least ceil(L / (lookahead + 1)) steps, L the most model tokens an episode of
the last batch sampled. Without the pace, episodes of one length begun together end together: the next phase
finds its batch complete and decodes nothing, the groups added meanwhile begin together again, and the stream
falls into lock-step cohorts whose tools all wait at once.

Staleness: an episode whose oldest sampled id would be more than k versions behind is abandoned and begun again
from its prompt (restart: a new environment, a new noise key), or its group dropped (drop). Checkpoints save
which prompts were in flight; a resume begins their episodes again (environments cannot be saved; docs/async.md).
Not here: running an episode (agents/episodes.py), the slots (rollout/session.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..agents.episodes import EpisodeRunner, EpisodeStart
from ..batch import ScoredBatch
from ..parallel import rank_and_world
from .episode_batch import episodes_batch
from .rollout_phase import group_offset
from .stream import AsyncStream


@dataclass(eq=False)
class EpisodeGroup:
    order: int
    index: int                 # the prompt's dataset index
    item: object
    runs: list                 # n of agents.episodes._Run

    @property
    def complete(self) -> bool:
        return all(r.finish_reason is not None for r in self.runs)

    @property
    def samples(self) -> list:  # what AsyncStream's counting reads
        return self.runs


def _sampled(run) -> int:
    """Model tokens an episode sampled so far, a turn cut at a phase's end included."""
    return sum(len(seg.token_ids) for seg in run.segments if seg.kind == "model") + len(run.cut[0])


def _oldest(run):
    versions = [v for seg in run.segments if seg.versions for v in seg.versions] + list(run.cut[2])
    return min(versions, default=None)


class AgentStream(AsyncStream):
    """rollout.max_staleness >= 1 for agent.env runs."""

    PHASE_STATS = (*AsyncStream.PHASE_STATS, "async/parked_episodes")
    LEFT_STATS = {"async/cut_samples": "cut", "async/parked_episodes": "released", "async/kept_sequences": "kept",
                  "async/kept_tokens": "kept_tokens", "async/reprefilled_sequences": "reprefilled",
                  "async/reprefill_tokens": "reprefill_tokens"}  # from EpisodeRunner.run_phase's counts

    def __init__(self, *, agent, **kwargs):
        super().__init__(**kwargs)
        self.agent = agent            # AgentSettings: factory, limits, workers
        self.runner = None            # made at the first phase (needs the run's tokenizer and sampling cap)
        self._resumed: list = []      # prompt indices in flight at the checkpoint: begun again first

    def _longest(self, groups: list) -> int:
        """The pace's L for episodes: the most model tokens one episode of these groups sampled (all its turns). An
        episode needs at least that many decode steps, plus its tools' waits, during which the others decode."""
        return max((_sampled(r) for g in groups for r in g.runs), default=0)

    def _unfinished(self) -> bool:
        return any(r.finish_reason is None for g in self._startable() for r in g.runs)

    def _runner(self, trainer) -> EpisodeRunner:
        if self.runner is None:
            run = trainer.run
            limits = dataclasses.replace(self.agent.limits, max_turn_tokens=run.sampling.max_new_tokens)
            self.runner = EpisodeRunner(self.agent.factory, run.tokenizer, limits, workers=self.agent.workers)
        return self.runner

    def _add_groups(self, indexed: list, trainer) -> None:
        if self._resumed:
            items = self.dataset.items
            indexed, self._resumed = [(i, items[i]) for i in self._resumed] + list(indexed), []
        for index, item in indexed:
            runs = [self._begin(trainer, item, k) for k in range(self.n)]
            self.groups.append(EpisodeGroup(self.next_order, index, item, runs))
            self.next_order += 1

    def _begin(self, trainer, item, k: int):
        rank, world = rank_and_world()
        key = self._new_key(rank, world)
        start = EpisodeStart(item, seed=(trainer.run.seed * 1_000_003 + key) & (2**31 - 1),
                             label=f"{item.row.source}, sample {k}", noise_key=key)
        return self._runner(trainer).begin_runs([start], first_index=key)[0]

    def _enforce_bound(self, version: int, stats: dict, trainer=None) -> None:
        floor = version - self.max_staleness
        kept = []
        for group in self.groups:
            stale = [i for i, r in enumerate(group.runs) if (_oldest(r) is not None and _oldest(r) < floor)]
            if stale and self.on_stale == "drop":
                for r in group.runs:
                    self.runner.forget_slot(r, self.session)
                    self.runner.abandon(r)
                stats["async/dropped_groups"] += 1
                continue
            for i in stale:
                self.runner.forget_slot(group.runs[i], self.session)
                self.runner.abandon(group.runs[i])
                group.runs[i] = self._begin(trainer, group.item, i)
                stats["async/restarted_samples"] += 1
            kept.append(group)
        self.groups = kept

    def _decode(self, trainer, version: int, stats: dict) -> None:
        run = trainer.run
        runner = self._runner(trainer)
        eos = [] if run.ignore_eos else run.eos_token_ids
        # the token stream's lookahead (trainer/stream.py); the runs a kept session holds are among them (they were
        # last phase, and the window only moves forward)
        runs = [r for g in self._startable() for r in g.runs]
        pace = self.pace_steps()  # the token stream's pace, in decode steps, so batches do not run as cohorts
        with self._open(trainer, run.sampling, slot_len=runner.limits.max_episode_tokens, eos=eos, stats=stats) as s:
            begun = s.stats.steps  # a kept session counts every phase's steps
            left = runner.run_phase(s, runs, version=version, keep=self.session is not None,
                                    enough=lambda: self._batch_ready() and (
                                        s.stats.steps - begun >= pace or not self._unfinished()))
        stats["async/phase_steps"] = float(s.stats.steps - begun)
        for key, name in self.LEFT_STATS.items():
            stats[key] = float(left[name])

    def _scored(self, trainer, groups: list) -> ScoredBatch:
        run = trainer.run
        episodes = [self.runner.episode(r) for g in groups for r in g.runs]
        batch = episodes_batch(episodes, self.n, tokenizer=run.tokenizer, pad_token_id=run.pad_token_id,
                               group_offset=group_offset(trainer), device=trainer.actor.device)
        return ScoredBatch(batch, run.shape_scores(run.reward.score(batch), batch))

    # ----- checkpoints: which prompts were in flight (their episodes begin again on resume) ------------
    def _end_kept_for_checkpoint(self) -> None:
        """Nothing: a resume begins the episodes in flight again from their prompts (not exact in any case), so the
        run that goes on keeps its episodes' slots."""

    def _own_state(self) -> dict:
        return {"next_order": self.next_order, "next_key": self.next_key,
                "episode_groups": [{"order": g.order, "index": g.index} for g in self.groups]}

    def load_state_dict(self, state: dict) -> None:
        if int(state["n"]) != self.n:
            raise ValueError(f"the checkpoint's stream has rollout.n={state['n']}, this run {self.n}")
        self._forget_session()  # its episodes are replaced: the saved prompts begin again
        rank, world = rank_and_world()
        saved = state["ranks"]
        groups = saved[rank]["episode_groups"] if len(saved) == world else sorted(
            (g for part in saved for g in part["episode_groups"]), key=lambda g: g["order"])[rank::world]
        self._resumed = [int(g["index"]) for g in groups]
        self.groups = []
        self.next_order = max(int(part["next_order"]) for part in saved)
        self.next_key = max(int(part["next_key"]) for part in saved)
