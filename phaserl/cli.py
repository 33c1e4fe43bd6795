"""The `phaserl` command line: quickstart, train, doctor, config --explain, export, report, train-rm, sft.

Each subcommand parses its arguments and calls one library function; nothing imports this module.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

log = logging.getLogger("phaserl")

QUICKSTART_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "world", "quickstart.yaml")
QUICKSTART_CONFIGS = {"arith": QUICKSTART_CONFIG,  # --task: single-turn arithmetic; multi-turn retry (docs/agents.md)
                      "agent": os.path.join(os.path.dirname(QUICKSTART_CONFIG), "agent_quickstart.yaml")}

DELEGATED = {"export": ("phaserl.checkpoint", "cli_export"), "report": ("phaserl.report", "cli_report"),
             "train-rm": (__name__, "cli_train_rm")}


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)


def cmd_config(args) -> int:
    from .config import explain, load_config, to_yaml

    cfg = load_config(args.config, args.overrides, world_size=args.world_size)
    print(explain(cfg, world_size=args.world_size) if args.explain else to_yaml(cfg))
    return 0


def _preflight(config_path, overrides, world_size: int) -> list:
    """Run the doctor's checks; print them on rank 0.  The FAIL results ([] when nothing FAILed)."""
    from .doctor import FAIL, format_report, load_doctor_config, run_doctor
    from .parallel import rank_and_world

    results = run_doctor(load_doctor_config(config_path, overrides), world_size=world_size)
    if rank_and_world()[0] == 0:
        print(format_report(results), flush=True)
    return [r for r in results if r.status == FAIL]


def cmd_doctor(args) -> int:
    from .parallel.launch import destroy, init_distributed

    _, world = init_distributed()  # under torchrun the shared-path check runs across ranks
    try:
        return 1 if _preflight(args.config, args.overrides, world) else 0
    finally:
        destroy()


def cmd_train(args) -> int:
    from .config import load_config
    from .parallel.launch import destroy, init_distributed, rank_errors
    from .trainer import RLTrainer

    if args.defaults:  # no file: the first positional word is an override too
        args.overrides = ([args.config] if args.config is not None else []) + list(args.overrides)
        args.config = None
    elif args.config is None:
        print("phaserl train: error: give a CONFIG file (or --defaults for the built-in defaults)", file=sys.stderr)
        return 2
    rank, world = init_distributed()  # (0, 1) without torchrun
    try:
        failed = [] if args.skip_doctor else _preflight(args.config, args.overrides, world)
        if failed:  # the reason last, not in the middle of the report
            from .doctor import format_failures

            if rank == 0:
                print(f"phaserl train: stopped before training: {len(failed)} preflight check(s) FAILed:\n"
                      f"{format_failures(failed)}\nfix {'them' if len(failed) > 1 else 'it'}, or pass --skip-doctor "
                      "to train anyway", file=sys.stderr)
            return 1
        cfg = load_config(args.config, args.overrides, world_size=world)
        with rank_errors():
            trainer = RLTrainer.from_config(cfg)  # loads and checks every input before the run writes a file
            if rank == 0:
                _write_resolved_config(cfg, cfg.trainer.log_dir)
            trainer.fit()
        if rank == 0 and (line := held_out_line(trainer)):
            log.info(line)  # the run's last line, as the quickstart's
        return 0
    finally:
        destroy()


def held_out_line(trainer, seconds: float | None = None) -> str:
    """'held-out score (greedy, 200 prompts): before 0.360 -> after 0.965 (+0.605)' from the run's validations
    (the first and the last of this process; a resumed run names their steps), or '' when it did not validate."""
    history = trainer.val_history
    if not history:
        return ""
    run = trainer.run
    how = "greedy" if run.val_sampling.temperature == 0 else f"temperature {run.val_sampling.temperature:g}, " \
                                                               f"{run.val_n} sample(s) each"
    if trainer.world_size == 1:
        how += f", {len(run.val_prompts)} prompts"
    (first_step, first), (last_step, last) = history[0], history[-1]
    before, after = first["val/score_mean"], last["val/score_mean"]
    took = "" if seconds is None else (f" in {seconds:.0f} s" if seconds < 120 else f" in {seconds / 60:.1f} min")
    if len(history) == 1:
        return f"held-out score ({how}): {after:.3f} at step {last_step}{took}"
    names = ("before", "after") if first_step == 0 else (f"step {first_step}", f"step {last_step}")
    return (f"held-out score ({how}): {names[0]} {before:.3f} -> {names[1]} {after:.3f} ({after - before:+.3f})"
            f"{took}")


