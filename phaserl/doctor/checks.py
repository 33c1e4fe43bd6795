"""The doctor's checks on the config and the loaded policy: one function per check, one `CheckResult` each.

Every check takes the shared `Context` (the config, the world size, and what earlier checks loaded:
device, tokenizer, policy, training rows, reward-model shape). A check that needs something an
earlier check failed to load is skipped with a WARN; a check that raises a phaserl error becomes a
FAIL carrying that error's message. Nothing here trains. Checks that run things on real rows (data,
rewards, reference, memory) are in `probes.py`; the order is `phaserl.doctor.CHECKS`; the memory
arithmetic is `memory.py`, the formatting `report.py`.
"""
from __future__ import annotations

import functools
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from ..config import Config, Derived, check_context_length, derive, validate
from ..config.invariance import same_samples_world_sizes
from ..errors import ConfigError, PhaserlError
from ..memory.budget import fmt_bytes, free_memory_bytes
from ..models import linear_attention, load_pretrained, load_tokenizer
from ..parallel import rank_and_world
from ..resolve import DTYPES, resolve_device, resolve_model_path
from ..roles.parallel_settings import FSDPSettings
from ..roles.reward_scoring import native_support
from .report import FAIL, OK, WARN, CheckResult


@dataclass
class Context:
    cfg: Config
    world_size: int
    device: Any = None            # torch.device, once `device` passed
    free_bytes: Optional[int] = None  # free device memory measured before anything was loaded
    tokenizer: Any = None
    policy: Any = None            # the loaded policy (CausalLM or HFCausalLM)
    train_rows: Optional[list] = None
    rm_shape: Any = None          # memory.ModelShape of the reward model, once probed
    rm_engine: Optional[str] = None   # phaserl | transformers: what the reward model loaded as, once probed
    rm_packed: Optional[bool] = None  # whether the run packs the RM's micro-batches (phaserl engine)
    problems: Optional[list] = None   # broken cross-field rules of `validate`, once run
    config_warnings: list = field(default_factory=list)


LABELS = {"free_bytes": "device", "train_rows": "training rows", "policy": "policy model"}


