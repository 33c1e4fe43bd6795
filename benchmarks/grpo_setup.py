"""The synthetic world of `benchmarks/grpo_step.py`: tokenizer, random model, prompt files, rule reward.

Everything is made locally (no hub): a word-level tokenizer with the Qwen2 vocabulary size, whose
tokens are `t2 ... t151935` plus `<pad>` (id 0) and `<eos>` (id 1), so a prompt of 128 space-separated
words is exactly 128 tokens; a random-weight Qwen2 decoder saved in Hugging Face format with that
tokenizer (phaserl and transformers both load the same directory); prompt files in phaserl's (verl's)
schema; and one cheap rule reward used by both trainers. This module does not train or measure.
"""
from __future__ import annotations

import os
import random

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from qwen2_shapes import SHAPES, decoder_config  # re-exported: grpo_step.py reads grpo_setup.SHAPES

PAD, EOS = "<pad>", "<eos>"


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: ids 0/1 are pad/eos, id i >= 2 is the word `t{i}`; decoding joins with spaces."""
    vocab = {PAD: 0, EOS: 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    backend.add_special_tokens([PAD, EOS])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=PAD)


def write_model(out_dir: str, shape: str, *, seed: int = 0, device: str = "cpu") -> tuple[str, str]:
    """A random-weight Qwen2 model (bf16, tied embeddings) and its tokenizer, in Hugging Face format.

    Returns (model_dir, tokenizer_dir). The tokenizer has a directory of its own for TRL's sake: next to a
    config.json that says `qwen2`, transformers 5's AutoTokenizer would rebuild Qwen2's byte-level pipeline
    around our vocabulary (phaserl's load_tokenizer would not).
    """
    from phaserl.models import CausalLM, save_pretrained

    tokenizer = build_tokenizer(SHAPES[shape]["vocab_size"])
    cfg = decoder_config(shape, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    with torch.device(device):
        model = CausalLM(cfg)
    model_dir, tokenizer_dir = os.path.join(out_dir, "model"), os.path.join(out_dir, "tokenizer")
    save_pretrained(model, model_dir, dtype=torch.bfloat16)
    tokenizer.save_pretrained(tokenizer_dir)
    return model_dir, tokenizer_dir


def prompt_texts(count: int, length: int, vocab_size: int, *, seed: int = 0) -> list[str]:
    """`count` prompts of exactly `length` tokens each (random words, never pad or eos)."""
    rng = random.Random(seed)
    return [" ".join(f"t{rng.randrange(2, vocab_size)}" for _ in range(length)) for _ in range(count)]


def write_prompt_file(out_dir: str, texts: list[str]) -> str:
    """The prompts as a phaserl (verl-schema) parquet file."""
    from phaserl.data import write_records

    records = [{"prompt": text, "data_source": "synthetic", "reward_model": {"style": "rule", "ground_truth": ""},
                "extra_info": {"index": i}} for i, text in enumerate(texts)]
    path = os.path.join(out_dir, "train.parquet")
    write_records(path, records)
    return path


def sevens(prompt, response, ground_truth, **row) -> float:
    """Rule reward (phaserl signature): the share of the response's characters that are the digit 7."""
    return response.count("7") / max(len(response), 1)


def trl_sevens(prompts, completions, **kwargs) -> list[float]:
    """The same reward in TRL's reward-function signature."""
    return [sevens(p, c, None) for p, c in zip(prompts, completions)]
