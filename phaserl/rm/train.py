"""Bradley–Terry reward-model training on preference pairs, and export as a Hugging Face RM directory.

The model is our decoder with a scalar head (`ValueModel`); its score for a sequence is the head's
value at the last non-padding token, the rule transformers' `*ForSequenceClassification` uses, so the
exported directory scores the same in `AutoModelForSequenceClassification` as here. The loss per pair
is -log σ(r_chosen − r_rejected), averaged over the pairs of a step.

The input format is the one the RM will be *scored* with: every text comes from
`RewardModelWrapper.format` and `_encode` (template on/off, custom template, truncation side) of a
wrapper built over the model being trained, and held-out accuracy is measured through
`RewardModelWrapper.score` itself. A reward model trained on one format and scored on another is classic
mistake 2; sharing the code rules it out.

Not here: the YAML config and CLI (config.py, __init__.py), making preference data (tiny_prefs.py),
micro-batching (a step is one forward of 2·P sequences), several GPUs.
Legend: P pairs in a step, N = 2P sequences (chosen rows first, then rejected), T longest in the batch.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from phaserl.data import PreferenceRow
from phaserl.errors import ConfigError, DataError
from phaserl.models import ValueModel, load_tokenizer, save_value_model
from phaserl.models.hf_io import check_value_model_export
from phaserl.rm.critic_init import init_critic, is_reward_model_dir
from phaserl.roles.optim import Optimizer, OptimSettings
from phaserl.roles.reward_model import RewardModelWrapper
from phaserl.roles.reward_scoring import right_pad

log = logging.getLogger("phaserl")
FORMAT_FILE = "phaserl_rm.json"  # written next to the weights: the format the RM was trained with


def last_non_pad_index(input_ids: torch.Tensor, pad_token_id: Optional[int]) -> torch.Tensor:
    """[N, T] -> [N]: the rightmost position holding a non-pad token (transformers' classifier pooling)."""
    T = input_ids.shape[1]
    if pad_token_id is None:
        return torch.full((input_ids.shape[0],), T - 1, dtype=torch.long, device=input_ids.device)
    non_pad = (input_ids != pad_token_id).long()                                  # [N, T]
    return (torch.arange(T, device=input_ids.device) * non_pad).argmax(-1)         # [N]


class SequenceScorer(nn.Module):
    """Our ValueModel read as a sequence classifier: one score per sequence, [N]. Wrap it in
    RewardModelWrapper to score with our own decoder instead of transformers' classes."""

    def __init__(self, value_model: ValueModel):
        super().__init__()
        self.value_model = value_model
        self.config = value_model.config  # the wrapper reads pad_token_id here (and sets it when missing)

    def get_input_embeddings(self) -> nn.Embedding:
        vm = self.value_model
        return vm.model.embed_tokens if isinstance(vm, ValueModel) else vm.get_input_embeddings()  # HFValueModel

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        values = self.value_model(input_ids, attention_mask=attention_mask)        # [N, T]
        last = last_non_pad_index(input_ids, self.config.pad_token_id)              # [N]
        return values.gather(1, last[:, None]).squeeze(1)                           # [N]


@dataclass
class PairAccuracy:
    accuracy: float      # share of pairs with r_chosen > r_rejected (a tie counts as wrong)
    margin_mean: float   # mean of r_chosen - r_rejected
    pairs: int


@dataclass
class RMTrainStats:
    steps: int
    seconds: float
    train_pairs: int
    val_before: Optional[PairAccuracy]    # held-out accuracy of the initial model (None without val rows)
    val_after: Optional[PairAccuracy]     # ... and after training
    truncated_inputs: int                 # training inputs over max_length (cut on truncation_side)
    out_dir: Optional[str]
    losses: list = field(default_factory=list)      # per step: mean BT loss over its pairs
    accuracies: list = field(default_factory=list)  # per step: share of its pairs ranked right


def evaluate_pairs(wrapper: RewardModelWrapper, rows: list[PreferenceRow]) -> PairAccuracy:
    """Pairwise accuracy of any reward model (ours or a transformers one) through its scoring path."""
    if not rows:
        raise DataError("evaluate_pairs: no preference rows to evaluate; pass at least one held-out pair")
    prompts = [r.prompt for r in rows]
    chosen = wrapper.score(prompts, [r.chosen_response for r in rows])      # [P]
    rejected = wrapper.score(prompts, [r.rejected_response for r in rows])  # [P]
    margin = chosen - rejected                                              # [P]
    return PairAccuracy(int((margin > 0).sum()) / len(rows), float(margin.mean()), len(rows))


def load_rm_init(path: str, *, device="cpu", trust_remote_code: bool = False) -> ValueModel:
    """A reward model to train from `path`: an RM directory keeps its head, a causal LM gets a zero head."""
    source = "reward_model" if is_reward_model_dir(path) else "policy"
    return init_critic(source, path, device=device, trust_remote_code=trust_remote_code)


def train_reward_model(model: Union[str, ValueModel], tokenizer, train_rows: list[PreferenceRow],
                       val_rows: list[PreferenceRow], *, steps: int, lr: float, batch_size: int, max_length: int,
                       apply_chat_template: bool, chat_template: Optional[str] = None,
                       truncation_side: str = "left", seed: int = 0, device="cpu", out_dir: Optional[str] = None,
                       weight_decay: float = 0.0, warmup_steps: int = 0, grad_clip: float = 1.0,
                       eval_batch_size: int = 64, log_every: int = 0) -> RMTrainStats:
    """Train `model` (a directory or a ValueModel, changed in place) on the pairs; export to `out_dir` if given.

    `batch_size` counts pairs per optimizer step; pairs are drawn without replacement, reshuffled each
    epoch (seeded). The RM sees exactly what `RewardModelWrapper(apply_chat_template, chat_template,
    max_length, truncation_side)` feeds it at scoring time.
    """
    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ConfigError(f"train_reward_model: steps={steps}, batch_size={batch_size} and lr={lr} must be positive")
    if not train_rows:
        raise DataError("train_reward_model: no training pairs; check the preference files (train_files)")
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    if isinstance(model, str):
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model)
        model = load_rm_init(model, device=device)
    if tokenizer is None:
        raise ConfigError("train_reward_model: pass the RM's tokenizer (or a model directory that holds one)")
    if out_dir is not None:
        check_value_model_export(model)  # before any step: the export would refuse it after training
    model.to(device)
    scorer = SequenceScorer(model)
    wrapper = RewardModelWrapper(scorer, tokenizer, apply_chat_template=apply_chat_template,
                                 chat_template=chat_template, response_key="chosen_response", max_length=max_length,
                                 truncation=True, truncation_side=truncation_side, batch_size=eval_batch_size,
                                 device=device)
    val_before = evaluate_pairs(wrapper, val_rows) if val_rows else None
    chosen, rejected = _encode_pairs(wrapper, train_rows)
    truncated = wrapper.truncated_count + wrapper.left_truncated_count

    scorer.requires_grad_(True).train()  # the wrapper froze what it wraps; training wants the gradients back
    optimizer = Optimizer(scorer.parameters(), OptimSettings(lr=lr, weight_decay=weight_decay, grad_clip=grad_clip,
                                                             warmup_steps=warmup_steps, total_steps=steps))
    stats = RMTrainStats(steps=steps, seconds=0.0, train_pairs=len(train_rows), val_before=val_before,
                         val_after=None, truncated_inputs=truncated, out_dir=None)
    order = _pair_order(len(train_rows), batch_size, steps, seed)
    for step in range(steps):
        idx = order[step * batch_size:(step + 1) * batch_size]
        input_ids, attention_mask = _pad_right([chosen[i] for i in idx] + [rejected[i] for i in idx],
                                               wrapper.pad_id, device)             # [N, T] each
        scores = scorer(input_ids, attention_mask)                                  # [N]
        margin = scores[:len(idx)] - scores[len(idx):]                              # [P]
        loss = -F.logsigmoid(margin).mean()
        loss.backward()
        optimizer.step()
        stats.losses.append(float(loss.detach()))
        stats.accuracies.append(float((margin > 0).float().mean()))
        if log_every and ((step + 1) % log_every == 0 or step + 1 == steps):
            recent = stats.accuracies[-log_every:]
            log.info(f"[train-rm] step {step + 1}/{steps} loss {stats.losses[-1]:.4f} "
                     f"pair accuracy (last {len(recent)} steps) {sum(recent) / len(recent):.3f}")
    scorer.requires_grad_(False).eval()
    stats.val_after = evaluate_pairs(wrapper, val_rows) if val_rows else None
    if out_dir is not None:
        stats.out_dir = str(export_reward_model(model, tokenizer, out_dir, wrapper=wrapper, stats=stats))
    stats.seconds = time.perf_counter() - t0
    return stats


