"""A complete tiny RL setup on disk for trainer tests: tokenizer + random model + prompt files.

`make_run_dir(tmp)` writes an HF-format model directory (our decoder, random weights, with the
char-level tokenizer of `_tiny_tokenizer`) and train/val JSONL files in verl's schema whose
ground truth is a single digit, and returns the config overrides that point a run at them.
"""
import os
import random

import torch

from _tiny_tokenizer import build_tiny_tokenizer
from phaserl.data import write_records
from phaserl.models import CausalLM, DecoderConfig, save_pretrained


def make_model_dir(root: str, *, seed: int = 0, model_type: str = "qwen2", name: str = "model", **arch) -> str:
    """arch: further DecoderConfig fields (a MoE model's experts)."""
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(seed)
    cfg = DecoderConfig(model_type=model_type, vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, tie_word_embeddings=True, attention_bias=model_type == "qwen2",
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **arch)
    path = os.path.join(root, name)
    save_pretrained(CausalLM(cfg), path, tokenizer=tokenizer)
    return path


def make_prompt_files(root: str, *, n_train: int = 64, n_val: int = 8, seed: int = 0) -> tuple:
    rng = random.Random(seed)
    files = []
    for split, n in (("train", n_train), ("val", n_val)):
        records = []
        for i in range(n):
            a, b = rng.randint(0, 4), rng.randint(0, 4)
            records.append({"prompt": [{"role": "user", "content": f"{a}+{b}"}], "data_source": "digits",
                            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                            "extra_info": {"split": split, "index": i}})
        path = os.path.join(root, f"{split}.jsonl")
        write_records(path, records)
        files.append(path)
    return tuple(files)


def make_run_dir(root: str, **kwargs) -> list:
    """Config overrides for a few-second CPU run on the tiny random setup."""
    model = make_model_dir(root)
    train, val = make_prompt_files(root)
    return [f"model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
            "data.max_prompt_length=32", "rollout.max_new_tokens=4", "rollout.prompts_per_step=4", "rollout.n=2",
            "rollout.batch_size=4", "trainer.total_steps=2", "trainer.device=cpu",
            f"trainer.log_dir={os.path.join(root, 'logs')}", f"trainer.checkpoint_path={os.path.join(root, 'ckpt')}",
            "ppo.micro_batch_tokens=64", "ppo.forward_micro_batch_tokens=128", "actor.optim.lr=1e-3"]
