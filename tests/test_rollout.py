"""Sampling math by hand, and generate() against a plain full-forward loop on a tiny random decoder."""
import math

import pytest
import torch
import transformers

from phaserl.errors import ConfigError, DataError
from phaserl.models import CausalLM, DecoderConfig
from phaserl.models.hf_fallback import HFCausalLM
from phaserl.rollout import SamplingParams, generate, sample_next
from phaserl.rollout.sampling import filter_top_k, filter_top_p

torch.set_num_threads(1)
NEG_INF = float("-inf")
VOCAB = 40
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 8, 9, 10], [11], [12, 13, 14, 15]]


def peaky(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights large enough that the next-token distributions are far from uniform."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") or name.endswith("ln_f.weight") else 0.0
            p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def model():
    cfg = DecoderConfig(model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64, attention_bias=True)
    return peaky(CausalLM(cfg))


def full_forward_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model(torch.tensor([ids])))[0]  # [T, V]


def greedy_reference(model, prompt: list[int], n: int, stop=()) -> list[int]:
    """No cache, no batching: argmax of a full forward over everything so far, one token at a time."""
    seq, out = list(prompt), []
    for _ in range(n):
        token = int(full_forward_logits(model, seq)[-1].argmax())
        out.append(token)
        seq.append(token)
        if token in stop:
            break
    return out


# ------------------------------------------------------------------------------------------ sampling.py

def test_top_k_keeps_the_k_largest_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert filter_top_k(logits, 2).tolist() == [[NEG_INF, 3.0, 2.0, NEG_INF]]
    assert filter_top_k(logits, 0).tolist() == logits.tolist()


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.tensor([[0.2, 0.5, 0.3]]).log()  # probabilities 0.2, 0.5, 0.3
    # sorted: 0.5 (mass above 0), 0.3 (above 0.5), 0.2 (above 0.8)
    assert filter_top_p(logits, 0.6).isfinite().tolist() == [[False, True, True]]
    assert filter_top_p(logits, 0.5).isfinite().tolist() == [[False, True, False]]
    assert filter_top_p(logits, 0.81).isfinite().tolist() == [[True, True, True]]


def test_logprob_is_from_the_temperature_scaled_unfiltered_distribution():
    # T = 2: scaled logits [0, ln 3] -> probabilities [1/4, 3/4]; top_k=1 always draws token 1
    logits = torch.tensor([[0.0, 2 * math.log(3.0)]])
    tokens, logprobs = sample_next(logits, SamplingParams(max_new_tokens=1, temperature=2.0, top_k=1))
    assert tokens.tolist() == [1]
    assert logprobs.item() == pytest.approx(math.log(0.75))  # not 0: the filter does not renormalize it
    # greedy reports the T = 1 log-prob: softmax([0, 2 ln 3]) = [1/10, 9/10]
    _, greedy_logprobs = sample_next(logits, SamplingParams(max_new_tokens=1, temperature=0.0))
    assert greedy_logprobs.item() == pytest.approx(math.log(0.9))


def test_sampling_frequencies_follow_the_scaled_distribution_and_the_seed():
    logits = torch.tensor([[0.0, 2 * math.log(3.0)]]).expand(4000, 2)
    params = SamplingParams(max_new_tokens=1, temperature=2.0)
    tokens, _ = sample_next(logits, params, torch.Generator().manual_seed(0))
    assert tokens.float().mean().item() == pytest.approx(0.75, abs=0.03)
    again, _ = sample_next(logits, params, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again)


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(top_k=-1)])
def test_invalid_sampling_params_are_rejected(bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        SamplingParams(**{"max_new_tokens": 4, **bad})


# ------------------------------------------------------------------------------------------ generate.py

def test_greedy_equals_a_plain_full_forward_loop(model):
    result = generate(model, PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0), eos_token_ids=[],
                      pad_token_id=0, batch_size=3)  # two batches: 3 + 1
    assert result.response_ids == [greedy_reference(model, p, 6) for p in PROMPTS]
    assert result.finish_reasons == ["length"] * 4


