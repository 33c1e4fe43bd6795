"""The transformers path (model.implementation = transformers, and every architecture without a native
decoder) computes exactly what the model's own forward computes: log-probs equal forward().logits'
log-softmax, soft-capping included; weights that do not match the config are an error that lists them;
the doctor's memory estimate reads any causal LM config."""
import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from phaserl.errors import ConfigError
from phaserl.memory.budget import ModelShape, UnknownShape
from phaserl.models import load_pretrained
from phaserl.models.hf_fallback import HFCausalLM
from phaserl.roles.forward import head_logprobs

torch.set_num_threads(1)

T = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
TWO = ["sliding_attention", "full_attention"]


def architectures():
    """(name, transformers config class name, kwargs): tiny configs of the architectures users bring."""
    return [
        ("mistral", "MistralConfig", dict(**T, sliding_window=3)),
        ("gemma2-softcap", "Gemma2Config", dict(**T, head_dim=8, final_logit_softcapping=3.0,
                                                attn_logit_softcapping=5.0, sliding_window=3)),
        ("gemma3-softcap", "Gemma3TextConfig", dict(**T, head_dim=8, final_logit_softcapping=3.0, sliding_window=3,
                                                    layer_types=TWO)),
        ("gemma4-softcap", "Gemma4TextConfig", dict(**T, head_dim=8, global_head_dim=8, sliding_window=3,
                                                    hidden_size_per_layer_input=8, vocab_size_per_layer_input=96,
                                                    final_logit_softcapping=3.0, layer_types=TWO)),
        ("olmo2", "Olmo2Config", dict(T)),
        ("phi3", "Phi3Config", dict(T)),
        ("qwen3-moe", "Qwen3MoeConfig", dict(**T, head_dim=8, moe_intermediate_size=16, num_experts=4,
                                             num_experts_per_tok=2)),
        ("qwen3.5", "Qwen3_5TextConfig", dict(**T, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2,
                                              linear_key_head_dim=8, linear_value_head_dim=8,
                                              layer_types=["linear_attention", "full_attention"])),
        ("gpt2", "GPT2Config", dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
                                    eos_token_id=2)),
    ]


def make_config(class_name: str, kwargs: dict):
    cls = getattr(transformers, class_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    return cls(**kwargs)


def randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return module.eval()


def saved_model(tmp_path, class_name, kwargs):
    hf = randomize(transformers.AutoModelForCausalLM.from_config(make_config(class_name, kwargs)))
    hf.save_pretrained(tmp_path / "m")
    return hf, tmp_path / "m"


@pytest.mark.parametrize("name,class_name,kwargs", architectures(), ids=[a[0] for a in architectures()])
def test_logprobs_equal_the_models_own_forward(tmp_path, name, class_name, kwargs):
    hf, directory = saved_model(tmp_path, class_name, kwargs)
    ours = load_pretrained(directory, implementation="transformers")
    assert isinstance(ours, HFCausalLM)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (2, 7), generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    targets = torch.randint(3, 96, (2, 7), generator=g)
    real = mask.bool()
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float().log_softmax(-1)
        expected = expected.gather(-1, targets[..., None]).squeeze(-1)[real]  # [N]
        hidden = ours(ids, attention_mask=mask)[real]  # [N, H]
        got, entropy = head_logprobs(ours, hidden, targets[real], temperature=1.0, chunk_size=3, with_entropy=True)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert entropy.shape == got.shape and (entropy >= 0).all()
    assert ours.plain_head == (getattr(ours.config.get_text_config(), "final_logit_softcapping", None) is None)


def test_softcapped_logprobs_have_the_naive_gradient(tmp_path):
    _, directory = saved_model(tmp_path, "Gemma2Config", architectures()[1][2])
    ours = load_pretrained(directory)  # gemma2 has no native decoder: the transformers path by itself
    hidden = torch.randn(5, 32, requires_grad=True)
    targets = torch.tensor([3, 4, 5, 6, 7])
    got, _ = ours.token_logprobs(hidden, targets, chunk_size=2)
    (grad,) = torch.autograd.grad(got.sum(), hidden)
    naive = ours.logits(hidden).log_softmax(-1).gather(-1, targets[:, None]).sum()
    (expected,) = torch.autograd.grad(naive, hidden)
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=1e-5)


def test_a_head_step_the_wrapper_does_not_know_is_an_error():
    hf = transformers.AutoModelForCausalLM.from_config(make_config("LlamaConfig", dict(T))).eval()
    original = hf.forward

    def doubled(*args, **kwargs):  # an architecture that rescales its logits in a way nobody told us about
        out = original(*args, **kwargs)
        out.logits = out.logits * 2
        return out

    hf.forward = doubled
    with pytest.raises(ConfigError, match="does not reproduce"):
        HFCausalLM(hf)


