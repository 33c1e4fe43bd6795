"""The tiny world: disjoint splits, sloppy teacher, tokenizer and chat template, verl records, committed model."""
import copy
import json
import os

import pytest
import torch

from phaserl.errors import ConfigError
from phaserl.world import build, task
from phaserl.world.sft import encode_example, evaluate, sft_train
from phaserl.world.tokenizer import ASSISTANT, EOS, USER, build_tokenizer, save_tokenizer

# ------------------------------------------------------------------------------------------ task

def test_splits_partition_the_problem_space():
    pools = {s: {p.question for p in task.make_problems(s, task.pool_size(s), seed=0)} for s in task.SPLITS}
    assert not pools["sft"] & pools["train"] and not pools["sft"] & pools["val"] and not pools["train"] & pools["val"]
    assert sum(len(p) for p in pools.values()) == 100 * 100
    assert all(task.split_of(q) == "val" for q in pools["val"])


def test_make_problems_is_seeded_and_answers_are_sums():
    a = task.make_problems("train", 50, seed=3)
    assert a == task.make_problems("train", 50, seed=3)
    assert a != task.make_problems("train", 50, seed=4)
    assert len({p.question for p in a}) == 50
    for p in a:
        x, y = p.question.rstrip("=").split("+")
        assert int(p.answer) == int(x) + int(y)


def test_make_problems_rejects_impossible_sizes():
    with pytest.raises(ConfigError, match="split 'val', which holds"):
        task.make_problems("val", task.pool_size("val") + 1, seed=0)
    with pytest.raises(ConfigError, match="unknown tiny-world split"):
        task.make_problems("test", 1, seed=0)


def test_carry_free_sum_drops_every_carry():
    assert task.carry_free_sum(57, 68) == 15  # 5+6=11 -> 1, 7+8=15 -> 5
    assert task.carry_free_sum(99, 1) == 90  # 9+0 -> 9, 9+1=10 -> 0
    assert task.carry_free_sum(12, 34) == 46  # no carry: the true sum
    assert task.carry_free_sum(0, 0) == 0


def test_teacher_is_sloppy_only_on_carry_problems():
    exact = task.make_teacher_problems(500, seed=0, sloppy_rate=0.0)
    always = task.make_teacher_problems(500, seed=0, sloppy_rate=1.0)
    for good, bad in zip(exact, always):
        x, y = map(int, good.question.rstrip("=").split("+"))
        assert good.answer == str(x + y)
        assert bad.answer == str(task.carry_free_sum(x, y))
    default = task.make_teacher_problems(task.pool_size("sft"), seed=0)
    carry = [p for p in default if task.carry_free_sum(*map(int, p.question.rstrip("=").split("+")))
             != sum(map(int, p.question.rstrip("=").split("+")))]
    wrong = sum(p.answer != str(sum(map(int, p.question.rstrip("=").split("+")))) for p in carry)
    assert abs(wrong / len(carry) - task.SLOPPY_RATE) < 0.03


def test_record_follows_the_verl_schema():
    record = task.to_record(task.Problem("23+45=", "68"), index=7, split="val")
    assert record == {"prompt": [{"role": "user", "content": "23+45="}], "data_source": "tiny_arith",
                      "reward_model": {"style": "rule", "ground_truth": "68"},
                      "extra_info": {"split": "val", "index": 7}}


# ------------------------------------------------------------------------------------------ tokenizer

def test_tokenizer_is_one_token_per_character_and_round_trips():
    tok = build_tokenizer()
    ids = tok("57+68=", add_special_tokens=False).input_ids
    assert len(ids) == 6 and tok.decode(ids) == "57+68="
    assert tok.convert_ids_to_tokens(ids) == list("57+68=")
    assert tok.decode(tok("12 + 3", add_special_tokens=False).input_ids) == "12 + 3"


