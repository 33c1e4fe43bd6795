"""RewardModelWrapper: the exact text the reward model sees (classic mistake 2), its own tokenizer,
truncation, and the output checks (shape [B], finite, not constant) with messages that name the cause."""
import logging

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import (
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

from _tiny_tokenizer import CHARS, SPECIAL_TOKENS, build_tiny_tokenizer
from phaserl.errors import RewardError
from phaserl.roles.reward_model import RewardModelWrapper

VERL_STYLE_TEMPLATE = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}{% endfor %}"
PROMPTS = ["What is 2+2?", "Name a colour.", "Say hi.", "Count to three.", "Spell cat."]
RESPONSES = ["4", "Blue, like the sky.", "hi", "one two three", "c-a-t"]


def tiny_rm(vocab_size: int = 100, seed: int = 0) -> LlamaForSequenceClassification:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         num_labels=1, pad_token_id=0)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.mul_(50.0)  # random init gives scores ~1e-3 apart; spread them
    return model


def reversed_tokenizer() -> PreTrainedTokenizerFast:
    """Same characters as the tiny tokenizer but numbered backwards: a different tokenizer."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARS[::-1])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>")


class ScriptedRM(torch.nn.Module):
    """A plain nn.Module RM that records its inputs and returns `fn(input_ids, attention_mask)` as logits."""

    def __init__(self, fn):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.fn, self.seen = fn, []

    def forward(self, input_ids, attention_mask):
        self.seen.append((input_ids.clone(), attention_mask.clone()))
        return self.fn(input_ids, attention_mask)


def length_scores(input_ids, attention_mask):
    return attention_mask.sum(-1, keepdim=True).float()  # [b, 1] number of real tokens


@pytest.fixture(scope="module")
def rm():
    return tiny_rm()


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def test_template_on_and_off_give_different_texts(rm, tok):
    on = RewardModelWrapper(rm, tok, apply_chat_template=True)
    off = RewardModelWrapper(rm, tok, apply_chat_template=False)
    assert on.format("Hi?", "Yes.") == "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\nYes.<|im_end|>\n"
    assert off.format("Hi?", "Yes.") == "Hi?Yes."
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    assert off.format(messages, "Yes.") == "Be brief.\nHi?Yes."
    assert on.format(messages, "Yes.").startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?")
    assert on.score(["Hi?"], ["Yes."]).item() != pytest.approx(off.score(["Hi?"], ["Yes."]).item(), abs=1e-6)


def test_the_verl_style_custom_chat_template_is_used_verbatim(rm, tok):
    wrapper = RewardModelWrapper(rm, tok, apply_chat_template=True, chat_template=VERL_STYLE_TEMPLATE)
    assert wrapper.format("What is 2+2?", "4") == "user: What is 2+2?assistant: 4"


def test_missing_chat_template_is_a_clear_error(rm):
    with pytest.raises(RewardError, match="no chat template: pass chat_template=.* or apply_chat_template=False"):
        RewardModelWrapper(rm, build_tiny_tokenizer(chat_template=None), apply_chat_template=True)


def test_score_rows_reads_the_response_key(rm, tok):
    rows = [{"prompt": p, "chosen_response": r, "rejected_response": "no"} for p, r in zip(PROMPTS, RESPONSES)]
    wrapper = RewardModelWrapper(rm, tok, apply_chat_template=False, response_key="chosen_response")
    torch.testing.assert_close(wrapper.score_rows(rows), wrapper.score(PROMPTS, RESPONSES))


def test_missing_response_key_names_the_key_the_fields_and_the_fix(rm, tok):
    rows = [{"prompt": "p", "chosen_response": "a", "rejected_response": "b"}]
    with pytest.raises(RewardError, match="row 0 has no 'response' field "
                                          r"\(its fields: prompt, chosen_response, rejected_response\).*response_key="):
        RewardModelWrapper(rm, tok).score_rows(rows)


def test_scores_are_one_float_per_response_whatever_the_batching_and_padding_side(rm, tok):
    wrapper = RewardModelWrapper(rm, tok, batch_size=2)
    scores = wrapper.score(PROMPTS, RESPONSES)
    assert scores.shape == (5,) and scores.dtype == torch.float32 and torch.isfinite(scores).all()
    alone = torch.cat([wrapper.score([p], [r]) for p, r in zip(PROMPTS, RESPONSES)])
    torch.testing.assert_close(scores, alone, atol=1e-5, rtol=1e-5)
    left_tok = build_tiny_tokenizer()
    left_tok.padding_side = "left"  # ignored: the wrapper always right-pads
    torch.testing.assert_close(RewardModelWrapper(rm, left_tok, batch_size=5).score(PROMPTS, RESPONSES), alone,
                               atol=1e-5, rtol=1e-5)


def test_scores_come_from_text_with_the_rms_own_tokenizer(rm, tok):
    rm_tok = reversed_tokenizer()  # the RM's tokenizer differs from the policy's (`tok`)
    wrapper = RewardModelWrapper(rm, rm_tok, apply_chat_template=False)
    score = wrapper.score(["2+2="], ["4"]).item()
    with torch.no_grad():
        by_rm_ids = rm(input_ids=torch.tensor([rm_tok("2+2=4")["input_ids"]])).logits.item()
        by_policy_ids = rm(input_ids=torch.tensor([tok("2+2=4")["input_ids"]])).logits.item()
    assert score == pytest.approx(by_rm_ids, abs=1e-5)
    assert abs(by_policy_ids - by_rm_ids) > 1e-4  # the policy's ids would have given another score


def test_left_truncation_keeps_the_response_end(tok):
    model = ScriptedRM(length_scores)
    wrapper = RewardModelWrapper(model, tok, apply_chat_template=False, max_length=8, truncation_side="left")
    assert wrapper.score(["a long prompt here "], ["the end"]).tolist() == [8.0]
    assert tok.decode(model.seen[0][0][0]) == " the end"  # the last 8 characters of "a long prompt here the end"
    assert (wrapper.left_truncated_count, wrapper.truncated_count) == (1, 0)


def test_right_truncation_cuts_the_response_end_and_counts_it(tok, caplog):
    model = ScriptedRM(length_scores)
    wrapper = RewardModelWrapper(model, tok, apply_chat_template=False, max_length=8, truncation_side="right")
    with caplog.at_level(logging.WARNING):
        wrapper.score(["a long prompt here ", "ok"], ["the end", "!"])
    assert tok.decode(model.seen[0][0][0]) == "a long p"
    assert tok.decode(model.seen[0][0][1][:3]) == "ok!"
    assert wrapper.truncated_count == 1
    assert "1 of 2 inputs were over max_length=8" in caplog.text


def test_truncation_off_and_too_long_is_an_error(tok):
    wrapper = RewardModelWrapper(ScriptedRM(length_scores), tok, apply_chat_template=False, max_length=8,
                                 truncation=False)
    with pytest.raises(RewardError, match="row 1 is 12 tokens, over max_length=8.*truncation"):
        wrapper.score(["ok", "twelve chars"], ["!", ""])


def test_nan_scores_name_the_rows_and_the_likely_cause(tok):
    def nan_on_row_1(input_ids, attention_mask):
        out = torch.zeros(input_ids.shape[0], 1)
        out[1] = float("nan")
        return out

    wrapper = RewardModelWrapper(ScriptedRM(nan_on_row_1), tok, chat_template=VERL_STYLE_TEMPLATE)
    with pytest.raises(RewardError, match=r"non-finite scores for rows \[1\] of 3.*chat_template.*response_key"
                                          r".*tokenizer is the RM's own.*'user: bassistant: y'"):
        wrapper.score(["a", "b", "c"], ["x", "y", "z"])


def test_wrong_output_shape_is_an_error_and_a_failed_probe(tok):
    wrapper = RewardModelWrapper(ScriptedRM(lambda ids, mask: torch.zeros(ids.shape[0], 2)), tok)
    with pytest.raises(RewardError, match=r"logits of shape \[2, 2\].*num_labels=1"):
        wrapper.score(["a", "b"], ["x", "y"])
    report = wrapper.probe(["a", "b"], ["x", "y"])
    assert not report.ok and "shape [2, 2]" in report.reason


def test_probe_reports_constant_scores_with_the_likely_cause(rm, tok):
    constant = RewardModelWrapper(ScriptedRM(lambda ids, mask: torch.full((ids.shape[0],), 0.5)), tok)
    report = constant.probe(PROMPTS, RESPONSES)
    assert not report.ok and report.scores == [0.5] * 5
    assert "same score 0.5 to all 5 responses" in report.reason and "chat_template" in report.reason
    healthy = RewardModelWrapper(rm, tok, chat_template=VERL_STYLE_TEMPLATE)
    report = healthy.probe(PROMPTS, RESPONSES)
    assert report.ok and report.reason == "" and len(report.scores) == 5
    assert report.example_input == "user: What is 2+2?assistant: 4"


def test_the_model_is_frozen_and_usable_under_inference_mode(tok):
    model = tiny_rm()
    wrapper = RewardModelWrapper(model, tok)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    with torch.inference_mode():
        inside = wrapper.score(PROMPTS[:2], RESPONSES[:2])
    outside = wrapper.score(PROMPTS[:2], RESPONSES[:2])
    torch.testing.assert_close(inside, outside)
    assert not outside.is_inference()
    (outside * torch.ones(2, requires_grad=True)).sum().backward()  # usable in the trainer's autograd code


def test_verl_style_snippets_work_with_a_model_loaded_from_a_directory(tmp_path, tok):
    tiny_rm().save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    reward_model = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    plain = RewardModelWrapper(model=reward_model, apply_chat_template=False, response_key="chosen_response")
    templated = RewardModelWrapper(model=reward_model, apply_chat_template=True, chat_template=VERL_STYLE_TEMPLATE)
    rows = [{"prompt": "Change a tyre?", "chosen_response": "Sure, step one.", "rejected_response": "No."}]
    assert plain.score_rows(rows).shape == (1,)
    assert templated.format("Change a tyre?", "Sure.") == "user: Change a tyre?assistant: Sure."
    loaded = RewardModelWrapper.from_pretrained(str(tmp_path), apply_chat_template=False)
    torch.testing.assert_close(loaded.score(PROMPTS, RESPONSES), plain.score(PROMPTS, RESPONSES))


def test_setup_errors_name_the_fix(tok):
    with pytest.raises(RewardError, match="needs the reward model's own tokenizer: pass tokenizer="):
        RewardModelWrapper(ScriptedRM(length_scores))
    with pytest.raises(RewardError, match="num_labels=2"):
        RewardModelWrapper(LlamaForSequenceClassification(LlamaConfig(
            vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_labels=2)), tok)
    with pytest.raises(RewardError, match="not found"):
        RewardModelWrapper.from_pretrained("/no/such/rm")
    small_vocab = RewardModelWrapper(tiny_rm(vocab_size=50), tok, apply_chat_template=False)
    with pytest.raises(RewardError, match=r"outside the reward model's vocabulary \(50 ids\).*tokenizer"):
        small_vocab.score(["zzz"], ["z"])  # "z" is id 94 in the tiny tokenizer


def test_a_tokenizer_without_pad_token_pads_with_eos_and_tells_the_model(caplog):
    no_pad = build_tiny_tokenizer()
    no_pad.pad_token = None
    model = tiny_rm()
    model.config.pad_token_id = None
    with caplog.at_level(logging.INFO):
        wrapper = RewardModelWrapper(model, no_pad)
    eos = no_pad.convert_tokens_to_ids("<|im_end|>")
    assert wrapper.pad_id == eos and model.config.pad_token_id == eos
    assert "no pad token; padding with its eos token" in caplog.text
    assert wrapper.score(PROMPTS[:3], RESPONSES[:3]).shape == (3,)
