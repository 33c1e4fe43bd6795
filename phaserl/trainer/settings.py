"""Plain run settings: everything the loop needs, resolved once from the Config by `build.py`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from tqdm import tqdm


@dataclass
class RunSettings:
    # data
    tokenizer: Any
    train_prompts: Any                 # PromptStream
    val_prompts: Optional[list]        # PromptItems (this rank's share) or None
    # rollout
    n: int
    val_n: int
    sampling: Any                      # SamplingParams
    greedy: Any                        # SamplingParams for ReMax's baseline
    val_sampling: Any
    temperature: float
    needs_greedy_baseline: bool
    generate_batch_size: int           # prompts per rank per generate call
    eos_token_ids: list
    pad_token_id: int
    sampling_generator: Any            # torch.Generator
    # score / advantage
    reward: Any                        # RewardSources
    advantage: Any                     # AdvantageSettings
    kl_controller: Any
    # update
    epochs: int
    mini_batch_per_rank: int
    responses_per_step: int
    forward_tokens: int
    train_tokens: int
    guard: Any                         # RuntimeGuard
    # run
    seed: int
    total_steps: int
    val_before_train: bool
    val_interval: int
    save_interval: int
    checkpoint_path: str
    log_dir: str
    keep_checkpoint_num: int
    metrics_logger: Any
    checkpointer: Any = None
    show_progress: bool = True
    ignore_eos: bool = False            # rollout.ignore_eos: generate to max_new_tokens
    reuse_update_logprobs: bool = True  # skip the old log-prob pass when the step is one optimizer step

    def progress_bar(self, start: int):
        return tqdm(total=self.total_steps, initial=start, desc="phaserl", unit="step",
                    disable=not self.show_progress, dynamic_ncols=True, leave=False)
