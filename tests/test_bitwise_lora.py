"""The bitwise numerics mode with LoRA adapters: the engine multiplies each adapted projection's merged weight
W + s·BA (invariant.merged_weight, computed once per call) and the trainer's forward multiplies the same tensor,
computed again from the same parameters, so the log-probs agree bit for bit; A and B still get the default LoRA
forward's gradients. The controls show the comparison can fail: another merge on one side, or the unmerged sum.
"""
import pytest
import torch

from phaserl.config import load_config
from phaserl.errors import ConfigError
from phaserl.models import invariant
from phaserl.models.lora import LoRALinear, LoRASettings, apply_lora
from phaserl.rollout import bitwise
from test_bitwise import _families, _grpo, _model, _trainer_vs_engine


@pytest.fixture(autouse=True)
def default_numerics_after():
    yield
    invariant.enable(False)


def _adapted(family: str, dtype=torch.float32, device="cpu"):
    """A tiny family model with rank-4 adapters on every projection, B random (a zero B would merge to W exactly)."""
    model = _model(_families()[family], dtype=dtype, device=device)
    apply_lora(model, LoRASettings(rank=4, alpha=8.0))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def _lora_layer(dtype=torch.float32) -> LoRALinear:
    torch.manual_seed(0)
    lora = LoRALinear(torch.nn.Linear(48, 40, bias=True), rank=4, alpha=8.0)
    with torch.no_grad():
        lora.lora_B.normal_()
    return lora.to(dtype) if dtype != torch.float32 else lora


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lora_projection_gives_a_row_the_same_bits_whatever_shares_the_call(dtype):
    lora = _lora_layer()
    lora.weight.data, lora.bias.data = lora.weight.data.to(dtype), lora.bias.data.to(dtype)
    x = torch.randn(23, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    whole = invariant.linear(x, lora)
    for idx in ([0], [5], [2, 9], [22, 0, 7], list(range(23))[::-1]):
        assert torch.equal(invariant.linear(x[idx], lora), whole[idx]), idx
    merged = invariant.merged_weight(lora.weight, lora.lora_A, lora.lora_B, lora.scaling)  # [out, in]
    assert merged.dtype == dtype
    assert torch.equal(whole, invariant.linear(x, invariant.Projection(merged, lora.bias)))  # the engine's numbers
    torch.testing.assert_close(whole.float(), lora(x).float(), atol=0.1 if dtype != torch.float32 else 1e-4,
                               rtol=1e-2)


def test_adapter_gradients_are_the_default_lora_forwards():
    lora = _lora_layer()
    x = torch.randn(9, 48, generator=torch.Generator().manual_seed(2), requires_grad=True)
    probe = torch.randn(9, 40, generator=torch.Generator().manual_seed(3))  # a loss linear in the output: the
    grads = []                                                                # same upstream gradient for both
    for forward in (lambda t: invariant.linear(t, lora), lora):
        (forward(x) * probe).sum().backward()
        grads.append((x.grad, lora.lora_A.grad, lora.lora_B.grad))
        x.grad = lora.lora_A.grad = lora.lora_B.grad = None
    assert lora.weight.grad is None
    for mine, default in zip(*grads):
        torch.testing.assert_close(mine, default)
    lora.adapter_enabled = False  # the reference pass: the base projection
    with torch.no_grad():
        assert torch.equal(invariant.linear(x, lora), invariant.linear(x, lora.weight, lora.bias))


@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma3-local-global", "olmo2", "phi3", "gemma4-global-layers"])
def test_trainer_logprobs_equal_the_engines_bit_for_bit_with_lora(family):
    """Padded and packed micro-batches of 1, 3 and all rows, with and without autograd (test_bitwise's comparison)."""
    diffs = _trainer_vs_engine(_adapted(family))
    assert max(diffs) == 0.0, diffs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_base_with_float32_adapters_is_exact_too(dtype):
    """The merge sums in float32 and rounds once to the base's dtype, on both sides alike."""
    assert max(_trainer_vs_engine(_adapted("qwen2", dtype=dtype))) == 0.0


def test_the_engine_refills_its_merged_weights_in_place_and_never_writes_the_base():
    """A second generate (or an in-flight update) writes the new merge into the same tensors (captured graphs keep
    their pointers); the reference's adapters-off layers are the modules themselves."""
    from phaserl.models.lora import adapters_disabled

    model = _adapted("qwen2")
    layer = model.model.layers[0]
    q = layer.self_attn.q_proj
    base = q.weight.detach().clone()
    with torch.inference_mode():
        first = bitwise.engine_weights(layer)
        before = first.q.weight.clone()
        with torch.no_grad():
            q.lora_B.mul_(2.0)
        second = bitwise.engine_weights(layer, first)
    assert isinstance(second.q, invariant.Projection) and second.q.weight.data_ptr() == first.q.weight.data_ptr()
    assert torch.equal(second.q.weight, invariant.merged_weight(q.weight, q.lora_A, q.lora_B, q.scaling))
    assert not torch.equal(second.q.weight, before) and torch.equal(q.weight, base) and second.q.bias is q.bias
    with adapters_disabled(model):
        assert bitwise.engine_weights(layer).q is q


def _default_merge_engine_weights(layer, previous=None):
    """The engine's weights with the default mode's merge (one GEMM, lora.LoRALinear.merged_weight) instead."""
    m = layer.weights()
    return m._replace(**{name: invariant.Projection(module.merged_weight(), module.bias)
                         for name, module in m._asdict().items() if invariant.is_adapter(module)})


def _unmerged(x, lora, bias=None):
    """base(x) + s·B(A(x)) with an invariant matmul each: batch-invariant too, but not the merged weight's sums."""
    low = invariant.linear(x, lora.lora_A.to(x.dtype))
    return invariant.linear(x, lora.weight, lora.bias) + invariant.linear(low, (lora.lora_B * lora.scaling).to(x.dtype))


@pytest.mark.parametrize("control", ["engine merges with the default GEMM", "trainer adds the unmerged adapter"])
def test_without_the_same_merged_weight_on_both_sides_the_log_probs_differ(monkeypatch, control):
    if control.startswith("engine"):
        monkeypatch.setattr(bitwise, "engine_weights", _default_merge_engine_weights)
    else:
        monkeypatch.setattr(invariant, "lora_linear", _unmerged)
    assert max(_trainer_vs_engine(_adapted("qwen2"))) > 0.0


def test_lora_dropout_is_refused_in_bitwise_mode_naming_the_key():
    load_config(None, ["rollout.bitwise=true", "actor.lora.rank=4"])  # LoRA itself runs
    for role in ("actor", "critic"):
        with pytest.raises(ConfigError, match=rf"{role}\.lora\.dropout = 0"):
            load_config(None, ["rollout.bitwise=true", f"{role}.lora.rank=4", f"{role}.lora.dropout=0.1"])
    lora = LoRALinear(torch.nn.Linear(8, 8), rank=2, alpha=4.0, dropout=0.1)
    with pytest.raises(ValueError, match="lora.dropout"):
        invariant.linear(torch.randn(3, 8), lora)


@pytest.mark.parametrize("engine_merge", ["invariant", "default GEMM (control)"])
def test_a_grpo_lora_run_in_bitwise_mode_logs_zero_mismatch_every_step(tmp_path, monkeypatch, engine_merge):
    """LoRA on every projection, varied rewards so the adapters get gradients: after the first update B is nonzero,
    so the later steps sample and score with merged adapters. The control merges in the engine with the default
    mode's GEMM: from the second step on (B nonzero) the mismatch is no longer 0."""
    if engine_merge != "invariant":
        monkeypatch.setattr(bitwise, "engine_weights", _default_merge_engine_weights)
    reward = tmp_path / "spread.py"
    reward.write_text("def spread(prompt, response, ground_truth, **row):\n"
                      "    return sum(ord(c) for c in response) % 7 / 7\n")
    lines = _grpo(tmp_path, "actor.lora.rank=4", "actor.lora.alpha=8", "actor.optim.lr=0.01", "trainer.total_steps=3",
                  "algorithm.rollout_correction=tis", f"reward.functions=[{{name: '{reward}:spread'}}]")
    assert [line["step"] for line in lines] == [1, 2, 3] and all(line["actor/grad_norm"] > 0 for line in lines)
    if engine_merge != "invariant":
        assert all(line["mismatch/abs_diff_max"] > 0.0 for line in lines[1:]), lines
        return
    for line in lines:
        assert line["mismatch/abs_diff_max"] == 0.0 and line["mismatch/k3"] == 0.0, line
        assert line["mismatch/correction_weight_mean"] == 1.0, line


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["qwen2", "gemma3-local-global"])
def test_gpu_trainer_logprobs_equal_the_engines_bit_for_bit_with_lora(family, dtype):
    model = _adapted(family, dtype=dtype, device="cuda")
    assert max(_trainer_vs_engine(model, device="cuda")) == 0.0


def test_merged_weight_matches_the_exact_merge_within_rounding():
    lora = _lora_layer()
    exact = lora.weight.double() + lora.scaling * lora.lora_B.double() @ lora.lora_A.double()
    merged = invariant.merged_weight(lora.weight, lora.lora_A, lora.lora_B, lora.scaling)
    torch.testing.assert_close(merged.double(), exact, atol=1e-6, rtol=1e-6)
