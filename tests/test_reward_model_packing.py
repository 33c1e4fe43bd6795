"""The reward model on phaserl's decoder: token-budget micro-batches, packed without padding.

`RewardModelWrapper.from_pretrained` loads a llama / qwen2 / qwen3 `*ForSequenceClassification` directory as
phaserl's ValueModel (engine "auto" / "phaserl") and must score exactly like transformers'
AutoModelForSequenceClassification on the same directory (engine "transformers"): same pooling (the last
non-pad token), same tokenizer (phaserl's `load_tokenizer`), whatever the micro-batching. Packed
micro-batches (the dense block-diagonal mask on CPU, the varlen kernel on CUDA) equal padded ones.
The wrapper's format/truncation tests live in test_reward_model.py; the sharded RM in test_distributed.py.
"""
import json
import os

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForSequenceClassification,
    Qwen2Config,
    Qwen2ForSequenceClassification,
    Qwen3Config,
    Qwen3ForSequenceClassification,
)

from _tiny_rm import make_reward_model_dir
from _tiny_tokenizer import build_tiny_tokenizer
from phaserl.config import load_config
from phaserl.errors import ConfigError, RewardError
from phaserl.models import ValueModel, decoder
from phaserl.resolve import build_reward_sources
from phaserl.roles import RewardModelWrapper
from phaserl.roles.reward_scoring import native_support, token_groups

torch.set_num_threads(1)
# Lengths from 2 to ~110 characters (the tokenizer is char-level): rows of very different sizes.
PROMPTS = ["What is 2+2?", "Name a colour.", "Hi", "Count to three, slowly, and explain each step in detail please.",
           "Spell cat.", "?", "Write a haiku about the sea.", "List three primes."]
RESPONSES = ["4", "Blue, like the sky on a clear summer afternoon.", "hi", "one... two... three. " * 3, "c-a-t",
             "", "Waves fold into foam / salt wind writes on the wet sand / the tide keeps its time", "2, 3, 5"]
ARCHS = {
    "llama": (LlamaForSequenceClassification, LlamaConfig, {}),
    "qwen2": (Qwen2ForSequenceClassification, Qwen2Config, {"num_key_value_heads": 1}),  # GQA, q/k/v bias
    "qwen3": (Qwen3ForSequenceClassification, Qwen3Config, {"head_dim": 8}),              # q/k norms
}


def save_rm(root, arch: str, *, num_labels: int = 1, seed: int = 0, hidden: int = 16, layers: int = 1,
            heads: int = 2) -> str:
    """A tiny transformers classifier of `arch` with the char-level tokenizer, saved to root/arch."""
    cls, config_cls, extra = ARCHS[arch]
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(seed)
    config = config_cls(**{"vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": 2 * hidden,
                           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
                           "max_position_embeddings": 256, "num_labels": num_labels,
                           "pad_token_id": tokenizer.pad_token_id, **extra})
    model = cls(config)
    with torch.no_grad():
        model.score.weight.mul_(50.0)  # random init gives scores ~1e-3 apart; spread them
    path = os.path.join(str(root), f"{arch}-{num_labels}")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rms")
    return {arch: save_rm(root, arch) for arch in ARCHS}


def record_forwards(wrapper) -> list:
    """(input shape, packed?) of every forward the wrapper's ValueModel runs from now on."""
    seen = []
    wrapper.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((tuple(args[0].shape), kwargs.get("seq_ids") is not None)),
        with_kwargs=True)
    return seen


