"""Regression (thirteenth session): under dynamic=True, dynamo made a layer's `spec.eps` a symbolic float; rms_norm
needs a concrete eps, so every compile of a decoder block restarted its analysis after AOTAutograd had traced the
joint graph once for nothing (4 of 11 AOT compiles thrown away in the warm-start smoke, each missing the cache on
every run). compile_cache.specialized_floats compiles with floats as constants; dynamo guards on their values, so
models with other eps values share the compiled block and stay exact. aot_eager traces forward and backward like
inductor does, without code generation (CPU)."""
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from phaserl.models import CausalLM, DecoderConfig, decoder


def _model(eps: float, seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    cfg = DecoderConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, attention_bias=True,
                        rms_norm_eps=eps)
    return CausalLM(cfg)


def _loss_and_grads(model: CausalLM, ids: torch.Tensor):
    model.zero_grad()
    loss = model(ids).float().pow(2).mean()
    loss.backward()
    return loss.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    decoder._COMPILED_BLOCKS.pop("aot_eager", None)
    counters.clear()
    yield
    decoder._COMPILED_BLOCKS.pop("aot_eager", None)
    torch._dynamo.reset()


def test_a_compiled_decoder_block_is_traced_once_per_graph_not_restarted(fresh_dynamo):
    model = _model(1e-6)
    decoder.enable_compile(model, backend="aot_eager")
    ids = torch.randint(0, 64, (2, 8))
    _loss_and_grads(model, ids)
    aot = counters["aot_autograd"]
    # the block is two graphs around the eager attention; each went through AOTAutograd exactly once
    assert aot["total"] == aot["ok"] == 2
    assert torch._dynamo.config.specialize_float is False  # set only while compiling, torch's default otherwise
    _loss_and_grads(model, ids)
    with torch.no_grad():
        model(ids)  # another grad mode: its own graphs, again without a restart
    assert counters["aot_autograd"]["total"] == counters["aot_autograd"]["ok"]


def test_models_with_other_eps_share_the_compiled_block_and_stay_exact(fresh_dynamo):
    ids = torch.randint(0, 64, (2, 8))
    for eps in (1e-6, 1e-2):  # the second recompiles on the guard on eps's value, never reuses the first's constant
        eager = _model(eps, seed=1)
        compiled = _model(eps, seed=1)
        decoder.enable_compile(compiled, backend="aot_eager")
        want_loss, want = _loss_and_grads(eager, ids)
        loss, grads = _loss_and_grads(compiled, ids)
        assert torch.allclose(loss, want_loss, rtol=1e-6, atol=0), eps
        assert [g is None for g in grads] == [w is None for w in want] and any(w is not None for w in want)
        for g, w in zip(grads, want):
            if w is not None:
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
