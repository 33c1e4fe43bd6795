"""Phases 1-3 as a stream: where a step's scored batch comes from, synchronous or asynchronous.

`rollout.max_staleness` (k) is the one knob (docs/async.md):

    k = 0   SyncStream: the step draws its prompts, samples every response and scores them (today's
            lock-step step, unchanged: the same calls in the same order, so the same samples).
    k >= 1  AsyncStream: responses are produced by a rollout that outlives the step. Up to (k + 1) steps'
            worth of groups (a prompt and its n responses) are in flight; a rollout phase decodes until
            the step's groups (the oldest in flight) are complete, then hands them to training. The
            responses still decoding are not thrown away: the next rollout phase continues them under the
            updated weights. rollout.partial_kv says how: `keep` (an engine kept awake through training)
            pauses them in one DecodeSession that outlives the phases (DecodeSession.pause: slots and KV kept,
            no prefill next phase); `prefill` cuts them (DecodeSession.suspend) and re-prefills their KV from
            the ids so far. A kept session that was lost in between (a validation generate(), a reloaded
            model) falls back to the re-prefill for its samples. Every sampled token keeps the policy version
            (optimizer steps before it) that sampled
            it and its behaviour log-prob; a group enters a batch only while its oldest token is at most k
            versions behind the weights being trained. A sample that would break the bound is started over
            (rollout.on_stale: restart) or its group dropped (drop), counted either way.

            Lookahead: a phase starts the responses of the groups due within a = max(1, k - 1) steps only (the
            step's batch and the next a batches). Starting all k + 1 batches at once trained on staler
            tokens than the work needed: on the tiny arithmetic world at k = 2, 1.8 versions behind on average
            and 0.04 of held-out score lost, against 0.85 versions and 0.003 lost with a = 1.

            Pace: every rollout phase decodes at least ceil(L / (a + 1)) steps, L the longest response of the last
            batch, even when the step's groups are already complete. A response started in a phase then gets
            a + 1 phases of that pace before its group is due, so a tail of L tokens is spread over a + 1 phases
            and a phase lasts about L / (a + 1) steps, its first steps decoding the next batch's bulk beside the
            tails. Without it, whenever the groups in flight completed together (all of them started at once,
            and the slots hold them all), the next phases found their batches ready and decoded nothing, the
            groups added meanwhile started together again, and the stream fell back into lock-step cohorts
            (measured: no faster than the synchronous step).

One GPU runs rollout and training in turns (the HybridActor switch): what the asynchronous stream gains
there is that no rollout phase waits for the slowest response of its batch (the long tail keeps decoding,
in full slots, into the next phase) and the versions it records let the update correct for staleness
(algorithm.rollout_correction: `auto` is `tis` with k >= 1). Sampling noise is keyed by the sample
and its position under one seed for the run, so a continued response draws the noise an uncut one would.
Not here: the decode loop's slots and KV (rollout/session.py), the correction math (algo/mismatch.py).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from ..batch import ScoredBatch, right_padded
from ..config.validate import async_lookahead
from ..data.prompts import decode_responses
from ..errors import ConfigError
from ..parallel import rank_and_world
from ..rollout import GenerationResult
from .rollout_phase import build_rollout_batch, group_offset

log = logging.getLogger("phaserl")
STALE_ACTIONS = ("restart", "drop")
PARTIAL_KV = ("keep", "prefill")  # rollout.partial_kv once resolved (config/auto.py partial_kv_rule)
KEY_RANKS = 1 << 16  # noise keys leave room for this many ranks


class SyncStream:
    """rollout.max_staleness = 0: the step's prompts, rolled out and scored now (with DAPO's rounds when on)."""

    max_staleness = 0

    def next_batch(self, trainer, clock) -> tuple[ScoredBatch, dict]:
        run = trainer.run
        with clock("prompts"):
            items = run.train_prompts.next_items()
        return run.sample(lambda chunk: trainer._rollout_and_score(chunk, clock), items, run.train_prompts.next_items)

    def after_update(self, trainer) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(eq=False)
class Sample:
    """One response of a group, as far as it has been sampled."""

    key: int                                       # its sampling-noise key (unique in the run's stream)
    ids: list = field(default_factory=list)        # sampled ids so far
    logprobs: list = field(default_factory=list)   # the behaviour log-prob of each
    versions: list = field(default_factory=list)   # the policy version that sampled each
    finish: Optional[str] = None                   # "stop" | "length" once complete
    cuts: int = 0                                  # rollout phases that ended before it did
    in_session: bool = False                       # its sequence holds a slot of the stream's kept session

    def start_over(self, key: int) -> None:
        self.key, self.ids, self.logprobs, self.versions, self.finish, self.cuts = key, [], [], [], None, 0


@dataclass(eq=False)
class Group:
    """A prompt and its n samples."""

    order: int                  # this rank's stream position: batches take groups in this order
    index: int                  # the prompt's index in the training dataset (saved in checkpoints)
    item: object                # its PromptItem
    samples: list
    pending: object = None      # its scores in the making (RewardSources.submit), from when it completed

    @property
    def complete(self) -> bool:
        return all(s.finish is not None for s in self.samples)

    def oldest(self) -> Optional[int]:
        return min((s.versions[0] for s in self.samples if s.versions), default=None)


class AsyncStream:
    """rollout.max_staleness = k >= 1 (the module docstring). State: the groups in flight, saved in checkpoints."""

    PHASE_STATS = ("async/restarted_samples", "async/dropped_groups", "async/cut_samples", "async/phase_steps",
                   "async/kept_sequences", "async/kept_tokens", "async/reprefilled_sequences",
                   "async/reprefill_tokens", "async/lost_sessions")

    def __init__(self, *, max_staleness: int, on_stale: str, n: int, prompts_per_rank: int, slots: int,
                 noise_seed: int, dataset, partial_kv: str = "prefill"):
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 1:
            raise ConfigError(f"rollout.max_staleness={max_staleness!r}: AsyncStream needs an integer >= 1 "
                              "(0 is the synchronous step)")
        if on_stale not in STALE_ACTIONS:
            raise ConfigError(f"rollout.on_stale={on_stale!r}: choose one of {', '.join(STALE_ACTIONS)}")
        if partial_kv not in PARTIAL_KV:
            raise ConfigError(f"rollout.partial_kv={partial_kv!r} reached the stream unresolved: choose one of "
                              f"{', '.join(PARTIAL_KV)} (auto is resolved by the builder)")
        self.partial_kv = partial_kv
        self.session = None         # partial_kv=keep: the DecodeSession kept across phases (None: none open)
        self.max_staleness, self.on_stale, self.n = max_staleness, on_stale, n
        self.prompts_per_rank, self.slots, self.noise_seed = prompts_per_rank, slots, noise_seed
        self.dataset = dataset      # the training PromptDataset: a checkpoint names its prompts by index
        self.longest_prompt = max((len(item.prompt_ids) for item in dataset.items), default=0) if dataset else 0
        self.capacity = prompts_per_rank * (max_staleness + 1)  # groups in flight: more would only go stale
        self.groups: list[Group] = []
        self.next_order = 0
        self.next_key = 0
        self.longest_response = 0   # tokens: the longest response of the last batch (sets the pace)
        self.lookahead = async_lookahead(max_staleness)  # a response starts at most this many steps before its batch
        self._saved_by_rank: Optional[list] = None

    # ----- the step's phases 1-3 ------------------------------------------------------------------
    def next_batch(self, trainer, clock) -> tuple[ScoredBatch, dict]:
        run, version = trainer.run, trainer.step_num
        stats = dict.fromkeys(self.PHASE_STATS, 0.0)  # every step logs each (a step whose batch was ready: 0)
        with clock("prompts"):
            self._enforce_bound(version, stats, trainer)
            while len(self.groups) < self.capacity:
                self._add_groups(run.train_prompts.next_indexed(), trainer)
        with clock("rollout"):
            if not self._batch_ready() or (self.pace_steps() and self._unfinished()):
                with trainer.actor.rollout_mode():
                    self._decode(trainer, version, stats)
        with clock("score"):
            batch_groups, self.groups = self.groups[:self.prompts_per_rank], self.groups[self.prompts_per_rank:]
            self.longest_response = self._longest(batch_groups)
            scored = self._scored(trainer, batch_groups)
        stats.update(self._version_stats(scored.batch, version))
        stats["async/in_flight_groups"] = float(len(self.groups))
        return scored, stats

    def _batch_ready(self) -> bool:
        """The batch is the oldest prompts_per_rank groups in flight (stream order), once they are all complete: not
        whichever complete first. Those would favour groups whose responses are short or whose episodes end early
        (on the tiny agent world, first-complete batches at k = 1 ended 0.06 below the synchronous score; in order,
        within 0.02), and the slow groups would go stale and start over. In order, a group added at a step is
        trained within k steps, so no sample ever passes the bound; the newer groups keep the slots full while
        the oldest ones' tails finish."""
        return all(g.complete for g in self.groups[:self.prompts_per_rank])

    def pace_steps(self) -> int:
        """Decode steps every rollout phase runs at least (the module docstring's pace): the last batch's longest
        response over lookahead + 1 phases; 0 before the first batch."""
        return -(-self.longest_response // (self.lookahead + 1))

    def _longest(self, groups: list) -> int:
        """Tokens of the longest response in these groups (the pace's L)."""
        return max((len(s.ids) for g in groups for s in g.samples), default=0)

    def _startable(self) -> list:
        """The groups whose samples a phase may decode: those due within `lookahead` steps (in stream order)."""
        return self.groups[:(self.lookahead + 1) * self.prompts_per_rank]

    def _unfinished(self) -> bool:
        return any(s.finish is None for g in self._startable() for s in g.samples)

    def after_update(self, trainer) -> None:
        pass

    def close(self) -> None:
        self._forget_session()

    # ----- the kept session (partial_kv=keep) ------------------------------------------------------
    def _open(self, trainer, params, *, slot_len: int, eos: list, stats: dict):
        """This phase's session and the context to run it in: the kept one (opened at the first phase; a lost one
        is forgotten first, its samples re-prefilled like cut ones) or, with prefill, a fresh one."""
        run = trainer.run
        keep = self.partial_kv == "keep"
        if keep and self.session is not None and self.session.lost is not None:
            log.info(f"async rollout: the kept decode session was lost ({self.session.lost}); its samples are "
                     "re-prefilled from their ids")
            stats["async/lost_sessions"] += 1
            self._forget_session()
        if self.session is None:
            run.sampling_generator.manual_seed(self.noise_seed)  # one seed for the stream: noise keyed by sample
            session = trainer.actor.decode_session(params, slot_len=slot_len, eos_token_ids=eos,
                                                   num_slots=self.slots,  # one layout every phase: graphs kept
                                                   generator=run.sampling_generator, keep=keep)
            if session is None:
                raise ConfigError("rollout.max_staleness >= 1 continues responses across updates in the built-in "
                                  "engine; this model runs on the transformers fallback (rollout.engine=hf or a "
                                  "non-native family): set rollout.max_staleness=0")
            if not keep:
                return session
            self.session = session
        return self.session.phase()

    def _forget_session(self) -> None:
        """Close the kept session (lost or not): every sample it held continues by a re-prefill of its ids."""
        if self.session is None:
            return
        for group in self.groups:
            for sample in group.samples:
                sample.in_session = False
        if self.session.lost is None:
            self.session.close()
        self.session = None

    def _end_kept_for_checkpoint(self) -> None:
        """A checkpoint ends the kept session. The checkpoint holds the responses in flight as ids (their KV cannot be
        saved), so a run resumed from it re-prefills them; the run that goes on re-prefills them too, at its next
        phase, and the two stay one run (docs/checkpoints.md's exact resume). One re-prefill per checkpoint."""
        self._forget_session()

    def _free_kept(self, key) -> None:
        """A sample given up (restarted, its group dropped) gives its kept slot back."""
        if self.session is not None and self.session.lost is None and key in self.session.live:
            self.session.drop(key)

    def _add_groups(self, indexed: list, trainer) -> None:
        rank, world = rank_and_world()
        for index, item in indexed:
            samples = [Sample(self._new_key(rank, world)) for _ in range(self.n)]
            self.groups.append(Group(self.next_order, index, item, samples))
            self.next_order += 1

    def _new_key(self, rank: int, world: int) -> int:
        key = self.next_key * KEY_RANKS + rank  # unique across ranks, and after a resume on another number of ranks
        self.next_key += 1
        return key

    def _enforce_bound(self, version: int, stats: dict, trainer=None) -> None:
        """Every sample whose oldest token would be more than k versions behind when trained (at this step's
        version or later) starts over, or its group is dropped."""
        floor = version - self.max_staleness
        rank, world = rank_and_world()
        kept = []
        for group in self.groups:
            stale = [s for s in group.samples if s.versions and s.versions[0] < floor]
            if stale and self.on_stale == "drop":
                for sample in group.samples:
                    self._free_kept(sample.key)
                stats["async/dropped_groups"] += 1
                continue
            for sample in stale:
                self._free_kept(sample.key)
                sample.in_session = False
                sample.start_over(self._new_key(rank, world))
                stats["async/restarted_samples"] += 1
            kept.append(group)
        self.groups = kept

    def _decode(self, trainer, version: int, stats: dict) -> None:
        """Decode the unfinished samples (in group order, slots refilled as they free) until the batch's groups (the
        oldest prompts_per_rank) are complete and the pace's steps are done; cut the rest (their ids so far are
        kept for the next phase)."""
        run = trainer.run
        params = run.sampling
        unfinished = [s for g in self._startable() for s in g.samples if s.finish is None]
        owner = {id(s): g for g in self.groups for s in g.samples}
        by_key = {s.key: s for g in self.groups for s in g.samples if s.finish is None}
        # the dataset's longest prompt, not this phase's: one slot layout for the run, so decode graphs are kept
        longest = self.longest_prompt or max(len(owner[id(s)].item.prompt_ids) for s in unfinished)
        slot_len = longest + params.max_new_tokens
        eos = [] if run.ignore_eos else run.eos_token_ids
        due = {id(g) for g in self.groups[:self.prompts_per_rank] if not g.complete}  # the batch's, incomplete
        admit_at = max(1, self.slots // 16)  # prefill several sequences per pass
        pace, steps = self.pace_steps(), 0
        with self._open(trainer, params, slot_len=slot_len, eos=eos, stats=stats) as s:
            pending = deque(s for s in unfinished if not s.in_session)  # kept ones continue in their slots
            while due or (steps < pace and (pending or s.decoding)):
                if pending and s.free_slots and (s.free_slots >= min(admit_at, len(pending)) or not s.decoding):
                    while pending and s.free_slots:
                        self._start(s, pending.popleft(), owner, params, stats)
                assert not s.idle, "async rollout stalled with groups incomplete"
                steps += 1
                for turn in s.step():
                    sample = by_key[turn.key]
                    self._append(sample, turn, version)
                    s.release(turn.key)
                    sample.in_session = False
                    if owner[id(sample)].complete:
                        due.discard(id(owner[id(sample)]))
                        self._submit_scores(run, owner[id(sample)])  # scored by the reward workers meanwhile
            ended, left = s.pause() if self.partial_kv == "keep" else s.suspend()
        for turn in ended + left:
            self._append(by_key[turn.key], turn, version)
            if owner[id(by_key[turn.key])].complete:
                self._submit_scores(run, owner[id(by_key[turn.key])])
        for turn in ended:
            if self.session is not None:  # kept: an ended turn parks its sequence; the sample is complete
                s.release(turn.key)
            by_key[turn.key].in_session = False
        for turn in left:
            sample = by_key[turn.key]
            sample.cuts += 1
            if self.session is not None:  # paused in its slot: the next phase continues it with no prefill
                stats["async/kept_sequences"] += 1
                stats["async/kept_tokens"] += s.held(turn.key)
            else:
                sample.in_session = False
        stats["async/cut_samples"] = float(len(left))
        stats["async/phase_steps"] = float(steps)

    def _start(self, s, sample: Sample, owner: dict, params, stats: dict) -> None:
        """Start a sample in a free slot: from its prompt, or (a response cut by an earlier phase, or held by a kept
        session that was lost) from its prompt and the ids sampled so far, re-prefilled."""
        prompt = list(owner[id(sample)].item.prompt_ids)
        s.start(sample.key, prompt + sample.ids, params.max_new_tokens - len(sample.ids), noise_key=sample.key)
        sample.in_session = True
        if sample.ids:
            stats["async/reprefilled_sequences"] += 1
            stats["async/reprefill_tokens"] += len(prompt) + len(sample.ids)

    def _append(self, sample: Sample, turn, version: int) -> None:
        sample.ids += turn.token_ids
        sample.logprobs += turn.logprobs
        sample.versions += [version] * len(turn.token_ids)
        if not turn.partial:
            sample.finish = "stop" if turn.stopped else "length"

    @staticmethod
    def _submit_scores(run, group: Group) -> None:
        """Start scoring a group that just completed (rule functions in the reward workers: reward.workers), so that
        scoring overlaps decoding; the batch collects the results (and runs the reward model once over it)."""
        if group.pending is None and hasattr(run.reward, "submit"):
            texts = decode_responses(run.tokenizer, [s.ids for s in group.samples])  # as build_rollout_batch decodes
            row = group.item.row
            group.pending = run.reward.submit([row.prompt] * len(texts), texts, [row] * len(texts))

    def _scored(self, trainer, groups: list) -> ScoredBatch:
        run = trainer.run
        samples = [s for g in groups for s in g.samples]
        result = GenerationResult([s.ids for s in samples], [s.logprobs for s in samples],
                                  [s.finish for s in samples])
        batch = build_rollout_batch([g.item for g in groups], self.n, result, tokenizer=run.tokenizer,
                                    pad_token_id=run.pad_token_id, group_offset=group_offset(trainer),
                                    device=trainer.actor.device)
        R = batch.response_mask.shape[1]
        versions = right_padded([[v + 1 for v in s.versions] for s in samples], R, torch.long) - 1  # [B, R], -1 pad
        batch = replace(batch, token_versions=versions.to(batch.input_ids.device))
        if not hasattr(run.reward, "collect"):  # a reward source of the Python API without submit/collect
            return ScoredBatch(batch, run.shape_scores(run.reward.score(batch), batch))
        for group in groups:
            self._submit_scores(run, group)  # groups restored from a checkpoint have none pending yet
        scores = run.reward.collect([g.pending for g in groups], device=trainer.actor.device)
        return ScoredBatch(batch, run.shape_scores(scores, batch))

    def _version_stats(self, batch, version: int) -> dict:
        """Per sampled token: how many versions behind the trained weights, mean, max and each lag's share."""
        versions = batch.token_versions[batch.loss_mask.bool()]  # [tokens]
        behind = (version - versions).clamp(min=0).cpu()
        stats = {"async/staleness_mean": float(behind.float().mean()) if len(behind) else 0.0,
                 "async/staleness_max": float(behind.max()) if len(behind) else 0.0}
        counts = torch.bincount(behind) if len(behind) else torch.zeros(1, dtype=torch.long)
        counts = torch.nn.functional.pad(counts, (0, max(0, self.max_staleness + 1 - len(counts))))
        for lag, count in enumerate(counts.tolist()):
            stats[f"async/token_share/behind_{lag}"] = count / max(len(behind), 1)
        return stats

    # ----- checkpoints ------------------------------------------------------------------------------
    def gather_for_save(self) -> None:
        """Collective (every rank, before a checkpoint is written): rank 0 gets every rank's groups."""
        self._end_kept_for_checkpoint()
        mine = self._own_state()
        rank, world = rank_and_world()
        if world == 1:
            self._saved_by_rank = [mine]
            return
        import torch.distributed as dist

        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        self._saved_by_rank = everyone

    def _own_state(self) -> dict:
        return {"next_order": self.next_order, "next_key": self.next_key, "longest_response": self.longest_response,
                "groups": [{"order": g.order, "index": g.index,
                            "samples": [{"key": s.key, "ids": s.ids, "logprobs": s.logprobs, "versions": s.versions,
                                         "finish": s.finish, "cuts": s.cuts} for s in g.samples]}
                           for g in self.groups]}

    def state_dict(self) -> dict:
        ranks = self._saved_by_rank if self._saved_by_rank is not None else [self._own_state()]
        return {"max_staleness": self.max_staleness, "n": self.n, "ranks": ranks}

    def load_state_dict(self, state: dict) -> None:
        """Each rank takes back its own groups (the same number of ranks), or the saved ranks' groups dealt out
        in turn (another number: each group whole, so nothing is lost or trained twice)."""
        if int(state["n"]) != self.n:
            raise ValueError(f"the checkpoint's stream has rollout.n={state['n']}, this run {self.n}")
        self._forget_session()  # the samples it held are replaced: theirs continue by re-prefill from the saved ids
        rank, world = rank_and_world()
        saved = state["ranks"]
        if len(saved) == world:
            mine = saved[rank]["groups"]
        else:
            everything = sorted((g for part in saved for g in part["groups"]), key=lambda g: (g["order"]))
            mine = everything[rank::world]
        items = self.dataset.items
        self.groups = [Group(g["order"], int(g["index"]), items[int(g["index"])],
                             [Sample(int(s["key"]), list(s["ids"]), list(s["logprobs"]), list(s["versions"]),
                                     s["finish"], int(s["cuts"])) for s in g["samples"]]) for g in mine]
        self.next_order = max(int(part["next_order"]) for part in saved)
        self.next_key = max(int(part["next_key"]) for part in saved)
        self.longest_response = max(int(part.get("longest_response", 0)) for part in saved)
