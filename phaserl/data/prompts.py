"""Turning validated prompt rows into token ids: chat template, tokenization, overlong policy; and sampled
response ids back into text (decode_responses).

Input: `PromptRow`s (rows.py) and a Hugging Face tokenizer. Output: a `PromptDataset` of
`PromptItem`s, each holding the ids the policy will see and the text they came from. Batching,
padding and ordering are not done here (the loader and the rollout engine do that).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from phaserl.data.rows import PromptRow
from phaserl.errors import ConfigError, DataError

logger = logging.getLogger("phaserl")

OVERLONG_POLICIES = ("error", "drop", "truncate_left", "truncate_right")


@dataclass(frozen=True)
class PromptItem:
    """One tokenized prompt."""

    row: PromptRow
    prompt_ids: tuple[int, ...]  # [P], P <= max_prompt_length
    prompt_text: str  # the text tokenized (after the chat template); after a cut, the text the kept ids spell
    images: object = None  # the row's data.images.ImageInputs (its ids hold their expanded placeholders), else None


@dataclass
class PromptDataset:
    """The tokenized prompts of one split, and what the overlong policy did to get them."""

    items: list[PromptItem]
    dropped: int  # overlong prompts dropped (overlong="drop")
    truncated: int  # overlong prompts cut to max_prompt_length (overlong="truncate_*")

    def __len__(self) -> int:
        return len(self.items)


def format_prompt(row: PromptRow, tokenizer, *, apply_chat_template: bool) -> str:
    """The text that is tokenized for `row`: the chat-templated conversation, or the raw string."""
    if apply_chat_template:
        messages = [{"role": "user", "content": row.prompt}] if isinstance(row.prompt, str) else row.prompt
        # add_generation_prompt: the text ends where the assistant's answer starts.
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not isinstance(row.prompt, str):
        raise DataError(
            f"{row.source}: the prompt is a list of chat messages but data.apply_chat_template is false, so "
            "there is no way to turn it into text. Set data.apply_chat_template=true, or store the prompt as a string."
        )
    return row.prompt


def _check_arguments(tokenizer, max_prompt_length: int, overlong: str, apply_chat_template: bool) -> None:
    if overlong not in OVERLONG_POLICIES:
        raise ConfigError(
            f"data.overlong_prompts={overlong!r} is not one of {', '.join(OVERLONG_POLICIES)}."
        )
    if max_prompt_length < 1:
        raise ConfigError(f"data.max_prompt_length={max_prompt_length} must be at least 1 token.")
    if apply_chat_template and not tokenizer.chat_template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(
            f"data.apply_chat_template is true but the tokenizer ({name}) has no chat template. "
            "Set data.apply_chat_template=false to feed prompts as plain text, or use a tokenizer whose "
            "tokenizer_config.json has a chat_template (e.g. an -Instruct model's)."
        )


def _overlong_error(row: PromptRow, length: int, max_prompt_length: int, others: int) -> DataError:
    more = f" ({others} more prompt(s) are over the limit too)" if others else ""
    return DataError(
        f"{row.source}: prompt is {length} tokens, over data.max_prompt_length={max_prompt_length}{more}. "
        "Raise data.max_prompt_length, or set data.overlong_prompts to 'drop' (skip such prompts), "
        "'truncate_left' (keep the end) or 'truncate_right' (keep the start)."
    )


def _truncate_last_user_turn(row: PromptRow, tokenizer, max_prompt_length: int, *, keep_end: bool):
    """Cut the content of the prompt's last user message (its start with keep_end, else its end) until the
    templated prompt fits: the template's turns and its generation prompt (`<|im_start|>assistant\\n`) are
    never cut. A prompt whose template and other messages alone are over the limit is an error."""
    messages = ([{"role": "user", "content": row.prompt}] if isinstance(row.prompt, str)
                else [dict(m) for m in row.prompt])
    users = [i for i, m in enumerate(messages) if m.get("role") == "user" and isinstance(m.get("content"), str)]
    if not users:
        raise DataError(f"{row.source}: prompt is over data.max_prompt_length={max_prompt_length} and has no user "
                        "message with text to cut; raise data.max_prompt_length or use data.overlong_prompts=drop.")
    target = users[-1]
    content_ids = tokenizer(messages[target]["content"], add_special_tokens=False)["input_ids"]

    def render(keep: int):
        kept = content_ids[len(content_ids) - keep:] if keep_end else content_ids[:keep]
        messages[target] = {**messages[target], "content": tokenizer.decode(kept, skip_special_tokens=False)}
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return text, tokenizer(text, add_special_tokens=False)["input_ids"]

    low, high = 0, len(content_ids)  # the most content tokens that fit lies in [low, high); keep=0 must fit
    text, ids = render(0)
    if len(ids) > max_prompt_length:
        raise DataError(f"{row.source}: even with its last user message emptied, the chat-templated prompt is "
                        f"{len(ids)} tokens, over data.max_prompt_length={max_prompt_length}; raise "
                        "data.max_prompt_length or use data.overlong_prompts=drop.")
    while high - low > 1:  # re-tokenizing after a cut can merge tokens differently: search on the real length
        mid = (low + high) // 2
        if len(render(mid)[1]) <= max_prompt_length:
            low = mid
        else:
            high = mid
    return render(low) if low else (text, ids)


def build_prompt_dataset(rows: Sequence[PromptRow], tokenizer, *, max_prompt_length: int, overlong: str,
                         apply_chat_template: bool) -> PromptDataset:
    """Tokenize `rows` and apply the overlong policy; errors name the file and row at fault."""
    _check_arguments(tokenizer, max_prompt_length, overlong, apply_chat_template)
    if not rows:
        raise DataError("there are no prompt rows to tokenize; check data.train_files / data.val_files.")
    texts = [format_prompt(row, tokenizer, apply_chat_template=apply_chat_template) for row in rows]
    # The chat template already writes BOS and the other special tokens; plain text gets the
    # tokenizer's usual special tokens (a BOS for Llama-style tokenizers, nothing for Qwen).
    ids_per_row = tokenizer(texts, add_special_tokens=not apply_chat_template)["input_ids"]

    overlong_rows = [i for i, ids in enumerate(ids_per_row) if len(ids) > max_prompt_length]
    if overlong == "error" and overlong_rows:
        first = overlong_rows[0]
        raise _overlong_error(rows[first], len(ids_per_row[first]), max_prompt_length, len(overlong_rows) - 1)

    items: list[PromptItem] = []
    dropped = truncated = 0
    for row, text, ids in zip(rows, texts, ids_per_row):
        if not ids:
            raise DataError(f"{row.source}: the prompt tokenizes to zero tokens; give it some text.")
        if len(ids) > max_prompt_length:
            if overlong == "drop":
                dropped += 1
                continue
            if apply_chat_template:
                text, ids = _truncate_last_user_turn(row, tokenizer, max_prompt_length,
                                                     keep_end=overlong == "truncate_left")
            else:
                ids = ids[-max_prompt_length:] if overlong == "truncate_left" else ids[:max_prompt_length]
                text = tokenizer.decode(ids, skip_special_tokens=False)
            truncated += 1
        items.append(PromptItem(row=row, prompt_ids=tuple(ids), prompt_text=text))

    if dropped:
        logger.warning("dropped %d of %d prompts longer than data.max_prompt_length=%d tokens "
                       "(data.overlong_prompts=drop)", dropped, len(rows), max_prompt_length)
    if truncated:
        logger.warning("truncated %d of %d prompts to data.max_prompt_length=%d tokens (data.overlong_prompts=%s)",
                       truncated, len(rows), max_prompt_length, overlong)
    if not items:
        raise DataError(
            f"all {len(rows)} prompts (first: {rows[0].source}) are longer than data.max_prompt_length="
            f"{max_prompt_length} and were dropped. Raise data.max_prompt_length or use a truncate_* policy."
        )
    return PromptDataset(items=items, dropped=dropped, truncated=truncated)


def decode_responses(tokenizer, responses: Sequence[Sequence[int]]) -> list[str]:
    """The texts of sampled responses: `tokenizer.batch_decode(responses, skip_special_tokens=True)`, the same
    strings. A plain fast tokenizer decodes through the tokenizers library's batch call (Rust, threads, no
    GIL): transformers 5's batch_decode decodes one sequence at a time in Python (512 responses of 256 tokens:
    ~50-100 ms of a 2-core host's time every step against ~12 ms). A tokenizer that decodes its own way (a
    subclass's decode, or clean_up_tokenization_spaces on) keeps transformers' call; one with only `decode` (an
    agent benchmark's stand-in) decodes each."""
    if _plain_fast(tokenizer):
        lists = [ids if isinstance(ids, list) else list(ids) for ids in responses]  # the engine's are lists already
        return tokenizer.backend_tokenizer.decode_batch(lists, skip_special_tokens=True)
    if not hasattr(tokenizer, "batch_decode"):
        return [tokenizer.decode(ids, skip_special_tokens=True) for ids in responses]
    return tokenizer.batch_decode(responses, skip_special_tokens=True)


def _plain_fast(tokenizer) -> bool:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    return (isinstance(tokenizer, PreTrainedTokenizerFast)
            and isinstance(getattr(tokenizer, "backend_tokenizer", None), Tokenizer)
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
            and all(getattr(cls, name) is getattr(PreTrainedTokenizerFast, name)
                    for name in ("batch_decode", "decode", "_decode")))
