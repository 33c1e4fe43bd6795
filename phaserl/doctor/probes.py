"""The doctor's checks that run things on real rows: data, chat template, rule rewards, the reward
model's input format (mistake 2 of the five), the frozen reference (mistake 3) and memory (mistake 4).

Each builds what `train` would build, from the same builder functions, and tries it on a few real
training rows. Nothing is trained. `Context` and the `check` decorator come from `checks.py`.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging

import torch

from .. import cuda_allocator
from ..config.auto import choose, compile_rule, head_kernels_missing, keep_awake_rule, keep_logits_rule
from ..config.validate import sequence_tokens, train_micro_batch_tokens
from ..data import build_prompt_dataset, format_prompt, load_prompt_rows
from ..data.images import build_vision_dataset, processor_for
from ..errors import PreflightError, RewardError
from ..memory.budget import (
    ModelShape,
    RoleMemory,
    UnknownShape,
    fmt_bytes,
    kept_engine_bytes,
    kept_logits_bytes,
    kv_cache_bytes_per_sequence,
    layer_bytes,
    response_tokens_of,
    role_memory,
    update_peak_bytes,
)
from ..memory.plan import Measures, asked_from_config, saved_bytes
from ..models import load_pretrained
from ..models.decoder import use_varlen
from ..models.lora import LoRASettings, adapter_parameter_count, resolve_targets
from ..parallel.fsdp import decoder_layers
from ..resolve import DTYPES, build_reward_sources, reference_is_lora_base, resolve_data_files, resolve_model_path
from ..rewards import RuleRewards
from ..roles import ReferencePolicy
from ..roles.forward import supports_packing
from ..rollout import RolloutEngine
from ..rollout.engine import engine_slot_tokens
from .checks import Context, check, roles_enabled, short
from .memory import PhaseSizes, ceil_div, effective, judge, plan_for, suggest_sizes
from .report import FAIL, OK, WARN, CheckResult

log = logging.getLogger("phaserl")

PROBE_ROWS = 4  # real training rows the reward model and the rule functions are tried on


@check("data", needs=("tokenizer",))
def check_data(ctx: Context) -> CheckResult:
    """Schema of every row, and what the overlong policy does to the prompts."""
    d, tok = ctx.cfg.data, ctx.tokenizer
    splits = [("train", d.train_files)] + ([("val", d.val_files)] if d.val_files else [])
    parts, cut = [], 0
    for split, files in splits:
        rows = load_prompt_rows(resolve_data_files(files, split), prompt_key=d.prompt_key)
        if split == "train":
            ctx.train_rows = rows
        if d.apply_chat_template and not tok.chat_template:
            parts.append(f"{split}: {len(rows)} rows")
            continue
        if getattr(ctx.policy, "takes_images", False):  # a vision-language policy: its rows' image tokens count
            processor = processor_for(ctx.policy.vision_config, min_pixels=d.min_pixels, max_pixels=d.max_pixels)
            ds = build_vision_dataset(rows, tok, processor, merge_size=ctx.policy.vision_config.spatial_merge_size,
                                      max_prompt_length=d.max_prompt_length, overlong=d.overlong_prompts,
                                      apply_chat_template=d.apply_chat_template, image_key=d.image_key)
        else:
            ds = build_prompt_dataset(rows, tok, max_prompt_length=d.max_prompt_length, overlong=d.overlong_prompts,
                                      apply_chat_template=d.apply_chat_template)
        longest = max(len(item.prompt_ids) for item in ds.items)
        cut += ds.dropped + ds.truncated
        parts.append(f"{split}: {len(rows)} rows, longest prompt {longest} tokens, {ds.dropped} dropped, "
                     f"{ds.truncated} truncated")
    message = "; ".join(parts) + f" (data.max_prompt_length = {d.max_prompt_length})"
    if d.apply_chat_template and not tok.chat_template:
        return CheckResult("data", WARN, f"{message}; prompt lengths not checked: no chat template (see below)")
    if cut:  # any cut prompt is reported: a truncated question may no longer say what its ground truth answers
        return CheckResult("data", WARN, f"{cut} prompt(s) are cut or dropped by data.overlong_prompts = "
                           f"{d.overlong_prompts}; {message}",
                           fix="raise data.max_prompt_length to keep every prompt whole")
    return CheckResult("data", OK, message)


@check("chat template", needs=("tokenizer",))
def check_chat_template(ctx: Context) -> CheckResult:
    tok = ctx.tokenizer
    if not ctx.cfg.data.apply_chat_template:
        return CheckResult("chat template", OK, "off: prompts are tokenized as plain text "
                                                "(data.apply_chat_template = false)")
    if not tok.chat_template:
        return CheckResult("chat template", FAIL, "data.apply_chat_template = true but the tokenizer "
                           f"({getattr(tok, 'name_or_path', '')}) has no chat template",
                           fix="set data.apply_chat_template=false to feed plain text, or model.tokenizer_path to "
                               "a tokenizer whose tokenizer_config.json has a chat_template (an -Instruct model's)")
    if not ctx.train_rows:
        return CheckResult("chat template", OK, "the tokenizer has a chat template")
    text = format_prompt(ctx.train_rows[0], tok, apply_chat_template=True)
    return CheckResult("chat template", OK, f"the first prompt renders as {short(text)}")


@check("reward functions", needs=("train_rows",))
def check_reward_functions(ctx: Context) -> CheckResult:
    specs = ctx.cfg.reward.functions
    if not specs:
        return CheckResult("reward functions", OK, "none configured (the reward model scores alone)")
    rules = RuleRewards([(f.name, f.weight, f.kwargs) for f in specs], timeout_s=ctx.cfg.reward.timeout_s)
    rows, names = ctx.train_rows[:PROBE_ROWS], ", ".join(r.spec for r in rules.rewards)
    for i, row in enumerate(rows):  # progress lines: a slow function shows where it is (reward.timeout_s bounds it)
        log.info(f"doctor: reward functions ({names}) on probe row {i + 1} of {len(rows)} ...")
        rules.smoke_test(row.prompt, row.ground_truth, dict(row.raw, __source__=row.source))
    return CheckResult("reward functions", OK, f"{names}: a finite number for an empty and a plausible response "
                                               f"on {len(rows)} real rows")


def probe_batch(rows: list, response_key: str) -> tuple[list, list]:
    """Real prompts with plausible responses: the row's response field, its ground truth, or the prompt."""
    prompts, responses = [], []
    for i, row in enumerate(rows):
        prompt_text = row.prompt if isinstance(row.prompt, str) else row.prompt[-1]["content"]
        if isinstance(row.raw.get(response_key), str):
            response = row.raw[response_key]
        elif row.ground_truth is not None and i % 2 == 0:
            response = f"The answer is {row.ground_truth}."
        else:
            response = prompt_text
        prompts.append(row.prompt)
        responses.append(response)
    return prompts, responses


