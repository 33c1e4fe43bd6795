"""Tokenized prompts: chat template with generation prompt, plain text, and the four overlong policies.

The tokenizer is char-level (tests/_tiny_tokenizer.py), so token counts are character counts.
"""
import logging

import pytest

from _tiny_tokenizer import build_tiny_tokenizer
from phaserl.data import PromptRow, build_prompt_dataset
from phaserl.errors import ConfigError, DataError


def row(prompt, index=0):
    return PromptRow(prompt=prompt, data_source="", ground_truth=None, extra_info={},
                     source=f"train.jsonl:row {index} (line {index + 1})", index=index, raw={"prompt": prompt})


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def build(rows, tokenizer, max_len=100, overlong="error", template=True):
    return build_prompt_dataset(rows, tokenizer, max_prompt_length=max_len, overlong=overlong,
                                apply_chat_template=template)


def test_string_prompt_gets_user_turn_and_generation_prompt(tokenizer):
    (item,) = build([row("2+2?")], tokenizer).items
    assert item.prompt_text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    # Special tokens are single ids, characters one id each, and nothing is added twice:
    # <|im_start|> "user\n2+2?" <|im_end|> "\n" <|im_start|> "assistant\n"
    assert len(item.prompt_ids) == 1 + 9 + 1 + 1 + 1 + 10
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert item.prompt_ids[0] == im_start and item.prompt_ids.count(im_start) == 2
    assert tokenizer.decode(item.prompt_ids) == item.prompt_text


def test_message_list_prompt_keeps_every_turn(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    (item,) = build([row(messages)], tokenizer).items
    assert item.prompt_text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                                "<|im_start|>assistant\n")
    assert item.row.prompt is messages


def test_plain_text_without_template(tokenizer):
    (item,) = build([row("abc")], tokenizer, template=False).items
    assert item.prompt_text == "abc"
    assert item.prompt_ids == tuple(tokenizer.convert_tokens_to_ids(["a", "b", "c"]))


def test_message_list_without_template_is_an_error(tokenizer):
    with pytest.raises(DataError) as e:
        build([row("ok"), row([{"role": "user", "content": "hi"}], index=1)], tokenizer, template=False)
    assert "train.jsonl:row 1" in str(e.value) and "data.apply_chat_template=true" in str(e.value)


def test_tokenizer_without_chat_template_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        build([row("hi")], build_tiny_tokenizer(chat_template=None))
    assert "no chat template" in str(e.value) and "data.apply_chat_template=false" in str(e.value)


def test_unknown_overlong_policy(tokenizer):
    with pytest.raises(ConfigError, match="data.overlong_prompts='cut'"):
        build([row("hi")], tokenizer, overlong="cut")


# "abcdefghij" is 10 tokens without the template.
ROWS = [row("abc", 0), row("abcdefghij", 1), row("xyz", 2), row("0123456789", 3)]


def test_overlong_error_names_row_length_limit_and_alternatives(tokenizer):
    with pytest.raises(DataError) as e:
        build(ROWS, tokenizer, max_len=5, template=False)
    msg = str(e.value)
    for part in ["train.jsonl:row 1", "10 tokens", "data.max_prompt_length=5", "1 more",
                 "'drop'", "'truncate_left'", "'truncate_right'"]:
        assert part in msg


def test_overlong_drop_counts_and_warns_once(tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="phaserl"):
        ds = build(ROWS, tokenizer, max_len=5, overlong="drop", template=False)
    assert [item.prompt_text for item in ds.items] == ["abc", "xyz"]
    assert [item.row.index for item in ds.items] == [0, 2]
    assert (ds.dropped, ds.truncated, len(ds)) == (2, 0, 2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["dropped 2 of 4 prompts longer than data.max_prompt_length=5 tokens "
                        "(data.overlong_prompts=drop)"]


def test_truncate_left_keeps_the_end_and_right_keeps_the_start(tokenizer):
    left = build(ROWS, tokenizer, max_len=4, overlong="truncate_left", template=False)
    right = build(ROWS, tokenizer, max_len=4, overlong="truncate_right", template=False)
    assert [i.prompt_text for i in left.items] == ["abc", "ghij", "xyz", "6789"]
    assert [i.prompt_text for i in right.items] == ["abc", "abcd", "xyz", "0123"]
    assert (left.truncated, left.dropped, right.truncated) == (2, 0, 2)
    assert all(len(i.prompt_ids) <= 4 for i in left.items + right.items)


# "<|im_start|>user\n" + content + "<|im_end|>\n<|im_start|>assistant\n" is 19 tokens around the content.
@pytest.mark.parametrize("overlong, kept", [("truncate_left", "question"), ("truncate_right", "a long q")])
def test_truncation_cuts_the_user_text_and_never_the_generation_prompt(tokenizer, overlong, kept):
    # Regression: truncate_right used to cut the template's `<|im_start|>assistant\n` off the end.
    (item,) = build([row("a long question")], tokenizer, max_len=27, overlong=overlong).items
    assert item.prompt_text == f"<|im_start|>user\n{kept}<|im_end|>\n<|im_start|>assistant\n"
    assert len(item.prompt_ids) == 27 and tokenizer.decode(item.prompt_ids) == item.prompt_text


def test_truncation_cuts_the_last_user_message_and_keeps_the_others(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "0123456789"}]
    (item,) = build([row(messages)], tokenizer, max_len=42, overlong="truncate_right").items
    assert item.prompt_text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n0123<|im_end|>\n"
                                "<|im_start|>assistant\n")
    assert messages[1]["content"] == "0123456789"  # the row itself is not changed


def test_a_template_longer_than_the_limit_is_refused_not_cut(tokenizer):
    with pytest.raises(DataError) as e:
        build([row("a long question")], tokenizer, max_len=12, overlong="truncate_left")
    assert "train.jsonl:row 0" in str(e.value) and "19 tokens" in str(e.value) and "drop" in str(e.value)


def test_dropping_everything_is_an_error(tokenizer):
    with pytest.raises(DataError, match="all 2 prompts .* were dropped"):
        build([row("abcdef", 0), row("ghijkl", 1)], tokenizer, max_len=3, overlong="drop", template=False)


def test_no_rows_is_an_error(tokenizer):
    with pytest.raises(DataError, match="no prompt rows"):
        build([], tokenizer)
