"""Prompt data: record files (files), verl-schema rows (rows), tokenized prompts (prompts) and the
resumable index loader (loader). Nothing here knows about models, rollout or rewards."""
from phaserl.data.files import SUPPORTED_EXTENSIONS, LocatedRecord, read_located_records, read_records, write_records
from phaserl.data.loader import StatefulLoader, epoch_permutation
from phaserl.data.prompts import (
    OVERLONG_POLICIES,
    PromptDataset,
    PromptItem,
    build_prompt_dataset,
    format_prompt,
)
from phaserl.data.rows import (
    CHAT_ROLES,
    PreferenceRow,
    PromptRow,
    check_prompt,
    load_preference_rows,
    load_prompt_rows,
    parse_prompt_row,
)

__all__ = [
    "CHAT_ROLES",
    "OVERLONG_POLICIES",
    "SUPPORTED_EXTENSIONS",
    "LocatedRecord",
    "PreferenceRow",
    "PromptDataset",
    "PromptItem",
    "PromptRow",
    "StatefulLoader",
    "build_prompt_dataset",
    "check_prompt",
    "epoch_permutation",
    "format_prompt",
    "load_preference_rows",
    "load_prompt_rows",
    "parse_prompt_row",
    "read_located_records",
    "read_records",
    "write_records",
]
