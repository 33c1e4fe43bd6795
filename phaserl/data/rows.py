"""Typed rows in verl's data schema: RL prompt rows and preference rows, validated one by one.

A prompt row is `{"prompt": str | [{"role", "content"}, ...], "data_source": str,
"reward_model": {"ground_truth": ..., "style": ...}, "extra_info": {...}}` (verl's preprocessed
parquet); a top-level `"ground_truth"` is accepted too. A preference row is
`{"prompt", "chosen_response", "rejected_response"}`. Each error names the file, row and field and
says how to fix it. Tokenizing is not done here (that is `prompts.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from phaserl.data.files import read_located_records
from phaserl.errors import DataError

CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class PromptRow:
    """One RL prompt with what its reward needs."""

    prompt: str | list[dict]  # a string, or chat messages [{"role": ..., "content": ...}, ...]
    data_source: str  # "" when the row has none
    ground_truth: object | None  # reward_model.ground_truth, else top-level ground_truth, else None
    extra_info: dict  # {} when the row has none
    source: str  # "train.parquet:row 12", for messages
    index: int  # 0-based row in its file
    raw: dict  # the whole record, handed to rule reward functions as **row


@dataclass(frozen=True)
class PreferenceRow:
    """One (prompt, chosen, rejected) triple for reward-model training and probing."""

    prompt: str | list[dict]
    chosen_response: str
    rejected_response: str
    source: str
    index: int


def _as_list(value):
    # Records read with Table.to_pylist hold lists; a caller who built rows through pandas/numpy may
    # hand us arrays or tuples, which we accept as lists.
    if isinstance(value, (str, bytes, dict)):
        return value
    if isinstance(value, tuple):
        return list(value)
    if hasattr(value, "tolist") and not isinstance(value, list):
        return value.tolist()
    return value


def check_prompt(value, *, source: str, field: str) -> str | list[dict]:
    """Validate a prompt (a non-empty string or chat-message list) and return it in plain form."""
    value = _as_list(value)
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{source}: field '{field}' is an empty string. Give the row a prompt or remove it.")
        return value
    if not isinstance(value, list):
        raise DataError(
            f"{source}: field '{field}' is a {type(value).__name__}; expected a string or a list of chat "
            "messages like [{\"role\": \"user\", \"content\": \"...\"}]."
        )
    if not value:
        raise DataError(f"{source}: field '{field}' is an empty message list. Give the row a prompt or remove it.")
    messages = []
    for i, message in enumerate(value):
        where = f"{source}: field '{field}', message {i}"
        if not isinstance(message, dict):
            raise DataError(f"{where} is a {type(message).__name__}; expected {{\"role\": ..., \"content\": ...}}.")
        missing = [k for k in ("role", "content") if message.get(k) is None]
        if missing:
            raise DataError(
                f"{where} has no {' or '.join(repr(k) for k in missing)} (keys present: {sorted(message)}). "
                "Every chat message needs both 'role' and 'content'."
            )
        if message["role"] not in CHAT_ROLES:
            raise DataError(
                f"{where} has role {message['role']!r}; allowed roles: {', '.join(CHAT_ROLES)}. "
                "Rename the role (e.g. 'human' -> 'user', 'gpt' -> 'assistant')."
            )
        if not isinstance(message["content"], str):
            raise DataError(
                f"{where} has content of type {type(message['content']).__name__}; expected a string."
            )
        # Parquet fills struct fields a message lacks with null; chat templates want them absent.
        messages.append({k: v for k, v in message.items() if v is not None})
    return messages


def _optional_dict(record: dict, key: str, *, source: str, example: str) -> dict:
    value = record.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DataError(
            f"{source}: field '{key}' is a {type(value).__name__} ({value!r:.60}); expected an object like "
            f"{example}, or leave the field out."
        )
    return value


def parse_prompt_row(record: dict, *, prompt_key: str, source: str, index: int) -> PromptRow:
    """Validate one verl-style record and return it as a PromptRow."""
    if not isinstance(record, dict):
        raise DataError(f"{source}: a row must be an object, got {type(record).__name__}.")
    if prompt_key not in record:
        raise DataError(
            f"{source}: no '{prompt_key}' field (keys present: {sorted(record)}). Add the field, or set "
            "data.prompt_key to the column that holds the prompt."
        )
    prompt = check_prompt(record[prompt_key], source=source, field=prompt_key)
    data_source = record.get("data_source")
    if data_source is None:
        data_source = ""
    if not isinstance(data_source, str):
        raise DataError(f"{source}: field 'data_source' is a {type(data_source).__name__}; expected a string.")
    reward_model = _optional_dict(record, "reward_model", source=source,
                                  example='{"ground_truth": "42", "style": "rule"}')
    extra_info = _optional_dict(record, "extra_info", source=source, example='{"split": "train", "index": 0}')
    ground_truth = reward_model.get("ground_truth")
    top_level = record.get("ground_truth")
    if ground_truth is None:
        ground_truth = top_level
    elif top_level is not None and top_level != ground_truth:
        raise DataError(
            f"{source}: 'reward_model.ground_truth' ({ground_truth!r:.40}) and top-level 'ground_truth' "
            f"({top_level!r:.40}) disagree. Keep one of them."
        )
    return PromptRow(prompt=prompt, data_source=data_source, ground_truth=ground_truth,
                     extra_info=extra_info, source=source, index=index, raw=record)


def _check_paths(paths: Sequence[str], what: str) -> list[str]:
    if isinstance(paths, str):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise DataError(f"no {what} files given; list at least one .jsonl or .parquet file.")
    return paths


def load_prompt_rows(paths: Sequence[str], *, prompt_key: str = "prompt") -> list[PromptRow]:
    """Read and validate every prompt row of every file, in file order."""
    rows: list[PromptRow] = []
    for path in _check_paths(paths, "prompt"):
        located = read_located_records(path)
        if not located:
            raise DataError(f"{path}: the file has no rows. Remove it from the file list or fill it.")
        rows.extend(parse_prompt_row(r.record, prompt_key=prompt_key, source=r.where, index=r.index)
                    for r in located)
    return rows


def _parse_preference_row(record: dict, *, source: str, index: int) -> PreferenceRow:
    fields = ("prompt", "chosen_response", "rejected_response")
    missing = [k for k in fields if k not in record]
    if missing:
        raise DataError(
            f"{source}: missing field(s) {', '.join(repr(k) for k in missing)} (keys present: {sorted(record)}). "
            "A preference row needs 'prompt', 'chosen_response' and 'rejected_response'."
        )
    prompt = check_prompt(record["prompt"], source=source, field="prompt")
    for key in ("chosen_response", "rejected_response"):
        if not isinstance(record[key], str):
            raise DataError(
                f"{source}: field '{key}' is a {type(record[key]).__name__}; expected the response text as a string."
            )
    return PreferenceRow(prompt=prompt, chosen_response=record["chosen_response"],
                         rejected_response=record["rejected_response"], source=source, index=index)


def load_preference_rows(paths: Sequence[str]) -> list[PreferenceRow]:
    """Read and validate every preference row of every file, in file order."""
    rows: list[PreferenceRow] = []
    for path in _check_paths(paths, "preference"):
        located = read_located_records(path)
        if not located:
            raise DataError(f"{path}: the file has no rows. Remove it from the file list or fill it.")
        rows.extend(_parse_preference_row(r.record, source=r.where, index=r.index) for r in located)
    return rows
