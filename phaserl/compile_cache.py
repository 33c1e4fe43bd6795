"""torch.compile's persistent caches in phaserl's cache directory, so that the compile warm-up is paid once per
machine, not once per run; and the console lines around it (before: a cold compile is coming and roughly how
long it takes; after the first step: how long it took and what the cache served).

    cache = enable_compile_cache("~/.cache/phaserl/torch-compile")  # before the first compile of the process
    watch = CompileWatch("the decoder layers", key, cache, device_type="cuda")
    log.info(watch.announce())                                      # cold or warm, and where the cache is
    ... first step ...
    log.info(watch.step_done(seconds))                              # measured; remembered for the next run

What torch caches (2.11 and 2.13 turn these on by default, under /tmp/torchinductor_$USER, which many machines
wipe): inductor's FX graph cache (generated code per graph), the AOTAutograd cache (forward + backward graphs),
autotuning results and the compiled Triton / C++ kernels, all under TORCHINDUCTOR_CACHE_DIR. This module points
that variable at phaserl's directory (unless the user set it) and leaves the caches' own switches
(TORCHINDUCTOR_FX_GRAPH_CACHE=0 etc.) alone. Dynamo still traces the Python code on every run (seconds) and the
rollout engine re-captures its CUDA graphs (they cannot be saved); what a warm run skips is code generation
and kernel compilation, most of the cost.

Safety. The cache holds code that torch generated and will execute (Python modules, shared libraries): a cache
directory is trusted like the Python environment itself. phaserl executes nothing from it on its own: it reads
one JSON file it wrote (`phaserl-warm-start.json`, timings only) and lets torch's own cache do the rest.
`torch.compiler.save_cache_artifacts` / `load_cache_artifacts` (the "mega-cache", one pickled blob to carry
caches between machines) are not used: per machine the on-disk caches already hold the same, and loading a blob
means unpickling a file. An unwritable directory gives a warning and torch's default directory; a corrupt entry
that torch itself cannot load (it recompiles corrupt graph entries on its own, but fails on a corrupt generated
module) is caught by `guard_compiled`, which moves the directory aside with a warning and compiles cold.
Not here: deciding whether to compile (config/auto.py, trainer/speed.py) or the compile calls themselves.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

log = logging.getLogger("phaserl")

ENV = "TORCHINDUCTOR_CACHE_DIR"
RECORD = "phaserl-warm-start.json"       # key -> the first step's timings of the last run with that key
COLD_ESTIMATE_S = {"cuda": 40, "cpu": 60}  # a cold compile, roughly (0.5B on an H200: decoder + engine layers)


@dataclass(frozen=True)
class CacheDir:
    """The directory torch's compile caches use in this process, and where it came from."""

    path: Optional[str]   # None: torch's default (phaserl's directory could not be used: `problem`)
    source: str           # "phaserl" | "TORCHINDUCTOR_CACHE_DIR" (set by the user) | "torch default"
    problem: str = ""

    def words(self) -> str:
        if self.path is None:
            return "torch's default cache directory"
        return self.path if self.source == "phaserl" else f"{self.path} ({self.source})"


_ACTIVE: Optional[CacheDir] = None


def _torch_default() -> Optional[str]:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        return os.path.abspath(default_cache_dir())
    except (ImportError, AttributeError):
        return None


def _writable(path: str) -> str:
    """'' when files can be created in `path` (made if missing), else why not."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".phaserl-probe-"):
            pass
        return ""
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def enable_compile_cache(directory: str) -> CacheDir:
    """Point torch's compile caches at `directory` for this process (once; later calls return the first
    answer). A TORCHINDUCTOR_CACHE_DIR the user set wins. Never raises: a directory that cannot be written gives
    a warning and torch's default."""
    global _ACTIVE
    if _ACTIVE is not None:
        return _ACTIVE
    directory = os.path.abspath(os.path.expanduser(directory))
    given = os.environ.get(ENV)
    if given and os.path.abspath(given) not in (_torch_default(), directory):  # torch writes its default there
        _ACTIVE = CacheDir(os.path.abspath(given), "TORCHINDUCTOR_CACHE_DIR")
        return _ACTIVE
    problem = _writable(directory)
    if problem:
        log.warning(f"compile cache: {directory} cannot be written ({problem}); torch.compile uses its default "
                    f"directory ({_torch_default()}) instead, so later runs may compile cold again. Set "
                    "PHASERL_CACHE_DIR (or TORCHINDUCTOR_CACHE_DIR) to a writable directory")
        _ACTIVE = CacheDir(None, "torch default", problem)
        return _ACTIVE
    os.environ[ENV] = directory
    _clear_torch_memo()
    _ACTIVE = CacheDir(directory, "phaserl")
    return _ACTIVE


