"""`phaserl config CFG --explain`: the resolved config, every key annotated with its help text, then
the batch arithmetic of one RL step (formula, numbers, result), what each batch size counts, which
roles run, and the rule behind each `auto` speed setting (config/auto.py).

Pure formatting on top of `derive`; no rules of its own. Every non-YAML line is a `#` comment, so
the whole text still loads as the same config (`phaserl config cfg.yaml --explain > resolved.yaml`).
"""
from __future__ import annotations

import dataclasses

import yaml

from phaserl.config.auto import AUTO_RULES
from phaserl.config.load import YamlDumper
from phaserl.config.schema import Config
from phaserl.config.validate import Derived, derive, train_micro_batch_tokens

COMMENT_COLUMN = 44
BATCH_SIZE_KEYS = ("rollout.prompts_per_step", "rollout.n", "rollout.batch_size", "reward_model.batch_size",
                   "ppo.mini_batch_size", "ppo.num_mini_batches", "ppo.micro_batch_tokens",
                   "ppo.forward_micro_batch_tokens")


def _flow(value) -> str:
    """One value as single-line YAML (flow style), quoted where YAML needs it."""
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    elif isinstance(value, list):
        value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
    # Dumping inside a list keeps a scalar on one line (a bare scalar gets a '...' document end).
    text = yaml.dump([value], Dumper=YamlDumper, default_flow_style=True, sort_keys=False, width=10**9,
                     allow_unicode=True)
    return text.strip()[1:-1]


def annotated_yaml(section, indent: int = 0) -> list[str]:
    """YAML lines of a config section, each key followed by `# help`."""
    lines = []
    for f in dataclasses.fields(section):
        value, pad = getattr(section, f.name), "  " * indent
        if dataclasses.is_dataclass(value):
            lines += [""] if indent == 0 and lines else []
            lines.append(f"{pad}{f.name}:".ljust(COMMENT_COLUMN) + f"  # {f.metadata['help']}")
            lines.extend(annotated_yaml(value, indent + 1))
        else:
            lines.append(f"{pad}{f.name}: {_flow(value)}".ljust(COMMENT_COLUMN) + f"  # {f.metadata['help']}")
    return lines


def _arithmetic(cfg: Config, d: Derived) -> list[tuple[str, str]]:
    """(quantity, 'formula = numbers = result') for every derived batch quantity."""
    r, ppo, rm, ws = cfg.rollout, cfg.ppo, cfg.reward_model, d.world_size
    if ppo.mini_batch_size is None:
        mini = (f"responses per step / ppo.num_mini_batches = {d.responses_per_step} / {ppo.num_mini_batches} = "
                f"{d.mini_batch_size}   (ppo.mini_batch_size = null: derived)")
    else:
        mini = (f"ppo.mini_batch_size = {d.mini_batch_size}   (× ppo.num_mini_batches {ppo.num_mini_batches} = "
                f"{d.mini_batch_size * ppo.num_mini_batches} = responses per step)")
    per_call = min(r.batch_size, d.prompts_per_rank)
    rows = [
        ("responses per step", f"rollout.prompts_per_step × rollout.n = {r.prompts_per_step} × {r.n} = "
                               f"{d.responses_per_step}   (global)"),
        ("prompts per rank", f"rollout.prompts_per_step / world_size = {r.prompts_per_step} / {ws} = "
                             f"{d.prompts_per_rank}"),
        ("responses per rank", f"prompts per rank × rollout.n = {d.prompts_per_rank} × {r.n} = "
                               f"{d.responses_per_rank}"),
        ("generate calls per rank", f"ceil(prompts per rank / rollout.batch_size) = ceil({d.prompts_per_rank} / "
                                    f"{r.batch_size}) = {d.generate_calls_per_rank}   (each call: up to {per_call} "
                                    f"prompts × {r.n} samples = {per_call * r.n} sequences)"),
    ]
    if cfg.algorithm.adv_estimator == "remax":
        rows.append(("remax greedy baseline", f"+ 1 greedy response per prompt = {d.prompts_per_rank} more "
                                              "sequences per rank per step (not trained on)"))
    if rm.enable:
        rows.append(("reward model calls per rank", _scoring_calls(rm, d)))
    else:
        rows.append(("reward model calls per rank", "0   (reward_model.enable = false)"))
    rows += [
        ("mini-batch size", mini),
        ("mini-batch per rank", f"mini-batch size / world_size = {d.mini_batch_size} / {ws} = "
                                f"{d.mini_batch_per_rank} responses"),
        ("optimizer steps per RL step", f"ppo.epochs × ppo.num_mini_batches = {ppo.epochs} × "
                                        f"{ppo.num_mini_batches} = {d.optimizer_steps_per_rl_step}"),
        ("max sequence tokens", f"data.max_prompt_length + rollout.max_new_tokens = {cfg.data.max_prompt_length} "
                                f"+ {r.max_new_tokens} = {d.max_sequence_tokens}"),
        ("full sequences per micro-batch", f"floor(ppo.micro_batch_tokens / max sequence tokens) = floor("
                                           f"{train_micro_batch_tokens(cfg)} / {d.max_sequence_tokens}) = "
                                           f"{d.sequences_per_micro_batch}" + ("   (ppo.micro_batch_tokens = auto: "
                                           "the value off CUDA; on CUDA the run decides, see Speed settings)"
                                           if ppo.micro_batch_tokens is None else "")),
        ("grad accumulation, worst case", f"ceil(mini-batch per rank / full sequences per micro-batch) = ceil("
                                          f"{d.mini_batch_per_rank} / {d.sequences_per_micro_batch}) = "
                                          f"{d.max_grad_accum_steps}   "
                                          "(micro-batches per optimizer step, per rank)"),
        ("total responses", f"trainer.total_steps × responses per step = {cfg.trainer.total_steps} × "
                            f"{d.responses_per_step} = {d.total_responses}"),
    ]
    return rows