def test_weights_that_do_not_match_the_config_are_listed(tmp_path, caplog):
    _, directory = saved_model(tmp_path, "GPT2Config", architectures()[-1][2])
    weights = directory / "model.safetensors"
    state = load_file(weights)
    dropped = sorted(k for k in state if ".h.1." in k)
    save_file({k: v for k, v in state.items() if k not in dropped}, weights, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"missing \d+ tensor\(s\).*transformer\.h\.1\..*allow_random_init"):
        load_pretrained(directory)
    with caplog.at_level(logging.WARNING, logger="phaserl"):
        assert isinstance(load_pretrained(directory, allow_random_init=True), HFCausalLM)
    assert "randomly initialized" in caplog.text
    save_file({**state, "transformer.extra.weight": torch.zeros(2)}, weights, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"unexpected 1 tensor\(s\) \['transformer.extra.weight'\]"):
        load_pretrained(directory)


def test_native_weights_missing_can_start_random_when_asked(tmp_path):
    _, directory = saved_model(tmp_path, "MistralConfig", dict(T))
    state = load_file(directory / "model.safetensors")
    del state["model.norm.weight"]
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"missing 1 tensor\(s\) \['model.norm.weight'\]"):
        load_pretrained(directory)
    model = load_pretrained(directory, allow_random_init=True)
    assert torch.equal(model.model.norm.weight, torch.ones(32))  # its init; the rest from the file
    torch.testing.assert_close(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])


@pytest.mark.parametrize("name,class_name,kwargs", architectures(), ids=[a[0] for a in architectures()])
def test_the_memory_estimate_reads_every_config(name, class_name, kwargs):
    hf = transformers.AutoModelForCausalLM.from_config(make_config(class_name, kwargs))
    shape = ModelShape.of(HFCausalLM(hf, verify=False))
    assert shape.num_layers == 2 and shape.hidden_size == 32 and shape.vocab_size == 96
    assert shape.num_params == sum(p.numel() for p in hf.parameters())
    if name == "gpt2":
        assert shape.intermediate_size == 4 * 32  # GPT-2's n_inner = null rule


def test_a_config_without_layer_counts_is_unknown_not_a_crash():
    class Bare(torch.nn.Module):
        config = type("WeirdConfig", (), {"hidden_size": 8, "num_attention_heads": 2, "vocab_size": 10})()

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(2))

    with pytest.raises(UnknownShape, match="WeirdConfig has none of num_hidden_layers, n_layer, num_layers"):
        ModelShape.of(Bare())


@pytest.mark.parametrize("index", [1, 3, 7, 8], ids=["gemma2", "gemma4", "qwen3.5", "gpt2"])
def test_rollout_with_transformers_cache_equals_recomputing_every_step(tmp_path, index):
    import importlib

    from phaserl.rollout import SamplingParams

    gen = importlib.import_module("phaserl.rollout.generate")

    name, class_name, kwargs = architectures()[index]
    _, directory = saved_model(tmp_path, class_name, kwargs)
    model = load_pretrained(directory, implementation="transformers")
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]  # left-padded together: positions differ per row
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    cached = gen.generate(model, prompts, params, eos_token_ids=[], pad_token_id=0)
    original = gen._HFCachedDecoder
    try:
        gen._HFCachedDecoder = gen._RecomputingDecoder
        recomputed = gen.generate(model, prompts, params, eos_token_ids=[], pad_token_id=0)
    finally:
        gen._HFCachedDecoder = original
    assert cached.response_ids == recomputed.response_ids
    for a, b in zip(cached.logprobs, recomputed.logprobs):
        assert a == pytest.approx(b, abs=1e-4)


def _gpt2_run(tmp_path) -> list:
    """Config overrides for a tiny GPT-2 (transformers path) run with the tiny tokenizer."""
    from _tiny_run import make_prompt_files
    from _tiny_tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    train, val = make_prompt_files(str(tmp_path), n_train=8, n_val=2)
    return [f"model.path={tmp_path / 'model'}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
            "trainer.device=cpu", f"trainer.log_dir={tmp_path / 'logs'}", f"trainer.checkpoint_path={tmp_path / 'c'}",
            "rollout.prompts_per_step=2", "rollout.n=2", "rollout.batch_size=2"]


