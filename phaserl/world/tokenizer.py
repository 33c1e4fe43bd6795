"""The tiny world's tokenizer: one token per character, plus a handful of special tokens.

Built with the `tokenizers` library (a WordLevel model over single characters) and wrapped as a
`transformers` fast tokenizer, so it saves to and loads from a plain directory with
`AutoTokenizer.from_pretrained(dir)` like any Hugging Face tokenizer. Its chat template renders

    [{"role": "user", "content": "23+45="}]  ->  "<|user|>23+45=<|assistant|>"   (add_generation_prompt=True)

and an assistant turn as `<|assistant|>68<|endoftext|>`, so a trained model answers with the
digits and then EOS. Characters outside the vocabulary become `<|unk|>`.
This module does not know the task; `task.py` does.
"""
from __future__ import annotations

import json
import os
import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<|pad|>", "<|endoftext|>", "<|unk|>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [PAD, EOS, UNK, SYSTEM, USER, ASSISTANT]  # ids 0..5, in this order
# Digits and arithmetic first (the task uses only these), then room for worded questions.
CHARACTERS = list("0123456789+-=*/()., ?") + list(string.ascii_lowercase)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}" + SYSTEM + "{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}" + USER + "{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}" + ASSISTANT + "{{ message['content'] }}" + EOS +
    "{%- else -%}{{ raise_exception('tiny-world chat template: unknown role ' ~ message['role']"
    " ~ '; use system, user or assistant') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + ASSISTANT + "{%- endif -%}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh character-level tokenizer with the chat template set; the same vocabulary every call."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own word; special tokens are matched before this split runs.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()  # join characters back without inserted spaces
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK,
        model_max_length=256, padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tokenizer(out_dir: str) -> PreTrainedTokenizerFast:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into `out_dir`.

    The config names the class `PreTrainedTokenizerFast` (not transformers 5's `TokenizersBackend`)
    so that transformers 4.x loads the directory as well.
    """
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out_dir)
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    return tokenizer
