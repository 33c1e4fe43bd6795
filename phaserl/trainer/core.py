"""RLTrainer: the controller.  One RL step reads top to bottom, phase by phase (README, "One step").

The trainer holds the `Roles` and the frozen `RunSettings` that `trainer/build.py` makes from a Config,
once; it never reads the config inside the loop. Data between phases travels as the dataclasses of
`phaserl.batch`.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from ..algo import TRAIN_KL_ESTIMATOR, kl_penalty, masked_mean, mismatch_metrics
from ..batch import ScoredBatch, TrainBatch
from ..metrics import StepPerf
from ..parallel import all_reduce_sum, rank_and_world, reduce_metrics, set_phase
from . import build
from .advantage_phase import compute_advantages, nonfinite_advantage_cause
from .hooks import HookRunner
from .oom import out_of_memory_screen
from .rollout_context import RolloutContext
from .settings import Roles, RunSettings
from .stop import StopSignals

log = logging.getLogger("phaserl")


class RLTrainer:
    """Runs RL steps with the given roles.

    Three ways to make one: `RLTrainer.from_config(cfg)` loads every model the config names;
    `RLTrainer(actor=..., critic=..., ref_policy=..., reward=..., config=cfg, checkpoint_path=...)` (the
    verl-style API) takes roles made by hand, and its keyword arguments override `trainer.*`, checked like
    YAML keys; `RLTrainer.from_parts(roles, settings)` takes what `trainer/build.py` made.
    """

    def __init__(self, actor, critic=None, ref_policy=None, reward=None, config=None, *, tokenizer=None,
                 checkpoint_path=None, log_dir=None, save_interval=None, keep_checkpoint_num=None):
        cfg = build.config_with_trainer_kwargs(config, checkpoint_path=checkpoint_path, log_dir=log_dir,
                                               save_interval=save_interval, keep_checkpoint_num=keep_checkpoint_num)
        roles = build.complete_roles(cfg, actor, critic, ref_policy, reward, tokenizer)
        self._start(roles, build.build_run(cfg, roles))

    @classmethod
    def from_config(cls, cfg) -> "RLTrainer":
        roles = build.build_roles(cfg)
        if build.is_rollout_rank():  # rollout.ranks: this rank generates for the trainer ranks and never trains
            from .rollout_worker import RolloutWorker

            return RolloutWorker.from_config(cfg, roles)
        return cls.from_parts(roles, build.build_run(cfg, roles))

    @classmethod
    def from_parts(cls, roles: Roles, settings: RunSettings) -> "RLTrainer":
        trainer = cls.__new__(cls)
        trainer._start(roles, settings)
        return trainer

    def _start(self, roles: Roles, settings: RunSettings) -> None:
        self.rank, self.world_size = rank_and_world()
        self.actor, self.critic, self.ref_policy = roles.actor, roles.critic, roles.ref_policy
        self.run = settings
        self.step_num = 0
        self.metrics: dict = {}
        self.val_history: list = []   # (step, validation metrics), in order
        self.hooks = HookRunner()
        self.perf = StepPerf(self.actor.model, self.ref_policy.model if self.ref_policy is not None else None,
                             self.critic.model if self.critic is not None else None,
                             device=self.actor.device, world_size=self.world_size,
                             held_bytes=lambda: self.actor.train_graphs.pool_bytes if self.actor.train_graphs else 0)

    # Names the verl-style hooks read.
    @property
    def step(self) -> int:
        return self.step_num

    @property
    def checkpoint_path(self) -> str:
        return self.run.checkpoint_path

    @property
    def log_dir(self) -> str:
        return self.run.log_dir

    def add_hook(self, event: str, fn) -> None:
        self.hooks.add(event, fn)

    # ------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train to trainer.total_steps.  SIGINT/SIGTERM stop it after the current step (trainer/stop.py)."""
        close = self.run.checkpointer.close if self.run.checkpointer is not None else (lambda: None)
        with StopSignals(rank=self.rank, save=self.run.save_on_signal, on_exit_now=close) as self._signals:
            try:
                with out_of_memory_screen(self):  # one screen naming the phase and what would fit (trainer/oom.py)
                    return self._fit()
            finally:
                close()  # the run lock of trainer.checkpoint_path
                self.run.reward.close()  # the rule reward workers (a later fit or validate starts new ones)
                if self.run.agent is not None:  # agent.env's pool (a harness run keeps none)
                    self.run.agent.workers.stop_idle()  # idle environment threads would outlive the run

    def _fit(self) -> dict:
        run = self.run
        if self.world_size > 1:
            from ..parallel.shared_storage import check_shared_paths

            check_shared_paths({"trainer.checkpoint_path": run.checkpoint_path, "trainer.log_dir": run.log_dir},
                               rank=self.rank, world_size=self.world_size)
        self._resume()
        if self.rank == 0 and run.show_progress:
            from .summary import run_summary

            log.info(run_summary(self))
        self.hooks.fire("on_train_start", self)
        progress = run.progress_bar(self.step_num)
        # step and [HybridEngine] lines print above the progress bar, not through it; an error closes the bar first,
        # so that its message is the run's last line
        with logging_redirect_tqdm(), progress:
            if run.val_before_train and self.step_num == 0 and run.val_prompts is not None:
                self._log(self.step_num, self.validate())
            while self.step_num < run.total_steps:
                self._signals.check(self)  # a safe point: SIGINT/SIGTERM stop here, with a checkpoint
                metrics = self.train_step()
                self.step_num += 1
                metrics.update(run.stream.after_update(self) or {})  # rollout ranks: the new weights (version = step)
                if run.val_interval and self.step_num % run.val_interval == 0 or self.step_num == run.total_steps:
                    metrics.update(self.validate())
                self._log(self.step_num, metrics)
                self.hooks.fire("on_step_end", self)
                if run.save_interval and self.step_num % run.save_interval == 0 or self.step_num == run.total_steps:
                    self.save_checkpoint()
                progress.update(1)
        progress.close()
        run.stream.close()  # rollout ranks: no version follows, they stop
        self.hooks.fire("on_train_end", self)
        run.metrics_logger.close()
        self._finish()
        return self.metrics

    def train_step(self) -> dict:
        run, timings = self.run, {}
        clock = _phase_clock(timings, self.step_num)
        self.perf.start_step()
        with clock("step"):
            # 1-3. prompts, rollout and score: this rank's share of the prompts, n responses each, scored (DAPO's
            #      dynamic sampling: more rounds until every group has rewards that differ). rollout.max_staleness
            #      >= 1: complete groups from the asynchronous stream, their tokens up to k versions old.
            scored, sampling_stats = run.stream.next_batch(self, clock)
            batch, scores, baseline_scores = scored.batch, scored.scores, scored.baseline_scores
            # 4. forward-only passes: old log-probs, reference log-probs, values
            with clock("forward"):
                old_logprobs = None  # one optimizer step per batch: the update's own log-probs are the old ones
                if not self._on_policy(batch):
                    old_logprobs = self.actor.compute_logprobs(batch, token_budget=run.forward_tokens)
                ref_logprobs = values = None
                if self.ref_policy is not None:
                    ref_logprobs = self.ref_policy.compute_logprobs(
                        batch, temperature=run.temperature, token_budget=run.forward_tokens)
                if self.critic is not None:
                    values = self.critic.compute_values(batch, token_budget=run.forward_tokens)
            # 5. advantages (KL in the reward, when chosen); every rank updates, skips or stops together
            with clock("advantage"):
                advantages, returns, _, _ = compute_advantages(
                    batch, scores.total, run.advantage, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                    values=values, kl_coef=run.kl_controller.value, baseline_scores=baseline_scores,
                    token_rewards=scores.token_rewards)
                zero_variance = run.zero_variance.observe(scores.total, batch.group_ids, self.step_num)
                update_ok = run.guard.advantages_ok(nonfinite_advantage_cause(advantages, scores.total, values),
                                                    self.step_num)
            # 6. update: epochs × mini-batches, micro-batches by token budget
            with clock("update"):
                train = TrainBatch(batch, old_logprobs, ref_logprobs, advantages, returns, values)
                update_stats = self.update(train) if update_ok else {}
                update_stats["train/skipped_step"] = float(not update_stats)
        # 7. metrics (checkpoint and logging happen in fit)
        step_metrics = self._step_metrics(batch, scores, advantages, returns, old_logprobs, ref_logprobs, update_stats)
        step_metrics.update(sampling_stats, **{"train/zero_variance_group_frac": zero_variance})
        if old_logprobs is not None:  # the trainer's own pre-update log-probs (else the update measured it)
            step_metrics.update(mismatch_metrics(old_logprobs, batch.rollout_logprobs, batch.loss_mask))
        metrics = reduce_metrics(step_metrics)  # every rank logs and adapts the KL coefficient from the same numbers
        metrics.update({f"timing_s/{k}": v for k, v in timings.items()})
        metrics.update(self.perf.step_metrics(batch.attention_mask, batch.response_mask, timings,
                                              update_epochs=run.epochs if update_ok else 0,
                                              old_pass=old_logprobs is not None))
        metrics["train/kl_coef"] = run.kl_controller.value  # the coefficient this step used (reward or loss)
        run.kl_controller.update(metrics.get("train/kl", 0.0), run.responses_per_step)  # for the next step
        if run.compile_watch is not None and (line := run.compile_watch.step_done(timings["step"])):
            log.info(line)  # the first step: how long the compile warm-up took, what torch's cache served
        return metrics

    def _on_policy(self, batch) -> bool:
        """True when the step makes exactly one optimizer step (1 epoch, 1 mini-batch) and nothing before
        the update reads the old log-probs (KL not in the reward). Then the old log-probs equal the
        update's own detached log-probs (ratio 1, as TRL does with num_iterations=1), and the forward
        pass that would compute them is skipped. `run.reuse_update_logprobs=False` keeps the pass."""
        run = self.run
        one_step = run.epochs == 1 and batch.num_responses // run.mini_batch_per_rank == 1
        return run.reuse_update_logprobs and one_step and not run.advantage.kl_in_reward

    def _engine_values(self, train: TrainBatch) -> bool:
        """The bitwise mode between its checks (rollout.bitwise_check_every): a synchronous step of one optimizer
        step trains the weights that sampled the batch, so the engine's log-probs are the exact ones to the bit
        and the update's loss takes them instead of an exact forward. Steps 1, 1 + every, ... check it."""
        every = self.run.bitwise_check_every  # self.step_num: the steps done before this one
        return (every > 1 and self.step_num % every != 0 and train.old_logprobs is None
                and self.run.stream.max_staleness == 0)

    def update(self, train: TrainBatch) -> dict:
        """ppo.epochs × ppo.num_mini_batches optimizer steps for the actor (and the critic).

        Mini-batch k of an epoch takes, from every block of K = num_mini_batches consecutive responses
        (global order), the one a random permutation of the block assigns to k. Ranks hold whole blocks, so
        the mini-batches, and the update, are the same on any number of ranks (docs/distributed.md).
        Stats are the mini-batch's global values: each rank's share summed over ranks.
        """
        run = self.run
        loss = self.actor.loss
        if loss.kl_loss_coef > 0 and loss.kl_loss_coef != run.kl_controller.value:  # adaptive KL in the loss:
            self.actor.loss = dataclasses.replace(loss, kl_loss_coef=run.kl_controller.value)  # this step's value
        sums, count = defaultdict(float), 0
        gen = torch.Generator().manual_seed(run.seed * 1_000_003 + self.step_num)
        K = train.num_responses // run.mini_batch_per_rank
        blocks_per_rank = train.num_responses // K
        for _ in range(run.epochs):
            assign = torch.rand(self.world_size * blocks_per_rank, K, generator=gen).argsort(dim=1)  # [G/K, K]
            mine = assign[self.rank * blocks_per_rank:(self.rank + 1) * blocks_per_rank].reshape(-1)  # [N]
            for k in range(K):
                idx = (mine == k).nonzero().squeeze(1).to(train.advantages.device)  # [N / K]
                mb = train.select(idx)
                global_tokens = float(all_reduce_sum(mb.rollout.loss_mask.sum().float()))  # tokens trained on
                global_seqs = float(all_reduce_sum(torch.tensor(float(len(idx)))))
                norm = dict(token_budget=run.train_tokens, global_tokens=global_tokens, global_seqs=global_seqs)
                stats = self.actor.update_mini_batch(mb, **norm, engine_values=self._engine_values(train))
                if self.critic is not None:
                    stats.update(self.critic.update_mini_batch(mb, **norm))
                # grad_norm and lr are global already; a _max is this rank's (reduce_metrics takes the max)
                shares = [key for key in stats if not key.endswith(("/grad_norm", "/lr", "_max"))]
                stats.update(zip(shares, all_reduce_sum(torch.tensor([stats[key] for key in shares],
                                                                     dtype=torch.float64)).tolist()))
                for key, value in stats.items():
                    sums[key] += value
                count += 1
                run.guard.check_update(stats, self.step_num)
        return {k: v / count for k, v in sums.items()}

    @torch.no_grad()
    def validate(self) -> dict:
        """Score held-out prompts (greedy by default) → `val/score_mean` and per data source."""
        run = self.run
        if run.val_prompts is None:
            return {}
        set_phase("validate", self.step_num)
        with self.actor.rollout_mode():
            batch = self._generate(run.val_prompts, run.val_sampling, run.val_n)
        scores = run.reward.score(batch).total                                      # [B]
        total, count = all_reduce_sum(scores.sum()), all_reduce_sum(torch.tensor(float(len(scores))))
        metrics = {"val/score_mean": float(total / count),
                   "val/response_length_mean": float(batch.response_lengths().float().mean())}
        by_source = defaultdict(list)
        for row, s in zip(batch.rows, scores.tolist()):
            by_source[row.data_source or "unknown"].append(s)
        if len(by_source) > 1:
            metrics.update({f"val/score_mean/{k}": sum(v) / len(v) for k, v in by_source.items()})
        metrics = reduce_metrics(metrics)
        self.metrics = {**self.metrics, **metrics}
        self.val_history.append((self.step_num, metrics))
        self.hooks.fire("on_validation_end", self)
        return metrics

    def save_checkpoint(self) -> None:
        if self.run.checkpointer is None:
            return
        set_phase("checkpoint", self.step_num)
        if self.run.stream.max_staleness:
            self.run.stream.gather_for_save()  # collective: rank 0 writes every rank's responses in flight
        self.run.checkpointer.save(self.checkpoint_state())
        self.hooks.fire("on_save_checkpoint", self)

    # ----- checkpoint state and resume (phaserl.checkpoint; docs/checkpoints.md) ---------------
    @property
    def last_checkpoint(self):
        """The step_N directory saved (or resumed from) last, or None."""
        return self.run.checkpointer.last_saved if self.run.checkpointer is not None else None

    def checkpoint_state(self):
        """The live objects a checkpoint saves and a resume restores."""
        from ..checkpoint import TrainingState

        run = self.run
        roles = {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}
        in_flight = {} if run.stream.max_staleness == 0 else {"rollout_stream": run.stream}
        return TrainingState(step=self.step_num, roles=roles, tokenizer=run.tokenizer,
                             stateful={"trainer": self, "kl_controller": run.kl_controller,
                                       "prompt_loader": run.train_prompts, **in_flight},
                             generators={"sampling": run.sampling_generator})

    def state_dict(self) -> dict:
        """The loop's own progress (JSON); weights and optimizers are in checkpoint_state().roles."""
        return {"step": self.step_num, "val_history": self.val_history, "metrics": self.metrics,
                "micro_batch_tokens": self.run.train_tokens}

    def load_state_dict(self, state: dict) -> None:
        self.step_num = int(state["step"])
        self.val_history = [(int(step), dict(m)) for step, m in state["val_history"]]
        self.metrics = dict(state["metrics"])
        if "micro_batch_tokens" in state:  # absent from checkpoints written before 2026-12-04
            self._keep_micro_batch(int(state["micro_batch_tokens"]))

    def _keep_micro_batch(self, saved: int) -> None:
        """ppo.micro_batch_tokens=auto resumes with the checkpoint's micro-batch: the machine's memory count could
        choose another, and the update's sums would then round differently from the uninterrupted run's."""
        choice = self.run.speed.micro_batch_tokens if self.run.speed is not None else None
        if choice is None or choice.asked is not None or saved == self.run.train_tokens:
            return
        log.info(f"resume: ppo.micro_batch_tokens=auto keeps the checkpoint's {saved} tokens (this machine's count "
                 f"chose {self.run.train_tokens}), so the update splits its micro-batches as before the stop")
        self.run = dataclasses.replace(self.run, train_tokens=saved)

    def _resume(self) -> None:
        """trainer.resume: continue exactly from a checkpoint, or start fresh; metrics.jsonl is cut to match."""
        import os

        from ..checkpoint import drop_metrics_after

        info = self.run.checkpointer.resume(self.checkpoint_state()) if self.run.checkpointer is not None else None
        if self.rank == 0:
            drop_metrics_after(os.path.join(self.run.log_dir, "metrics.jsonl"), info.step if info else -1)
        saved_world = info.metadata.get("world_size") if info is not None else None
        if self.rank == 0 and saved_world and saved_world != self.world_size:
            self._warn_if_samples_change(saved_world)
        if info is not None and self.step_num >= self.run.total_steps:
            log.info(f"{info.path} is step {self.step_num}, and trainer.total_steps={self.run.total_steps}: nothing "
                     "left to train. Raise trainer.total_steps to continue, or set trainer.resume=never and a new "
                     "trainer.checkpoint_path to train again from the start")

    def _warn_if_samples_change(self, saved_world: int) -> None:
        """A resume onto another world size samples like the uninterrupted run only where rollout.batch_size
        divides the prompts per rank on both world sizes (docs/distributed.md)."""
        from ..config.invariance import same_samples_world_sizes

        prompts, size = self.run.responses_per_step // self.run.n, self.run.generate_batch_size
        same = same_samples_world_sizes(prompts, size)
        if saved_world not in same or self.world_size not in same:
            log.warning(f"resume: the checkpoint was written by {saved_world} rank(s) and this run has "
                        f"{self.world_size}; rollout.batch_size = {size} does not divide the prompts per rank "
                        f"({prompts} / {saved_world} and {prompts} / {self.world_size}) on both, so from here on the "
                        "samples differ from those of the uninterrupted run (set rollout.batch_size to a common "
                        f"divisor, e.g. {math.gcd(prompts // saved_world, prompts // self.world_size, size)}, "
                        "to keep them)")

    def _finish(self) -> None:
        """Rank 0: the run report, and one last console line naming what the run left on disk."""
        if self.rank != 0:
            return
        import os

        from ..report import write_report

        metrics_file = os.path.join(self.run.log_dir, "metrics.jsonl")
        report = write_report(self.run.log_dir) if os.path.isfile(metrics_file) else None
        log.info(f"phaserl: done at step {self.step_num}; metrics {metrics_file}"
                 + (f"; report {report}" if report else "")
                 + (f"; checkpoint {self.last_checkpoint}" if self.last_checkpoint else ""))

    # ------------------------------------------------------------------------------------------
    def _rollout_and_score(self, items: list, clock) -> ScoredBatch:
        """Phases 2-3 for `items`: the actor samples n responses per prompt in rollout mode (and ReMax's
        greedy baseline), then the reward sources score them (DAPO's overlong shaping, when on, included)."""
        run = self.run
        with clock("rollout"), self.actor.rollout_mode():
            batch = self._generate(items, run.sampling, run.n)
            baseline = self._generate(items, run.greedy, 1) if run.needs_greedy_baseline else None
        with clock("score"):
            scores = run.shape_scores(run.reward.score(batch), batch)
            baseline_scores = None
            if baseline is not None:
                baseline_scores = run.shape_scores(run.reward.score(baseline), baseline).total.repeat_interleave(run.n)
        return ScoredBatch(batch, scores, baseline_scores)

    def _generate(self, items: list, params, n: int):
        """n responses (single-turn) or episodes (multi-turn) per prompt: the rollout phase chosen at build
        time (trainer/rollout_phase.py, trainer/agent_phase.py)."""
        return self.run.rollout_phase(RolloutContext(self.run, self.actor, self.rank, self.step_num), items, params, n)

    def _step_metrics(self, batch, scores, advantages, returns, old_logprobs, ref_logprobs, update_stats) -> dict:
        mask = batch.loss_mask.float()  # [B, R] the sampled tokens
        lengths = batch.sampled_lengths().float()
        m = {"train/reward_mean": float(scores.total.mean()),
             "train/reward_std": float(scores.total.std(unbiased=False)),
             "train/reward_min": float(scores.total.min()), "train/reward_max": float(scores.total.max()),
             "train/response_length_mean": float(lengths.mean()), "train/response_length_max": float(lengths.max()),
             "train/truncated_frac": sum(r == "length" for r in batch.finish_reasons) / len(batch.finish_reasons),
             "train/advantage_mean": float(masked_mean(advantages, mask)),
             "train/advantage_max": float(advantages[mask.bool()].max()),
             "train/advantage_min": float(advantages[mask.bool()].min()),
             "train/return_mean": float(masked_mean(returns, mask))}
        m.update({f"train/reward/{k}": float(v.mean()) for k, v in scores.by_source.items()})
        m.update(batch.rollout_metrics)  # agent/* of multi-turn rollouts
        if ref_logprobs is not None and old_logprobs is not None:
            m["train/kl"] = float(masked_mean(kl_penalty(old_logprobs, ref_logprobs, TRAIN_KL_ESTIMATOR), mask))
        m.update(update_stats)  # without an old log-prob pass, train/kl comes from the update (global mean)
        self.run.guard.check_rewards(scores.total, self.step_num)
        self.metrics = m
        return m

    def _log(self, step: int, metrics: dict) -> None:
        metrics = {**metrics, **self.actor.switch_log.drain()}  # the mode switches since the last line (rank 0's)
        self.metrics = metrics
        self.run.metrics_logger.log(step, metrics)


@contextmanager
def _timed(timings: dict, name: str, step: int):
    set_phase(name, step)  # a collective timeout or a failure on any rank names the phase
    t0 = time.perf_counter()
    try:
        with torch.profiler.record_function(f"phase/{name}"):  # a profile's kernels, by phase (benchmarks/profiling.py)
            yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0


def _phase_clock(timings: dict, step: int):
    return lambda name: _timed(timings, name, step)
