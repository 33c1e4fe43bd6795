"""The `auto` speed settings: the rule behind each one, as words (for `--explain` and the docs) and as pure
functions of plain facts (for the builder and the doctor, which gather the facts).

A setting left at null (written `auto` or `null` in YAML / on the command line) is decided once, when the run
is built, from the machine and the run: `trainer/speed.py` measures the facts (device, Triton, model size,
world size, the doctor's memory count) and calls the rules below; `phaserl doctor` calls the same rules on
its own count. `true` / `false` always win over the rule. Nothing here looks at a device or a model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from phaserl.errors import ConfigError

GIB = 2**30
COMPILE_MIN_PARAMS = 100_000_000   # smaller models stay eager: the compile costs more than it saves in a run
KEEP_AWAKE_SHARE = 0.75            # a kept engine: the update's peak with it stays under this share of the device
LORA_KEEP_SHARE = 0.25             # LoRA: the kept engine is at most this share of the update's peak
MICRO_BATCH_CAP = 32768            # auto training micro-batch, about (tokens per rank): see micro_batch_rule
MICRO_BATCH_OFF_CUDA = 16384       # ... off CUDA, where compute and not launches binds: the old fixed default
MICRO_ACTIVATION_SHARE = 0.4       # ... its activations at most this share of what the fixed state leaves (the
                                   # rest: the allocator's slack; 62.8 GiB reserved for 35.8 allocated at 0.5B, 32k,
                                   # without expandable segments, 36.2 with them: cuda_allocator.py)
REWARD_WORKERS_CAP = 4             # math-verify over 512 responses: 2.9 s in the main process, 1.6 s on 2 workers
CHEAP_REWARDS = ("tiny_exact", "gsm8k", "format")  # built-ins that take microseconds a call

# key -> the rule, in words; the order is the order of the start-of-run block
AUTO_RULES = {
    "actor.compile": "on for phaserl's decoder on one CUDA GPU with Triton installed and a model of at least "
                     f"{COMPILE_MIN_PARAMS // 10**6}M parameters; off on the CPU, for transformers models, for tiny "
                     "models and on several ranks (not measured with FSDP yet). The reference policy follows it",
    "critic.compile": "the same rule as actor.compile, for the critic's model",
    "rollout.engine_compile": "on when the built-in engine runs on CUDA with Triton installed and some layer has no "
                              "fused decode kernels (rollout/fused.py); off on the CPU",
    "rollout.engine_keep_awake": "on when the built-in engine runs on CUDA, the actor is not sharded over several "
                                 "ranks, and the doctor's memory count of the update's peak plus the kept KV cache, "
                                 f"fused weights and graphs is at most {KEEP_AWAKE_SHARE:.0%} of this process's "
                                 "device memory, and for a LoRA actor the kept engine is at most "
                                 f"{LORA_KEEP_SHARE:.0%} of that peak (its merged weight copies are a second copy "
                                 "of the model); off otherwise (CPU, FSDP, tight memory, a large LoRA model)",
    "rollout.partial_kv": "with rollout.max_staleness >= 1: keep (unfinished responses and waiting episodes keep "
                          "their slots and KV through training, continued with no prefill) when the engine is kept "
                          "awake (rollout.engine_keep_awake), else prefill (their ids prefilled again next phase)",
    "ppo.packing": "on where the varlen flash kernel runs (CUDA, bf16/fp16 compute); padded elsewhere",
    "ppo.micro_batch_tokens": f"on CUDA the fewest micro-batches of whole sequences, about {MICRO_BATCH_CAP} tokens "
                              "each (the sequences dealt evenly) and at most one mini-batch, whose activations (the "
                              "memory plan's count) take at most "
                              f"{MICRO_ACTIVATION_SHARE:.0%} of the device memory that the weights, gradients, "
                              f"optimizer state and a kept engine leave; {MICRO_BATCH_OFF_CUDA} elsewhere",
    "ppo.train_graphs": "off: at the auto micro-batch the graphs measured no gain (the host keeps up with 6 large "
                        "micro-batches); `true` graphs the actor's packed training micro-batches on one CUDA GPU for "
                        "phaserl's dense decoder, for a smaller ppo.micro_batch_tokens (less memory) at little cost",
    "ref.stream_weights": "the memory plan, its cheapest measure (docs/memory.md): on one CUDA GPU when the step does "
                          "not fit the device with the reference's layers resident; off otherwise, on the CPU and on "
                          "several ranks (ref.fsdp.cpu_offload there)",
    "actor.checkpoint_layers": "the memory plan, after the reference: none when the step fits; else the fewest layers "
                               "whose recomputation leaves room for a micro-batch of about 4096 tokens (all of them "
                               "for a transformers model, which checkpoints all or none); 0 on the CPU",
    "actor.optimizer_offload": "the memory plan, after checkpointing: on one CUDA GPU only when the step does not fit "
                               "even with every layer checkpointed; off otherwise, on the CPU, on several ranks and "
                               "for float16 weights (their AdamW steps float32 masters on the device)",
    "actor.offload_activations": "the memory plan, after checkpointing: on one CUDA GPU only when the step does not "
                                 "fit even with the layers checkpointed, before the optimizer's CPU step (its copies "
                                 "overlap the layers' compute; the CPU step is waited for); off otherwise, on the CPU "
                                 "and for a transformers model",
    "ppo.keep_head_logits": "on where the Triton log-prob kernels run (CUDA, Triton, the actor compiled, phaserl's "
                            "decoder) and a micro-batch's kept logits (its response tokens x vocabulary, bf16) fit "
                            "beside the update's peak in the room ppo.micro_batch_tokens's rule gives activations; "
                            "off otherwise (the logits are recomputed in backward, as before)",
    "reward.workers": "0 (the main process) when every rule function is a cheap built-in (tiny_exact, gsm8k, "
                      "format: 512 responses take 4 ms there and 15-40 ms through workers); otherwise "
                      f"min({REWARD_WORKERS_CAP}, CPU cores per rank - 1), 0 with a single core per rank",
}


@dataclass(frozen=True)
class Choice:
    """One setting as chosen for this run: what the config asked (None = auto), the value used, and why."""

    key: str
    asked: object      # None (auto), or the configured value (True / False; a number for a size)
    value: object      # bool for a switch, int for a size
    why: str

    def line(self) -> str:
        asked = "auto" if self.asked is None else str(self.asked).lower()  # true / false, or a number
        value = ("on" if self.value else "off") if isinstance(self.value, bool) else str(self.value)
        return f"{self.key}={asked} -> {value}: {self.why}"


def choose(key: str, asked, rule: tuple[object, str]) -> Choice:
    """`asked` (None = auto) resolved with `rule` = (value, why) when auto; an explicit value wins."""
    if asked is None:
        return Choice(key, None, *rule)
    return Choice(key, asked, asked if not isinstance(rule[0], bool) else bool(asked), "set in the config")


def compile_rule(*, native: bool, device_type: str, triton: bool, num_params: int, world_size: int,
                 model_name: str) -> tuple[bool, str]:
    """actor.compile / critic.compile when auto: (on?, why)."""
    if not native:
        return False, f"the model ({model_name}) is not phaserl's decoder"
    if device_type != "cuda":
        return False, f"{device_type.upper()} (compiling costs more than it saves off CUDA)"
    if not triton:
        return False, "Triton is not installed"
    if num_params < COMPILE_MIN_PARAMS:
        return False, f"a small model ({num_params / 1e6:.1f}M parameters): the compile would cost more than it saves"
    if world_size > 1:
        return False, f"{world_size} ranks (compile with FSDP is not measured yet; set true to try it)"
    return True, "CUDA, phaserl's decoder, Triton"


def engine_compile_rule(*, engine_runs: bool, device_type: str, triton: bool, fused: bool = False) -> tuple[bool, str]:
    """rollout.engine_compile when auto (the engine's own rule, phaserl/rollout/engine.py). fused: every decoder
    layer decodes through the engine's fused kernels (rollout/fused.py), where compiling adds only warm-up."""
    if not engine_runs:
        return False, "the built-in engine does not run (rollout.engine=hf or a transformers model)"
    if device_type != "cuda":
        return False, device_type.upper()
    if not triton:
        return False, "Triton is not installed"
    if fused:
        return False, "every layer decodes through the engine's fused Triton kernels (compiling adds only warm-up)"
    return True, "CUDA, Triton, layers without fused decode kernels"


def keep_awake_rule(*, engine_runs: bool, device_type: str, world_size: int, actor_sharded: bool,
                    needed_bytes: int, budget_bytes: int, kept_bytes: int = 0, lora: bool = False) -> tuple[bool, str]:
    """rollout.engine_keep_awake when auto. `needed_bytes`: the doctor's count of the update's peak with the
    engine kept, `kept_bytes` the kept engine's share of it; `budget_bytes`: the device memory this process can
    have; `lora`: the actor trains LoRA adapters.

    A LoRA run keeps the engine only while it is at most LORA_KEEP_SHARE of that peak: a kept engine holds its
    weight copies (adapters merged: a second copy of the model beside the frozen base, which is what LoRA saves)
    and the KV cache through the update. Measured on the H200 (2026-12-01, lora_step.py): 7B r16 kept, 11.15 s
    and 58.7 GiB peak, above TRL + PEFT's 54.3 GiB; asleep by this rule (2026-12-03) 11.34 s and 41.3 GiB; 0.5B
    r64 kept, 2.66 s and 16.6 GiB, below TRL + PEFT's 18.4 GiB."""
    if not engine_runs:
        return False, "the built-in engine does not run (rollout.engine=hf or a transformers model)"
    if device_type != "cuda":
        return False, f"{device_type.upper()} (no CUDA graphs to keep)"
    if world_size > 1 and actor_sharded:
        return False, (f"the actor is sharded over {world_size} ranks (FSDP): its gathered weights move every "
                       "step, so the graphs would be re-captured anyway")
    if lora and kept_bytes > LORA_KEEP_SHARE * needed_bytes:
        return False, (f"LoRA: the kept engine ({kept_bytes / GIB:.1f} GiB: its merged weight copies and KV cache) "
                       f"would be more than {LORA_KEEP_SHARE:.0%} of the update's peak ({needed_bytes / GIB:.1f} GiB)")
    words = f"{needed_bytes / GIB:.1f} GiB needed of {budget_bytes / GIB:.0f} GiB"
    if needed_bytes > KEEP_AWAKE_SHARE * budget_bytes:
        return False, f"{words} (more than {KEEP_AWAKE_SHARE:.0%}: tight memory)"
    return True, words


def partial_kv_choice(asked: str, *, max_staleness: int, rollout_ranks: int, keep_awake: bool) -> Optional[Choice]:
    """rollout.partial_kv as the asynchronous stream will run it (None: no stream on this process continues responses
    across updates: max_staleness 0, or rollout ranks, which re-prefill). keep needs the engine kept awake through
    training (rollout.engine_keep_awake, chosen before this): asked for without it, a ConfigError saying why."""
    if max_staleness == 0 or rollout_ranks:
        return None
    key = "rollout.partial_kv"
    if asked == "keep" and not keep_awake:
        raise ConfigError(f"{key}=keep keeps responses' KV through training, but the engine is not kept awake "
                          "(rollout.engine_keep_awake is off or chose off: the CPU, FSDP, tight memory): its KV cache "
                          f"is freed at every update; set rollout.engine_keep_awake=true or {key}=auto / prefill")
    if asked != "auto":
        return Choice(key, asked, asked, "set in the config")
    if keep_awake:
        return Choice(key, None, "keep", "the engine is kept awake: unfinished responses keep their slots and KV")
    return Choice(key, None, "prefill", "the engine sleeps through training: unfinished responses are re-prefilled")


def micro_batch_rule(*, device_type: str, sequence_tokens: int, mini_batch_sequences: int, fixed_bytes: int,
                     budget_bytes: int, peak_of: Callable[[int], int]) -> tuple[int, str]:
    """ppo.micro_batch_tokens when auto: (tokens per training micro-batch per rank, why).

    `peak_of(tokens)`: the doctor's count of the update's peak with a micro-batch of that many tokens;
    `fixed_bytes`: its part that does not grow with the micro-batch (weights, gradients, AdamW, a kept engine);
    `budget_bytes`: the device memory this process can have. Whole sequences of `sequence_tokens`, never more than
    the mini-batch's `mini_batch_sequences`, never fewer than one sequence. The cap counts micro-batches: the
    mini-batch takes ceil(its tokens / MICRO_BATCH_CAP) of them, its sequences dealt evenly (so a micro-batch may
    pass the cap by less than a sequence: 512 sequences of 384 tokens make 6 micro-batches of 86, not 6 of 85
    and a seventh of 2); where memory allows fewer sequences, the count that needs, dealt evenly again.

    Why as large as fits on CUDA: each micro-batch costs the host a fixed amount of work (launches, Python), and
    how long that takes differs several-fold between machines. At the 0.5B reference shape (1.21 s of update
    kernels) it came to 11-15 ms per micro-batch on one lent H200 and 29-89 ms on another (BENCHMARKS.md,
    2026-12-04: the update took 1.39 s vs 1.30 s at 12,288 vs 32,640 tokens on the first, 2.04 s vs
    1.39 s on the second; 8,064 tokens 3.44 s). A rule that picked "just enough work per micro-batch" (3.6e13
    FLOP, tried that day) made the update 47% slower at 0.5B (against 32,640 tokens) and 54% at 1.5B (against
    10,240) on the slower host; the largest micro-batch is the one that is fast on both. The price is memory:
    35.8 GiB allocated at 32,640 tokens against 20.5 at 12,288 (0.5B); what the allocator holds beyond that is
    kept small by expandable segments (cuda_allocator.py: 36.2 GiB reserved instead of 62.8). Where memory is
    tight it goes the other way: a 7B full fine-tune on one H200 peaks at 101 GiB with 6,144-token micro-batches;
    the old fixed 16,384 would need about 170 GiB there by the same count."""
    T, S = sequence_tokens, mini_batch_sequences
    if device_type != "cuda":
        return max(T, MICRO_BATCH_OFF_CUDA), f"{device_type.upper()} (the fixed default off CUDA)"
    most = _ceil_div(S, _ceil_div(S * T, MICRO_BATCH_CAP))  # the cap's count of micro-batches, dealt evenly
    room = update_room(fixed_bytes, budget_bytes)
    lo, hi = 1, most  # the peak grows with the micro-batch: the largest n with peak_of(n * T) <= room
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if peak_of(mid * T) <= room else (lo, mid - 1)
    count = _ceil_div(S, lo)
    lo = _ceil_div(S, count)  # as many micro-batches as lo needs, each as small as that count allows
    tokens, peak = lo * T, peak_of(lo * T)
    words = (f"{lo} sequence(s) of {T} tokens ({count} micro-batch(es) of the {S}-sequence mini-batch), update peak "
             f"{peak / GIB:.1f} GiB of {budget_bytes / GIB:.0f} GiB")
    if peak > room:
        return tokens, words + " (tight memory: one sequence does not leave the activations their share)"
    if lo == most:
        limit = "the mini-batch" if most == S else f"the {MICRO_BATCH_CAP}-token cap"
        return tokens, f"{words} ({limit})"
    return tokens, words


def reward_workers_rule(*, functions: list, cpus: int, ranks_here: int) -> tuple[int, str]:
    """reward.workers when auto: (worker processes per rank, why). `functions`: reward.functions' names; `cpus`:
    the cores this process may run on; `ranks_here`: the ranks on this machine, which share them. A worker pays
    where a call costs milliseconds (math-verify: about 6 ms; a user's function: unknown, so assumed slow) and a
    core is free for it; a cheap built-in costs microseconds, less than the hand-off to a worker."""
    if not functions:
        return 0, "no rule functions"
    if all(name in CHEAP_REWARDS for name in functions):
        return 0, f"only cheap built-ins ({', '.join(functions)}): a call costs less than the hand-off to a worker"
    per_rank = max(1, cpus // max(1, ranks_here))
    workers = min(REWARD_WORKERS_CAP, per_rank - 1)
    if workers < 1:
        return 0, "one CPU core per rank: none to spare for workers"
    return workers, f"{per_rank} CPU cores per rank, one kept for the trainer (at most {REWARD_WORKERS_CAP})"


def update_room(fixed_bytes: int, budget_bytes: int) -> float:
    """What the update may peak at: the fixed state plus MICRO_ACTIVATION_SHARE of what it leaves of the budget."""
    return fixed_bytes + MICRO_ACTIVATION_SHARE * max(0, budget_bytes - fixed_bytes)


def head_kernels_missing(*, device_type: str, triton: bool, compiled: bool, plain_head: bool) -> str:
    """Why the actor's log-probs will not run through the Triton head kernels ('' when they will)."""
    return (f"{device_type.upper()}: no Triton log-prob kernels" if device_type != "cuda" else
            "Triton is not installed" if not triton else
            "the actor is not compiled (its log-probs take the unfused head)" if not compiled else
            "the actor is not phaserl's decoder with a plain LM head" if not plain_head else "")


def train_graphs_rule(*, why_not: str, packing: bool, world_size: int) -> tuple[bool, str]:
    """ppo.train_graphs when auto: (graph the actor's packed training micro-batches, why). `why_not`:
    roles/train_graphs.unsupported's answer for the actor's model ('' when it can run).

    Off where it could run too. Measured on the H200 at the 0.5B reference shape (BENCHMARKS.md, eighteenth
    session): at the auto micro-batch (33,024 tokens, 6 micro-batches) 2.247 s a step with graphs against 2.239 s
    without, in one process; at 12,288-token micro-batches 2.28 against 2.51 s (another host, one process), the
    update's host cost per micro-batch 7.7 ms with graphs against 20-92 ms without. The graphs pay off where the
    micro-batches are small, which the auto micro-batch avoids; a user who lowers ppo.micro_batch_tokens for memory
    should turn them on."""
    if world_size > 1:
        return False, f"{world_size} ranks (FSDP's hooks gather and free parameters inside the forward)"
    if not packing:
        return False, "ppo.packing is off (the graphs take packed micro-batches)"
    if why_not:
        return False, why_not
    return False, ("no gain measured at the auto micro-batch; `true` with a smaller ppo.micro_batch_tokens for "
                   "less memory")


def keep_logits_rule(*, device_type: str, triton: bool, compiled: bool, plain_head: bool, peak_bytes: int,
                     logits_bytes: int, fixed_bytes: int, budget_bytes: int) -> tuple[bool, str]:
    """ppo.keep_head_logits when auto: (keep a micro-batch's LM-head logits from forward to backward, why).

    Keeping them spares the backward one of the head's four matmuls (it turns the kept logits into their gradient
    instead of recomputing them: algo.token_logprobs_from_hidden's save_logits), which only the Triton log-prob
    kernels do: CUDA, Triton, the actor compiled, and `plain_head` (phaserl's decoder, logits exactly
    hidden @ output_weight.T). `peak_bytes`: the doctor's update peak at the chosen micro-batch (a kept engine
    included when it is kept); `logits_bytes`: what keeping adds (the micro-batch's response tokens x vocabulary
    in bf16). Measured on the H200 at the 0.5B reference shape (BENCHMARKS.md, 2026-12-04): the update
    1.304 -> 1.232 s, +5.5 GiB allocated."""
    why_not = head_kernels_missing(device_type=device_type, triton=triton, compiled=compiled, plain_head=plain_head)
    if why_not:
        return False, why_not
    room, after = update_room(fixed_bytes, budget_bytes), peak_bytes + logits_bytes
    words = (f"{logits_bytes / GIB:.1f} GiB of kept logits, update peak {after / GIB:.1f} GiB of "
             f"{budget_bytes / GIB:.0f} GiB")
    if after > room:
        return False, f"{words}: more than the room the micro-batch leaves (recomputed in backward)"
    return True, words


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class SpeedChoices:
    """The auto-able speed settings of one run, as chosen (config/auto.py's keys)."""

    actor_compile: Choice
    critic_compile: Optional[Choice]   # None without a critic
    engine_compile: Choice
    engine_keep_awake: Choice
    packing: Optional[Choice] = None   # filled in by the builder once set_packing chose (per role; the actor's)
    partial_kv: Optional[Choice] = None            # rollout.partial_kv (None: no asynchronous stream here)
    micro_batch_tokens: Optional[Choice] = None    # ppo.micro_batch_tokens (an int)
    keep_head_logits: Optional[Choice] = None      # ppo.keep_head_logits
    train_graphs: Optional[Choice] = None          # ppo.train_graphs
    stream_reference: Optional[Choice] = None      # ref.stream_weights     (the memory plan: memory/plan.py)
    checkpoint_layers: Optional[Choice] = None     # actor.checkpoint_layers
    optimizer_offload: Optional[Choice] = None     # actor.optimizer_offload
    offload_activations: Optional[Choice] = None   # actor.offload_activations
    memory_plan: str = ""                          # the plan in one line, with its predicted peak ('' uncounted)
    memory: object = None                          # (memory.plan.PlanFacts, MemoryPlan): for the out-of-memory screen

    def all(self) -> list[Choice]:
        return [c for c in (self.actor_compile, self.critic_compile, self.engine_compile, self.engine_keep_awake,
                            self.partial_kv, self.packing, self.stream_reference, self.checkpoint_layers,
                            self.offload_activations, self.optimizer_offload, self.micro_batch_tokens,
                            self.keep_head_logits, self.train_graphs)
                if c is not None]

    @property
    def compiles(self) -> bool:
        """Some torch.compile will run in this process (the first steps pay it)."""
        return self.actor_compile.value or bool(self.critic_compile and self.critic_compile.value) or \
            self.engine_compile.value