def _write_resolved_config(cfg, log_dir: str) -> None:
    """`{log_dir}/config.yaml`, the run's resolved config; called only once every input has loaded."""
    from .config import dump_yaml
    from .errors import ConfigError

    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError as exc:  # an existing file in the way, or no permission (the doctor says so too)
        raise ConfigError(f"trainer.log_dir={log_dir!r} cannot be used as a directory ({exc.strerror}); point it "
                          "at a writable directory") from None
    dump_yaml(cfg, os.path.join(log_dir, "config.yaml"))


def cmd_quickstart(args) -> int:
    from .config import load_config
    from .trainer import RLTrainer
    from .world import prepare_tiny_world

    t0 = time.perf_counter()
    prepare_tiny_world()
    out = args.out
    overrides = [f"trainer.log_dir={out}", f"trainer.checkpoint_path={os.path.join(out, 'checkpoints')}",
                 f"trainer.device={args.device}", *args.overrides]
    cfg = load_config(QUICKSTART_CONFIGS[args.task], overrides)  # the tiny world's recipe, then the user's overrides
    trainer = RLTrainer.from_config(cfg)  # a bad --device or override fails here, before anything is written
    if os.path.isdir(cfg.trainer.checkpoint_path):
        log.info(f"{out} holds an earlier quickstart run: it resumes from its newest checkpoint "
                 "(pass a new --out to train again from the start)")
    _write_resolved_config(cfg, out)
    task = "multi-turn retry" if args.task == "agent" else "arithmetic"
    log.info(f"phaserl quickstart: GRPO on the built-in tiny {task} task, {cfg.trainer.total_steps} steps "
             f"on {args.device}; resolved config in {os.path.join(out, 'config.yaml')}")
    trainer.fit()
    scores = held_out_line(trainer, time.perf_counter() - t0) or "no validation ran"
    log.info(f"{scores}; metrics in {os.path.join(out, 'metrics.jsonl')}")
    return 0


def cmd_sft(args) -> int:
    from .world.build import regenerate_assets

    regenerate_assets()
    return 0


def _delegate(module: str, function: str, argv: list) -> int:
    """Subcommands that parse their own arguments (export, report, train-rm)."""
    import importlib

    return getattr(importlib.import_module(module), function)(argv)


