"""Models: our decoder (Llama, Qwen2/3, Qwen3.5, Mistral, Ministral, Gemma 3, OLMo 2, Phi-3), its value-head variant,
and Hugging Face directory I/O.

    config.py       DecoderConfig: shapes and the fields in which the families differ
    families.py     each model_type's config.json <-> DecoderConfig, checkpoint tensor layout
    layers.py       the layer pieces, once for training and rollout (norms, projections, RoPE, gated MLP)
    hybrid.py       Qwen3.5's layers: Gated DeltaNet or gated partial-RoPE attention, then the MLP
    linear_attention.py  Gated DeltaNet: chunked (training) and recurrent (engine) rule, packed-aware
    attention.py    attention cores: dense masks (causal, padding, sliding window) and varlen for packing
    rope.py         rotary embeddings (default, linear, dynamic, llama3, yarn)
    decoder.py      CausalLM, KVCache (forward returns hidden states; callers project to the vocabulary)
    value.py        ValueModel (scalar head, HF *ForSequenceClassification names)
    hf_io.py        load_pretrained / save_pretrained / load_tokenizer / save_value_model / load_value_model
    hf_fallback.py  HFCausalLM: any other transformers architecture behind the same interface (slow, exact);
                    HFValueModel, its critic; value_model_of picks the critic for a backbone
"""
from phaserl.models.config import DecoderConfig
from phaserl.models.decoder import CausalLM, KVCache
from phaserl.models.hf_fallback import value_model_of
from phaserl.models.hf_io import load_pretrained, load_tokenizer, load_value_model, save_pretrained, save_value_model
from phaserl.models.value import ValueModel

__all__ = ["DecoderConfig", "CausalLM", "KVCache", "ValueModel", "load_pretrained", "save_pretrained",
           "load_tokenizer", "save_value_model", "load_value_model", "value_model_of"]
