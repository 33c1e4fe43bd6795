"""docs/models.md's coverage table is true: every row's architecture, built tiny and random with transformers,
runs one `phaserl train` step, and the path it took (native decoder, builtin engine, packing, or the
transformers path only) is what the table says."""
import json
import math
import os
import re

import pytest
import torch
import transformers

from _tiny_run import make_prompt_files
from _tiny_tokenizer import build_tiny_tokenizer
from phaserl.config import load_config
from phaserl.models import CausalLM
from phaserl.roles.forward import supports_packing
from phaserl.trainer import RLTrainer

pytestmark = pytest.mark.slow  # one train step per architecture: ~50 s on 2 cores

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "models.md")
TWO = ["sliding_attention", "full_attention"]


def table_rows() -> list[dict]:
    rows = []
    for line in open(DOC, encoding="utf-8"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[1] and re.fullmatch(r"[a-z0-9_]+", cells[1]) and cells[1] != "model_type":
            rows.append({"model_type": cells[1], **{k: v == "✓" for k, v in zip(
                ("native", "engine", "packing", "fallback_only"), cells[2:])}})
    return rows


def tiny_config(model_type: str, vocab: int, eos: int, pad: int):
    """A tiny transformers config of `model_type` with its distinguishing features on."""
    T = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    builders = {
        "llama": ("LlamaConfig", T),
        "qwen2": ("Qwen2Config", T),
        "qwen3": ("Qwen3Config", dict(T, head_dim=8)),
        "mistral": ("MistralConfig", dict(T, sliding_window=8)),
        "ministral": ("MinistralConfig", dict(T, head_dim=8, sliding_window=8, layer_types=TWO)),
        "gemma3_text": ("Gemma3TextConfig", dict(T, head_dim=8, sliding_window=8, layer_types=TWO)),
        "olmo2": ("Olmo2Config", T),
        "gemma2": ("Gemma2Config", dict(T, head_dim=8, sliding_window=8, final_logit_softcapping=30.0)),
        # with E2B/E4B's per-layer inputs and key/value sharing (layers 2 and 3 read layers 0 and 1)
        "gemma4_text": ("Gemma4TextConfig", dict(T, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
                                                 attention_k_eq_v=True, sliding_window=8, final_logit_softcapping=30.0,
                                                 num_hidden_layers=4, layer_types=TWO * 2, num_kv_shared_layers=2,
                                                 hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab)),
        "phi3": ("Phi3Config", dict(T, sliding_window=8)),
        "qwen3_moe": ("Qwen3MoeConfig", dict(T, head_dim=8, moe_intermediate_size=16, num_experts=4,
                                             num_experts_per_tok=2)),
        "qwen2_moe": ("Qwen2MoeConfig", dict(T, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                             num_experts=4, num_experts_per_tok=2)),
        "qwen3_5_text": ("Qwen3_5TextConfig", dict(T, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2,
                                                   linear_key_head_dim=8, linear_value_head_dim=8,
                                                   layer_types=["linear_attention", "full_attention"])),
        "gpt2": ("GPT2Config", dict(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                    eos_token_id=eos, pad_token_id=pad, bos_token_id=None)),
    }
    # the multimodal directory, read as its text model
    builders["gemma4"] = ("Gemma4Config", dict(vision_config=None, audio_config=None,
                                               text_config=builders["gemma4_text"][1]))
    # vision-language: text rows here (images: tests/test_trainer_vision.py); the vision markers sit past the
    # tokenizer's ids, so prompts never hold them
    text = dict(T, vocab_size=vocab + 4, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2],
                                                            "rope_theta": 10000.0})
    vision = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=32)
    markers = dict(image_token_id=vocab, video_token_id=vocab + 1, vision_start_token_id=vocab + 2,
                   vision_end_token_id=vocab + 3)
    builders["qwen2_5_vl"] = ("Qwen2_5_VLConfig", dict(text_config=text, vision_config=dict(
        vision, window_size=16, fullatt_block_indexes=[0]), **markers))
    builders["qwen3_vl"] = ("Qwen3VLConfig", dict(text_config=dict(text, head_dim=8, rope_parameters=dict(
        text["rope_parameters"], mrope_interleaved=True)), vision_config=dict(
        vision, num_position_embeddings=16, deepstack_visual_indexes=[0]), **markers))
    assert model_type in builders, f"docs/models.md lists {model_type}, which this test cannot build: add it here"
    class_name, kwargs = builders[model_type]
    cls = getattr(transformers, class_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    return cls(**kwargs)


def test_the_table_lists_every_native_family():
    from phaserl.models.families import NATIVE_MODEL_TYPES

    native = {r["model_type"] for r in table_rows() if r["native"]}
    composites = {"gemma4", "qwen2_5_vl", "qwen3_vl"}  # read natively around a native family's text model
    assert native - composites == set(NATIVE_MODEL_TYPES)


@pytest.mark.parametrize("row", table_rows(), ids=[r["model_type"] for r in table_rows()])
def test_each_architecture_trains_one_step_on_the_path_the_table_names(tmp_path, row):
    tokenizer = build_tiny_tokenizer()
    hf_config = tiny_config(row["model_type"], len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    vision = "vision_config" in hf_config
    auto = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
    auto.from_config(hf_config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    train, val = make_prompt_files(str(tmp_path), n_train=8, n_val=2)
    cfg = load_config(None, [
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        "data.max_prompt_length=32", "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.n=2",
        "rollout.batch_size=2", "trainer.total_steps=1", "trainer.device=cpu", "trainer.loggers=[jsonl]",
        f"trainer.log_dir={tmp_path / 'logs'}", f"trainer.checkpoint_path={tmp_path / 'ckpt'}",
        "ppo.micro_batch_tokens=64", "ppo.forward_micro_batch_tokens=128", "ppo.packing=true"])
    trainer = RLTrainer.from_config(cfg)
    trainer.fit()
    lines = [json.loads(line) for line in open(tmp_path / "logs" / "metrics.jsonl")]
    assert lines[-1]["step"] == 1 and math.isfinite(lines[-1]["actor/grad_norm"])
    model = trainer.actor.model
    observed = {"native": isinstance(model, CausalLM), "engine": trainer.actor.engine is not None,
                "packing": supports_packing(model), "fallback_only": not isinstance(model, CausalLM)}
    assert observed == {k: row[k] for k in observed}, f"docs/models.md's row for {row['model_type']} is wrong"