def check(name: str, needs: tuple = ()):
    """Name a check; skip it when `needs` (Context attributes) were not loaded; turn errors into FAIL."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(ctx: Context) -> CheckResult:
            missing = [LABELS.get(n, n) for n in needs if getattr(ctx, n) is None]
            if missing:
                return CheckResult(name, WARN, f"skipped: needs the {' and '.join(missing)}, which did not load "
                                              "(see the FAIL above)")
            try:
                return fn(ctx)
            except PhaserlError as exc:
                return CheckResult(name, FAIL, str(exc))
            except Exception as exc:  # the doctor reports; it never ends in a traceback
                return CheckResult(name, FAIL, f"{type(exc).__name__}: {exc}")
        run.check_name = name
        return run
    return wrap


def short(text: str, limit: int = 100) -> str:
    return repr(text) if len(text) <= limit else f"{text[:limit - 30]!r} ... {text[-25:]!r}"


def reward_model_engine(cfg: Config) -> str:
    """reward_model.engine, with auto decided the way the loader decides it (the RM directory's
    config.json); auto stays when there is no directory to read yet (e.g. the built-in 'tiny' RM)."""
    rm = cfg.reward_model
    if rm.engine != "auto" or not rm.path or not os.path.isdir(rm.path):
        return rm.engine
    return "transformers" if native_support(rm.path) else "phaserl"


def roles_enabled(cfg: Config) -> tuple[bool, bool]:
    """(critic on, reference on), resolving the null defaults as `derive` does."""
    critic = cfg.critic.enable if cfg.critic.enable is not None else cfg.algorithm.adv_estimator == "gae"
    ref = cfg.ref.enable if cfg.ref.enable is not None else cfg.algorithm.kl_placement != "none"
    return critic, ref


# ---- config-only checks -------------------------------------------------------------------------
# The cross-field rules of `config.validate` are run once; each broken rule is reported by the check
# that owns its keys (the first key its message names), the rest by "config rules".
OWNERS = {"parallel settings": ("critic.hybrid_engine",),
          "batch sizes": ("world_size", "rollout.prompts_per_step", "ppo.")}


def config_problems(ctx: Context, owner: str) -> list[str]:
    """The broken cross-field rules whose message starts with a key `owner` owns."""
    if ctx.problems is None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                validate(ctx.cfg, ctx.world_size, source="config")
                ctx.problems = []
            except ConfigError as exc:
                ctx.problems = split_problems(str(exc))
        ctx.config_warnings = [str(w.message).removeprefix("config: ") for w in caught]

    def owned_by(problem: str) -> str:
        return next((name for name, keys in OWNERS.items() if problem.startswith(keys)), "config rules")
    return [p for p in ctx.problems if owned_by(p) == owner]


def split_problems(text: str) -> list[str]:
    """The rules of a `validate` ConfigError ('config: N problems:\n  - ...' or 'config: one problem')."""
    text = text.removeprefix("config: ")
    head, sep, rest = text.partition(" problems:\n")
    if sep and head.isdigit():
        return [line.removeprefix("  - ") for line in rest.split("\n")]
    return [text]


def _problems_result(name: str, problems: list[str], fix: str = "", details: tuple = ()) -> CheckResult:
    message = problems[0] if len(problems) == 1 else f"{len(problems)} problems:\n" + "\n".join(
        f"- {p}" for p in problems)
    return CheckResult(name, FAIL, message, fix=fix, details=details)


@check("config rules")
def check_config_rules(ctx: Context) -> CheckResult:
    problems = config_problems(ctx, "config rules")
    if problems:
        return _problems_result("config rules", problems)
    if ctx.config_warnings:
        return CheckResult("config rules", WARN, f"{len(ctx.config_warnings)} setting(s) are ignored or wasted",
                           details=tuple(ctx.config_warnings))
    return CheckResult("config rules", OK, f"the cross-field rules hold (world_size = {ctx.world_size})")


@check("parallel settings")
def check_parallel_settings(ctx: Context) -> CheckResult:
    """Classic mistake 1: each role its own FSDP settings; only the actor switches modes."""
    cfg = ctx.cfg
    critic_on, ref_on = roles_enabled(cfg)

    def line(role: str, fsdp, on: bool = True, extra: str = "") -> str:
        s = FSDPSettings.from_any(fsdp, role=role)
        state = "" if on else "   (role off)"
        return (f"{role:<7} {s.sharding_strategy}, cpu_offload={s.cpu_offload}, param_dtype={s.param_dtype}, "
                f"reshard_after_forward={s.reshard_after_forward}{extra}{state}")

    switch = cfg.actor.hybrid_engine.enable_rollout_optimization_switch
    problems = config_problems(ctx, "parallel settings")
    if ctx.world_size == 1:  # nothing is sharded in one process: the FSDP table would describe settings not in force
        message = ("one process: no sharding (each role's FSDP settings apply from 2 ranks on); only the actor "
                   f"switches between rollout and training (actor.hybrid_engine: {'on' if switch else 'off'})")
        return _problems_result("parallel settings", problems) if problems else \
            CheckResult("parallel settings", OK, message)
    details = (line("actor", cfg.actor.fsdp, extra=f"; switches rollout/training: {str(switch).lower()}"),
               line("critic", cfg.critic.fsdp, critic_on, "; never switches"),
               line("ref", cfg.ref.fsdp, ref_on, "; frozen, never switches"),
               line("rm", cfg.reward_model.fsdp, cfg.reward_model.enable, "; forward only, never switches"))
    if problems:
        return _problems_result("parallel settings", problems, details=details)
    return CheckResult("parallel settings", OK, "each role has its own FSDP settings; only the actor switches "
                                                "between rollout and training", details=details)


@check("batch sizes")
def check_batch_sizes(ctx: Context) -> CheckResult:
    """Classic mistake 4: one size per phase, and the arithmetic between them holds."""
    problems = config_problems(ctx, "batch sizes")
    if problems:
        return _problems_result("batch sizes", problems, fix="see memory below for the sizes that fit this machine")
    cfg, r, ppo = ctx.cfg, ctx.cfg.rollout, ctx.cfg.ppo
    d = derive(cfg, ctx.world_size, reward_model_engine=reward_model_engine(cfg) if cfg.reward_model.enable else None)
    rm = f"{_scoring_calls(cfg, d)}, " if cfg.reward_model.enable else ""
    same = same_samples_world_sizes(r.prompts_per_step, r.batch_size)
    per_rank = r.prompts_per_step // ctx.world_size
    samples = (f"rollout samples are the same on {', '.join(map(str, same))} rank(s), where rollout.batch_size = "
               f"{r.batch_size} divides the prompts per rank" if same else
               f"rollout.batch_size = {r.batch_size} divides the prompts per rank on no world size")
    message = (f"{d.responses_per_step} responses per step ({r.prompts_per_step} prompts × {r.n}); per rank: "
               f"{d.generate_calls_per_rank} generate call(s) of ≤ {r.batch_size} prompts, {rm}"
               f"{d.optimizer_steps_per_rl_step} optimizer step(s) of {d.mini_batch_per_rank} responses in ≤ "
               f"{d.max_grad_accum_steps} micro-batch(es) of {ppo.micro_batch_tokens or 'auto'} tokens"
               + (" (auto: decided on the machine; the memory check says what)"
                  if ppo.micro_batch_tokens is None else ""))
    if ctx.world_size > 1 and per_rank % r.batch_size:
        return CheckResult("batch sizes", WARN, (
            f"rollout.batch_size = {r.batch_size} does not divide the {per_rank} prompts per rank: generate calls "
            "start at other prompts than on 1 rank, so the samples (and the run) differ from a run, or a resume, "
            "on another number of ranks"), fix=f"set rollout.batch_size to a divisor of {per_rank} (e.g. "
            f"{math.gcd(per_rank, r.batch_size)}) if runs must agree across world sizes", details=(message, samples))
    return CheckResult("batch sizes", OK, message, details=(samples,))


def _scoring_calls(cfg: Config, d: Derived) -> str:
    """The reward model's forwards per rank per step, in the unit of the key that sizes them."""
    rm, calls = cfg.reward_model, d.reward_model_scoring_calls_per_rank
    if d.reward_model_engine == "transformers":
        return f"{calls} reward-model call(s) of ≤ {rm.batch_size} sequences (reward_model.batch_size)"
    held = (f"{d.reward_model_inputs_per_call} full-length input(s) of reward_model.max_length = {rm.max_length} "
            "tokens each")
    if d.reward_model_engine == "phaserl":
        return (f"≤ {calls} reward-model forward(s) of ≤ {rm.micro_batch_tokens} tokens "
                f"(reward_model.micro_batch_tokens: {held})")
    return (f"≤ {calls} reward-model call(s) (reward_model.engine = auto, not decided yet: ≤ {rm.batch_size} "
            f"sequences per call with transformers, ≤ {rm.micro_batch_tokens} tokens with phaserl's decoder)")