def cli_train_rm(argv: list[str]) -> int:
    """`phaserl train-rm [CFG] [key=value ...]`; errors are raised as phaserl errors for `main` to print."""
    from .resolve import resolve_rm_config
    from .rm import load_rm_config, run_train_rm

    parser = argparse.ArgumentParser(prog="phaserl train-rm",
                                     description="Train a Bradley-Terry reward model on preference pairs and "
                                                 "export it as a Hugging Face sequence-classification directory.")
    parser.add_argument("args", nargs="*", metavar="[CFG] [key=value ...]",
                        help="a train-rm YAML file (optional: the defaults train the tiny-world RM), then overrides")
    parsed = parser.parse_args(argv)
    path = parsed.args[0] if parsed.args and "=" not in parsed.args[0] else None
    overrides = parsed.args[1:] if path is not None else parsed.args
    run_train_rm(resolve_rm_config(load_rm_config(path, overrides)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phaserl", description="RL post-training for LLMs, phase by phase.")
    sub = p.add_subparsers(dest="command", required=True)

    q = sub.add_parser("quickstart", help="GRPO on the built-in tiny task; prints the held-out score before/after")
    q.add_argument("--out", default="runs/quickstart", help="run directory (metrics.jsonl, config.yaml)")
    q.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    q.add_argument("--task", default="arith", choices=sorted(QUICKSTART_CONFIGS),
                   help="arith: single-turn addition; agent: multi-turn episodes with an environment's feedback")
    q.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    q.set_defaults(fn=cmd_quickstart)

    t = sub.add_parser("train", help="run RL training from a YAML config")
    t.add_argument("config", nargs="?", default=None, help="the YAML config (omit it with --defaults)")
    t.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. ppo.mini_batch_size=16 rollout.n=8")
    t.add_argument("--skip-doctor", action="store_true", help="do not run the preflight checks first")
    t.add_argument("--defaults", action="store_true", help="no config file: the built-in defaults plus the overrides")
    t.set_defaults(fn=cmd_train)

    d = sub.add_parser("doctor", help="preflight: check the five classic mistakes and the rest without training")
    d.add_argument("config")
    d.add_argument("overrides", nargs="*")
    d.set_defaults(fn=cmd_doctor)

    c = sub.add_parser("config", help="print the resolved config; --explain adds the batch arithmetic")
    c.add_argument("config", nargs="?", default=None)
    c.add_argument("overrides", nargs="*")
    c.add_argument("--explain", action="store_true", help="print derived batch sizes and what each means")
    c.add_argument("--world-size", type=int, default=1, help="number of ranks to explain for")
    c.set_defaults(fn=cmd_config)

    e = sub.add_parser("export", add_help=False,
                       help="write a checkpoint's actor (or --critic) as a Hugging Face directory")
    e.add_argument("args", nargs=argparse.REMAINDER)
    e.set_defaults(fn=lambda a: _delegate(*DELEGATED["export"], a.args))

    r = sub.add_parser("report", add_help=False, help="plot a run's metrics.jsonl to report.png")
    r.add_argument("args", nargs=argparse.REMAINDER)
    r.set_defaults(fn=lambda a: _delegate(*DELEGATED["report"], a.args))

    m = sub.add_parser("train-rm", add_help=False, help="train a reward model (Bradley–Terry) on preference pairs")
    m.add_argument("args", nargs=argparse.REMAINDER)
    m.set_defaults(fn=lambda a: _delegate(*DELEGATED["train-rm"], a.args))

    s = sub.add_parser("sft", help="rebuild the tiny world's warm-started model (supervised) from scratch")
    s.set_defaults(fn=cmd_sft)
    return p


def main(argv=None) -> int:
    from .errors import PhaserlError

    _setup_logging()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:  # these parse their own arguments, --help included
        module, function = DELEGATED[argv[0]]
        try:
            return _delegate(module, function, argv[1:])
        except PhaserlError as exc:
            print(f"phaserl {argv[0]}: error: {exc}", file=sys.stderr)
            return 1
    args = build_parser().parse_args(argv)
    from .parallel import RankFailure
    from .trainer.oom import SCREEN_TITLE
    from .trainer.stop import RunStopped

    previous = signal.signal(signal.SIGTERM, _terminated) if _main_thread() else None
    try:
        return args.fn(args)
    except PhaserlError as exc:
        print(f"phaserl {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except RankFailure as exc:  # under torchrun: a rank's out-of-memory screen, on it and on the ranks it stopped
        if SCREEN_TITLE not in str(exc):
            raise
        print(f"phaserl {args.command}: {exc}", file=sys.stderr)
        return 1
    except RunStopped as stop:  # SIGINT/SIGTERM during training: stopped at a safe point (trainer/stop.py)
        if _rank() == 0:
            print(f"phaserl {args.command}: {stop}", file=sys.stderr)
        return stop.exit_code
    except (KeyboardInterrupt, _Terminated) as exc:  # outside the training loop: nothing half-written to keep
        signum = signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT
        name = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        print(f"phaserl {args.command}: stopped by {name} outside the training loop; no checkpoint was being "
              "written, so nothing is left half-done", file=sys.stderr)
        return 128 + signum
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class _Terminated(BaseException):
    """SIGTERM outside fit() (which handles it itself): a clean exit with a line instead of a silent death."""


def _terminated(signum, frame):
    raise _Terminated()


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))  # the process group is gone by the time an exception gets here


if __name__ == "__main__":
    sys.exit(main())
