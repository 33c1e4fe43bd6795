"""Measuring one phaserl trainer step for the benchmarks: device syncs and peak memory, a step between syncs, the
engine's and dynamo's counters, and the optional diagnostics of grpo_step.py (`--profile`: one more step under
torch.profiler; `--rollout-probe`: the rollout phase alone at several KV memory fractions; `--ab`: on/off settings
alternated in this process). The diagnostics print
through the caller's `emit` (its bench name and, under multi_gpu.py, its rank tag).
Not here: the step configs, the TRL side, the summary lines (grpo_step.py).
"""
from __future__ import annotations

import dataclasses
import json
import time

import torch


def json_or_none(line: str):
    """A JSON object printed on one line by a benchmark process, or None for any other line."""
    if not line.startswith("{"):
        return None
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def memory_gib() -> dict:
    if not torch.cuda.is_available():
        return {"peak_allocated_gib": None, "peak_reserved_gib": None}
    return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)}


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def timed_step(trainer) -> tuple[dict, float]:
    """One `trainer.train_step()` between device syncs: (its metrics, seconds); the step counter advances."""
    sync()
    t0 = time.perf_counter()
    metrics = trainer.train_step()
    sync()
    seconds = time.perf_counter() - t0
    trainer.step_num += 1
    return metrics, seconds


def metric_group(metrics: dict, prefix: str, digits: int) -> dict:
    """{name: value} of the metrics named `prefix/name`, rounded."""
    return {k.split("/", 1)[1]: round(v, digits) for k, v in metrics.items() if k.startswith(prefix + "/")}


def profile_one_step(trainer, emit, phases: str = "all") -> None:
    """One more step under torch.profiler: device time per kernel group, host waits, how busy the GPU was, and
    the top kernels per phase. `phases` other than "all" (e.g. "forward,update"): only those phases' calls are
    profiled (the actor's generate, the reference's log-probs, the trainer's update), one profiler each."""
    from torch.profiler import ProfilerActivity, profile

    import profiling

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    if phases == "all":
        with profile(activities=activities) as prof:
            metrics, wall = timed_step(trainer)
        emit(measure="profiled_step", side="ours", seconds=round(wall, 3),
             timing_s=metric_group(metrics, "timing_s", 3))
        for record in profiling.summarize(prof, wall):
            emit(measure="profile", side="ours", **record)
        for record in profiling.by_phase(prof):
            emit(measure="profile_phase", side="ours", **record)
        return
    calls = {"rollout": (trainer.actor, "generate"), "forward": (trainer.ref_policy, "compute_logprobs"),
             "update": (trainer, "update")}
    wanted = [name.strip() for name in phases.split(",") if name.strip()]
    unknown = sorted(set(wanted) - set(calls))
    if unknown:
        raise SystemExit(f"--profile-phases: {unknown} are not phases; choose from all or {', '.join(calls)}")
    profiled: list = []  # (phase, profiler, wall seconds of the call)

    def under_profiler(phase: str, fn):
        def call(*args, **kwargs):
            sync()
            t0 = time.perf_counter()
            with profile(activities=activities, with_stack=True) as prof:
                out = fn(*args, **kwargs)
                sync()
            profiled.append((phase, prof, time.perf_counter() - t0))
            return out
        return call

    wrapped = [(*calls[name], name) for name in wanted if calls[name][0] is not None]  # no reference: no forward
    for obj, attr, name in wrapped:
        setattr(obj, attr, under_profiler(name, getattr(obj, attr)))  # an instance attribute over the method
    try:
        metrics, wall = timed_step(trainer)
    finally:
        for obj, attr, _ in wrapped:
            delattr(obj, attr)
    emit(measure="profiled_step", side="ours", seconds=round(wall, 3), timing_s=metric_group(metrics, "timing_s", 3),
         profiled=wanted)
    for phase, prof, seconds in profiled:
        for record in profiling.summarize(prof, seconds):
            emit(measure="profile", side="ours", phase=phase, **record)
        emit(measure="idle_gaps", side="ours", phase=phase, **profiling.idle_gaps(prof))