def test_chat_template_renders_prompt_and_answer(tmp_path):
    save_tokenizer(tmp_path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    user = [{"role": "user", "content": "23+45="}]
    assert tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == f"{USER}23+45={ASSISTANT}"
    full = user + [{"role": "assistant", "content": "68"}]
    assert tok.apply_chat_template(full, tokenize=False) == f"{USER}23+45={ASSISTANT}68{EOS}"
    prompt, answer = encode_example(tok, "23+45=", "68")
    assert tok.convert_ids_to_tokens(prompt) == [USER, "2", "3", "+", "4", "5", "=", ASSISTANT]
    assert answer == tok.convert_tokens_to_ids(["6", "8"]) + [tok.eos_token_id]
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    with pytest.raises(Exception, match="unknown role"):
        tok.apply_chat_template([{"role": "robot", "content": "hi"}], tokenize=False)


# ------------------------------------------------------------------------------------------ files

def test_prepare_writes_verl_files_once(tmp_path):
    from phaserl.data.files import read_records

    world = build.prepare_tiny_world(tmp_path)
    train, val, sft = (read_records(f) for f in (world.train_file, world.val_file, world.sft_file))
    assert (len(train), len(val), len(sft)) == (build.NUM_TRAIN, build.NUM_VAL, task.pool_size("sft"))
    assert val[0]["reward_model"]["style"] == "rule" and val[0]["data_source"] == "tiny_arith"
    assert all(task.split_of(r["prompt"][0]["content"]) == "val" for r in val)
    assert all(task.split_of(r["prompt"][0]["content"]) == "train" for r in train)
    assert sft[0]["prompt"][0]["role"] == "user" and isinstance(sft[0]["response"], str)
    stamps = {f: os.stat(f).st_mtime_ns for f in (world.train_file, world.val_file, world.sft_file)}
    assert build.prepare_tiny_world(tmp_path) == world  # a second call reuses the cache, writes nothing
    assert {f: os.stat(f).st_mtime_ns for f in stamps} == stamps


# ------------------------------------------------------------------------------------------ SFT

def _tiny_model(tok, seed=0):
    from phaserl.models import CausalLM, DecoderConfig

    torch.manual_seed(seed)
    return CausalLM(DecoderConfig(model_type="qwen2", vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                  tie_word_embeddings=True, attention_bias=True,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))


def test_sft_loss_counts_only_the_answer_and_eos_tokens():
    tok = build_tokenizer()
    problems = [task.Problem("01+02=", "3"), task.Problem("40+05=", "45")]
    model = _tiny_model(tok)
    fresh = copy.deepcopy(model)
    stats = sft_train(model, tok, problems, steps=1, batch_size=2, lr=1e-3, seed=0)
    nll = []  # -log p(token | everything before it), for "3", EOS, "4", "5", EOS only
    with torch.no_grad():
        for p in problems:
            prompt, answer = encode_example(tok, p.question, p.answer)
            logp = torch.log_softmax(fresh.logits(fresh(torch.tensor([prompt + answer]))), -1)[0]  # [T, V]
            nll += [-logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(answer)]
    assert len(nll) == 5
    assert stats.losses[0] == pytest.approx(sum(nll) / len(nll), rel=1e-5)


def test_sft_is_deterministic_and_learns_the_answers():
    tok = build_tokenizer()
    problems = [task.Problem("01+02=", "3"), task.Problem("40+05=", "45")]
    a, b = _tiny_model(tok), _tiny_model(tok)
    stats = sft_train(a, tok, problems, steps=40, batch_size=2, lr=2e-2, seed=0)
    sft_train(b, tok, problems, steps=40, batch_size=2, lr=2e-2, seed=0)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert stats.losses[-1] < 0.1 * stats.losses[0]
    assert evaluate(a, tok, problems) == 1.0
    assert evaluate(a, tok, [task.Problem("01+02=", "4")]) == 0.0


# ------------------------------------------------------------------------------------------ the committed model

def test_committed_model_matches_transformers_and_sits_in_its_accuracy_band():
    from transformers import AutoModelForCausalLM

    from phaserl.models import load_pretrained, load_tokenizer

    world_dir = build.ASSETS_DIR
    ours, tok = load_pretrained(world_dir), load_tokenizer(world_dir)
    theirs = AutoModelForCausalLM.from_pretrained(world_dir, local_files_only=True).eval()
    ids = torch.tensor([encode_example(tok, "57+68=", "125")[0] + encode_example(tok, "57+68=", "125")[1]])
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(ours(ids)), theirs(ids).logits, atol=1e-5, rtol=1e-5)
    val = task.make_problems("val", 100, seed=0)
    # The warm start answers the carry-free problems and few others: room for RL (see phaserl/world/__init__.py).
    assert 0.1 <= evaluate(ours, tok, val) <= 0.6