def export_reward_model(model: ValueModel, tokenizer, out_dir: str, *, wrapper: RewardModelWrapper,
                        stats: Optional[RMTrainStats] = None) -> str:
    """Write the RM as a `*ForSequenceClassification` directory that scores like `wrapper` does.

    A custom chat_template becomes the saved tokenizer's own template, so that loading the directory
    with apply_chat_template=true and no chat_template reproduces the training format. The format
    (and the held-out accuracy) is also recorded in phaserl_rm.json for people.
    """
    saved_tokenizer = tokenizer
    if wrapper.apply_chat_template and wrapper.chat_template is not None:
        saved_tokenizer = copy.deepcopy(tokenizer)
        saved_tokenizer.chat_template = wrapper.chat_template
    path = save_value_model(model, out_dir, tokenizer=saved_tokenizer)
    record = {"apply_chat_template": wrapper.apply_chat_template, "chat_template": wrapper.chat_template,
              "max_length": wrapper.max_length, "truncation_side": wrapper.truncation_side,
              "pad_token_id": wrapper.pad_id}
    if stats is not None:
        record.update(train_pairs=stats.train_pairs, steps=stats.steps,
                      val_before=asdict(stats.val_before) if stats.val_before else None,
                      val_after=asdict(stats.val_after) if stats.val_after else None)
    tmp = os.path.join(path, f".{FORMAT_FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    os.replace(tmp, os.path.join(path, FORMAT_FILE))
    return str(path)


def _encode_pairs(wrapper: RewardModelWrapper, rows: list[PreferenceRow]) -> tuple[list, list]:
    """Token ids of every chosen and rejected input, exactly as the wrapper would score them."""
    chosen = wrapper._encode([wrapper.format(r.prompt, r.chosen_response) for r in rows])
    rejected = wrapper._encode([wrapper.format(r.prompt, r.rejected_response) for r in rows])
    vocab = wrapper.vocab_size
    top = max(max(ids, default=0) for ids in chosen + rejected)
    if vocab is not None and top >= vocab:
        raise ConfigError(f"token id {top} is outside the reward model's vocabulary ({vocab} ids): the tokenizer is "
                          f"not the model's own; set tokenizer_path to the model's tokenizer")
    same = [r.source for r, c, j in zip(rows, chosen, rejected) if c == j]
    if same:
        log.warning(f"[train-rm] {len(same)} of {len(rows)} pairs have identical chosen and rejected inputs after "
                    f"formatting and truncation (first: {same[0]}); they carry no signal. Raise max_length or use "
                    f"truncation_side=left if truncation cut the responses")
    return chosen, rejected


def _pair_order(n: int, batch_size: int, steps: int, seed: int) -> list[int]:
    """Indices of the pairs for every step: seeded epochs of a permutation, concatenated."""
    rng, order = random.Random(f"train-rm:{seed}"), []
    while len(order) < batch_size * steps:
        epoch = list(range(n))
        rng.shuffle(epoch)
        order.extend(epoch)
    return order


def _pad_right(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids, attention_mask = right_pad(rows, pad_id)  # [N, T] each, the scorer's own padding
    return input_ids.to(device), attention_mask.to(device)
