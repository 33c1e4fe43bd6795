"""A character-level Hugging Face tokenizer built in memory, for CPU tests (no download, no files).

One token per printable ASCII character (and newline), plus ChatML-style special tokens:
`<|endoftext|>` (pad, id 0), `<|im_end|>` (eos, id 1), `<|im_start|>` (id 2), `<unk>` (id 3).
Token counts are therefore easy to compute by hand: len(text) for plain ASCII text.
"""
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_end|>", "<|im_start|>", "<unk>"]
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_tokenizer(chat_template: str | None = CHATML_TEMPLATE) -> PreTrainedTokenizerFast:
    """A char-level PreTrainedTokenizerFast; `chat_template=None` gives one without a template."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARS)}
    # BPE with no merges splits every word into single characters: a char-level model.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", unk_token="<unk>")
    tokenizer.chat_template = chat_template
    return tokenizer
