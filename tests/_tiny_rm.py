"""A tiny reward model on disk for CPU tests: transformers' LlamaForSequenceClassification (num_labels=1)
saved with the char-level tokenizer of `_tiny_tokenizer`, optionally broken the way classic mistake 2 breaks it."""
import os

import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from _tiny_tokenizer import CHATML_TEMPLATE, build_tiny_tokenizer


def make_reward_model_dir(root: str, *, name: str = "rm", head: str = "random", vocab_size: int | None = None,
                          chat_template: str | None = CHATML_TEMPLATE, seed: int = 0) -> str:
    """head: 'random' (scores spread out), 'zero' (every score 0: constant) or 'nan' (every score NaN);
    vocab_size smaller than the tokenizer's 100 tokens gives an RM that does not match its tokenizer."""
    tokenizer = build_tiny_tokenizer(chat_template)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size or len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=256, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        if head == "random":
            model.score.weight.mul_(50.0)  # random init gives scores ~1e-3 apart; spread them
        else:
            model.score.weight.fill_(0.0 if head == "zero" else float("nan"))
    path = os.path.join(root, name)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
