"""Scoring with phaserl's own decoder: a reward model loaded as a `ValueModel`, in token-budget micro-batches.

`RewardModelWrapper` (reward_model.py) owns the input format and the output checks; this module owns
what happens to the token ids of a call when the RM runs on phaserl's decoder (a llama / qwen2 / qwen3
`*ForSequenceClassification` directory with num_labels=1): which directories qualify (`native_support`),
how the rows are grouped into micro-batches by a token budget (`token_groups`, longest rows first),
and the forward of one micro-batch, either packed without padding (`score_packed`: the rows' tokens
in one sequence, each row with its own positions and a sequence id, so attention stays inside a row:
the varlen flash kernel on CUDA in bf16/fp16, a dense block-diagonal mask elsewhere) or right-padded
(`score_padded`).
Pooling is transformers' `*ForSequenceClassification` rule, so both engines give the same scores: the
score at the rightmost token that is not the pad id (position 0 when every token is the pad id).
Not here: formatting, truncation, vocabulary and finiteness checks, the FSDP lockstep (reward_model.py);
transformers models (the wrapper runs those itself).
Legend: b rows of a micro-batch, N their tokens packed together, T the longest of them.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from ..errors import ConfigError
from ..models import ValueModel, load_value_model
from ..models.families import NATIVE_MODEL_TYPES, config_from_hf

ENGINES = ("auto", "phaserl", "transformers")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def native_support(path: str) -> str:
    """'' when the directory `path` holds a reward model phaserl's decoder runs; otherwise why not."""
    config_file = os.path.join(path, "config.json")
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        return f"{config_file} is not readable JSON ({err})"
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return f"{config_file} names architectures {architectures}, not a *ForSequenceClassification model"
    if config.get("model_type") not in NATIVE_MODEL_TYPES:
        return (f"model_type {config.get('model_type')!r} in {config_file} is not one of phaserl's decoders "
                f"({', '.join(NATIVE_MODEL_TYPES)})")
    # transformers' own rule: id2label decides, else num_labels, else its default of 2
    num_labels = len(config["id2label"]) if "id2label" in config else config.get("num_labels", 2)
    if num_labels != 1:
        return f"{config_file} says num_labels={num_labels}; a reward model outputs one score (num_labels=1)"
    try:
        config_from_hf(config, source=config_file)
    except ConfigError as err:
        return str(err)
    return ""


def load_native(path: str, *, dtype: Optional[torch.dtype], device) -> ValueModel:
    """The RM directory `path` as a ValueModel; dtype None keeps the checkpoint's (transformers 5's default)."""
    if dtype is None:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        saved = config.get("dtype") or config.get("torch_dtype")
        dtype = _DTYPES.get(saved, torch.float32)  # transformers too loads float32 when the config names none
    return load_value_model(path, dtype=dtype, device=device)


def token_groups(lengths: list[int], token_budget: int, *, packed: bool) -> list[list[int]]:
    """Row indices of each micro-batch: rows longest first, cut into runs whose cost stays within
    `token_budget` (real tokens when packed, rows x longest row when padded); a longer row goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in order:
        # Longest first: a padded group is as wide as its first row.
        cost = tokens + lengths[i] if packed else (len(current) + 1) * (lengths[current[0]] if current else lengths[i])
        if current and cost > token_budget:
            groups.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += lengths[i]
    return groups + ([current] if current else [])


def pooled_position(ids: list[int], pad_id: int) -> int:
    """Where transformers' classifiers read a row's score: its rightmost non-pad token, 0 if all are pad."""
    for k in range(len(ids) - 1, -1, -1):
        if ids[k] != pad_id:
            return k
    return 0


def right_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> input_ids and attention_mask, right-padded with `pad_id`.  [b, T] each, long"""
    longest = max(len(ids) for ids in rows)
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)  # [b, T]
    attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)   # [b, T]
    for row, ids in enumerate(rows):
        input_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, :len(ids)] = 1
    return input_ids, attention_mask


def score_packed(model: ValueModel, rows: list[list[int]], pad_id: int, device) -> torch.Tensor:
    """One forward over `rows` concatenated without padding; one score per row.  [b] float32 on `device`"""
    lengths = torch.tensor([len(ids) for ids in rows], dtype=torch.long)                 # [b]
    starts = lengths.cumsum(0) - lengths                                                 # [b]
    seq_ids = torch.repeat_interleave(torch.arange(len(rows)), lengths)                  # [N]
    position_ids = torch.arange(len(seq_ids)) - starts[seq_ids]                          # [N] each row from 0
    input_ids = torch.tensor([t for ids in rows for t in ids], dtype=torch.long)         # [N]
    values = model(input_ids[None].to(device), position_ids=position_ids[None].to(device),
                   seq_ids=seq_ids[None].to(device))                                     # [1, N]
    pooled = starts + torch.tensor([pooled_position(ids, pad_id) for ids in rows])      # [b]
    return values[0, pooled.to(device)]


def score_padded(model: ValueModel, rows: list[list[int]], pad_id: int, device) -> torch.Tensor:
    """One forward over `rows` right-padded into [b, T]; one score per row.  [b] float32 on `device`"""
    input_ids, attention_mask = right_pad(rows, pad_id)                                  # [b, T] each
    values = model(input_ids.to(device), attention_mask=attention_mask.to(device))      # [b, T]
    pooled = torch.tensor([pooled_position(ids, pad_id) for ids in rows], device=device)  # [b]
    return values.gather(1, pooled[:, None]).squeeze(1)