@check("reward model", needs=("device",))
def check_reward_model(ctx: Context) -> CheckResult:
    """Classic mistake 2: score a real batch in the configured format; FAIL on non-finite/constant/wrong shape."""
    rc = ctx.cfg.reward_model
    if not rc.enable:
        return CheckResult("reward model", OK, "no reward model (reward_model.enable = false)")
    if not ctx.train_rows:
        return CheckResult("reward model", WARN, "skipped: needs the training rows (see data)")
    rm_only = dataclasses.replace(ctx.cfg, reward=dataclasses.replace(ctx.cfg.reward, functions=[]))
    try:
        wrapper = build_reward_sources(rm_only, ctx.device).reward_model
    except RewardError as exc:
        return CheckResult("reward model", FAIL, str(exc), fix="in the config: reward_model.path / tokenizer_path "
                           "(the RM's own directory), reward_model.chat_template or apply_chat_template=false")
    try:
        ctx.rm_shape = ModelShape.of(wrapper.model)
    except UnknownShape:  # the memory check then leaves the reward model out
        ctx.rm_shape = None
    ctx.rm_engine = wrapper.engine
    ctx.rm_packed = _rm_packs(ctx.cfg, wrapper, ctx.world_size)
    rows = ctx.train_rows[:PROBE_ROWS]
    prompts, responses = probe_batch(rows, rc.response_key)
    report = wrapper.probe(prompts, responses)
    try:
        seen = short(wrapper.format(prompts[0], responses[0]), 160)
    except Exception as exc:  # the probe's reason already says why formatting failed
        seen = f"nothing ({type(exc).__name__})"
    template = "custom" if rc.chat_template else "the RM tokenizer's own"
    format_line = (f"format: apply_chat_template = {rc.apply_chat_template}, chat_template = {template}, "
                   f"truncation_side = {rc.truncation_side}; the RM saw {seen}")
    if not report.ok:
        return CheckResult("reward model", FAIL, report.reason, details=(format_line, _engine_line(ctx)))
    scores = ", ".join(f"{s:.4g}" for s in report.scores)
    message = (f"probe of {len(rows)} real prompts: scores [{scores}], finite, shape [{len(rows)}], "
               f"not constant")
    limit = getattr(wrapper.model.config, "max_position_embeddings", None)
    if limit is not None and rc.max_length > limit:
        return CheckResult("reward model", WARN, f"{message}; but reward_model.max_length = {rc.max_length} is over "
                           f"the reward model's max_position_embeddings = {limit}: longer inputs would sit at "
                           f"positions it never saw", fix=f"set reward_model.max_length <= {limit}",
                           details=(format_line, _engine_line(ctx)))
    if rc.response_key != "response" and not any(rc.response_key in row.raw for row in rows):
        return CheckResult("reward model", WARN, f"{message}; reward_model.response_key = {rc.response_key!r} is "
                           "in none of the training rows", fix="in RL the reward model scores the actor's "
                           "responses; response_key only names the field of preference rows (prompt, "
                           "chosen_response, ...): leave it at 'response' here",
                           details=(format_line, _engine_line(ctx)))
    return CheckResult("reward model", OK, message, details=(format_line, _engine_line(ctx)))