def rollout_probe(trainer, fractions: list, emit) -> None:
    """The rollout phase alone, on one set of prompts, once per (KV memory fraction, adapters merged | off).

    Each line: the switch to rollout (seconds, KV cache allocated), generate's wall seconds, the engine's own
    stats (slots, decode steps, begin seconds = layout + weight refill + graph capture) and the seconds of one
    more refill of the engine's weight copies (with adapters merged: the LoRA merge). `off` runs the base
    weights the way a full fine-tune's engine does (o/down read in place, no merge), in the same process; a
    short untimed call per mode first, so that compiling the engine's functions for it is not measured.
    The actor's engine is rebuilt per line, then once more with the run's own settings.
    """
    from phaserl.models.lora import has_lora
    from phaserl.rollout import RolloutEngine

    actor, run = trainer.actor, trainer.run
    items = run.train_prompts.next_items()
    prompts = [list(item.prompt_ids) for item in items for _ in range(run.n)]
    modes = ("merged", "off") if has_lora(actor.model) else ("full",)
    short = dataclasses.replace(run.sampling, max_new_tokens=min(8, run.sampling.max_new_tokens))
    for mode in modes:
        probe_call(trainer, prompts[:2], short, fractions[0], mode)  # warm-up: compiles, not measured
    for fraction in fractions:
        for mode in modes:
            line = probe_call(trainer, prompts, run.sampling, fraction, mode)
            emit(measure="rollout_probe", side="ours", memory_fraction=fraction, adapters=mode, **line)
    actor.engine.release()
    actor.engine = RolloutEngine(actor.model, actor.engine_config)


def probe_call(trainer, prompts: list, params, fraction: float, mode: str) -> dict:
    """One generate() in rollout mode on a fresh engine of KV memory `fraction`; `mode` off = adapters off."""
    from contextlib import nullcontext

    from phaserl.models.lora import adapters_disabled
    from phaserl.rollout import RolloutEngine
    from phaserl.rollout.runner import fused_weights

    actor, run = trainer.actor, trainer.run
    if actor.engine is not None:
        actor.engine.release()
    actor.engine = RolloutEngine(actor.model, dataclasses.replace(actor.engine_config, memory_fraction=fraction))
    layers = actor.model.model.layers
    with actor.rollout_mode(), (adapters_disabled(actor.model) if mode == "off" else nullcontext()):
        switch = dict(actor.last_switch)
        sync()
        t0 = time.perf_counter()
        actor.generate(prompts, params, eos_token_ids=[] if run.ignore_eos else run.eos_token_ids,
                       pad_token_id=run.pad_token_id, batch_size=len(prompts), generator=run.sampling_generator)
        sync()
        seconds = time.perf_counter() - t0
        runner = actor.engine.runner
        with torch.inference_mode():
            t1 = time.perf_counter()
            runner.weights = [fused_weights(layer, old) for layer, old in zip(layers, runner.weights)]
            sync()
            refill = time.perf_counter() - t1
        stats = engine_stats(actor)
    return dict(seconds=round(seconds, 3), refill_s=round(refill, 4), switch_s=round(switch["seconds"], 3),
                kv_cache_gib=round(switch["kv_cache_gb"], 2), engine=stats, **memory_gib())


def dynamo_counters() -> dict:
    """torch._dynamo's running totals (frames compiled, unique graphs, graph breaks): growth between timed steps
    means recompiles in the steady state."""
    from torch._dynamo.utils import counters

    return {"frames": dict(counters["frames"]), "unique_graphs": counters["stats"].get("unique_graphs", 0),
            "graph_breaks": sum(counters["graph_break"].values())}


def engine_stats(actor) -> dict:
    """The rollout engine's own seconds (generate() alone, graph capture included) and graph count."""
    stats = getattr(getattr(actor, "engine", None), "last_stats", None) or {}
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in stats.items()}


