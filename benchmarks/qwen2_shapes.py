"""The model shapes every benchmark uses: the Qwen2 family's published architectures (random weights).

`decoder_config(shape)` is phaserl's DecoderConfig for one of them; "tiny" is a CPU-sized stand-in
that `--smoke` / `--tiny` runs use to check a script without a GPU. Nothing here loads or measures.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from phaserl.models import DecoderConfig  # noqa: E402

SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=4096, tie_word_embeddings=True),
}


def decoder_config(shape: str, **extra) -> DecoderConfig:
    """Qwen2 (qkv bias, RoPE theta 1e6, 32k positions) at `shape`; `extra` sets other fields (eos/pad ids)."""
    return DecoderConfig(model_type="qwen2", attention_bias=True, max_position_embeddings=32768, rope_theta=1e6,
                         rms_norm_eps=1e-6, **SHAPES[shape], **extra)