@check("shared paths")
def check_shared_paths(ctx: Context) -> CheckResult:
    """Classic mistake 5: every rank must see the same checkpoint and log directories."""
    t = ctx.cfg.trainer
    paths = {"trainer.checkpoint_path": t.checkpoint_path, "trainer.log_dir": t.log_dir}
    rank, world = rank_and_world()
    if world > 1:
        from ..parallel.shared_storage import check_shared_paths as check_on_all_ranks

        check_on_all_ranks(paths, rank=rank, world_size=world)
        return CheckResult("shared paths", OK, f"all {world} ranks see the same {' and '.join(paths)}")
    fix = "on several nodes put them on storage every node mounts (NFS, Lustre), e.g. /shared/ckpt/run1"
    if ctx.world_size > 1:
        return CheckResult("shared paths", WARN, f"not verified: world_size = {ctx.world_size} but the doctor runs "
                           f"in one process", fix=f"run it the way you train (torchrun --nproc-per-node ... -m "
                           f"phaserl doctor CONFIG) so that every rank checks the paths; {fix}")
    relative = [k for k, v in paths.items() if not os.path.isabs(v)]
    note = f" ({', '.join(relative)} relative to {os.getcwd()})" if relative else ""
    # One process shares nothing, so a node-local path is no problem here, and multi-node advice is not for this
    # run (what matters is the run in front of the doctor; docs/distributed.md has the rest).
    return CheckResult("shared paths", OK, f"single process: nothing to share{note}")


# ---- loading: device, tokenizer, policy ---------------------------------------------------------

@check("device")
def check_device(ctx: Context) -> CheckResult:
    ctx.device = resolve_device(ctx.cfg.trainer.device)
    ctx.free_bytes = free_memory_bytes(ctx.device)
    what = "RAM available" if ctx.device.type == "cpu" else "free"
    return CheckResult("device", OK, f"{ctx.device}: {fmt_bytes(ctx.free_bytes)} {what}")


@check("model", needs=("device",))
def check_model(ctx: Context) -> CheckResult:
    m = ctx.cfg.model
    model_dir, t0 = resolve_model_path(m.path), time.perf_counter()
    ctx.policy = load_pretrained(model_dir, dtype=DTYPES[m.dtype], device=ctx.device,
                                 trust_remote_code=m.trust_remote_code, implementation=m.implementation,
                                 allow_random_init=m.allow_random_init)
    seconds = time.perf_counter() - t0
    ctx.tokenizer = load_tokenizer(resolve_model_path(m.tokenizer_path or m.path),
                                   trust_remote_code=m.trust_remote_code)
    params = sum(p.numel() for p in ctx.policy.parameters())
    kind = "transformers fallback" if hasattr(ctx.policy, "hf_model") else "native decoder"
    line = (f"{ctx.policy.config.model_type}, {params / 1e6:.2f}M parameters ({kind}, {m.dtype}) loaded from "
            f"{model_dir} in {seconds:.1f} s")
    trouble = _transformers_delta_rule_trouble(ctx.policy, ctx.device)
    if trouble is None:
        return CheckResult("model", OK, line)
    return CheckResult("model", WARN, f"{line}; {trouble}",
                       fix="model.implementation=native (phaserl's decoder, which probes fla and keeps its own rule), "
                           "or uninstall fla-core (transformers then uses its torch fallback, slower), "
                           "or Triton >= 3.7.1")


