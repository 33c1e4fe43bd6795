"""The typed config tree: one dataclass per section, with units in the field comments.

This module only declares fields, defaults and per-field ranges (`meta`). Loading YAML, applying
`key=value` overrides and checking cross-field rules live in `load.py` and `validate.py`.
Every batch size says what it counts (prompts or responses), and whether it is global (the whole
job) or per rank (one GPU / one process).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


def spec(default, help: str, *, choices=None, min=None, max=None, factory=None, auto=False):
    """A dataclass field that carries its help text and allowed range for validation/--explain.

    On a list field, `choices`/`min`/`max` apply to each item. auto: an optional number whose null, also written
    `auto`, is decided when the run is built (config/auto.py), like an optional on/off setting.
    """
    meta = {"help": help, "choices": choices, "min": min, "max": max, "auto": auto}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    path: str = spec("tiny", "policy init: a Hugging Face model directory, or 'tiny' for the built-in tiny world model")
    tokenizer_path: Optional[str] = spec(None, "tokenizer directory; null means model.path")
    dtype: str = spec("float32", "parameter dtype for training", choices=["float32", "bfloat16", "float16"])
    trust_remote_code: bool = spec(False, "allow code from the model directory (off unless you turn it on)")
    implementation: str = spec("auto", "auto: phaserl's decoder for the native families (docs/models.md), transformers "
                               "for the rest; native; transformers (exact, slow)",
                               choices=["auto", "native", "transformers"])
    allow_random_init: bool = spec(False, "start tensors missing from the model directory from random init "
                                   "(otherwise an error that lists them)")
    vision_trainable: bool = spec(False, "vision-language models: train the vision tower and its merger too (frozen "
                                  "by default; LoRA never adapts them: docs/vision.md)")


@dataclass
class DataConfig:
    train_files: list[str] = spec(None, "prompt files (.parquet or .jsonl, verl schema); 'tiny' = built-in task",
                                  factory=lambda: ["tiny"])
    val_files: list[str] = spec(None, "held-out prompt files; 'tiny' = built-in task", factory=lambda: ["tiny"])
    prompt_key: str = spec("prompt", "column holding the prompt (a string or a list of chat messages)")
    max_prompt_length: int = spec(128, "tokens; prompts longer than this follow data.overlong_prompts", min=1)
    overlong_prompts: str = spec("error", "what to do with a prompt over max_prompt_length (truncate_*: "
                                 "cut the last user message's text, never the chat template's turns)",
                                 choices=["error", "drop", "truncate_left", "truncate_right"])
    apply_chat_template: bool = spec(True, "format prompts with the tokenizer's chat template (with generation prompt)")
    shuffle: bool = spec(True, "reshuffle the training prompts every epoch (seeded by trainer.seed)")
    val_max_prompts: Optional[int] = spec(None, "use at most this many held-out prompts; null = all", min=1)
    image_key: str = spec("images", "vision-language models: the column holding each row's images (docs/vision.md)")
    min_pixels: int = spec(3136, "vision-language models: images are resized to at least this many pixels", min=1)
    max_pixels: int = spec(1003520, "vision-language models: images are resized to at most this many pixels (the "
                                    "image tokens of a prompt scale with it)", min=1)


@dataclass
class RolloutConfig:
    prompts_per_step: int = spec(32, "prompts per RL step, GLOBAL (all ranks together)", min=1)
    n: int = spec(4, "responses sampled per prompt", min=1)
    batch_size: int = spec(32, "prompts per GPU (rank) per generate call", min=1)
    max_new_tokens: int = spec(64, "tokens per response, at most", min=1)
    temperature: float = spec(1.0, "sampling temperature (0 = greedy)", min=0.0)
    top_p: float = spec(1.0, "nucleus sampling mass (1 = off)", min=0.0, max=1.0)
    top_k: int = spec(0, "sample among the k most likely tokens (0 = off)", min=0)
    engine: str = spec("auto", "rollout engine: builtin (our KV-cache engine), hf (transformers generate), auto",
                        choices=["auto", "builtin", "hf"])
    engine_max_slots: int = spec(512, "builtin engine: most sequences decoded together, per rank", min=1)
    engine_memory_fraction: float = spec(0.4, "builtin engine: share of free GPU memory for its KV cache at each "
                                              "switch to rollout mode, at most engine_max_slots sequences of "
                                              "data.max_prompt_length + max_new_tokens", min=0.01, max=0.95)
    engine_cuda_graphs: bool = spec(True, "builtin engine: capture decode steps in CUDA graphs (GPU only)")
    engine_keep_awake: Optional[bool] = spec(None, "builtin engine: keep its KV cache, fused weight copies and CUDA "
                                                   "graphs on the GPU during training, so the next rollout does not "
                                                   "re-capture its graphs (their memory stays taken in the update). "
                                                   "null = auto: on with one GPU (or an unsharded actor) when the "
                                                   "doctor's memory count says they fit beside the update with "
                                                   "margin; off on the CPU, with FSDP or tight memory")
    engine_compile: Optional[bool] = spec(None, "builtin engine: torch.compile its layers (null = auto: on CUDA with "
                                                "Triton where some layer has no fused decode kernels; the first "
                                                "rollout on a machine then pays the compile, cached for later runs: "
                                                "docs/performance.md)")
    bitwise: bool = spec(False, "exact numerics: the engine and the trainer compute every token with batch-invariant "
                                "kernels, so the trainer's log-prob of each sampled token equals the sampler's bit for "
                                "bit (mismatch/abs_diff_max = 0; corrections become no-ops). Native dense families on "
                                "the builtin engine; slower (docs/numerics.md)")
    bitwise_check_every: int = spec(1, "bitwise mode, synchronous one-optimizer-step updates: the update recomputes "
                                       "the exact log-probs and logs mismatch/* every this many steps; on the steps "
                                       "between, its loss takes the engine's log-probs as the values (equal to the "
                                       "bit by the mode) and skips that forward (docs/numerics.md)", min=1)
    val_temperature: float = spec(0.0, "temperature for validation (0 = greedy)", min=0.0)
    val_n: int = spec(1, "responses per held-out prompt during validation", min=1)
    ignore_eos: bool = spec(False, "EOS does not end a response: every response runs to max_new_tokens (fixed-length "
                                   "benchmarks; the EOS token then stays in the text)")
    max_staleness: int = spec(0, "asynchronous rollout: a batch may hold tokens sampled up to this many policy "
                                 "versions (optimizer steps) before the weights it trains; responses still decoding "
                                 "when a batch is ready continue after the update (docs/async.md). 0 = the "
                                 "synchronous step",
                              min=0)
    on_stale: str = spec("restart", "asynchronous rollout: a response whose oldest token would pass max_staleness is "
                                    "started over (restart) or its whole group dropped (drop); counted either way",
                         choices=["restart", "drop"])
    partial_kv: str = spec("auto", "asynchronous rollout: what a response still decoding (or an episode waiting for "
                                   "its tool) keeps across an update: keep = its slot and KV in a decode session kept "
                                   "through training (no prefill next phase; needs engine_keep_awake), prefill = its "
                                   "ids prefilled again next phase; auto = keep when the engine is kept awake, else "
                                   "prefill (docs/async.md)",
                           choices=["auto", "keep", "prefill"])
    ranks: int = spec(0, "rollout ranks: under torchrun the last `ranks` ranks only generate and the others only "
                         "train, sending new weights to them after each optimizer step (docs/distributed.md, 'Rollout "
                         "ranks'). 0 = every rank both generates and trains (the hybrid actor)", min=0)
    weight_bucket_mb: int = spec(256, "rollout ranks: weights travel to them in buckets of at most this many MiB "
                                      "(a larger parameter travels alone)", min=1)


@dataclass
class RewardFunctionConfig:
    name: str = spec("tiny_exact", "built-in rule name or 'path/to/file.py:function'")
    weight: float = spec(1.0, "weight of this function in the summed reward")
    kwargs: dict = spec(None, "extra keyword arguments passed to the function", factory=dict)


@dataclass
class RewardConfig:
    functions: list[RewardFunctionConfig] = spec(None, "rule reward functions (list of {name, weight, kwargs}, "
                                                       "or plain names)", factory=lambda: [RewardFunctionConfig()])
    reward_model_weight: float = spec(1.0, "weight of the reward model's score when reward_model.enable")
    timeout_s: float = spec(300.0, "longest a rule reward function may take on one response before the run "
                                   "stops with an error naming it and the row", min=0.001)
    workers: Optional[int] = spec(None, "worker processes that run the rule reward functions, per rank (0 = in the "
                                        "main process; the scores are the same). null = auto: 0 when every "
                                        "function is a cheap built-in (tiny_exact, gsm8k, format), otherwise "
                                        "min(4, CPU cores per rank - 1)", min=0, auto=True)


@dataclass
class FSDPConfig:
    sharding_strategy: str = spec("FULL_SHARD", "FSDP2 sharding of this role",
                                  choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
    cpu_offload: bool = spec(False, "keep parameters on the CPU between uses")
    param_dtype: Optional[str] = spec(None, "mixed precision compute dtype (null = parameter dtype)",
                                      choices=[None, "float32", "bfloat16", "float16"])
    reshard_after_forward: bool = spec(True, "free gathered parameters after forward")


@dataclass
class RewardModelConfig:
    enable: bool = spec(False, "score responses with a sequence-classification reward model")
    path: Optional[str] = spec(None, "reward model directory (Hugging Face format)")
    tokenizer_path: Optional[str] = spec(None, "the reward model's own tokenizer; null means reward_model.path")
    engine: str = spec("auto", "how the RM runs: phaserl (phaserl's decoder, for llama/qwen2/qwen3 "
                               "*ForSequenceClassification with num_labels=1; token-budget micro-batches), "
                               "transformers (AutoModelForSequenceClassification, batch_size rows per call), auto "
                               "(phaserl when the directory qualifies)", choices=["auto", "phaserl", "transformers"])
    batch_size: int = spec(16, "sequences per GPU (rank) per scoring call (transformers engine; the phaserl engine "
                               "forms its calls by micro_batch_tokens)", min=1)
    micro_batch_tokens: int = spec(16384, "phaserl engine: tokens per scoring forward, per rank (real tokens when "
                                          "packed, rows x longest row when padded); a longer input is scored alone",
                                   min=1)
    packing: Optional[bool] = spec(None, "phaserl engine: pack each scoring forward's inputs without padding. null = "
                                         "auto, ppo.packing's rule: on where the varlen flash kernel runs (CUDA, "
                                         "bf16/fp16 compute), padded elsewhere")
    max_length: int = spec(512, "tokens of prompt+response the reward model sees, at most", min=8)
    truncation: bool = spec(True, "truncate inputs over max_length (false: error on overlong input)")
    truncation_side: str = spec("left", "which end to cut when truncating (left keeps the response end)",
                                choices=["left", "right"])
    apply_chat_template: bool = spec(True, "format (prompt, response) with a chat template before scoring")
    chat_template: Optional[str] = spec(None, "a Jinja chat template overriding the RM tokenizer's own")
    response_key: str = spec("response", "field of a row that holds the response to score")
    fsdp: FSDPConfig = spec(None, "parallel settings of the reward model (forward only: FULL_SHARD splits it over "
                                  "the ranks, NO_SHARD keeps a full replica per rank; cpu_offload allowed)",
                            factory=FSDPConfig)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = spec("grpo", "advantage estimator",
                              choices=["gae", "grpo", "rloo", "reinforce_plus_plus",
                                       "reinforce_plus_plus_baseline", "remax", "grpo_passk", "opo", "gpg"])
    norm_adv_by_std: bool = spec(True, "GRPO: divide by the group std (false = Dr.GRPO)")
    gamma: float = spec(1.0, "discount factor", min=0.0, max=1.0)
    lam: float = spec(1.0, "GAE lambda", min=0.0, max=1.0)
    kl_placement: str = spec("loss", "where the KL to the reference goes", choices=["loss", "reward", "none"])
    kl_estimator: str = spec("k3", "KL estimator (verl's kl / mse / low_var_kl = k1 / k2 / k3; a trailing + is the "
                                   "straight-through variant: the value of the estimator, the gradient of k2)",
                             choices=["k1", "k1+", "k2", "k2+", "k3", "k3+", "abs", "abs+", "kl", "kl+", "mse", "mse+",
                                      "low_var_kl", "low_var_kl+"])
    kl_coef: float = spec(0.001, "KL coefficient (initial value when adaptive)", min=0.0)
    kl_target: Optional[float] = spec(None, "adaptive KL controller target, in the loss or the reward (null = fixed "
                                            "coefficient)", min=0.0)
    kl_horizon: int = spec(10000, "adaptive KL controller horizon, in responses: while the KL is 20% or more off "
                                  "target the coefficient moves by about x1.2 (x0.8) every horizon responses, at "
                                  "most that much in one step, and within 100x of kl_coef either way", min=1)
    rollout_correction: str = spec("auto", "rollout/training mismatch correction, a per-token weight on the policy "
                                           "loss: tis (truncated IS), icepop, masked_is, seq_mask (geometric mean), "
                                           "decoupled (decoupled PPO: the proximal policy is the weights before the "
                                           "update, tokens whose behaviour weight passes the cap masked); auto = "
                                           "tis with rollout.max_staleness >= 1, else none",
                                   choices=["auto", "none", "tis", "icepop", "masked_is", "seq_mask", "decoupled"])
    rollout_correction_cap: float = spec(2.0, "C of the correction: TIS's cap, the masks' band [1/C, C]", min=1.0)
    dynamic_sampling: bool = spec(False, "DAPO: drop groups whose rewards are all equal and sample more prompts "
                                         "until the step has rollout.prompts_per_step informative groups")
    dynamic_sampling_max_rounds: int = spec(4, "dynamic sampling: extra rounds of prompts_per_step prompts at most",
                                            min=1)
    overlong_buffer: int = spec(0, "DAPO overlong shaping: tokens before rollout.max_new_tokens where the score "
                                   "falls linearly by up to overlong_penalty (0 = off)", min=0)
    overlong_penalty: float = spec(1.0, "DAPO overlong shaping: the penalty at the length limit", min=0.0)


@dataclass
class HybridEngineConfig:
    enable_rollout_optimization_switch: bool = spec(True, "switch between rollout and training modes (actor only)")
    offload_optimizer: bool = spec(False, "move optimizer state to CPU while in rollout mode")


@dataclass
class OptimConfig:
    lr: float = spec(1e-6, "learning rate", min=0.0)
    weight_decay: float = spec(0.0, "AdamW weight decay", min=0.0)
    betas: list[float] = spec(None, "AdamW betas", factory=lambda: [0.9, 0.999])
    grad_clip: float = spec(1.0, "max gradient norm (0 = off)", min=0.0)
    warmup_steps: int = spec(0, "linear warmup, in optimizer steps", min=0)
    lr_schedule: str = spec("constant", "after warmup", choices=["constant", "cosine"])


# models/lora.py resolves these (short names, all-linear) to the decoder's projections; a test keeps both in step.
LORA_TARGETS = ["all-linear", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "q", "k", "v", "o", "gate", "up", "down",
                "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]  # Qwen3.5's linear attention


@dataclass
class LoRAConfig:
    rank: int = spec(0, "LoRA rank r (0 = off: every parameter trains); with r > 0 only the adapters (and their "
                        "AdamW state) train and the base weights stay frozen", min=0)
    alpha: float = spec(16.0, "LoRA alpha: the update is (alpha / rank) * B A", min=0.0)
    dropout: float = spec(0.0, "dropout on the adapters' input (training only)", min=0.0, max=0.99)
    target_modules: list[str] = spec(None, "projections that get adapters: q_proj k_proj v_proj o_proj gate_proj "
                                           "up_proj down_proj (or q, k, v, o, gate, up, down), Qwen3.5's linear "
                                           "attention in_proj_qkv in_proj_z in_proj_b in_proj_a out_proj, or "
                                           "all-linear (every one the model has)",
                                     choices=LORA_TARGETS, factory=lambda: ["all-linear"])


@dataclass
class ActorConfig:
    optim: OptimConfig = spec(None, "optimizer", factory=OptimConfig)
    policy_loss: str = spec("ppo", "policy loss (docs/concepts.md); vanilla and geo_mean are verl's names for ppo and "
                                   "gmpo", choices=["ppo", "gspo", "cispo", "sapo", "gmpo", "dro", "dppo_tv",
                                                    "dppo_kl", "gpg", "vanilla", "geo_mean"])
    clip_ratio_low: Optional[float] = spec(None, "the policy loss's range below / where A <= 0, as in verl: PPO/GSPO "
                                                 "clip ratio >= 1 - clip_ratio_low, CISPO's weight bound, GMPO's "
                                                 "log-space bound, DPPO's threshold where A <= 0 (null = 0.2; DPPO: "
                                                 "actor.dppo_delta)", min=0.0)
    clip_ratio_high: Optional[float] = spec(None, "the policy loss's range above / where A > 0, as in verl: PPO/GSPO "
                                                  "clip ratio <= 1 + clip_ratio_high (clip-higher when > low), CISPO, "
                                                  "GMPO, DPPO's threshold where A > 0 (null = 0.2; DPPO: "
                                                  "actor.dppo_delta)", min=0.0)
    dual_clip_c: Optional[float] = spec(3.0, "dual-clip constant for negative advantages (null = off)", min=1.0)
    loss_agg_mode: str = spec("token-mean", "how per-token losses become one number",
                              choices=["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                       "seq-mean-token-sum-norm", "token-sum"])
    entropy_coef: float = spec(0.0, "entropy bonus coefficient", min=0.0)
    sapo_tau_pos: float = spec(1.0, "SAPO gate temperature for positive advantages", min=0.0)
    sapo_tau_neg: float = spec(1.05, "SAPO gate temperature for negative advantages", min=0.0)
    dro_beta: float = spec(0.1, "DRO: weight of the quadratic log-ratio penalty", min=0.0)
    dppo_delta: Optional[float] = spec(None, "DPPO trust region on the sampled token's probability change (TV) or "
                                             "binary KL, one value for both signs of the advantage: the shorthand "
                                             "for clip_ratio_low/high, which win on their side when set (null = "
                                             "the paper's: 0.15 for dppo_tv, 0.05 for dppo_kl)", min=0.0)
    dppo_ratio_cap: float = spec(20.0, "DPPO: truncated-IS cap on the ratio", min=1.0)
    gradient_checkpointing: bool = spec(False, "recompute every layer's activations in backward to save memory (the "
                                               "same as actor.checkpoint_layers = all)")
    checkpoint_layers: Optional[int] = spec(None, "activation checkpointing, selective: how many of the actor's "
                                                  "decoder layers recompute their activations in backward (0 = none; "
                                                  "the model's layer count or more = all). null = auto: the memory "
                                                  "plan (docs/memory.md): none when the step fits the device, else the "
                                                  "fewest that make it fit", min=0, auto=True)
    optimizer_offload: Optional[bool] = spec(None, "keep AdamW's moments on the CPU and run the optimizer step there "
                                                   "(gradients go down, updated weights come back, bucket by bucket "
                                                   "overlapped; one process only). null = auto: the memory plan: on "
                                                   "only when the step does not fit the device otherwise")
    offload_activations: Optional[bool] = spec(None, "keep the checkpointed layers' saved inputs in pinned host "
                                                     "memory between forward and backward (copied on a side stream, "
                                                     "at most 2 on the device at once; phaserl's decoder only). "
                                                     "null = auto: the memory plan: on only when checkpointing the "
                                                     "layers does not fit the step")
    sequence_parallel: int = spec(1, "Ulysses sequence parallelism (docs/memory.md): groups of this many ranks "
                                     "spread each micro-batch's tokens over their GPUs for the actor's and the "
                                     "reference's training forwards, all-to-alls around attention (phaserl's dense "
                                     "decoders; must divide the world size and every layer's query heads). 1 = off",
                                  min=1)
    compile: Optional[bool] = spec(None, "torch.compile the decoder layers and the log-prob kernels of the actor and "
                                         "the reference (phaserl's decoder only). null = auto: on for phaserl's "
                                         "decoder on one CUDA GPU with Triton and >= 100M parameters, off on the "
                                         "CPU; the first run on a machine pays the compile, later runs read "
                                         "torch's cache (docs/performance.md)")
    fsdp: FSDPConfig = spec(None, "parallel settings of the actor", factory=FSDPConfig)
    hybrid_engine: HybridEngineConfig = spec(None, "rollout/training mode switch", factory=HybridEngineConfig)
    lora: LoRAConfig = spec(None, "LoRA adapters on the actor (docs/lora.md); the reference is then the actor's base "
                                  "with adapters off, no second copy", factory=LoRAConfig)
    routing_replay: bool = spec(False, "MoE models: the rollout engine records each position's experts and the "
                                       "training forwards use them (docs/models.md)")


@dataclass
class CriticConfig:
    enable: Optional[bool] = spec(None, "train a value model (null = only when algorithm.adv_estimator is gae)")
    path: Optional[str] = spec(None, "critic init directory (null = model.path, with a fresh value head)")
    init_from: str = spec("policy", "critic start: policy (critic.path or model.path, zero value head) or "
                                    "reward_model (critic.path or reward_model.path, the RM's trained head)",
                          choices=["policy", "reward_model"])
    optim: OptimConfig = spec(None, "optimizer", factory=lambda: OptimConfig(lr=1e-5))
    cliprange_value: float = spec(0.5, "value clipping around the old values", min=0.0)
    loss_coef: float = spec(0.5, "value loss coefficient", min=0.0)
    gradient_checkpointing: bool = spec(False, "recompute activations in backward to save memory")
    compile: Optional[bool] = spec(None, "torch.compile the critic's decoder layers (phaserl's decoder only); "
                                         "null = auto: actor.compile's rule, for the critic's model")
    fsdp: FSDPConfig = spec(None, "parallel settings of the critic (never switches modes)", factory=FSDPConfig)
    hybrid_engine: Optional[HybridEngineConfig] = spec(None, "must stay null: only the actor switches modes")
    lora: LoRAConfig = spec(None, "LoRA adapters on the critic's decoder (its value head trains fully)",
                            factory=LoRAConfig)


@dataclass
class RefConfig:
    enable: Optional[bool] = spec(None, "keep a frozen reference policy (null = when algorithm.kl_placement != none)")
    path: Optional[str] = spec(None, "reference init directory (null = model.path)")
    fsdp: FSDPConfig = spec(None, "parallel settings of the reference", factory=FSDPConfig)
    stream_weights: Optional[bool] = spec(None, "keep the reference's decoder layers in CPU memory and copy each to "
                                                "the GPU one layer ahead of its forward-only pass (one process; on "
                                                "several ranks ref.fsdp.cpu_offload does it per shard). null = auto: "
                                                "the memory plan: on only when the step does not fit the device "
                                                "otherwise")


@dataclass
class PPOConfig:
    mini_batch_size: Optional[int] = spec(None, "responses per optimizer step, GLOBAL (null = derived from "
                                                "num_mini_batches)", min=1)
    num_mini_batches: int = spec(1, "optimizer steps per epoch over one RL step's responses", min=1)
    epochs: int = spec(1, "passes over one RL step's responses", min=1)
    micro_batch_tokens: Optional[int] = spec(None, "tokens per training micro-batch, per rank (forward+backward). "
                                                   "null = auto: on CUDA the fewest micro-batches of about 32768 "
                                                   "tokens (whole sequences, dealt evenly) that the doctor's memory "
                                                   "count gives room for; 16384 elsewhere",
                                             min=1, auto=True)
    forward_micro_batch_tokens: Optional[int] = spec(None, "tokens per forward-only micro-batch, per rank (ref, "
                                                           "old log-probs, values). null = auto: 32768, or one whole "
                                                           "sequence when a sequence is longer", min=1, auto=True)
    keep_head_logits: Optional[bool] = spec(None, "keep a training micro-batch's LM-head logits (its response tokens "
                                                  "x vocabulary, bf16) from forward to backward instead of "
                                                  "recomputing them: one of the head's four matmuls saved (Triton "
                                                  "log-prob kernels only). null = auto: on where they run and the "
                                                  "doctor's memory count has room at the chosen micro-batch")
    train_graphs: Optional[bool] = spec(None, "run a packed training micro-batch's decoder body (forward and "
                                              "backward) as CUDA graph replays, padded to a few static shapes: the "
                                              "host's cost per micro-batch goes, so small micro-batches (less memory) "
                                              "run nearly as fast as large ones. null = auto: off (no gain measured "
                                              "at the auto micro-batch; docs/performance.md)")
    packing: Optional[bool] = spec(None, "pack micro-batches without padding (budgets count real tokens; phaserl's "
                                         "decoder only). null = auto: on where the varlen flash kernel runs (CUDA, "
                                         "bf16/fp16 compute); padded elsewhere, where the dense block mask costs "
                                         "more than the padding it saves")


@dataclass
class TrainerConfig:
    total_steps: int = spec(10, "RL steps to run", min=1)
    seed: int = spec(0, "seed for data order, sampling and init")
    device: str = spec("auto", "cpu, cuda, or auto (cuda when available)", choices=["auto", "cpu", "cuda"])
    checkpoint_path: str = spec("runs/default/checkpoints",
                                "where step_{N}/ checkpoints go (shared storage on several nodes)")
    log_dir: str = spec("runs/default", "metrics.jsonl, TensorBoard events and the report go here")
    save_interval: int = spec(0, "save every this many steps (0 = only at the end)", min=0)
    keep_checkpoint_num: int = spec(3, "keep the newest N complete checkpoints", min=1)
    val_interval: int = spec(0, "validate every this many steps (0 = only before and after training)", min=0)
    val_before_train: bool = spec(True, "validate at step 0")
    resume: str = spec("auto", "auto (newest complete checkpoint), never, or a checkpoint path")
    export_hf: bool = spec(False, "also export the actor in Hugging Face format at each save")
    checkpoint_verify: str = spec("full", "what resume and export check against a checkpoint's manifest: full "
                                  "(sizes and SHA-256 of every file) or size (sizes only: faster for huge checkpoints)",
                                  choices=["full", "size"])
    resume_fallback: bool = spec(True, "a damaged newest checkpoint: resume from the newest good one (false: stop)")
    save_on_signal: bool = spec(True, "SIGINT/SIGTERM: save a checkpoint at the next safe point before stopping")
    loggers: list[str] = spec(None, "where metrics go (rank 0 only)",
                              choices=["console", "jsonl", "tensorboard", "wandb"],
                              factory=lambda: ["console", "jsonl", "tensorboard"])
    on_nonfinite: str = spec("stop", "non-finite advantages/loss/grad norm: stop the run or skip the step",
                             choices=["stop", "skip"])


@dataclass
class VerifiersConfig:
    env: Optional[str] = spec(None, "agent.harness: verifiers: the environment, an installed module (a taskset "
                                    "package, or one defining load_environment) or 'path/to/env.py' (docs/agents.md)")
    kwargs: dict = spec(None, "load_environment(**kwargs), or for a taskset package its environment config "
                              "({taskset: {...}, agent: {harness: ..., runtime: ...}})", factory=dict)
    eval_kwargs: Optional[dict] = spec(None, "the validation environment: these keys laid over kwargs (e.g. "
                                             "{taskset: {split: test}}); null = validation prompts come from "
                                             "data.val_files with prompts: files, none with prompts: env")
    prompts: str = spec("env", "env: the environment's tasks are the prompt rows (data.train_files / val_files "
                               "unused); files: data.*_files rows, each read as one of the environment's tasks",
                        choices=["env", "files"])


@dataclass
class AgentConfig:
    env: Optional[str] = spec(None, "multi-turn RL: the environment class, 'path/to/file.py:ClassName' or "
                                    "'package.module:ClassName' (a fresh instance per episode; docs/agents.md). "
                                    "null = single-turn RL")
    kwargs: dict = spec(None, "keyword arguments of the environment's constructor", factory=dict)
    max_turns: int = spec(4, "model turns per episode, at most (then the episode ends: agent/ended/max_turns)", min=1)
    max_episode_tokens: int = spec(1024, "tokens of prompt + every turn + every observation, at most (capped by "
                                         "the model's context); rollout.max_new_tokens caps one turn", min=2)
    step_timeout_s: float = spec(60.0, "seconds an environment's reset/step call may take; then the episode "
                                       "ends (agent/ended/env_timeout)", min=0.0)
    on_env_error: str = spec("end", "an environment that raises, hangs or returns a bad value: end the episode "
                                    "(counted) or stop the run", choices=["end", "stop"])
    workers: int = spec(16, "environment calls running at once (threads), per rank", min=1)
    overlap: bool = spec(True, "use an environment's answer as soon as it arrives (decoding never waits); false: "
                               "at a fixed point after each decode step, so a seeded run repeats exactly")
    harness: Optional[str] = spec(None, "multi-turn RL driven by an external harness instead of agent.env: "
                                        "'path/to/file.py:function' or 'package.module:function', called as "
                                        "harness(base_url, row) -> reward or None against phaserl's OpenAI-compatible "
                                        "endpoint (None: reward.functions score the last reply; docs/agents.md); "
                                        "'verifiers': a verifiers environment's own rollouts (agent.verifiers)")
    harness_workers: int = spec(16, "harness conversations running at once (threads), per rank", min=1)
    harness_timeout_s: float = spec(300.0, "seconds one harness conversation may take; then its recorded turns "
                                           "are kept with reward 0 (agent/ended/env_error)", min=0.001)
    tool_parser: str = spec("hermes", "how the endpoint parses tool calls out of the model's replies (agent.harness)")
    verifiers: VerifiersConfig = spec(None, "agent.harness: verifiers: the environment and where prompts come from",
                                      factory=VerifiersConfig)


@dataclass
class Config:
    model: ModelConfig = spec(None, "the policy model", factory=ModelConfig)
    data: DataConfig = spec(None, "prompt data", factory=DataConfig)
    rollout: RolloutConfig = spec(None, "generation", factory=RolloutConfig)
    reward: RewardConfig = spec(None, "rule rewards", factory=RewardConfig)
    reward_model: RewardModelConfig = spec(None, "reward model", factory=RewardModelConfig)
    algorithm: AlgorithmConfig = spec(None, "advantages and KL", factory=AlgorithmConfig)
    actor: ActorConfig = spec(None, "the policy's training settings", factory=ActorConfig)
    critic: CriticConfig = spec(None, "the value model (PPO)", factory=CriticConfig)
    ref: RefConfig = spec(None, "the frozen reference policy", factory=RefConfig)
    ppo: PPOConfig = spec(None, "update-phase batch sizes", factory=PPOConfig)
    trainer: TrainerConfig = spec(None, "run length, seeds, paths, logging", factory=TrainerConfig)
    agent: AgentConfig = spec(None, "multi-turn episodes with an environment or a harness (off unless agent.env "
                                    "or agent.harness is set)",
                              factory=AgentConfig)
