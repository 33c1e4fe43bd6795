"""The rollout batch's layout built through masks (batch.layout_ids, right_padded) equals the row-at-a-time
layout it replaced, decode_responses gives transformers' batch_decode strings, and batch.send moves host tensors."""
import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from phaserl.batch import layout_ids, right_padded, send
from phaserl.data.prompts import _plain_fast, decode_responses
from phaserl.world.tokenizer import build_tokenizer


def row_at_a_time(prompts, responses, pad):
    """The layout as build_rollout_batch wrote it before (one row, one slice at a time)."""
    P, R = max(map(len, prompts)), max(1, max(map(len, responses)))
    ids = torch.full((len(prompts), P + R), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), P + R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        ids[i, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, P - len(p):P + len(r)] = 1
    return ids, mask, P


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layout_ids_equals_the_row_at_a_time_layout_with_ragged_and_empty_rows(seed):
    rng = random.Random(seed)
    prompts = [tuple(rng.randrange(3, 50) for _ in range(rng.randint(1, 9))) for _ in range(7)]
    responses = [[rng.randrange(3, 50) for _ in range(rng.choice([0, 1, 5, 12]))] for _ in range(7)]
    ids, mask, P = layout_ids(prompts, responses, pad_token_id=2)
    want_ids, want_mask, want_P = row_at_a_time(prompts, responses, 2)
    assert P == want_P and torch.equal(ids, want_ids) and torch.equal(mask, want_mask)


def test_layout_ids_with_every_response_empty_keeps_one_response_column():
    ids, mask, P = layout_ids([(5, 6), (7,)], [[], []], pad_token_id=0)
    assert P == 2 and ids.shape == (2, 3)
    assert ids.tolist() == [[5, 6, 0], [0, 7, 0]] and mask.tolist() == [[1, 1, 0], [0, 1, 0]]


def test_right_padded_puts_each_list_at_the_start_of_its_row():
    out = right_padded([[0.5, -1.0], [], [2.0]], 3, torch.float32)
    assert out.dtype == torch.float32
    assert out.tolist() == [[0.5, -1.0, 0.0], [0.0, 0.0, 0.0], [2.0, 0.0, 0.0]]


def bpe_tokenizer(clean_up: bool) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    corpus = ["The answer is 42.", "Let's think: 3 + 4 = 7 , so ...", "naïve café 東京 ✓", "don't stop , ok ?"] * 20
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   clean_up_tokenization_spaces=clean_up)


@pytest.mark.parametrize("make", [build_tokenizer, lambda: bpe_tokenizer(False)], ids=["tiny_world", "byte_bpe"])
def test_decode_responses_gives_batch_decodes_strings_through_the_rust_batch_call(make):
    tok = make()
    assert _plain_fast(tok)
    texts = ["12+30=42", "don't stop , ok ?", "naïve café 東京 ✓", "", "The answer is 42."]
    responses = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    responses[1] = responses[1] + [tok.eos_token_id]  # a special token inside a response is skipped
    responses[2] = responses[2][:-1]                  # cut inside a multi-byte character: the replacement char
    responses.append([])
    assert decode_responses(tok, responses) == tok.batch_decode(responses, skip_special_tokens=True)
    assert decode_responses(tok, []) == []


def test_decode_responses_keeps_transformers_call_when_the_tokenizer_cleans_up_spaces():
    tok = bpe_tokenizer(True)
    assert not _plain_fast(tok)
    responses = [tok("don't stop , ok ?", add_special_tokens=False)["input_ids"]]
    assert decode_responses(tok, responses) == tok.batch_decode(responses, skip_special_tokens=True)


def test_decode_responses_decodes_each_with_a_tokenizer_that_has_only_decode():
    """An agent's tokenizer stand-in (a benchmark's, a user's) may offer decode alone: each response through it,
    with special tokens skipped as batch_decode would."""
    class DecodeOnly:
        def decode(self, ids, skip_special_tokens: bool = False) -> str:
            return ",".join(str(i) for i in ids if not (skip_special_tokens and i == 0))

    assert decode_responses(DecodeOnly(), [[5, 0, 6], [], [7]]) == ["5,6", "", "7"]


def test_layout_ids_returns_torch_long_tensors_and_right_padded_keeps_its_dtype():
    ids, mask, P = layout_ids([[5, 6], [7]], [[1, 2, 3], []], 0)
    assert ids.dtype == mask.dtype == torch.long and P == 2
    assert ids.tolist() == [[5, 6, 1, 2, 3], [0, 7, 0, 0, 0]] and mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert right_padded([[0.5], []], 2, torch.float32).dtype == torch.float32


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_send_gives_the_same_values_on_the_target_device(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    t = torch.arange(10)
    out = send(t, device)
    assert out.device.type == device and torch.equal(out.cpu(), t)
    assert torch.equal(send(out, "cpu"), t)  # and back, from wherever it is
