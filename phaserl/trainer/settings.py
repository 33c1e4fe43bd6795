"""What the builder hands the loop: the `Roles` and the frozen, typed `RunSettings`.

`trainer/build.py` makes both from a Config, once; `RLTrainer` reads them and never the config. The
fields are grouped by the phase that reads them (the numbers of `RLTrainer.train_step`). Frozen means
the fields are not reassigned: the loop's stateful parts (the prompt stream, the KL controller, the
sampling generator, the guard) change inside themselves and are saved in checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch
from tqdm import tqdm

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ..algo import AdaptiveKLController, FixedKLController
    from ..checkpoint import Checkpointer
    from ..compile_cache import CompileWatch
    from ..config.auto import SpeedChoices
    from ..data import PromptItem
    from ..metrics import MetricsLogger
    from ..rewards import RewardSources
    from ..roles import Critic, HybridActor, ReferencePolicy
    from ..rollout import SamplingParams
    from .advantage_phase import AdvantageSettings, ZeroVarianceMonitor
    from .agent_phase import AgentSettings
    from .guard import RuntimeGuard
    from .harness_phase import HarnessSettings, VerifiersSettings
    from .prompt_stream import PromptStream


@dataclass(frozen=True)
class Roles:
    """The models of a run, each in its role; critic and ref_policy are None when the algorithm has none."""

    actor: "HybridActor"
    critic: Optional["Critic"]
    ref_policy: Optional["ReferencePolicy"]
    reward: "RewardSources"
    tokenizer: "PreTrainedTokenizerBase"      # the policy's


@dataclass(frozen=True)
class RunSettings:
    # 1. prompts
    tokenizer: "PreTrainedTokenizerBase"
    train_prompts: "PromptStream"
    val_prompts: Optional[list["PromptItem"]]  # this rank's share of the held-out prompts, or None
    # 2. rollout
    n: int                                     # responses per prompt
    val_n: int
    sampling: "SamplingParams"
    greedy: "SamplingParams"                   # ReMax's greedy baseline
    val_sampling: "SamplingParams"
    temperature: float                         # the sampling temperature the log-probs are computed at
    needs_greedy_baseline: bool
    generate_batch_size: int                   # prompts per rank per generate call
    eos_token_ids: list[int]
    pad_token_id: int
    sampling_generator: torch.Generator
    ignore_eos: bool                           # rollout.ignore_eos: generate to max_new_tokens
    # 2.-3. one round of rollout + score (dynamic_sampling.single_round) or DAPO's DynamicSampling
    sample: Callable
    # 3. score
    reward: "RewardSources"
    shape_scores: Callable                     # score_shaping.OverlongShaping or no_shaping
    # 4.-5. forward-only passes, advantage
    forward_tokens: int                        # token budget of a forward-only micro-batch
    advantage: "AdvantageSettings"
    zero_variance: "ZeroVarianceMonitor"       # logs / warns about groups with all-equal rewards
    kl_controller: Union["FixedKLController", "AdaptiveKLController"]
    # 6. update
    epochs: int
    mini_batch_per_rank: int                   # responses per rank per optimizer step
    responses_per_step: int                    # global
    train_tokens: int                          # update micro-batch token budget (ppo.micro_batch_tokens as chosen)
    guard: "RuntimeGuard"
    # 7. checkpoint, log, the loop
    seed: int
    total_steps: int
    val_before_train: bool
    val_interval: int
    save_interval: int
    checkpoint_path: str
    log_dir: str
    keep_checkpoint_num: int
    metrics_logger: "MetricsLogger"
    checkpointer: Optional["Checkpointer"]
    show_progress: bool
    # 2.-3. chosen at build time (agent_phase.rollout_choice): (RolloutContext, items, params, n) -> RolloutBatch
    rollout_phase: Callable
    agent: Optional["AgentSettings"]           # agent.env: environment, limits, workers (read by agent_rollout)
    harness: Union["HarnessSettings", "VerifiersSettings", None]  # agent.harness: read by its own rollout phase
    # 1.-3. where the step's scored batch comes from: SyncStream (rollout.max_staleness 0), the AsyncStream, or
    # the groups rollout ranks send (build.rollout_stream)
    stream: object
    # the auto speed settings as chosen for this machine (trainer/speed.py), and the first compiled step's
    # console lines (rank 0, when something compiles; compile_cache.py)
    speed: "SpeedChoices"
    compile_watch: Optional["CompileWatch"]
    reuse_update_logprobs: bool = True  # skip the old log-prob pass when the step is one optimizer step
    save_on_signal: bool = True         # trainer.save_on_signal: SIGINT/SIGTERM save before stopping
    bitwise_check_every: int = 0        # rollout.bitwise_check_every in the bitwise mode; 0: not that mode

    def progress_bar(self, start: int):
        return tqdm(total=self.total_steps, initial=start, desc="phaserl", unit="step",
                    disable=not self.show_progress, dynamic_ncols=True, leave=False)