def _scoring_calls(rm, d: Derived) -> str:
    """The reward model's forwards per rank: rows per call on transformers, full-length inputs per token
    budget on phaserl's decoder (a bound: shorter inputs share forwards), the larger count when auto."""
    tokens = "max(1, floor(reward_model.micro_batch_tokens / reward_model.max_length))"
    numbers = f"max(1, floor({rm.micro_batch_tokens} / {rm.max_length}))"
    per_call = {"transformers": ("reward_model.batch_size", str(rm.batch_size)),
                "phaserl": (tokens, numbers),
                "auto": (f"min(reward_model.batch_size, {tokens})", f"min({rm.batch_size}, {numbers})")}
    formula, values = per_call[d.reward_model_engine]
    note = {"transformers": "", "phaserl": "   (at most; phaserl engine)",
            "auto": "   (at most; reward_model.engine = auto: the RM directory decides)"}[d.reward_model_engine]
    return (f"ceil(responses per rank / {formula}) = ceil({d.responses_per_rank} / {values}) = "
            f"{d.reward_model_scoring_calls_per_rank}{note}")


def _lookup(cfg: Config, key: str):
    """(value, help) of a dotted key."""
    section_name, name = key.split(".")
    section = getattr(cfg, section_name)
    help_text = next(f.metadata["help"] for f in dataclasses.fields(section) if f.name == name)
    return getattr(section, name), help_text


def _batch_sizes(cfg: Config, d: Derived) -> list[str]:
    """One line per batch size: its value and what it counts, with its scope (global / per rank)."""
    lines = []
    for key in BATCH_SIZE_KEYS:
        value, help_text = _lookup(cfg, key)
        derived = key == "ppo.mini_batch_size" and value is None
        shown = f"null → {d.mini_batch_size}" if derived else "auto" if value is None else str(value)
        off = key.startswith("reward_model.") and not cfg.reward_model.enable
        unused = "   (unused: reward_model.enable = false)" if off else ""
        lines.append(f"#   {key:<32} = {shown:<10} {help_text}{unused}")
    return lines


def _roles(cfg: Config, d: Derived) -> list[str]:
    def why(flag: bool, key: str, value, reason: str) -> str:
        state = "on" if flag else "off"
        if value is None:
            return f"{state}   ({key} = null → {state}, because {reason})"
        return f"{state}   ({key} = {str(value).lower()})"

    rules = ", ".join(f"{f.name} × {f.weight:g}" for f in cfg.reward.functions) or "none"
    rm = f"{cfg.reward_model.path} × {cfg.reward.reward_model_weight:g}" if cfg.reward_model.enable else "off"
    return [
        f"#   actor            : {cfg.model.path}   (switches rollout/training modes: "
        f"{str(cfg.actor.hybrid_engine.enable_rollout_optimization_switch).lower()})",
        "#   critic           : " + why(d.critic_enabled, "critic.enable", cfg.critic.enable,
                                        f"algorithm.adv_estimator = {cfg.algorithm.adv_estimator}"),
        "#   reference policy : " + why(d.ref_enabled, "ref.enable", cfg.ref.enable,
                                        f"algorithm.kl_placement = {cfg.algorithm.kl_placement}"),
        f"#   rule rewards     : {rules}",
        f"#   reward model     : {rm}",
    ]


def explain(cfg: Config, world_size: int = 1) -> str:
    """The resolved config as annotated YAML, then the derived batch arithmetic, batch sizes and roles."""
    d = derive(cfg, world_size)
    rows = _arithmetic(cfg, d)
    width = max(len(label) for label, _ in rows)
    return "\n".join([
        _heading("Resolved config"),
        *annotated_yaml(cfg),
        "",
        _heading(f"Derived batch arithmetic (world_size = {world_size})"),
        *(f"#   {label:<{width}} = {text}" for label, text in rows),
        "#",
        _heading("Batch sizes: what each one counts"),
        *_batch_sizes(cfg, d),
        "#",
        _heading("Roles"),
        *_roles(cfg, d),
        "#",
        _heading("Speed settings: auto (null) is decided for the machine when the run starts"),
        *_auto_settings(cfg),
        "",
    ])


def _auto_settings(cfg: Config) -> list[str]:
    """Each auto-able speed setting: its value here and, when auto, the rule the run will apply (auto.py)."""
    lines = []
    for key, rule in AUTO_RULES.items():
        value, _ = _lookup(cfg, key)
        shown = "auto" if value in (None, "auto") else f"{str(value).lower()} (set: the rule is not applied)"
        lines.append(f"#   {key:<26} = {shown}")
        lines.append(f"#   {'':<26}   rule: {rule}")
    lines.append("#   (`phaserl train` prints the choices and why at start; "
                 "`phaserl doctor` counts keep_awake's memory)")
    return lines


def _heading(title: str) -> str:
    return f"# ── {title} ".ljust(100, "─")