# ----- parity with transformers -------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(ARCHS))
def test_phaserl_engine_scores_like_transformers_classifier(rm_dirs, arch):
    ours = RewardModelWrapper.from_pretrained(rm_dirs[arch], micro_batch_tokens=150, packing=True)
    theirs = RewardModelWrapper.from_pretrained(rm_dirs[arch], engine="transformers", batch_size=3)
    assert ours.engine == "phaserl" and isinstance(ours.model, ValueModel)
    assert theirs.engine == "transformers" and not isinstance(theirs.model, ValueModel)
    seen = record_forwards(ours)
    expected = theirs.score(PROMPTS, RESPONSES)  # [8]
    assert expected.std() > 0.05  # distinct scores: a row mix-up would show
    torch.testing.assert_close(ours.score(PROMPTS, RESPONSES), expected, atol=1e-5, rtol=1e-5)
    assert len(seen) >= 3 and all(packed and shape[0] == 1 for shape, packed in seen)  # several packed forwards
    unpacked = RewardModelWrapper.from_pretrained(rm_dirs[arch], engine="phaserl", micro_batch_tokens=150,
                                                  packing=False)
    torch.testing.assert_close(unpacked.score(PROMPTS, RESPONSES), expected, atol=1e-5, rtol=1e-5)


def test_trailing_pad_tokens_are_skipped_like_transformers_does(rm_dirs):
    """transformers pools at the rightmost token that is not the pad id, even inside a row's real tokens."""
    ours = RewardModelWrapper.from_pretrained(rm_dirs["qwen2"], apply_chat_template=False, packing=True)
    theirs = RewardModelWrapper.from_pretrained(rm_dirs["qwen2"], apply_chat_template=False, engine="transformers")
    responses = ["ab<|endoftext|><|endoftext|>", "ab", "<|endoftext|>", "xyz"]  # <|endoftext|> is the pad token
    prompts = ["Q: ", "Q: ", "", "Q: "]
    scores = ours.score(prompts, responses)
    torch.testing.assert_close(scores, theirs.score(prompts, responses), atol=1e-5, rtol=1e-5)
    assert scores[0].item() == pytest.approx(scores[1].item(), abs=1e-5)  # causal: read at "b" in both rows


def test_from_pretrained_tokenizes_with_phaserls_loader(rm_dirs):
    """Regression: transformers 5's AutoTokenizer rebuilds a generic tokenizer.json next to a qwen2 config as
    Qwen2Tokenizer and drops the spaces of this char-level tokenizer; the RM must see what it was saved with."""
    text = "Say hi. 2 + 2 = 4"
    saved = build_tiny_tokenizer()(text)["input_ids"]
    for engine in ("phaserl", "transformers"):
        wrapper = RewardModelWrapper.from_pretrained(rm_dirs["qwen2"], engine=engine, apply_chat_template=False)
        assert wrapper.tokenizer(text)["input_ids"] == saved
        assert wrapper._encode([text]) == [saved]


