"""The multimodal Gemma 4 directory (`gemma4`, Gemma4ForConditionalGeneration) on the native decoder as its text
model: the logits equal transformers' composite on text, the towers are skipped with one log line, the engine samples
it, export writes the composite again (the trained text, the source's towers unchanged) that transformers loads with
our logits (from a model, from a GRPO run's checkpoint, and a LoRA run's PEFT adapter), and the mixture-of-experts
text model stays refused natively (transformers runs it under implementation=auto)."""
import json
import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file

from _hf_pairs import left_padded_batch, randomize
from phaserl.errors import ConfigError
from phaserl.models import CausalLM, load_pretrained, save_pretrained
from phaserl.models.gemma4_composite import TOWERS_NOT_LOADED
from phaserl.models.hf_fallback import HFCausalLM
from test_gemma4_per_layer import tiny_config

torch.set_num_threads(1)


def composite_config(**overrides) -> transformers.Gemma4Config:
    """The tiny per-layer-input / shared-KV text model with a vision and an audio tower of one layer each."""
    vision = transformers.Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    audio = transformers.Gemma4AudioConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    text = overrides.pop("text", {})
    return transformers.Gemma4Config(text_config=tiny_config(**text).to_dict(), vision_config=vision.to_dict(),
                                     audio_config=audio.to_dict(), **overrides)


def save_composite(directory, **overrides) -> transformers.Gemma4ForConditionalGeneration:
    torch.manual_seed(0)
    composite = randomize(transformers.Gemma4ForConditionalGeneration(composite_config(**overrides)))
    composite.save_pretrained(directory)
    return composite


def hf_logits(model, batch) -> torch.Tensor:
    ids, mask, positions = batch
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[mask.bool()]


def our_logits(model, batch) -> torch.Tensor:
    ids, mask, positions = batch
    with torch.no_grad():
        return model.logits(model(ids, attention_mask=mask, position_ids=positions))[mask.bool()]


# The composite's tie_word_embeddings decides the head, whatever text_config says (transformers ties the composite's
# lm_head by the outer flag); absent, it is true.
@pytest.mark.parametrize("tie", [None, False])
def test_the_composite_loads_natively_with_its_logits_on_text(tmp_path, caplog, tie):
    overrides = {"text": {"tie_word_embeddings": True}} if tie is None else {"tie_word_embeddings": tie}
    composite = save_composite(tmp_path / "composite", **overrides)
    with caplog.at_level(logging.INFO, logger="phaserl"):
        ours = load_pretrained(tmp_path / "composite")  # implementation=auto: native
    assert isinstance(ours, CausalLM) and ours.config.tie_word_embeddings is (tie is None)
    assert sum(TOWERS_NOT_LOADED in r.getMessage() for r in caplog.records) == 1
    assert not any("tower" in name or "embed_vision" in name for name in ours.state_dict())
    batch = left_padded_batch(96)
    torch.testing.assert_close(our_logits(ours, batch), hf_logits(composite, batch), atol=1e-5, rtol=1e-5)
    again = load_pretrained(tmp_path / "composite", implementation="native")
    torch.testing.assert_close(our_logits(again, batch), our_logits(ours, batch), atol=0, rtol=0)


