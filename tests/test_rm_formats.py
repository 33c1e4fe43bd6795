"""Classic mistake 2 end to end: policy tokens -> decoded text -> the RM's own format and tokens -> one score.

The policy is the tiny world's (character tokenizer, `<|user|>`/`<|assistant|>` template, EOS
`<|endoftext|>`); the reward model has a *different* tokenizer (ChatML, EOS `<|im_end|>`, and
`<|endoftext|>` as its PAD token, so a policy EOS leaking into the text would look like padding to the
RM). Responses go through the trainer's real rollout packing and score phase (`build_rollout_batch`,
`RewardSources`); a hook on the RM records the exact ids it was given.
Wrapper-level details (truncation counts, probes, output checks) are tested in test_reward_model.py.
"""
import logging

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from _tiny_rm import make_reward_model_dir
from _tiny_tokenizer import build_tiny_tokenizer
from phaserl.data import build_prompt_dataset, load_preference_rows, parse_prompt_row, read_records, write_records
from phaserl.errors import RewardError
from phaserl.rewards import RewardSources
from phaserl.rm import evaluate_pairs, make_tiny_preference_records
from phaserl.roles import RewardModelWrapper
from phaserl.rollout import GenerationResult
from phaserl.trainer.rollout_phase import build_rollout_batch
from phaserl.world.task import Problem, to_record
from phaserl.world.tokenizer import build_tokenizer

torch.set_num_threads(1)
VERL_STYLE_TEMPLATE = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}{% endfor %}"
PROBLEMS = [Problem("23+45=", "68"), Problem("57+68=", "125")]


@pytest.fixture(scope="module")
def policy_tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def rm_model(tmp_path_factory):
    model = AutoModelForSequenceClassification.from_pretrained(
        make_reward_model_dir(str(tmp_path_factory.mktemp("rm"))))
    model.seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: module.seen.append(kwargs["input_ids"].clone()),
                                    with_kwargs=True)
    return model


def rollout_and_score(policy_tok, wrapper, responses: list, finish=None):
    """Score policy responses (token ids, as the sampler returns them) through the trainer's phases."""
    rows = [parse_prompt_row(to_record(p, i, "val"), prompt_key="prompt", source=f"val:row {i}", index=i)
            for i, p in enumerate(PROBLEMS[:len(responses)])]
    items = build_prompt_dataset(rows, policy_tok, max_prompt_length=32, overlong="error",
                                 apply_chat_template=True).items
    result = GenerationResult(response_ids=responses, logprobs=[[0.0] * len(r) for r in responses],
                              finish_reasons=finish or ["stop"] * len(responses))
    batch = build_rollout_batch(items, 1, result, tokenizer=policy_tok, pad_token_id=policy_tok.pad_token_id,
                                group_offset=0, device="cpu")
    wrapper.model.seen.clear()
    scores = RewardSources(reward_model=wrapper).score(batch).by_source["reward_model"]  # [B]
    return batch, scores


def seen_texts(wrapper) -> list:
    """What the RM was fed, decoded with its own tokenizer (right padding dropped)."""
    ids = torch.cat(wrapper.model.seen)
    return [wrapper.tokenizer.decode(row[:int((row != wrapper.pad_id).nonzero().max()) + 1].tolist()) for row in ids]


def policy_ids(policy_tok, text: str, eos: bool = True) -> list:
    return policy_tok(text, add_special_tokens=False).input_ids + ([policy_tok.eos_token_id] if eos else [])


def test_policy_response_tokens_reach_the_rm_as_text_in_its_own_template_and_ids(policy_tok, rm_model):
    wrapper = RewardModelWrapper(rm_model, build_tiny_tokenizer(), apply_chat_template=True)
    batch, scores = rollout_and_score(policy_tok, wrapper, [policy_ids(policy_tok, "68"),
                                                            policy_ids(policy_tok, "125")])
    assert batch.response_texts == ["68", "125"]  # the policy's EOS is gone before the RM sees anything
    expected = "<|im_start|>user\n23+45=<|im_end|>\n<|im_start|>assistant\n68<|im_end|>\n"
    assert seen_texts(wrapper) == [expected, expected.replace("23+45=", "57+68=").replace("68<", "125<")]
    rm_ids = wrapper.tokenizer(expected, add_special_tokens=False).input_ids
    assert wrapper.model.seen[0][0, :len(rm_ids)].tolist() == rm_ids
    assert rm_ids[-5:] != policy_tok(expected[-5:]).input_ids  # the two tokenizers number tokens differently
    torch.testing.assert_close(scores, wrapper.score(["23+45=", "57+68="], ["68", "125"]))


