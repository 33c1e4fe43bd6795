"""Does `AutoTokenizer.from_pretrained(export_dir)` give the token ids the run trained on?

transformers 5 picks a tokenizer class from config.json's model_type for some families (qwen2, phi3, …)
whatever tokenizer_config.json names, and rebuilds it from the vocabulary with that family's own
pre-tokenizer: a byte-level BPE tokenizer of another kind then splits " 84" into ' ', '8', '4'. phaserl
cannot change that choice from the files it writes, so `phaserl export` tries the usual call on a few
probe texts and, when the ids differ, names the call that gives the training ids
(`PreTrainedTokenizerFast.from_pretrained(dir)`, which reads tokenizer.json as it is).
Not here: writing the tokenizer files (the tokenizer's own save_pretrained does that).
"""
from __future__ import annotations

import logging
from typing import Optional

log = logging.getLogger("phaserl")

# Digits after spaces, several spaces, tabs and newlines, punctuation and non-ASCII text: where
# pre-tokenizers of different families disagree.
PROBE_TEXTS = ("what is 12 plus 84? 96", " 84", "Hello,  world!\n\tindented line\n\n", "x=1234567;y = -0.5",
               "naïve café — 日本語", "#include <stdio.h>\nint main() { return 0; }")


def _ids(tokenizer, texts: list) -> list:
    return [tokenizer(text, add_special_tokens=special)["input_ids"] for text in texts for special in (False, True)]


def probe_texts(tokenizer) -> list:
    """The probe texts, plus one chat-templated prompt when the tokenizer has a template."""
    texts = list(PROBE_TEXTS)
    if getattr(tokenizer, "chat_template", None):
        texts.append(tokenizer.apply_chat_template([{"role": "user", "content": "what is 12 plus 84?"}],
                                                   add_generation_prompt=True, tokenize=False))
    return texts


def auto_tokenizer_hint(trained, export_dir: str) -> Optional[str]:
    """None when AutoTokenizer loads `export_dir` to `trained`'s ids; else a message with the call that does."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    texts = probe_texts(trained)
    want = _ids(trained, texts)
    auto = AutoTokenizer.from_pretrained(export_dir, local_files_only=True)
    got = _ids(auto, texts)
    if got == want:
        return None
    first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    example = (f"{texts[first // 2]!r} becomes {got[first][:12]} with {type(auto).__name__}, "
               f"{want[first][:12]} in training")
    generic = PreTrainedTokenizerFast.from_pretrained(export_dir, local_files_only=True)
    if _ids(generic, texts) != want:
        return (f"AutoTokenizer.from_pretrained({export_dir!r}) tokenizes differently from training ({example}), "
                "and no generic loading call matches either; load the tokenizer the run was given "
                "(model.tokenizer_path) instead of the exported one")
    return (f"AutoTokenizer.from_pretrained({export_dir!r}) returns {type(auto).__name__}, which tokenizes "
            f"differently from training ({example}): transformers picks that class from config.json's "
            "model_type. Load the exported tokenizer with "
            f"`transformers.PreTrainedTokenizerFast.from_pretrained({export_dir!r})` to get the training ids")
