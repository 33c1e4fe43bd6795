"""Native decoder vs transformers: same logits both ways through Hugging Face directories, plus the cache,
RoPE variants, the value head, the transformers fallback and the errors people see."""
import json
import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from _hf_pairs import randomize
from phaserl.errors import ConfigError
from phaserl.models import (
    CausalLM,
    DecoderConfig,
    KVCache,
    ValueModel,
    load_pretrained,
    load_tokenizer,
    load_value_model,
    save_pretrained,
    save_value_model,
)
from phaserl.models.families import config_from_hf, config_to_hf
from phaserl.models.rope import ROPE_FUNCTIONS

torch.set_num_threads(1)

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64)


def hf_configs():
    """(name, transformers config) for each family, each exercising its distinguishing feature."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8, "rope_theta": 500000.0}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    return [
        ("llama-gqa-llama3rope", transformers.LlamaConfig(**TINY, num_key_value_heads=2, rope_parameters=llama3)),
        ("qwen2-bias-tied", transformers.Qwen2Config(**TINY, num_key_value_heads=2, tie_word_embeddings=True)),
        ("qwen3-qknorm-headdim", transformers.Qwen3Config(**TINY, num_key_value_heads=1, head_dim=16,
                                                          rope_parameters=yarn)),
    ]


def batch_with_left_padding(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, 7), generator=g)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


@pytest.mark.parametrize("name,hf_config", hf_configs(), ids=[n for n, _ in hf_configs()])
def test_transformers_checkpoint_loads_with_identical_logits(tmp_path, name, hf_config):
    hf = randomize(transformers.AutoModelForCausalLM.from_config(hf_config))
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    assert isinstance(ours, CausalLM)
    ids, mask, positions = batch_with_left_padding(hf_config.vocab_size)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        hidden = ours(ids, attention_mask=mask)  # positions derived from the mask
    got = ours.logits(hidden)
    assert hidden.isfinite().all(), "padding positions must not produce NaN"
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,hf_config", hf_configs(), ids=[n for n, _ in hf_configs()])
def test_our_checkpoint_loads_in_transformers_with_identical_logits(tmp_path, name, hf_config):
    cfg = config_from_hf(hf_config.to_dict())
    ours = randomize(CausalLM(cfg), seed=3)
    save_pretrained(ours, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids, mask, positions = batch_with_left_padding(cfg.vocab_size)
    with torch.no_grad():
        expected = ours.logits(ours(ids, attention_mask=mask))
        got = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=1e-5, rtol=1e-5)
    names = set(load_file(tmp_path / "out" / "model.safetensors"))
    assert ("lm_head.weight" in names) == (not cfg.tie_word_embeddings)
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation.get("eos_token_id") == cfg.eos_token_id


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.7, "mscale_all_dim": 1.0},
], ids=["default", "linear", "dynamic", "llama3", "yarn", "yarn-mscale"])
def test_rope_frequencies_match_transformers(rope_scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": 10000.0}
    hf_config = transformers.LlamaConfig(**{**TINY, "hidden_size": 64}, rope_parameters=params)
    cfg = config_from_hf(hf_config.to_dict())
    ours, ours_scale = ROPE_FUNCTIONS[cfg.rope_type](cfg)
    if cfg.rope_type == "default":
        expected = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
        expected_scale = 1.0
    else:
        expected, expected_scale = ROPE_INIT_FUNCTIONS[cfg.rope_type](hf_config, "cpu")
    torch.testing.assert_close(ours, expected, atol=0, rtol=1e-6)
    assert ours_scale == pytest.approx(expected_scale)


def test_dynamic_rope_beyond_the_trained_context_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(**TINY, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                  "rope_theta": 10000.0})
    cfg = config_from_hf(hf_config.to_dict())
    from phaserl.models.rope import dynamic_rope
    expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_config, "cpu", seq_len=100)
    torch.testing.assert_close(dynamic_rope(cfg, 100)[0], expected, atol=0, rtol=1e-6)
    assert not torch.allclose(dynamic_rope(cfg, 100)[0], dynamic_rope(cfg, 64)[0])


def tiny_cfg(**overrides) -> DecoderConfig:
    base = dict(model_type="qwen2", **TINY, num_key_value_heads=2, attention_bias=True)
    return DecoderConfig(**{**base, **overrides})


def test_kv_cache_prefill_then_decode_equals_one_full_forward():
    model = randomize(CausalLM(tiny_cfg()))
    ids, mask, _ = batch_with_left_padding(96)
    with torch.no_grad():
        full = model(ids, attention_mask=mask)  # [B, 7, H]
        cache = KVCache.allocate(model.config, batch_size=3, max_len=10, dtype=torch.float32, device="cpu")
        prefill = model(ids[:, :4], attention_mask=mask[:, :4], kv_cache=cache)
        steps = [model(ids[:, t:t + 1], attention_mask=mask[:, t:t + 1], kv_cache=cache) for t in range(4, 7)]
    assert cache.length == 7
    incremental = torch.cat([prefill, *steps], dim=1)
    real = mask.bool()
    torch.testing.assert_close(incremental[real], full[real], atol=1e-5, rtol=1e-5)


def test_kv_cache_overflow_is_an_error():
    model = CausalLM(tiny_cfg())
    cache = KVCache.allocate(model.config, batch_size=1, max_len=3, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="overflow"):
        model(torch.zeros(1, 4, dtype=torch.long), kv_cache=cache)


def test_right_padding_leaves_real_tokens_unchanged():
    model = randomize(CausalLM(tiny_cfg()))
    ids = torch.randint(0, 96, (1, 5))
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]])
    with torch.no_grad():
        alone, in_padding = model(ids), model(padded, attention_mask=mask)
    torch.testing.assert_close(in_padding[:, :5], alone, atol=1e-5, rtol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = CausalLM(tiny_cfg(model_type="qwen3", attention_bias=False, qk_norm=True)).train()
    ids = torch.randint(0, 96, (2, 6))
    grads = []
    for enabled in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = enabled
        model.logits(model(ids)).logsumexp(-1).mean().backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


def test_value_model_round_trips_through_sequence_classification(tmp_path):
    value = randomize(ValueModel(CausalLM(tiny_cfg(pad_token_id=0))))
    save_value_model(value, tmp_path / "critic")
    names = set(load_file(tmp_path / "critic" / "model.safetensors"))
    assert "score.weight" in names and "lm_head.weight" not in names
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "critic").eval()
    ids = torch.randint(1, 96, (2, 5))
    with torch.no_grad():
        values = value(ids)
        assert values.dtype == torch.float32 and values.shape == (2, 5)
        # transformers scores the last token; ours gives a value for every prefix.
        torch.testing.assert_close(hf(input_ids=ids).logits[:, 0], values[:, -1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(load_value_model(tmp_path / "critic")(ids), values)


def test_value_model_from_a_policy_checkpoint_is_refused_with_a_hint(tmp_path):
    save_pretrained(CausalLM(tiny_cfg()), tmp_path / "policy")
    with pytest.raises(ConfigError, match="ValueModel\\(load_pretrained"):
        load_value_model(tmp_path / "policy")


def test_unknown_architecture_loads_through_transformers_with_a_log_line(tmp_path, caplog):
    gpt2 = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    hf = randomize(transformers.AutoModelForCausalLM.from_config(gpt2))
    hf.save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="phaserl"):
        model = load_pretrained(tmp_path)
    assert "model_type gpt2 is not implemented natively; using transformers' AutoModelForCausalLM (slow path)" \
        in caplog.text
    ids = torch.randint(0, 64, (2, 5))
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        got = model.logits(model(ids, attention_mask=mask))
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=1e-5, rtol=1e-5)
    assert model.output_weight.shape == (64, 32)
    save_pretrained(model, tmp_path / "again")
    with torch.no_grad():
        reloaded = load_pretrained(tmp_path / "again")
        torch.testing.assert_close(reloaded.logits(reloaded(ids, attention_mask=mask)), got)


def test_sharded_checkpoint_loads(tmp_path):
    hf_config = hf_configs()[0][1]
    hf = randomize(transformers.AutoModelForCausalLM.from_config(hf_config))
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, hf_config.vocab_size, (1, 6))
    ours = load_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(ours(ids)), hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_missing_directory_config_and_weights_are_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_pretrained(tmp_path / "nope")
    with pytest.raises(ConfigError, match="config.json: missing"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(tiny_cfg())))
    with pytest.raises(ConfigError, match="no model.safetensors"):
        load_pretrained(tmp_path)


def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path):
    save_pretrained(CausalLM(tiny_cfg()), tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    state = load_file(weights)
    state["model.extra.weight"] = state.pop("model.norm.weight")
    save_file(state, weights)
    with pytest.raises(ConfigError, match=r"missing 1 tensor\(s\) \['model.norm.weight'\].*'model.extra.weight'"):
        load_pretrained(tmp_path / "m")
    state["model.norm.weight"] = torch.ones(7)
    del state["model.extra.weight"]
    save_file(state, weights)
    with pytest.raises(ConfigError, match=r"model.safetensors: tensor 'model.norm.weight' has shape \(7,\)"):
        load_pretrained(tmp_path / "m")


def test_config_errors_name_the_problem():
    with pytest.raises(ConfigError, match="model_type='gpt2' is not implemented natively"):
        config_from_hf({"model_type": "gpt2"})
    with pytest.raises(ConfigError, match="missing key.*intermediate_size"):
        config_from_hf({"model_type": "llama", "vocab_size": 8, "hidden_size": 8,
                                    "num_hidden_layers": 1, "num_attention_heads": 2})
    with pytest.raises(ConfigError, match="final_logit_softcapping=30.0 is not implemented natively"):
        config_from_hf({**config_to_hf(tiny_cfg()), "final_logit_softcapping": 30.0})
    with pytest.raises(ConfigError, match="longrope"):
        tiny_cfg(rope_scaling={"rope_type": "longrope", "factor": 2.0})


def test_saving_over_an_existing_directory_replaces_it_whole(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "stale.txt").write_text("from an older export")
    save_pretrained(CausalLM(tiny_cfg()), out, dtype=torch.bfloat16)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert load_file(out / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temp dirs left behind


def test_tokenizer_saves_with_the_model_and_loads_locally(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "</s>": 1, "hello": 2, "world": 3}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="</s>")
    # (llama: transformers 5 swaps in its own Qwen2Tokenizer class next to a qwen2 config.json)
    save_pretrained(CausalLM(tiny_cfg(model_type="llama", attention_bias=False)), tmp_path / "m", tokenizer=tok)
    assert load_tokenizer(tmp_path / "m")("hello world")["input_ids"] == [2, 3]
    with pytest.raises(ConfigError, match="tokenizer directory"):
        load_tokenizer(tmp_path)


def test_a_generic_tokenizer_next_to_a_qwen2_config_loads_as_its_tokenizer_json_defines(tmp_path):
    """transformers 5's AutoTokenizer rebuilds a Qwen2 directory's tokenizer as Qwen2Tokenizer, whose own
    pre-tokenizer turns 'w1 w2' into nothing for a word-level vocabulary; load_tokenizer must not."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={"<pad>": 0, "w1": 1, "w2": 2, "<eos>": 3}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")
    cfg = DecoderConfig(model_type="qwen2", vocab_size=4, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, attention_bias=True)
    save_pretrained(CausalLM(cfg), tmp_path, tokenizer=tokenizer)
    loaded = load_tokenizer(tmp_path)
    assert loaded("w2 w1 w2")["input_ids"] == [2, 1, 2]
    assert loaded.eos_token_id == 3 and loaded.pad_token_id == 0


def test_regression_a_critics_head_takes_the_backbones_dtype_and_device():
    """Bug (H200, 2026-12-04, benchmarks/multi_gpu.py's ppo_rm scenario): ValueModel made its score head with torch's
    defaults, float32 on the CPU, after the backbone was loaded in bf16 on the GPU: on 1 rank the head's matmul met a
    CPU weight, on 2 FSDP refused the mixed bf16/float32 parameters."""
    from phaserl.models import CausalLM, DecoderConfig, ValueModel

    cfg = DecoderConfig(model_type="qwen2", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1)
    backbone = CausalLM(cfg).to(torch.bfloat16)
    critic = ValueModel(backbone)
    assert {p.dtype for p in critic.parameters()} == {torch.bfloat16}
    assert critic(torch.randint(0, 64, (2, 5))).dtype == torch.float32  # values come out in float32
    with torch.device("meta"):
        on_meta = ValueModel(CausalLM(cfg))
    assert {p.device.type for p in on_meta.parameters()} == {"meta"}