def test_sampled_logprobs_equal_log_softmax_of_a_full_forward(model):
    params = SamplingParams(max_new_tokens=5, temperature=0.7, top_k=8, top_p=0.9)
    result = generate(model, PROMPTS, params, eos_token_ids=[], pad_token_id=0,
                      generator=torch.Generator().manual_seed(1))
    for prompt, response, logprobs in zip(PROMPTS, result.response_ids, result.logprobs):
        logits = full_forward_logits(model, prompt + response)  # [T, V]
        positions = range(len(prompt) - 1, len(prompt) + len(response) - 1)  # each predicts the next token
        expected = [(logits[i] / 0.7).log_softmax(-1)[tok].item() for i, tok in zip(positions, response)]
        assert logprobs == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("how", ["eos", "stop_token"])
def test_a_stop_token_ends_the_response_and_is_kept(model, how):
    plain = generate(model, PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0), eos_token_ids=[],
                     pad_token_id=0)
    stop = plain.response_ids[0][2]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(stop,) if how == "stop_token" else ())
    result = generate(model, PROMPTS, params, eos_token_ids=[stop] if how == "eos" else [], pad_token_id=0)
    for full, got, logprobs, reason in zip(plain.response_ids, result.response_ids, result.logprobs,
                                           result.finish_reasons):
        expected = full[:full.index(stop) + 1] if stop in full else full
        assert got == expected and len(logprobs) == len(got)
        assert reason == ("stop" if stop in full else "length")
    assert result.finish_reasons[0] == "stop" and len(result.response_ids[0]) <= 3


def test_left_padding_does_not_change_a_prompts_output(model):
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    alone = generate(model, [PROMPTS[0]], params, eos_token_ids=[], pad_token_id=0)
    padded = generate(model, [PROMPTS[1], PROMPTS[0]], params, eos_token_ids=[], pad_token_id=0)  # 4 pads
    assert padded.response_ids[1] == alone.response_ids[0]
    assert padded.logprobs[1] == pytest.approx(alone.logprobs[0], abs=1e-5)


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6)], ids=["top_k=1", "top_p=1e-6"])
def test_filters_that_keep_one_token_equal_greedy(model, filters):
    greedy = generate(model, PROMPTS, SamplingParams(max_new_tokens=5, temperature=0.0), eos_token_ids=[],
                      pad_token_id=0)
    filtered = generate(model, PROMPTS, SamplingParams(max_new_tokens=5, temperature=1.0, **filters),
                        eos_token_ids=[], pad_token_id=0, generator=torch.Generator().manual_seed(0))
    assert filtered.response_ids == greedy.response_ids


def test_a_seeded_generator_makes_sampling_reproducible(model):
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    runs = [generate(model, PROMPTS, params, eos_token_ids=[], pad_token_id=0,
                     generator=torch.Generator().manual_seed(seed)).response_ids for seed in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_transformers_fallback_model_generates_without_a_kv_cache(tmp_path):
    gpt2 = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    model = HFCausalLM(peaky(transformers.AutoModelForCausalLM.from_config(gpt2)))
    result = generate(model, PROMPTS[:2], SamplingParams(max_new_tokens=4, temperature=0.0), eos_token_ids=[],
                      pad_token_id=0)
    assert result.response_ids == [greedy_reference(model, p, 4) for p in PROMPTS[:2]]


def test_bad_prompts_are_named(model):
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(DataError, match="prompt 1 is empty"):
        generate(model, [[1], []], params, eos_token_ids=[], pad_token_id=0)
    with pytest.raises(DataError, match=r"prompt 0 has token ids \[40\] outside"):
        generate(model, [[1, 40]], params, eos_token_ids=[], pad_token_id=0)


@pytest.mark.gpu
def test_generate_on_cuda_matches_cpu_greedy_and_runs_in_bfloat16(model):
    import copy

    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    on_cpu = generate(model, PROMPTS, params, eos_token_ids=[], pad_token_id=0)
    on_gpu = copy.deepcopy(model).cuda()
    assert generate(on_gpu, PROMPTS, params, eos_token_ids=[], pad_token_id=0).response_ids == on_cpu.response_ids
    sampled = generate(on_gpu.to(torch.bfloat16), PROMPTS, SamplingParams(max_new_tokens=6, top_p=0.9),
                       eos_token_ids=[], pad_token_id=0, generator=torch.Generator("cuda").manual_seed(0))
    assert all(len(r) == 6 for r in sampled.response_ids)
    assert all(math.isfinite(lp) and lp <= 0 for row in sampled.logprobs for lp in row)