@pytest.mark.slow
def test_the_doctor_estimates_memory_for_gpt2_and_fails_on_weights_that_do_not_match(tmp_path):
    from phaserl.doctor import load_doctor_config, run_doctor
    from phaserl.doctor.report import FAIL

    overrides = _gpt2_run(tmp_path)
    results = {r.name: r for r in run_doctor(load_doctor_config(None, overrides))}
    assert results["model"].status != FAIL and "transformers fallback" in results["model"].message
    memory = results["memory"]  # was AttributeError: 'GPT2Config' object has no attribute 'intermediate_size'
    assert memory.status != FAIL and not memory.message.startswith("skipped"), memory.message
    assert any(line.startswith("KV cache     2 × 2 layers × 4 kv heads × 8 head dim") for line in memory.details)
    weights = tmp_path / "model" / "model.safetensors"
    state = load_file(weights)
    save_file({k: v for k, v in state.items() if not k.startswith("transformer.h.")}, weights,
              metadata={"format": "pt"})
    results = {r.name: r for r in run_doctor(load_doctor_config(None, overrides))}
    assert results["model"].status == FAIL and "transformer.h.0." in results["model"].message


@pytest.mark.slow  # two trainer steps and an export
def test_ppo_with_a_critic_trains_and_exports_on_the_transformers_path(tmp_path):
    """A GAE run on a transformers-path model (GPT-2) used to stop at build: the critic wrapped the backbone as
    our ValueModel, which reads `backbone.model` (AttributeError). Its critic now trains, resumes from the run's
    checkpoint, and exports as transformers' own GPT2ForSequenceClassification with the same values."""
    from phaserl.checkpoint import export_checkpoint
    from phaserl.config import load_config
    from phaserl.models.hf_fallback import HFValueModel
    from phaserl.trainer import RLTrainer

    cfg = load_config(None, _gpt2_run(tmp_path) + [
        "algorithm.adv_estimator=gae", "critic.enable=true", "critic.optim.lr=1e-2", "rollout.max_new_tokens=4",
        "trainer.total_steps=2", "trainer.save_interval=2", "trainer.loggers=[]"])
    trainer = RLTrainer.from_config(cfg)
    critic = trainer.critic.model
    assert isinstance(critic, HFValueModel) and not hasattr(critic.hf_model, "lm_head")  # no vocabulary head kept
    assert critic.score.weight.abs().sum() == 0  # zero-initialised: the first values are 0
    with torch.no_grad():
        critic.score.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))  # as if trained: values
    start = critic.score.weight.detach().clone()  # far from the (all-zero) returns, so the update moves them
    trainer.fit()
    assert trainer.metrics["critic/vf_loss"] > 0 and not torch.equal(critic.score.weight.detach(), start)
    ids = torch.tensor([[3, 9, 4, 12, 7]])
    with torch.no_grad():
        want = critic.eval()(ids)
    out = export_checkpoint(str(tmp_path / "c"), str(tmp_path / "critic"), critic=True)
    back = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert type(back).__name__ == "GPT2ForSequenceClassification" and back.config.num_labels == 1
    assert back.score.weight.shape == (1, 32)
    with torch.no_grad():
        hidden = back.transformer(input_ids=ids).last_hidden_state
        torch.testing.assert_close(back.score(hidden).squeeze(-1), want, atol=1e-5, rtol=1e-5)


def test_lora_all_linear_reaches_a_transformers_models_own_layers():
    """all-linear on the transformers path used to pass our decoder's projection names to peft, which GPT-2
    (Conv1D c_attn / c_proj / c_fc) does not have: peft raised NoMatchingPeftModuleError. peft's own all-linear
    rule now picks the layers; names that match nothing are a ConfigError listing the model's layer names."""
    pytest.importorskip("peft")
    from phaserl.models.lora import LoRASettings, apply_lora, resolve_targets

    config = transformers.GPT2Config(vocab_size=40, n_embd=32, n_layer=1, n_head=4, n_positions=64)
    model = HFCausalLM(transformers.GPT2LMHeadModel(config))
    names = apply_lora(model, LoRASettings(rank=2, alpha=4.0, target_modules=resolve_targets(["all-linear"])))
    assert {n.rsplit(".", 1)[-1] for n in names} == {"c_attn", "c_proj", "c_fc"}
    assert not any("lm_head" in n for n in names)
    other = HFCausalLM(transformers.GPT2LMHeadModel(config))
    with pytest.raises(ConfigError, match="c_attn"):
        apply_lora(other, LoRASettings(rank=2, alpha=4.0, target_modules=resolve_targets(["q", "v"])))