def _clear_torch_memo() -> None:
    """Forget cache paths torch memoized in this process (only matters when something compiled before)."""
    import sys

    if "torch._inductor.utils" in sys.modules:
        try:
            sys.modules["torch._inductor.utils"].clear_caches()
        except AttributeError:
            pass


# ----- a corrupt cache: move it aside and compile cold ------------------------------------------------------
def _chain(exc: Optional[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and all(exc is not e for e in out):
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _raised_in(exc: BaseException, path: str) -> bool:
    """True when `exc`'s message or one of its traceback frames names a file under `path`."""
    if path in str(exc):
        return True
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(path + os.sep):
            return True
        tb = tb.tb_next
    return False


def _cache_failure(exc: BaseException, path: str) -> bool:
    """A failure of torch.compile itself (not of the compiled code running) caused by a file in the cache
    directory `path`: a compile error in the chain, and some exception of the chain names or ran that file."""
    import torch._dynamo.exc as dynamo_exc

    kinds = tuple(k for k in (getattr(dynamo_exc, "BackendCompilerFailed", None), _inductor_error()) if k)
    chain = _chain(exc)
    return any(isinstance(e, kinds) for e in chain) and any(_raised_in(e, path) for e in chain)


def _inductor_error():
    try:
        from torch._inductor.exc import InductorError
        return InductorError
    except ImportError:
        return None


def quarantine(reason: str) -> Optional[str]:
    """Move the active cache directory aside (to `<dir>.corrupt-<time>`) and start an empty one; returns where
    it went (None when there was nothing of phaserl's to move)."""
    cache = _ACTIVE
    if cache is None or cache.path is None:
        return None
    aside = f"{cache.path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    try:
        os.replace(cache.path, aside)
        os.makedirs(cache.path, exist_ok=True)
    except OSError as exc:
        log.warning(f"compile cache: could not move {cache.path} aside ({exc})")
        return None
    log.warning(f"compile cache: {cache.path} could not be loaded ({reason}); moved it to {aside} and compiling "
                "cold (delete the moved directory once you no longer need it)")
    _clear_torch_memo()
    return aside


def guard_compiled(compiled: Callable) -> Callable:
    """`compiled` (a torch.compile'd function) that survives a corrupt cache: when torch.compile fails (a backend
    or inductor error, not an error of the compiled code running) because of a file in the active cache
    directory (named in a message or a traceback frame), the directory is moved aside, dynamo forgets what it
    compiled, and the call runs again: the failure happened while compiling, before anything ran. Other errors
    pass through, and so does a second failure."""
    def call(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except Exception as exc:
            cache = _ACTIVE
            if cache is None or cache.path is None or not _cache_failure(exc, cache.path):
                raise
            if quarantine(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") is None:
                raise
            torch._dynamo.reset()
            return compiled(*args, **kwargs)

    call.__wrapped__ = compiled
    return call


def specialize_floats() -> None:
    """Make dynamo treat the Python floats it reads as constants in every compile of this process from now on
    (torch._dynamo.config.specialize_float = True, torch's default before 2.6; phaserl also raises recompile_limit
    process-wide, rollout/runner.py). Called wherever phaserl compiles.

    Why: under dynamic=True torch 2.6+ makes such a float (a layer's `spec.eps`) a symbolic input, and an op that
    needs the number (rms_norm's eps) makes the tensorify pass restart the frame's whole analysis after AOTAutograd
    has traced the joint graph once for nothing: every compile and recompile paid twice, and the discarded trace
    misses the AOTAutograd cache on every run (CPU warm-start smoke: 11 AOT compiles of which 4 thrown away, warm
    first step 7.9 s; with floats constant 7 of 7, 4.8-5.3 s). Dynamo guards on each float's value instead, so a
    model with another eps, or a new sampling temperature, compiles its own graph."""
    import torch._dynamo  # noqa: F401  (seconds to import: only when compiling)

    torch._dynamo.config.specialize_float = True


# ----- the console lines around the first compiled step -----------------------------------------------------
# dynamo's timers (torch._dynamo.utils.compilation_time_metrics) the report splits the compile into; the names
# are torch's own (2.11, 2.13) and may change: a missing one reads 0
TIMERS = {"compile_s": "_compile.compile_inner", "tracing_s": "bytecode_tracing",
          "cache_load_s": "PyCodeCache.load_by_key_path", "kernel_build_s": "compile_file"}


def _timers() -> dict:
    """Seconds so far in this process per TIMERS entry (0 when torch keeps no such timer)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {k: 0.0 for k in TIMERS}
    return {k: float(sum(compilation_time_metrics.get(name, []))) for k, name in TIMERS.items()}


def _cache_counts() -> tuple[int, int]:
    """(hits, misses) of inductor's FX graph cache in this process so far."""
    try:
        from torch._dynamo.utils import counters
        return int(counters["inductor"]["fxgraph_cache_hit"]), int(counters["inductor"]["fxgraph_cache_miss"])
    except (ImportError, AttributeError, KeyError):
        return 0, 0


def _read_records(path: str) -> dict:
    try:
        with open(path) as f:
            records = json.load(f)
        return records if isinstance(records, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # a damaged record only costs the estimate
        log.warning(f"compile cache: ignoring {path} ({type(exc).__name__}: {exc})")
        return {}


class CompileWatch:
    """The compile warm-up of one run: what is compiled (`what`, for the console), under which `key` (torch
    version, device, model shape: what makes the cache hit) and in which cache."""

    def __init__(self, what: str, key: str, cache: CacheDir, *, device_type: str):
        self.what, self.key, self.cache, self.device_type = what, key, cache, device_type
        self.record_path = os.path.join(cache.path, RECORD) if cache.path else None
        self.previous = _read_records(self.record_path).get(key) if self.record_path else None
        self.report: Optional[dict] = None  # the first step's measurements, once step_done ran
        self._start = (_timers(), *_cache_counts())

    @property
    def cold(self) -> bool:
        """No earlier run with this key wrote its timings to this cache (the compile will likely be cold)."""
        return not isinstance(self.previous, dict)

    def announce(self) -> str:
        if self.cold:
            return (f"compile: compiling {self.what} (first run on this machine: "
                    f"~{COLD_ESTIMATE_S[self.device_type]} s; cached afterwards in {self.cache.words()})")
        last = self.previous.get("first_step_s")
        last = f"; the first step took {last:.1f} s then" if isinstance(last, (int, float)) else ""
        return f"compile: compiling {self.what} from the cache in {self.cache.words()} (compiled here before{last})"

    def step_done(self, seconds: float) -> Optional[str]:
        """After the first step (later calls: None): the measured line; the timings are kept for the next run."""
        if self.report is not None:
            return None
        timers, hits, misses = _timers(), *_cache_counts()
        self.report = {"first_step_s": round(seconds, 2),
                       **{k: round(v - self._start[0][k], 2) for k, v in timers.items()},
                       "cache_hits": hits - self._start[1], "cache_misses": misses - self._start[2],
                       "cold": self.cold, "torch": torch.__version__}
        self._remember()
        r = self.report
        return (f"compile: first step {r['first_step_s']:.1f} s, of which torch.compile {r['compile_s']:.1f} s "
                f"(inductor graph cache: {r['cache_hits']} hits, {r['cache_misses']} misses)")

    def _remember(self) -> None:
        if self.record_path is None:
            return
        records = _read_records(self.record_path)
        records[self.key] = {**self.report, "written": time.strftime("%Y-%m-%d %H:%M:%S")}
        tmp = f"{self.record_path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(records, f, indent=1, sort_keys=True)
            os.replace(tmp, self.record_path)
        except OSError as exc:
            log.warning(f"compile cache: could not write {self.record_path} ({exc})")