def test_auto_picks_phaserl_only_for_its_own_single_label_classifiers(rm_dirs, tmp_path):
    assert native_support(rm_dirs["llama"]) == ""
    two_labels = save_rm(tmp_path, "llama", num_labels=2)
    assert "num_labels=2" in native_support(two_labels)
    with pytest.raises(RewardError, match="engine=phaserl but phaserl's decoder cannot run .*num_labels=2.*"
                                          "engine=transformers"):
        RewardModelWrapper.from_pretrained(two_labels, engine="phaserl")
    with pytest.raises(RewardError, match="num_labels=2"):  # auto: transformers loads it, the wrapper refuses it
        RewardModelWrapper.from_pretrained(two_labels)
    causal = os.path.join(tmp_path, "causal")
    os.makedirs(causal)
    with open(os.path.join(causal, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, f)
    assert "not a *ForSequenceClassification" in native_support(causal)
    with pytest.raises(ConfigError, match="engine='onnx'; expected one of auto, phaserl, transformers"):
        RewardModelWrapper.from_pretrained(rm_dirs["llama"], engine="onnx")


# ----- packing and the token budget ---------------------------------------------------------------------
def test_token_groups_by_hand():
    # longest first: 9 | 7 + 5 = 12 | 3 (9 + 7 = 16 and 12 + 3 = 15 are over 12)
    assert token_groups([5, 9, 3, 7], 12, packed=True) == [[1], [3, 0], [2]]
    # padded costs rows x longest: 2 x 9 = 18 | 2 x 7 = 14 | 2 x 5 = 10
    assert token_groups([5, 9, 3, 7], 12, packed=False) == [[1], [3], [0, 2]]
    assert token_groups([20, 2], 8, packed=True) == [[0], [1]]  # over the budget: scored alone
    assert token_groups([4, 4, 4], 100, packed=True) == [[0, 1, 2]]
    assert token_groups([], 8, packed=True) == []


def test_packed_equals_padded_on_cpu_with_the_dense_block_mask(rm_dirs):
    packed = RewardModelWrapper.from_pretrained(rm_dirs["llama"], micro_batch_tokens=200, packing=True)
    padded = RewardModelWrapper.from_pretrained(rm_dirs["llama"], micro_batch_tokens=200, packing=False)
    seen_packed, seen_padded = record_forwards(packed), record_forwards(padded)
    torch.testing.assert_close(packed.score(PROMPTS, RESPONSES), padded.score(PROMPTS, RESPONSES),
                               atol=1e-5, rtol=1e-5)
    lengths = sorted((len(ids) for ids in packed._encode([packed.format(p, r) for p, r in zip(PROMPTS, RESPONSES)])),
                     reverse=True)
    assert sum(shape[1] for shape, _ in seen_packed) == sum(lengths)  # real tokens only, no padding at all
    assert all(is_packed for _, is_packed in seen_packed) and not any(is_packed for _, is_packed in seen_padded)
    assert all(rows * width <= max(200, lengths[0]) for (rows, width), _ in seen_padded)


def test_auto_packing_is_off_where_the_varlen_kernel_does_not_run(rm_dirs):
    """packing=None follows ppo.packing's rule: CPU (or float32) scores right-padded micro-batches."""
    for dtype in ("float32", "bfloat16"):
        wrapper = RewardModelWrapper.from_pretrained(rm_dirs["llama"], dtype=dtype)
        seen = record_forwards(wrapper)
        wrapper.score(PROMPTS[:3], RESPONSES[:3])
        assert seen and not any(is_packed for _, is_packed in seen)


def test_a_budget_smaller_than_every_input_scores_each_alone(rm_dirs):
    one_each = RewardModelWrapper.from_pretrained(rm_dirs["qwen3"], micro_batch_tokens=1, packing=True)
    all_at_once = RewardModelWrapper.from_pretrained(rm_dirs["qwen3"], micro_batch_tokens=100_000, packing=True)
    seen_one, seen_all = record_forwards(one_each), record_forwards(all_at_once)
    torch.testing.assert_close(one_each.score(PROMPTS, RESPONSES), all_at_once.score(PROMPTS, RESPONSES),
                               atol=1e-5, rtol=1e-5)
    assert len(seen_one) == len(PROMPTS) and len(seen_all) == 1


def test_the_config_keys_reach_the_wrapper(rm_dirs):
    cfg = load_config(None, ["reward_model.enable=true", f"reward_model.path={rm_dirs['llama']}",
                             "reward_model.micro_batch_tokens=64", "reward_model.packing=true"])
    rm = build_reward_sources(cfg, torch.device("cpu")).reward_model
    assert (rm.engine, rm.micro_batch_tokens, rm.packing) == ("phaserl", 64, True)
    cfg = load_config(None, ["reward_model.enable=true", f"reward_model.path={rm_dirs['llama']}",
                             "reward_model.engine=transformers", "reward_model.batch_size=3"])
    rm = build_reward_sources(cfg, torch.device("cpu")).reward_model
    assert (rm.engine, rm.batch_size) == ("transformers", 3)


# ----- the wrapper's checks hold on the phaserl engine --------------------------------------------------
def test_errors_and_probe_on_the_phaserl_engine(tmp_path):
    small_vocab = RewardModelWrapper.from_pretrained(make_reward_model_dir(str(tmp_path), name="v50", vocab_size=50),
                                                     apply_chat_template=False)
    assert small_vocab.engine == "phaserl"
    with pytest.raises(RewardError, match=r"outside the reward model's vocabulary \(50 ids\).*tokenizer"):
        small_vocab.score(["zzz"], ["z"])  # "z" is id 94 in the tiny tokenizer
    nan = RewardModelWrapper.from_pretrained(make_reward_model_dir(str(tmp_path), name="nan", head="nan"))
    with pytest.raises(RewardError, match=r"non-finite scores for rows \[0, 1\] of 2"):
        nan.score(["a", "b"], ["x", "y"])
    zero = RewardModelWrapper.from_pretrained(make_reward_model_dir(str(tmp_path), name="zero", head="zero"))
    report = zero.probe(PROMPTS[:4], RESPONSES[:4])
    assert not report.ok and "same score 0 to all 4 responses" in report.reason
    plain = RewardModelWrapper.from_pretrained(make_reward_model_dir(str(tmp_path), name="ok"),
                                               apply_chat_template=False, max_length=8, truncation=False)
    with pytest.raises(RewardError, match="row 0 is 12 tokens, over max_length=8.*truncation"):
        plain.score(["twelve chars"], [""])
    with pytest.raises(RewardError, match=r"rows \[1\] have no tokens at all"):
        plain.score(["ok", ""], ["!", ""])


def test_scores_are_ordinary_cpu_float32_tensors(rm_dirs):
    wrapper = RewardModelWrapper.from_pretrained(rm_dirs["llama"], dtype="bfloat16", packing=True)
    assert next(wrapper.model.parameters()).dtype == torch.bfloat16
    assert not any(p.requires_grad for p in wrapper.model.parameters()) and not wrapper.model.training
    scores = wrapper.score(PROMPTS[:3], RESPONSES[:3])
    assert scores.dtype == torch.float32 and scores.device.type == "cpu" and not scores.is_inference()


# ----- GPU: the varlen kernel ---------------------------------------------------------------------------
@pytest.mark.gpu
def test_varlen_kernel_scores_like_the_padded_path_on_gpu(tmp_path, monkeypatch):
    path = save_rm(tmp_path, "qwen2", hidden=256, layers=3, heads=8, seed=1)
    varlen = RewardModelWrapper.from_pretrained(path, dtype="bfloat16", device="cuda", micro_batch_tokens=300)
    padded = RewardModelWrapper.from_pretrained(path, dtype="bfloat16", device="cuda", micro_batch_tokens=300,
                                                packing=False)
    fp32 = RewardModelWrapper.from_pretrained(path, dtype="float32", device="cuda", engine="transformers",
                                              batch_size=8)
    assert decoder.use_varlen(torch.device("cuda"), torch.bfloat16), "torch.nn.attention.varlen unavailable"
    calls = []
    monkeypatch.setattr(decoder, "_attend", lambda q, k, v, attn, *rest: calls.append(type(attn).__name__)
                        or decoder.attend(q, k, v, attn, *rest))
    prompts, responses = PROMPTS * 4, RESPONSES[::-1] * 4  # 32 rows, several micro-batches of 300 tokens
    s_varlen = varlen.score(prompts, responses)
    assert "PackedSeqs" in calls and "Tensor" not in calls  # auto packing took the kernel: no dense mask
    s_padded, s_fp32 = padded.score(prompts, responses), fp32.score(prompts, responses)
    scale = s_fp32.abs().max().item()
    # bf16 both ways; each as far from the float32 scores as the other
    torch.testing.assert_close(s_varlen, s_fp32, rtol=0, atol=3e-2 * scale)
    err_varlen, err_padded = (s_varlen - s_fp32).abs().max().item(), (s_padded - s_fp32).abs().max().item()
    assert err_varlen <= 2 * err_padded + 5e-3 * scale
