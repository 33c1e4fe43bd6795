"""A rollout rank's whole run (rollout.ranks >= 1): generate for the trainer ranks, never train.

`RolloutWorker.fit()` is the loop of one rollout rank:

1. Take the trainer's first weights (version v0: 0, or a resumed run's step), then draw prompts from there on:
   the prompt order is the run's (data.shuffle, trainer.seed) and each of the k rollout ranks draws its own share of
   every step's prompts (`rollout.prompts_per_step / k`), so every prompt is drawn exactly once across them.
2. Keep up to (max_staleness + 1) steps' worth of groups in flight and decode them in one DecodeSession, slots
   refilled as responses end; each group is sent to trainer rank 0 the moment its n responses are complete, each
   token with the policy version that sampled it and its behaviour log-prob (parallel/sample_channel.py).
3. Between two decode steps, poll for new weights. When a version has come: the responses being decoded are cut
   (DecodeSession.suspend; their tokens so far keep their versions), the weights are copied into the model in
   place and the engine's fused copies refilled (RolloutEngine.refresh_weights), and the cut responses continue
   from their ids, their KV prefilled again under the new weights, as the one-GPU stream continues them
   (trainer/stream.py). A response whose oldest token would be past the bound starts over.
4. Never draw prompts for a step more than max_staleness versions ahead of the last weights received: with nothing
   left to decode, wait for the next version (at most the collective timeout, then a one-line RankFailure).
5. Stop when the trainer closes the weight sync: what is still in flight is dropped, the sample channel closed.

Sampling noise is keyed by the sample and its position under one seed, as in the one-GPU stream.
Not here: the transfers (parallel/weight_sync.py, sample_channel.py), the trainer's side (remote_stream.py).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

import torch

from ..config.validate import sequence_tokens
from ..errors import ConfigError
from ..parallel import set_phase
from ..parallel.rank_split import RankGroups, rank_groups
from ..parallel.sample_channel import SampleGroup, SampleSender
from ..parallel.weight_sync import WeightReceiver
from ..rollout import EngineConfig, SamplingParams
from .prompt_stream import PromptStream
from .stream import KEY_RANKS, Group, Sample

log = logging.getLogger("phaserl")


class RolloutWorker:
    """One rollout rank (the module docstring). `fit()` runs it to the end of the trainer's run."""

    def __init__(self, *, actor, groups: RankGroups, dataset, prompts_per_step: int, n: int, max_staleness: int,
                 sampling: SamplingParams, eos_token_ids: list, slots: int, noise_seed: int, seed: int, shuffle: bool):
        split = groups.split
        k = split.rollout_ranks
        if prompts_per_step % k:
            raise ConfigError(f"rollout.prompts_per_step = {prompts_per_step} does not split over rollout.ranks = {k}: "
                              f"each rollout rank draws an equal share of every step's prompts; use a multiple of {k}")
        self.actor, self.groups, self.dataset, self.n = actor, groups, dataset, n
        self.rank, self.world_size = groups.rank, split.world_size
        self.prompts = PromptStream(dataset, prompts_per_step, seed=seed, shuffle=shuffle,
                                    rank=groups.rank - split.num_trainers, world_size=k)
        self.per_step = prompts_per_step // k
        self.max_staleness, self.sampling, self.eos, self.slots = max_staleness, sampling, eos_token_ids, slots
        self.noise_seed = noise_seed
        self.capacity = self.per_step * (max_staleness + 1)
        self.receiver = WeightReceiver(actor.model, groups)  # the handshake with trainer rank 0
        self.sender = SampleSender(groups)
        self.version = -1          # the weights' version the model holds
        self.next_step = 0         # the trainer step the next prompts drawn are meant for
        self.groups_in_flight: list[Group] = []
        self.next_key = 0
        self.on_weights: list[Callable] = []  # fn(worker) after each version is in (tests read the weights)
        self.sent_groups = 0
        self.versions: list = []  # (version, seconds to receive it)
        self.val_history: list = []

    @classmethod
    def from_config(cls, cfg, roles) -> "RolloutWorker":
        from . import build

        r = cfg.rollout
        build.set_numerics(r.bitwise, roles.actor.model)  # the trainer ranks' kernels (rollout.bitwise)
        roles.actor.configure_rollout(r.engine, EngineConfig(
            max_slots=r.engine_max_slots, memory_fraction=r.engine_memory_fraction, cuda_graphs=r.engine_cuda_graphs,
            max_seq_tokens=sequence_tokens(cfg)))
        dataset = build._prompt_dataset(cfg, cfg.data.train_files, "train", roles.tokenizer, roles.actor.model)
        return cls(actor=roles.actor, groups=rank_groups(), dataset=dataset, prompts_per_step=r.prompts_per_step,
                   n=r.n, max_staleness=r.max_staleness,
                   sampling=SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                           top_k=r.top_k),
                   eos_token_ids=[] if r.ignore_eos else build._eos_ids(roles.tokenizer, roles.actor.model),
                   slots=min(r.batch_size * r.n, r.engine_max_slots), noise_seed=cfg.trainer.seed * 7919 + 17,
                   seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)

    # ----- the loop -------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        set_phase("rollout")
        if not self._take_weights(refresh=None):
            self.sender.close()
            return {}
        for _ in range(self.version):  # a resumed run: the prompts of the steps trained already are not drawn again
            self.prompts.loader.next_global_batch()
        self.next_step = self.version
        longest = max(len(item.prompt_ids) for item in self.dataset.items)
        generator = torch.Generator(device=self.actor.device).manual_seed(self.noise_seed)
        with self.actor.rollout_mode():
            session = self.actor.decode_session(self.sampling, slot_len=longest + self.sampling.max_new_tokens,
                                                eos_token_ids=self.eos, num_slots=self.slots, generator=generator)
            if session is None:
                raise ConfigError("rollout.ranks generates with the built-in engine; this model runs on the "
                                  "transformers fallback (rollout.engine=hf or a non-native family): set "
                                  "rollout.ranks=0")
            with session as s:
                self._decode(s)
        self.sender.close()
        log.info(f"[rank {self.rank}] rollout rank done: {self.sent_groups} groups sent, weight versions "
                 f"{self.versions[0][0]}..{self.versions[-1][0]}")
        return {}

    def _decode(self, s) -> None:
        by_key: dict = {}
        pending: deque = deque()
        while True:
            while len(self.groups_in_flight) < self.capacity and self.next_step <= self.version + self.max_staleness:
                pending.extend(self._draw(by_key))
            must_wait = s.idle and not pending  # everything sent, and the bound allows no more prompts
            if must_wait or self.receiver.poll():
                ended, cut = s.suspend()
                for turn in ended + cut:
                    self._append(by_key[turn.key], turn)
                self._send_complete()
                if not self._take_weights(refresh=self.actor.engine):
                    return
                pending = deque(self._restart_stale(by_key))
                continue
            while pending and s.free_slots:
                sample, prompt = pending.popleft()
                s.start(sample.key, prompt + sample.ids, self.sampling.max_new_tokens - len(sample.ids),
                        noise_key=sample.key)
            for turn in s.step():
                self._append(by_key[turn.key], turn)
                s.release(turn.key)
            self._send_complete()

    def _draw(self, by_key: dict) -> list:
        """This rank's prompts of the next step, as groups of n new samples; the (sample, prompt ids) to start."""
        starts = []
        for index, item in self.prompts.next_indexed():
            samples = [self._new_sample() for _ in range(self.n)]
            self.groups_in_flight.append(Group(self.next_step, index, item, samples))
            for sample in samples:
                by_key[sample.key] = sample
                starts.append((sample, list(item.prompt_ids)))
        self.next_step += 1
        return starts

    def _new_sample(self) -> Sample:
        sample = Sample(self.next_key * KEY_RANKS + self.rank)  # noise keys unique across ranks
        self.next_key += 1
        return sample

    def _append(self, sample: Sample, turn) -> None:
        sample.ids += turn.token_ids
        sample.logprobs += turn.logprobs
        sample.versions += [self.version] * len(turn.token_ids)
        if not turn.partial:
            sample.finish = "stop" if turn.stopped else "length"

    def _send_complete(self) -> None:
        done = [g for g in self.groups_in_flight if g.complete]
        if not done:
            return
        self.groups_in_flight = [g for g in self.groups_in_flight if not g.complete]
        self.sender.send([SampleGroup(g.index, [s.ids for s in g.samples], [s.logprobs for s in g.samples],
                                      [s.versions for s in g.samples], [s.finish for s in g.samples]) for g in done])
        self.sent_groups += len(done)

    def _restart_stale(self, by_key: dict) -> list:
        """Every unfinished sample to (re)start, in group order; a sample whose oldest token is past the bound of the
        weights just received starts over from its prompt (the trainer would drop its group)."""
        floor = self.version - self.max_staleness
        starts = []
        for group in self.groups_in_flight:  # complete groups were sent: every group here is unfinished
            for i, sample in enumerate(group.samples):
                if sample.versions and sample.versions[0] < floor:  # finished or not: its group would be dropped
                    del by_key[sample.key]
                    sample = group.samples[i] = self._new_sample()
                    by_key[sample.key] = sample
                if sample.finish is None:
                    starts.append((sample, list(group.item.prompt_ids)))
        return starts

    def _take_weights(self, refresh) -> bool:
        """Receive the next version (blocking, at most the timeout) into the model; False once the sync is closed."""
        start = time.perf_counter()
        version = self.receiver.receive()
        if version is None:
            return False
        if refresh is not None:
            refresh.refresh_weights()  # the engine's fused copies, from the parameters just written
        self.version = version
        self.versions.append((version, time.perf_counter() - start))
        for fn in self.on_weights:
            fn(self)
        return True
