"""Regression (2026-12-04): under dynamic=True, dynamo made a layer's `spec.eps` a symbolic float; rms_norm
needs a concrete eps, so every compile of a decoder block restarted its analysis after AOTAutograd had traced the
joint graph once for nothing (4 of 11 AOT compiles thrown away in the warm-start smoke, each missing the cache on
every run). compile_cache.specialize_floats makes dynamo treat floats as constants wherever phaserl compiles; it
guards on their values, so models with other eps values share the compiled block and stay exact. aot_eager traces
forward and backward like inductor does, without code generation (CPU)."""
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
    with torch._dynamo.config.patch(specialize_float=False):  # torch's default, whatever ran before in the process
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
    assert torch._dynamo.config.specialize_float is True  # for the rest of the process (the fixture restores it)
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


@pytest.mark.slow
def test_the_compiled_engine_layers_compile_once_and_decode_as_the_eager_ones(fresh_dynamo):
    """The engine's compiled layer pieces (layer_fns.compiled_fns, inductor's C++ on the CPU) restarted the same way,
    also on their recompiles (prefill and decode shapes); with floats constant each compile runs once and greedy
    decoding is unchanged."""
    from phaserl.rollout import RolloutEngine
    from phaserl.rollout import layer_fns as runner
    from phaserl.rollout.engine import EngineConfig
    from phaserl.rollout.sampling import SamplingParams

    runner.compiled_fns.cache_clear()  # made anew here, as in a fresh process (an earlier test may have made them)

    model = _model(1e-6).eval()
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    results = []
    for compile in (False, True):
        engine = RolloutEngine(model, EngineConfig(compile=compile, cuda_graphs=False))
        results.append(engine.generate(prompts, params, eos_token_ids=[], pad_token_id=0, ignore_eos=True))
    eager, compiled = results
    assert compiled.response_ids == eager.response_ids
    for a, b in zip(compiled.logprobs, eager.logprobs):
        assert a == pytest.approx(b, abs=1e-5)
    aot = counters["aot_autograd"]
    assert aot["total"] == aot["ok"] > 0  # each compiled piece went through AOTAutograd once: no restarts