def test_template_off_and_the_seeds_custom_template(policy_tok, rm_model):
    off = RewardModelWrapper(rm_model, build_tiny_tokenizer(), apply_chat_template=False)
    rollout_and_score(policy_tok, off, [policy_ids(policy_tok, "68")])
    assert seen_texts(off) == ["23+45=68"]  # the policy's chat template does not leak into the RM input
    custom = RewardModelWrapper(rm_model, build_tiny_tokenizer(chat_template=None), apply_chat_template=True,
                                chat_template=VERL_STYLE_TEMPLATE)
    rollout_and_score(policy_tok, custom, [policy_ids(policy_tok, "68")])
    assert seen_texts(custom) == ["user: 23+45=assistant: 68"]


def test_a_response_cut_by_length_and_one_stopped_by_eos_end_the_same_way(policy_tok, rm_model):
    wrapper = RewardModelWrapper(rm_model, build_tiny_tokenizer(), apply_chat_template=True)
    _, scores = rollout_and_score(policy_tok, wrapper, [policy_ids(policy_tok, "68"),
                                                        policy_ids(policy_tok, "68", eos=False)], ["stop", "length"])
    stopped, cut = seen_texts(wrapper)
    assert stopped.replace("57+68=", "23+45=") == cut.replace("57+68=", "23+45=")
    assert cut.endswith("assistant\n68<|im_end|>\n") and cut.count("<|im_end|>") == 2


def test_too_long_inputs_keep_the_response_end_or_are_counted_or_refused(policy_tok, rm_model, caplog):
    long_answer = policy_ids(policy_tok, "1234567890" * 3, eos=False)  # a rambling policy cut by max_new_tokens
    left = RewardModelWrapper(rm_model, build_tiny_tokenizer(), apply_chat_template=True, max_length=16)
    rollout_and_score(policy_tok, left, [long_answer], ["length"])
    assert seen_texts(left) == [("1234567890" * 3)[-14:] + "<|im_end|>\n"]  # 14 characters + 2 special tokens
    assert left.left_truncated_count == 1 and left.truncated_count == 0
    right = RewardModelWrapper(rm_model, build_tiny_tokenizer(), apply_chat_template=True, max_length=16,
                               truncation_side="right")
    with caplog.at_level(logging.WARNING):
        rollout_and_score(policy_tok, right, [long_answer], ["length"])
    assert "<|im_end|>" in seen_texts(right)[0] and "assistant" not in seen_texts(right)[0]
    assert right.truncated_count == 1 and "cut their response end" in caplog.text
    strict = RewardModelWrapper(rm_model, build_tiny_tokenizer(), apply_chat_template=True, max_length=16,
                                truncation=False)
    with pytest.raises(RewardError, match="over max_length=16, and truncation is off"):
        rollout_and_score(policy_tok, strict, [long_answer], ["length"])


def test_preference_rows_are_scored_through_the_response_field_they_name(rm_model, tmp_path):
    write_records(tmp_path / "prefs.jsonl", make_tiny_preference_records("val", 6, seed=0))
    records = read_records(tmp_path / "prefs.jsonl")
    chosen = RewardModelWrapper(rm_model, build_tiny_tokenizer(), response_key="chosen_response")
    rejected = RewardModelWrapper(rm_model, build_tiny_tokenizer(), response_key="rejected_response")
    margin = chosen.score_rows(records) - rejected.score_rows(records)  # [6]
    pairs = evaluate_pairs(chosen, load_preference_rows([str(tmp_path / "prefs.jsonl")]))
    assert pairs.margin_mean == pytest.approx(float(margin.mean()), abs=1e-6)
    assert pairs.accuracy == int((margin > 0).sum()) / 6
    with pytest.raises(RewardError, match="row 0 has no 'response' field.*response_key='chosen_response'"):
        RewardModelWrapper(rm_model, build_tiny_tokenizer()).score_rows(records)