@pytest.mark.parametrize("tie", [True, False])
def test_export_writes_the_composite_with_the_trained_text_and_the_source_towers(tmp_path, tie):
    save_composite(tmp_path / "composite", text={"use_bidirectional_attention": "vision"},  # images: both ways
                   tie_word_embeddings=tie)
    ours = load_pretrained(tmp_path / "composite")
    with torch.no_grad():  # "training": every text weight moves
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = save_pretrained(ours, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma4" and config["vision_config"] and config["audio_config"]
    assert config["text_config"]["use_bidirectional_attention"] == "vision"  # the multimodal model's, kept
    source, written = load_file(tmp_path / "composite" / "model.safetensors"), load_file(out / "model.safetensors")
    assert ("lm_head.weight" in written) is (not tie) and config["tie_word_embeddings"] is tie
    towers = [n for n in source if not n.startswith("model.language_model.") and n != "lm_head.weight"]
    assert towers and all(torch.equal(written[n], source[n]) for n in towers)
    reloaded, info = transformers.Gemma4ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    batch = left_padded_batch(96)
    torch.testing.assert_close(hf_logits(reloaded.eval(), batch), our_logits(ours, batch), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(our_logits(load_pretrained(out), batch), our_logits(ours, batch), atol=0, rtol=0)


def test_export_names_the_source_directory_when_it_is_gone(tmp_path):
    save_composite(tmp_path / "composite")
    ours = load_pretrained(tmp_path / "composite")
    (tmp_path / "composite").rename(tmp_path / "moved")
    with pytest.raises(ConfigError, match=r"composite: the multimodal Gemma 4 directory .* is gone"):
        save_pretrained(ours, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_the_mixture_of_experts_text_model_stays_refused_natively(tmp_path):
    config = composite_config(text={"enable_moe_block": True, "num_experts": 2, "top_k_experts": 1,
                                    "moe_intermediate_size": 16})
    transformers.Gemma4ForConditionalGeneration(config).save_pretrained(tmp_path / "moe")
    with pytest.raises(ConfigError, match=r"\(text_config\): enable_moe_block=true .* model.implementation="
                                          r"transformers"):
        load_pretrained(tmp_path / "moe", implementation="native")
    assert isinstance(load_pretrained(tmp_path / "moe"), HFCausalLM)  # auto: transformers runs the composite


@pytest.mark.slow  # one short GRPO run
def test_a_grpo_run_on_the_composite_exports_the_composite_with_the_trained_text(tmp_path):
    from _tiny_run import make_prompt_files
    from _tiny_tokenizer import build_tiny_tokenizer
    from phaserl.checkpoint.export import export_checkpoint
    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer
    from test_family_resume import REWARD
    from test_model_coverage import tiny_config as family_config

    tokenizer = build_tiny_tokenizer()
    text = family_config("gemma4_text", len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    config = composite_config()
    config.text_config = text
    torch.manual_seed(0)
    transformers.Gemma4ForConditionalGeneration(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    train, val = make_prompt_files(str(tmp_path), n_train=4, n_val=2)
    trainer = RLTrainer.from_config(load_config(None, [
        f"model.path={tmp_path / 'model'}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        "data.max_prompt_length=32", "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.n=2",
        "rollout.batch_size=2", "trainer.total_steps=1", "trainer.device=cpu", "trainer.loggers=[]",
        "trainer.save_interval=1", "trainer.export_hf=true", "actor.optim.lr=1e-2",
        f"reward.functions=[{{name: {REWARD}:compute_score}}]", f"trainer.log_dir={tmp_path / 'logs'}",
        f"trainer.checkpoint_path={tmp_path / 'ckpt'}", "ppo.micro_batch_tokens=128"]))
    assert isinstance(trainer.actor.model, CausalLM)  # the native decoder and engine
    trainer.fit()
    exported = export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "export"))
    ids = torch.tensor([[3, 7, 1, 12, 5, 9, 4, 2]])
    with torch.no_grad():
        want = trainer.actor.model.logits(trainer.actor.model(ids))
    source = load_file(tmp_path / "model" / "model.safetensors")
    for out in (exported, tmp_path / "ckpt" / "step_1" / "hf"):  # `phaserl export` and trainer.export_hf
        hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(out).eval()
        with torch.no_grad():
            torch.testing.assert_close(hf(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
        written = load_file(out / "model.safetensors")
        assert all(torch.equal(written[n], t) for n, t in source.items() if not n.startswith("model.language_"))
        assert not torch.equal(written["model.language_model.embed_tokens.weight"],
                               source["model.language_model.embed_tokens.weight"])  # trained


def test_a_peft_adapter_of_the_text_model_loads_onto_the_composite_with_our_logits(tmp_path):
    peft = pytest.importorskip("peft")
    from phaserl.checkpoint.lora_export import write_peft_adapter
    from phaserl.models.lora import LoRASettings, apply_lora, resolve_targets

    composite = save_composite(tmp_path / "composite")
    ours = load_pretrained(tmp_path / "composite")
    apply_lora(ours, LoRASettings(rank=2, alpha=4.0, target_modules=resolve_targets(["q", "v", "o", "up"])))
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0.0, 0.3)
    ours.eval()
    out = write_peft_adapter(ours, str(tmp_path / "adapter"), str(tmp_path / "composite"))
    base = transformers.Gemma4ForConditionalGeneration.from_pretrained(tmp_path / "composite")
    adapted = peft.PeftModel.from_pretrained(base, str(out)).eval()
    assert not any("tower" in n and "lora_" in n for n, _ in adapted.named_parameters())  # text model only
    batch = left_padded_batch(96)
    want = our_logits(ours, batch)
    assert (want - hf_logits(composite, batch)).abs().max() > 1e-2  # the adapters matter
    torch.testing.assert_close(hf_logits(adapted, batch), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_engine_samples_the_composite_as_its_text_model(tmp_path, device):
    # On CUDA the engine decodes with CUDA graphs and the Triton kernels: greedy tokens equal a full forward's.
    from _hf_pairs import PROMPTS, greedy_reference
    from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams

    composite = save_composite(tmp_path / "composite").to(device)
    ours = load_pretrained(tmp_path / "composite", device=device).eval()
    batch = tuple(t.to(device) for t in left_padded_batch(96))
    torch.testing.assert_close(our_logits(ours, batch), hf_logits(composite, batch), atol=1e-4, rtol=1e-4)
    engine = RolloutEngine(ours, EngineConfig(max_slots=4))
    result = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0), eos_token_ids=[],
                             pad_token_id=0)
    assert result.response_ids == [greedy_reference(ours, p, 6) for p in PROMPTS]