def micro_batch_sweep(trainer, sizes: list, steps: int, sequence_tokens: int, emit) -> None:
    """The update phase at several training micro-batch sizes in this one process (same host, same compiled code,
    same world): one untimed step per size, then `steps` timed. The update does the same device work at every size
    (the same tokens), so its wall time against the number of micro-batches is a line whose slope is the host's
    cost per micro-batch on this machine (launches, Python, allocator) and whose intercept is the rest; emitted as
    `measure=micro_batch_sweep` per size and one `measure=host_cost_per_micro_batch` (least squares). Restores the
    trainer's micro-batch afterwards. Fixed-length sequences assumed (grpo_step's world ignores EOS mostly)."""
    import math
    import statistics

    before, points, run = trainer.run.train_tokens, [], trainer.run
    mini = run.mini_batch_per_rank  # responses per optimizer step (this rank)
    minis = run.responses_per_step // mini // trainer.world_size  # optimizer steps per RL step
    for tokens in sizes:
        trainer.run = dataclasses.replace(trainer.run, train_tokens=tokens)
        updates = []
        for i in range(1 + steps):
            reset_peak()
            metrics, _ = timed_step(trainer)
            if i:
                updates.append(metrics["timing_s/update"])
        micro = run.epochs * minis * math.ceil(mini / max(1, tokens // sequence_tokens))
        update = statistics.median(updates)
        points.append((micro, update))
        emit(measure="micro_batch_sweep", micro_batch_tokens=tokens, micro_batches=micro,
             update_s=round(update, 4), update_s_all=[round(u, 4) for u in updates], **memory_gib())
    trainer.run = dataclasses.replace(trainer.run, train_tokens=before)
    if len({m for m, _ in points}) < 2:
        return
    mx, my = statistics.fmean(m for m, _ in points), statistics.fmean(u for _, u in points)
    slope = sum((m - mx) * (u - my) for m, u in points) / sum((m - mx) ** 2 for m, _ in points)
    emit(measure="host_cost_per_micro_batch", seconds=round(slope, 5), intercept_s=round(my - slope * mx, 4),
         points=[[m, round(u, 4)] for m, u in points])


def _pinned_copies(trainer) -> bool:
    import phaserl.batch

    return phaserl.batch.PIN_HOST_COPIES


def _set_pinned_copies(trainer, on: bool) -> None:
    import phaserl.batch

    phaserl.batch.PIN_HOST_COPIES = on


def _set_train_graphs(trainer, on: bool) -> None:
    """ppo.train_graphs: the actor's TrainGraphs kept across rounds (its graphs are captured once)."""
    from phaserl.roles.train_graphs import TrainGraphs

    actor = trainer.actor
    if on and getattr(actor, "_ab_graphs", None) is None:
        actor._ab_graphs = actor.train_graphs or TrainGraphs(actor.model)
    actor.train_graphs = actor._ab_graphs if on else None


# name -> (read the setting, set it on or off): settings a built trainer can change between steps
AB_SETTINGS = {
    "keep_head_logits": (lambda t: t.actor.keep_head_logits,
                         lambda t, on: setattr(t.actor, "keep_head_logits", on)),  # ppo.keep_head_logits
    "pinned_copies": (_pinned_copies, _set_pinned_copies),  # batch.send
    "train_graphs": (lambda t: t.actor.train_graphs is not None, _set_train_graphs),  # ppo.train_graphs
}


def ab_counts_problem(steps: int, rounds: int):
    """What is wrong with --steps / --ab-rounds for settings_ab (None: nothing); grpo_step.py asks before building."""
    if steps < 1 or rounds < 1:
        return (f"--ab times --steps steps per side in each of --ab-rounds rounds: got --steps {steps}, "
                f"--ab-rounds {rounds}; give both at least 1")
    return None


def settings_ab(trainer, names: list, rounds: int, steps: int, emit) -> None:
    """Each named on/off setting (AB_SETTINGS) alternated in this one process, so that the machine's drift and its
    difference from other machines fall on both sides alike: `rounds` x (on, off), each side one untimed step (a
    kernel the other side does not use compiles there) and `steps` timed. Emits `measure=ab_side` per side and
    round, and `measure=ab` per setting: the medians of all of each side's steps, and on - off. Restores the setting."""
    import statistics

    unknown = sorted(set(names) - set(AB_SETTINGS))
    if unknown:
        raise SystemExit(f"--ab: {unknown} are not settings; choose from {', '.join(AB_SETTINGS)}")
    problem = ab_counts_problem(steps, rounds)
    if problem:
        raise SystemExit(problem)
    for name in names:
        read, write = AB_SETTINGS[name]
        before, seconds = read(trainer), {True: [], False: []}
        for r in range(rounds):
            for on in (True, False):
                write(trainer, on)
                metrics, _ = timed_step(trainer)  # untimed
                side = []
                for _ in range(steps):
                    reset_peak()
                    metrics, wall = timed_step(trainer)
                    side.append(wall)
                seconds[on] += side
                emit(measure="ab_side", setting=name, on=on, round=r, s_all=[round(x, 4) for x in side],
                     timing_s=metric_group(metrics, "timing_s", 3), **memory_gib())
        write(trainer, before)
        on_s, off_s = statistics.median(seconds[True]), statistics.median(seconds[False])
        emit(measure="ab", setting=name, on_s=round(on_s, 4), off_s=round(off_s, 4),
             on_minus_off_s=round(on_s - off_s, 4),
             steps_per_side=len(seconds[True]))