def _rm_packs(cfg, wrapper, world_size: int) -> bool:
    """Whether the run packs the RM's micro-batches (the wrapper's rule): reward_model.packing, else where
    the varlen kernel runs for the RM's compute dtype (reward_model.fsdp.param_dtype once sharded)."""
    rc = cfg.reward_model
    if wrapper.engine != "phaserl":
        return False
    if rc.packing is not None:
        return rc.packing
    dtype = next(wrapper.model.parameters()).dtype
    if world_size > 1 and rc.fsdp.param_dtype is not None:
        dtype = getattr(torch, rc.fsdp.param_dtype)
    return use_varlen(wrapper.device, dtype)


def _engine_line(ctx: Context) -> str:
    rc = ctx.cfg.reward_model
    if ctx.rm_engine == "transformers":
        return (f"engine: transformers (reward_model.engine = {rc.engine}), right-padded calls of "
                f"reward_model.batch_size = {rc.batch_size} sequences")
    layout = "packed without padding" if ctx.rm_packed else "right-padded"
    return (f"engine: phaserl's decoder (reward_model.engine = {rc.engine}), {layout} forwards of at most "
            f"reward_model.micro_batch_tokens = {rc.micro_batch_tokens} tokens (reward_model.batch_size unused)")


def shared_parameter_names(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names (in `a`) of parameters whose storage `b` also holds."""
    held = {p.data_ptr() for p in b.parameters() if p.numel()}
    return [name for name, p in a.named_parameters() if p.numel() and p.data_ptr() in held]


def check_reference_frozen(ref: ReferencePolicy, actor_model=None) -> CheckResult:
    """Classic mistake 3 for built roles: nothing in the reference trains, and it shares no weights with the actor."""
    try:
        ref.check_frozen()
    except PreflightError as exc:
        return CheckResult("reference frozen", FAIL, str(exc))
    if actor_model is not None:
        shared = shared_parameter_names(ref.model, actor_model)
        if shared:
            return CheckResult("reference frozen", FAIL, f"the reference shares {len(shared)} parameter(s) with "
                               f"the actor ({', '.join(shared[:3])}, ...): freezing the reference froze the actor",
                               fix="give ReferencePolicy its own copy: ReferencePolicy(model=load_pretrained(path))")
    n = sum(p.numel() for p in ref.model.parameters())
    return CheckResult("reference frozen", OK, f"{n / 1e6:.2f}M parameters, none requires grad; eval mode; "
                                               "forward under torch.inference_mode()")


@check("reference frozen", needs=("policy",))
def check_reference(ctx: Context) -> CheckResult:
    cfg = ctx.cfg
    if not roles_enabled(cfg)[1]:
        return CheckResult("reference frozen", OK, f"no reference policy (algorithm.kl_placement = "
                                                   f"{cfg.algorithm.kl_placement}, ref.enable = {cfg.ref.enable})")
    if reference_is_lora_base(cfg):
        return CheckResult("reference frozen", OK, "the actor's base weights with its LoRA adapters off (no second "
                                                   "copy): the base is frozen, only adapters train; checked every step")
    path = cfg.ref.path or cfg.model.path
    model = ctx.policy if path == cfg.model.path else load_pretrained(
        resolve_model_path(path), dtype=DTYPES[cfg.model.dtype], device=ctx.device,
        trust_remote_code=cfg.model.trust_remote_code, implementation=cfg.model.implementation)
    ref = ReferencePolicy(model, fsdp_config=cfg.ref.fsdp)  # the doctor never trains: freezing the policy is fine
    vocab, policy_vocab = ref.model.output_weight.shape[0], ctx.policy.output_weight.shape[0]
    if vocab != policy_vocab:
        return CheckResult("reference frozen", FAIL, f"the reference ({path}) has a {vocab}-token vocabulary, the "
                           f"policy {policy_vocab}: the KL compares their log-probs token by token",
                           fix="start the reference from the policy's initial checkpoint (ref.path = null)")
    return check_reference_frozen(ref)


def phase_sizes(ctx: Context) -> PhaseSizes:
    """The configured per-phase sizes and what each phase can use at most on one rank."""
    cfg, ws = ctx.cfg, ctx.world_size
    r, ppo, rm = cfg.rollout, cfg.ppo, cfg.reward_model
    prompts_per_rank = ceil_div(r.prompts_per_step, ws)
    mini = ppo.mini_batch_size or ceil_div(r.prompts_per_step * r.n, ppo.num_mini_batches)
    return PhaseSizes(n=r.n, prompt_tokens=cfg.data.max_prompt_length,
                      sequence_tokens=sequence_tokens(cfg),  # a whole episode in multi-turn runs
                      rollout_batch_size=r.batch_size, prompts_per_rank=prompts_per_rank,
                      rm_engine=ctx.rm_engine or rm.engine, rm_batch_size=rm.batch_size,
                      rm_micro_batch_tokens=rm.micro_batch_tokens, rm_packed=bool(ctx.rm_packed),
                      rm_max_length=rm.max_length,
                      responses_per_rank=prompts_per_rank * r.n, micro_batch_tokens=train_micro_batch_tokens(cfg),
                      mini_batch_per_rank=ceil_div(mini, ws), gradient_checkpointing=cfg.actor.gradient_checkpointing,
                      routing_replay=cfg.actor.routing_replay, compiled=actor_compiles(ctx))


def actor_compiles(ctx: Context) -> bool:
    """actor.compile as the run will choose it (config/auto.py's rule on this machine, as trainer/speed.py asks it)."""
    asked = ctx.cfg.actor.compile
    if asked is not None:
        return bool(asked)
    return compile_rule(native=supports_packing(ctx.policy), device_type=ctx.device.type,
                        triton=importlib.util.find_spec("triton") is not None,
                        num_params=sum(p.numel() for p in ctx.policy.parameters()), world_size=ctx.world_size,
                        model_name=type(ctx.policy).__name__)[0]


@check("memory", needs=("policy", "free_bytes"))
def check_memory(ctx: Context) -> CheckResult:
    """Classic mistake 4: estimate each phase's memory and suggest the sizes that fit this machine."""
    try:
        shape = ModelShape.of(ctx.policy)
    except UnknownShape as exc:
        return CheckResult("memory", WARN, f"memory estimate unknown: {exc}; the sizes are not checked against "
                                           "this machine", fix="watch the first steps' peak memory (metrics.jsonl)")
    cfg, sizes = ctx.cfg, phase_sizes(ctx)
    critic_on, ref_on = roles_enabled(cfg)

    def state(fsdp, trainable: bool) -> RoleMemory:
        return role_memory(shape.num_params, shape.param_bytes, trainable=trainable, strategy=fsdp.sharding_strategy,
                           world_size=ctx.world_size, cpu_offload=fsdp.cpu_offload, dtype=cfg.model.dtype)

    def lora_state(lora, fsdp) -> RoleMemory:  # a frozen base (params only) + float32 adapters that train
        adapters = adapter_parameter_count(ctx.policy, LoRASettings(lora.rank, lora.alpha, lora.dropout,
                                                                    resolve_targets(lora.target_modules)))
        base, extra = state(fsdp, False), role_memory(adapters, 4, trainable=True, strategy=fsdp.sharding_strategy,
                                                      world_size=ctx.world_size, cpu_offload=fsdp.cpu_offload)
        lora_lines.append(f"{'LoRA':<12} r={lora.rank} adapters: {adapters / 1e6:.2f}M float32 parameters train; "
                          "grads and AdamW for them only, the base is frozen")
        return RoleMemory(base.params + extra.params, extra.grads, extra.optimizer)

    lora_lines: list = []
    roles = {"actor": (lora_state(cfg.actor.lora, cfg.actor.fsdp) if cfg.actor.lora.rank
                       else state(cfg.actor.fsdp, True))}
    if critic_on:
        roles["critic"] = lora_state(cfg.critic.lora, cfg.critic.fsdp) if cfg.critic.lora.rank else \
            state(cfg.critic.fsdp, True)
    shared_ref = ref_on and reference_is_lora_base(cfg)
    roles.update({"ref": state(cfg.ref.fsdp, False)} if ref_on and not shared_ref else {})
    if ctx.rm_shape is not None:
        rm_fsdp = cfg.reward_model.fsdp
        roles["reward model"] = role_memory(ctx.rm_shape.num_params, ctx.rm_shape.param_bytes, trainable=False,
                                            strategy=rm_fsdp.sharding_strategy, world_size=ctx.world_size,
                                            cpu_offload=rm_fsdp.cpu_offload)
    resident = sum(m.params + m.optimizer for m in roles.values())  # gradients live only during the update
    facts, plan, ctx = _memory_plan(ctx, shape, sizes, roles)  # what the run's builder will choose (memory/plan.py)
    resident -= saved_bytes(facts, plan.measures)
    sizes = dataclasses.replace(sizes, checkpoint_layers=plan.measures.layers,
                                offload_activations=plan.measures.activations,
                                micro_batch_tokens=plan.micro_batch_tokens.value)
    micro_line = plan.micro_batch_tokens.line() if cfg.ppo.micro_batch_tokens is None else ""
    keep, auto_line = _keep_awake(ctx, shape, sizes, resident=resident, grads=roles["actor"].grads)
    kept = keep_candidate(cfg, shape, sizes, ctx.free_bytes) if keep else 0
    logits, logits_line = _keep_logits(ctx, shape, sizes, resident=resident, grads=roles["actor"].grads, kept=kept)
    suggestions = suggest_sizes(shape, ctx.rm_shape, sizes, resident=resident,
                                update_extra=roles["actor"].grads + kept + logits, free_bytes=ctx.free_bytes)
    details = [f"{name:<12} params {fmt_bytes(m.params)}" + (f" + grads {fmt_bytes(m.grads)} + AdamW "
                                                             f"{fmt_bytes(m.optimizer)}" if m.grads else "")
               + " per rank" for name, m in roles.items()]
    details += lora_lines + [plan.summary()] + [c.line() for c in plan.all()
                                                     if c.asked is None and c.key != "ppo.micro_batch_tokens"]
    details += [line for line in (micro_line, auto_line, logits_line) if line]
    if shared_ref:
        details.append(f"{'ref':<12} 0 B: the actor's base with adapters off (no copy)")
    details.append(kv_line(shape, sizes))
    if shape.hybrid:
        details.append(hybrid_activation_line(shape, sizes))
    if kept:
        details.append(f"rollout.engine_keep_awake: {fmt_bytes(kept)} of KV cache and fused weights stay on the "
                       "device through the update")
    if ctx.device.type == "cuda":  # what the run's builder will set (cuda_allocator.py): the slack beyond the count
        details.append(f"CUDA allocator: {cuda_allocator.planned()}")
    details += [_size_line(s, sizes, ctx.free_bytes) for s in suggestions]
    suggested = _suggested(suggestions, sizes)
    details.append(f"suggested for this machine: {suggested}")
    usable = fmt_bytes(ctx.free_bytes)
    problems = [p for p in (judge(s, sizes, device_type=ctx.device.type) for s in suggestions) if p]
    if resident > ctx.free_bytes:
        problems.insert(0, f"the weights and optimizer state alone need {fmt_bytes(resident)} per rank, more than "
                           f"the {usable} free")
    elif not plan.fits:
        problems.insert(0, plan.problem)
    fix = (f"{suggested}; or shard over more ranks (FULL_SHARD), turn on actor.gradient_checkpointing, or use "
           "model.dtype=bfloat16")
    if problems:
        return CheckResult("memory", WARN, "; ".join(problems), fix=fix, details=tuple(details))
    return CheckResult("memory", OK, f"~{fmt_bytes(resident)} of weights and optimizer state per rank; every phase "
                                     f"fits the {usable} free on {ctx.device}", details=tuple(details))


def _memory_plan(ctx: Context, shape: ModelShape, sizes: PhaseSizes, roles: dict):
    """The memory plan the run's builder will choose on this machine (memory/plan.py's rule on the doctor's count,
    as trainer/speed.py asks it): room for a kept engine where one is asked for, or where it may be kept and costs no
    measure. Returns (its facts, the plan, the context the rest of the check reads: with rollout.engine_keep_awake
    off where the plan rules the kept engine out)."""
    cfg, asked = ctx.cfg, asked_from_config(ctx.cfg, shape.num_layers)
    engine = cfg.rollout.engine != "hf" and RolloutEngine.supports(ctx.policy)
    keep = cfg.rollout.engine_keep_awake
    in_layers = sum(p.numel() for layer in decoder_layers(ctx.policy) for p in layer.parameters())

    def plan(kept: int):
        return plan_for(shape, sizes, roles, asked, free_bytes=ctx.free_bytes, device_type=ctx.device.type,
                        world_size=ctx.world_size, kept=kept, layer_share=in_layers / max(1, shape.num_params),
                        selective=supports_packing(ctx.policy), kv_fraction=cfg.rollout.engine_memory_fraction,
                        trained_dtype="float32" if cfg.actor.lora.rank else cfg.model.dtype)  # adapters: float32
    candidate = keep_candidate(cfg, shape, sizes, ctx.free_bytes) if engine and keep is not False else 0
    facts, chosen = plan(candidate if keep is True else 0)
    if keep is None and candidate and chosen.measures == Measures():
        roomy = plan(candidate)
        facts, chosen = roomy if roomy[1].measures == Measures() else (facts, chosen)
    if keep is None and chosen.measures != Measures():  # the run turns the kept engine off: memory comes first
        ctx = dataclasses.replace(ctx, cfg=dataclasses.replace(cfg, rollout=dataclasses.replace(
            cfg.rollout, engine_keep_awake=False)))
    return facts, chosen, ctx


def hybrid_activation_line(shape: ModelShape, sizes: PhaseSizes) -> str:
    """Qwen3.5's details line: what each layer kind saves for backward per token (memory.layer_bytes), with the
    delta rule the Gated DeltaNet count is for; fla's count is read from its source, not yet measured on a GPU."""
    rule = ("flash-linear-attention's kernels: counted from fla-core 0.6.0's source, not yet measured on a GPU; "
            "watch the first steps' peak memory" if shape.hybrid.delta_rule == "fla" else "torch chunked rule")
    names = {"linear_attention": f"Gated DeltaNet, {rule}", "gated_attention": "gated attention"}
    kinds = layer_bytes(shape, sequence_tokens=sizes.sequence_tokens)
    return "activations  per token: " + " + ".join(f"{count} × {fmt_bytes(each)} ({names[kind]})"
                                                   for kind, (count, each) in kinds.items())


def kv_line(shape: ModelShape, sizes: PhaseSizes) -> str:
    """The details line of what one sequence holds in the rollout engine, with the arithmetic behind it."""
    T, slot, b = sizes.sequence_tokens, shape.slot, shape.param_bytes
    total = fmt_bytes(kv_cache_bytes_per_sequence(shape, T, routes=sizes.routing_replay))
    heads = f"{shape.num_kv_heads} kv heads × {shape.head_dim} head dim"
    if slot is None:
        return f"KV cache     2 × {shape.num_layers} layers × {heads} × {b} B × {T} tokens = {total} per sequence"
    if [width for _, width in slot.kv_rows] == [shape.num_kv_heads * shape.head_dim]:
        rows = f"{slot.kv_layers} {'attention layers' if slot.linear_layers else 'layers'} × {heads}"
    else:  # Gemma 4: each layer's row is its own width, the global layers' wider than the sliding ones'
        rows = "(" + " + ".join(f"{n} layers × {width}" for n, width in slot.kv_rows) + ") kv heads × head dim"
    parts = [f"2 × {rows} × {b} B × {T} tokens"]
    if slot.state_per_slot:
        parts.append(f"{slot.linear_layers} linear-attention layers' recurrent state {fmt_bytes(slot.state_per_slot)} "
                     "(any length)")
    if sizes.routing_replay and slot.routes_per_token:
        parts.append(f"routing replay's expert ids {slot.routes_per_token} B × {T} tokens")
    return f"KV cache     {' + '.join(parts)} = {total} per sequence"


def keep_candidate(cfg, shape: ModelShape, sizes: PhaseSizes, free_bytes: int) -> int:
    """What the engine would hold through the update if kept awake: the KV pool it allocates (engine.py's
    sizing), the recurrent state and route record beside it, and its weight copies."""
    r = cfg.rollout
    return kept_engine_bytes(shape, r.engine_max_slots, engine_slot_tokens(sizes.sequence_tokens),
                             kv_limit=int(r.engine_memory_fraction * free_bytes), routes=sizes.routing_replay)


def _keep_awake(ctx: Context, shape: ModelShape, sizes: PhaseSizes, *, resident: int, grads: int) -> tuple[bool, str]:
    """rollout.engine_keep_awake as the run will choose it (config/auto.py's rule on this count), and the
    details line saying so when it was auto ('' when set)."""
    cfg = ctx.cfg
    if cfg.rollout.engine_keep_awake is not None:
        return cfg.rollout.engine_keep_awake, ""
    micro = min(sizes.micro_batch_tokens, sizes.mini_batch_per_rank * sizes.sequence_tokens)
    peak = update_peak_bytes(shape, resident=resident, grads=grads, micro_batch_tokens=micro,
                             gradient_checkpointing=sizes.gradient_checkpointing, compiled=sizes.compiled,
                             checkpoint_layers=sizes.checkpoint_layers,
                             offload_activations=sizes.offload_activations,
                             sequence_tokens=sizes.sequence_tokens)
    kept = keep_candidate(cfg, shape, sizes, ctx.free_bytes)
    choice = choose("rollout.engine_keep_awake", None, keep_awake_rule(
        engine_runs=cfg.rollout.engine != "hf" and RolloutEngine.supports(ctx.policy), device_type=ctx.device.type,
        world_size=ctx.world_size, actor_sharded=cfg.actor.fsdp.sharding_strategy != "NO_SHARD",
        needed_bytes=peak + kept, kept_bytes=kept, budget_bytes=ctx.free_bytes, lora=bool(cfg.actor.lora.rank)))
    return choice.value, choice.line()


def _keep_logits(ctx: Context, shape: ModelShape, sizes: PhaseSizes, *, resident: int, grads: int,
                 kept: int) -> tuple[int, str]:
    """ppo.keep_head_logits as the run will choose it (config/auto.py's rule on this count, at the micro-batch and
    with the kept engine as chosen): (the bytes keeping adds to the update, the details line when it was auto)."""
    micro = min(sizes.micro_batch_tokens, sizes.mini_batch_per_rank * sizes.sequence_tokens)
    logits = kept_logits_bytes(shape, response_tokens_of(micro, sizes.sequence_tokens, sizes.prompt_tokens))
    head = dict(device_type=ctx.device.type, triton=importlib.util.find_spec("triton") is not None,
                compiled=sizes.compiled, plain_head=supports_packing(ctx.policy) and getattr(ctx.policy, "plain_head",
                                                                                                 False))
    asked = ctx.cfg.ppo.keep_head_logits
    if asked is not None:  # set: kept whenever the kernels run, whatever the count says
        return (logits if asked and not head_kernels_missing(**head) else 0), ""
    peak = kept + update_peak_bytes(shape, resident=resident, grads=grads, micro_batch_tokens=micro,
                                    gradient_checkpointing=sizes.gradient_checkpointing, compiled=sizes.compiled,
                                    checkpoint_layers=sizes.checkpoint_layers,
                                    offload_activations=sizes.offload_activations,
                                    sequence_tokens=sizes.sequence_tokens)
    choice = choose("ppo.keep_head_logits", None, keep_logits_rule(
        **head, peak_bytes=peak, logits_bytes=logits, fixed_bytes=resident + grads + kept, budget_bytes=ctx.free_bytes))
    return (logits if choice.value else 0), choice.line()


def _suggested(suggestions: list, sizes: PhaseSizes) -> str:
    """The sizes to change, each with its reason: a size that does not fit is lowered, one below what fits is
    raised; a size that fits and that its phase fills is left alone (lowering a micro-batch that fits to the most
    one step can use, saying nothing of why, would only confuse)."""
    changes, why = [], []
    for s in suggestions:
        used = effective(s, sizes)
        if not s.fits:
            changes.append(f"{s.key}={s.whole or 1}")
            why.append(f"{s.key}: not even one full-length item fits")
        elif used > s.fits:
            changes.append(f"{s.key}={s.fits}")
            why.append(f"{s.key}: {s.configured} does not fit, {s.fits} does")
        elif s.fits > used:
            changes.append(f"{s.key}={s.fits}")
            why.append(f"{s.key}: up to {s.fits} fit{' (all one step can use)' if s.fits >= s.cap else ''}, so fewer "
                       "passes")
    if not changes:
        return "the configured sizes (each fits this machine)"
    return " ".join(changes) + f"  ({'; '.join(why)})"


def _size_line(s, sizes: PhaseSizes, free_bytes: int) -> str:
    """One phase's size in words: what the configured value uses, of what is free, and what would fit."""
    used = effective(s, sizes)
    units = ("prompts" if s.key == "rollout.batch_size" else "sequences" if s.key == "reward_model.batch_size"
             else "tokens")
    if s.fits >= s.cap:
        room = f"the most this phase can use ({s.cap}) fits"
    elif s.fits:
        room = f"at most {s.fits} would fit"
    else:
        room = "not even one full-length item fits"
    return (f"{s.key} = {s.configured}: uses at most {used} {units}, {fmt_bytes(used * s.per_item)} of the "
            f"{fmt_bytes(free_bytes)} free ({fmt_bytes(s.per_item)} per {_unit(s.key, sizes)}); {room}")


def _unit(key: str, sizes: PhaseSizes) -> str:
    scoring = f"token of a {'packed' if sizes.rm_packed else 'right-padded'} scoring forward"
    return {"rollout.batch_size": "prompt with its rollout.n sequences", "reward_model.batch_size": "sequence",
            "reward_model.micro_batch_tokens": scoring}.get(key, "token")
