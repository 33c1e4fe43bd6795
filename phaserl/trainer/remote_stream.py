"""Phases 1-3 on the trainer ranks when rollout ranks generate (rollout.ranks >= 1; docs/distributed.md).

The rollout ranks (trainer/rollout_worker.py) draw the prompts, sample, and send every complete group (a prompt's
n responses, each token with its policy version and behaviour log-prob) to trainer rank 0 as it completes.
`RemoteStream.next_batch` is the step's phases 1-3 on this side:

    rollout   trainer rank 0 takes groups as they come (parallel/sample_channel.py) until it holds a step's
              worth within the bound, drops (and counts) every group whose oldest token is more than
              rollout.max_staleness versions behind the weights this step trains, and hands each trainer rank
              its share (scatter_groups): one rank decides which groups train together
    score     each trainer rank scores its share and builds the RolloutBatch with its token versions, as the
              one-GPU stream does (AsyncStream._scored)

After each optimizer step every trainer rank sends the new weights (`after_update`: WeightSender, version = the
trainer's step number, the optimizer steps taken); the first version goes before the first batch, so the rollout
ranks start from the trainer's weights (a resumed run's too). `close()` ends the weight sync, which stops the
rollout ranks, and drains what they still send.

Checkpoints hold no groups in flight: what the rollout ranks were generating, and what trainer rank 0 had received
but not trained, is generated again after a resume (the rollout ranks draw prompts from the resumed step on).
Not here: the transfers (parallel/weight_sync.py, parallel/sample_channel.py), the rollout loop (rollout_worker.py).
"""
from __future__ import annotations

from ..parallel.rank_split import RankGroups
from ..parallel.sample_channel import SampleGroup, SampleReceiver, scatter_groups
from ..parallel.weight_sync import WeightSender
from .stream import AsyncStream, Group, Sample


class RemoteStream(AsyncStream):
    """rollout.ranks >= 1 on a trainer rank: complete groups from the rollout ranks (the module docstring).
    Reuses AsyncStream's batch building and version metrics; holds nothing a checkpoint must save."""

    def __init__(self, *, groups: RankGroups, model, max_staleness: int, n: int, prompts_per_rank: int, dataset,
                 bucket_bytes: int):
        super().__init__(max_staleness=max_staleness, on_stale="drop", n=n, prompts_per_rank=prompts_per_rank,
                         slots=1, noise_seed=0, dataset=dataset)
        self.groups = groups
        self.trainers = groups.split.num_trainers
        self.is_root = groups.rank == groups.sender_rank
        self.sender = WeightSender(model, groups, bucket_bytes=bucket_bytes)  # the handshake with the rollout ranks
        self.receiver = SampleReceiver(groups) if self.is_root else None
        self.waiting: list[SampleGroup] = []  # trainer rank 0: received within the bound, not yet in a batch

    def next_batch(self, trainer, clock):
        version = trainer.step_num
        stats = {}
        if self.sender.last_version is None:  # the rollout ranks start from these weights
            with clock("weight_sync"):
                self.sender.send(version)
        with clock("rollout"):  # the wait for complete groups
            shares, dropped = self._take(version) if self.is_root else (None, 0)
            mine = scatter_groups(self.groups, shares) if self.trainers > 1 else shares[0]
        with clock("score"):
            scored = self._scored(trainer, [self._group(g) for g in mine])
        stats.update(self._version_stats(scored.batch, version))
        if self.is_root:  # one rank's counts: reduce_metrics averages over the ranks that have the key
            stats.update({"async/dropped_groups": float(dropped), "async/in_flight_groups": float(len(self.waiting))})
        return scored, stats

    def _take(self, version: int) -> tuple[list, int]:
        """Trainer rank 0: a step's worth of groups within the bound, one share per trainer rank; the groups dropped."""
        floor, need = version - self.max_staleness, self.prompts_per_rank * self.trainers
        kept = [g for g in self.waiting if _oldest(g) >= floor]
        dropped = len(self.waiting) - len(kept)
        while len(kept) < need:
            got = self.receiver.receive()
            if got is None:
                raise RuntimeError(f"rank {self.groups.rank}: every rollout rank closed its samples before this step "
                                   f"had its {need} groups (they stop only when the trainer closes the weight sync)")
            for group in got[1]:
                if _oldest(group) >= floor:
                    kept.append(group)
                else:
                    dropped += 1
        batch, self.waiting = kept[:need], kept[need:]
        per = self.prompts_per_rank
        return [batch[r * per:(r + 1) * per] for r in range(self.trainers)], dropped

    def _group(self, g: SampleGroup) -> Group:
        samples = [Sample(0, ids.tolist(), lp.tolist(), ver.tolist(), reason)
                   for ids, lp, ver, reason in zip(g.token_ids, g.logprobs, g.versions, g.finish_reasons)]
        return Group(0, g.prompt_index, self.dataset.items[g.prompt_index], samples)

    def after_update(self, trainer) -> dict:
        """Every trainer rank, after the step's optimizer steps: the new weights to the rollout ranks."""
        self.sender.send(trainer.step_num)
        return {"timing_s/weight_sync": self.sender.last_seconds} if self.is_root else {}

    def close(self) -> None:
        """The end of the run: no version follows; take (and drop) what the rollout ranks still send."""
        self.sender.close()
        if self.receiver is not None:
            self.receiver.drain()

    # ----- checkpoints: nothing in flight is saved (the module docstring) ---------------------------------------
    def gather_for_save(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"max_staleness": self.max_staleness, "n": self.n, "ranks": []}

    def load_state_dict(self, state: dict) -> None:
        if int(state["n"]) != self.n:
            raise ValueError(f"the checkpoint's stream has rollout.n={state['n']}, this run {self.n}")


def _oldest(group: SampleGroup) -> int:
    """The version of the group's oldest sampled token (a group of empty responses counts as current)."""
    return min((int(v.min()) for v in group.versions if v.numel()), default=1 << 62)


def remote_stream(cfg, dataset, *, prompts_per_rank: int, model) -> RemoteStream:
    """The stream of a trainer rank under rollout.ranks (build.rollout_stream picks it)."""
    from ..errors import ConfigError
    from ..parallel.rank_split import rank_groups

    r = cfg.rollout
    if rank_groups() is None:
        raise ConfigError(f"rollout.ranks = {r.ranks}: the launch is split into trainer and rollout ranks when the "
                          "roles are loaded from the config (phaserl train, RLTrainer.from_config); with roles made "
                          "by hand set rollout.ranks = 0")
    if r.max_staleness < 1:
        raise ConfigError(f"rollout.ranks = {r.ranks} generates on ranks of its own while the trainer ranks train, so "
                          f"a batch holds tokens of the previous weights: set rollout.max_staleness >= 1 (it is "
                          f"{r.max_staleness}), or rollout.ranks = 0")
    if cfg.agent.env or cfg.agent.harness:
        raise ConfigError(f"rollout.ranks = {r.ranks} runs single-turn prompts; agent episodes (agent.env, "
                          "agent.harness) run on colocated ranks: set rollout.ranks = 0")
    return RemoteStream(groups=rank_groups(), model=model, max_staleness=r.max_staleness, n=r.n,
                        prompts_per_rank=prompts_per_rank, dataset=dataset, bucket_bytes=r.weight_bucket_mb * 2**20)
