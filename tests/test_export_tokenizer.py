"""Export and tokenizers: loading an export with `AutoTokenizer.from_pretrained` must give the
token ids training used, or `phaserl export` names the call that does. transformers 5 loads a qwen2 export's
tokenizer as Qwen2Tokenizer, rebuilt with Qwen's own pre-tokenizer (digits split one by one), so a byte-level
BPE tokenizer of another kind (GPT-2 style: " 84" is one token) tokenizes differently; under a llama config
the same files load as they are."""
import logging
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from phaserl.checkpoint import Checkpointer, TrainingState, export_checkpoint
from phaserl.checkpoint.tokenizer_check import probe_texts
from phaserl.models import CausalLM, DecoderConfig
from phaserl.roles.optim import Optimizer, OptimSettings


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE tokenizer trained in memory on arithmetic questions (no download)."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator([f"what is {a} plus {b}? {a + b}" for a in range(100) for b in range(0, 100, 7)], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tokenizer


def _checkpoint(root, model_type: str, tokenizer) -> str:
    torch.manual_seed(0)
    cfg = DecoderConfig(model_type=model_type, vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                        tie_word_embeddings=True, attention_bias=model_type == "qwen2",
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = CausalLM(cfg)
    role = SimpleNamespace(model=model, optimizer=Optimizer(model.parameters(), OptimSettings(lr=1e-2)))
    ckpt = Checkpointer(root=str(root / "ckpt"), keep=1, resume_mode="auto", export_hf=False)
    return ckpt.save(TrainingState(step=1, roles={"actor": role}, tokenizer=tokenizer))


def _ids(tokenizer, texts):
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_the_export_loads_to_the_training_ids_or_export_names_the_call_that_does(tmp_path, caplog, model_type):
    tokenizer = byte_level_bpe()
    texts = probe_texts(tokenizer) + ["what is 12 plus 84? 96", " 84"]
    with caplog.at_level(logging.WARNING, logger="phaserl"):
        out = str(export_checkpoint(_checkpoint(tmp_path, model_type, tokenizer), str(tmp_path / "hf")))
    auto = AutoTokenizer.from_pretrained(out)
    warned = [r.getMessage() for r in caplog.records if "tokenizes differently" in r.getMessage()]
    if _ids(auto, texts) == _ids(tokenizer, texts):
        assert not warned                       # llama: AutoTokenizer reads tokenizer.json as it is
    else:
        # qwen2 on transformers 5: the export says so, and the call it names gives the training ids
        (message,) = warned
        assert f"transformers.PreTrainedTokenizerFast.from_pretrained({out!r})" in message
        assert "' 84'" in message or "what is 12 plus 84" in message
        assert _ids(PreTrainedTokenizerFast.from_pretrained(out), texts) == _ids(tokenizer, texts)
    if model_type == "llama":
        assert _ids(auto, texts) == _ids(tokenizer, texts)
    if model_type == "qwen2" and type(auto).__name__ == "Qwen2Tokenizer":
        assert warned  # the reported problem (transformers 5.24 here): Qwen's pre-tokenizer splits " 84"