def _transformers_delta_rule_trouble(policy, device) -> Optional[str]:
    """A Qwen3.5 on the transformers path where flash-linear-attention imports but its rule does not pass
    linear_attention's probe (fla-core 0.6.0 on Hopper with Triton < 3.7.1 refuses its backward, fla #640):
    transformers calls fla's kernels when fla is installed (seen with transformers 5.17 on an H200), so the first
    update would stop there. phaserl's native decoder probes fla itself and keeps its torch rule."""
    config = getattr(policy, "config", None)
    if not hasattr(policy, "hf_model") or "linear_attention" not in (getattr(config, "layer_types", None) or ()):
        return None
    status = linear_attention.fla_status(device)
    if status is None or status[1]:
        return None
    what = "its backward refuses here" if status[0] else "it fails or disagrees with the reference rule here"
    return (f"the transformers path runs this model's Gated DeltaNet layers through flash-linear-attention when it is "
            f"installed, and {what} (Triton {_triton_version()}; fla-core 0.6.0 refuses its backward on Hopper "
            "below Triton 3.7.1, fla #640): the first update would likely stop")


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


@check("tokenizer/model", needs=("tokenizer", "policy"))
def check_tokenizer_model(ctx: Context) -> CheckResult:
    tok, config = ctx.tokenizer, ctx.policy.config
    rows = ctx.policy.output_weight.shape[0]
    name = "tokenizer/model"
    if len(tok) > rows:
        return CheckResult(name, FAIL, f"the tokenizer has {len(tok)} tokens but the model's vocabulary has {rows} "
                           f"rows: token ids >= {rows} index past the embedding (an index error, on GPU a "
                           f"device-side assert, in the middle of a rollout)",
                           fix="use the tokenizer saved with this model (model.tokenizer_path = null), or resize "
                               "the model's embeddings before training")
    model_eos = config.eos_token_id if isinstance(config.eos_token_id, (list, tuple)) else [config.eos_token_id]
    model_eos = [e for e in model_eos if e is not None]
    eos = [e for e in [tok.eos_token_id, *model_eos] if e is not None]
    if not eos:
        return CheckResult(name, FAIL, "neither the tokenizer nor config.json defines an EOS token: responses would "
                           "never stop", fix="set eos_token in tokenizer_config.json or eos_token_id in config.json")
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    outside = [f"{what} id {i}" for what, ids in (("eos", eos), ("pad", [pad])) for i in ids if not 0 <= i < rows]
    if outside:
        return CheckResult(name, FAIL, f"{', '.join(outside)} outside the model's {rows}-row vocabulary",
                           fix="fix eos_token/pad_token in tokenizer_config.json (or eos_token_id in config.json)")
    pad_note = (f"pad {tok.pad_token!r} (id {pad})" if tok.pad_token_id is not None
                else f"no pad token: pads with eos id {pad}")
    message = f"{len(tok)} tokens ≤ {rows} embedding rows; eos {tok.eos_token!r} (id {tok.eos_token_id}); {pad_note}"
    if model_eos and tok.eos_token_id is not None and tok.eos_token_id not in model_eos:
        return CheckResult(name, WARN, f"{message}; but config.json says eos_token_id = {config.eos_token_id}",
                           fix="generation stops at either id; make sure the model was trained to end its answers "
                               f"with {tok.eos_token!r}, or give the tokenizer the model's eos token")
    return CheckResult(name, OK, message)


@check("context length", needs=("policy",))
def check_context(ctx: Context) -> CheckResult:
    limit = ctx.policy.config.max_position_embeddings
    check_context_length(ctx.cfg, limit, source=os.path.join(resolve_model_path(ctx.cfg.model.path), "config.json"))
    p, t = ctx.cfg.data.max_prompt_length, ctx.cfg.rollout.max_new_tokens
    return CheckResult("context length", OK, f"prompt + response ≤ {p} + {t} = {p + t} tokens of the model's "
                                             f"{limit} (max_position_embeddings)")
