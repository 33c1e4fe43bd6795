"""Activation offload (actor.offload_activations, roles/activation_offload.py): the checkpointed layers' saved inputs
go to host memory and come back for backward with the same gradients; the memory plan takes it only where
checkpointing is not enough, before the optimizer's CPU step; the key is checked. The CUDA case (streams, events,
at most two inputs on the device) is the gpu-marked test at the end."""
import dataclasses

import pytest
import torch

from phaserl.config import load_config
from phaserl.errors import ConfigError
from phaserl.memory import budget
from phaserl.memory.budget import ModelShape
from phaserl.memory.plan import Asked, Measures, PlanFacts, choose_plan, peak_bytes
from phaserl.models import CausalLM, DecoderConfig
from phaserl.roles.activation_offload import ActivationOffload

GIB = 2**30


def _model(layers: int = 4, **over) -> CausalLM:
    torch.manual_seed(0)
    cfg = DecoderConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64, **over)
    return CausalLM(cfg).train()


def _grads(model, ids) -> list:
    model.zero_grad()
    model(ids).float().square().mean().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("checkpointed", [4, 2])
def test_offloaded_inputs_give_exactly_the_resident_gradients(checkpointed):
    model = _model()
    model.model.checkpoint_layers = checkpointed
    ids = torch.randint(0, 64, (2, 16))
    resident = _grads(model, ids)
    offload = ActivationOffload(torch.device("cpu"), in_flight=2)
    model.model.activation_offload = offload
    moved = _grads(model, ids)
    assert offload.offloaded == checkpointed  # each checkpointed layer's input, not the RoPE tables or the mask
    assert offload.offloaded_bytes == checkpointed * 2 * 16 * 32 * 4
    assert len(moved) == len(resident)
    assert all(torch.equal(a, b) for a, b in zip(moved, resident))  # float32, exactly


class _Recorder:
    """Stand-ins for CUDA streams and events on the CPU, so that the CUDA branch's bookkeeping runs here."""

    def __init__(self):
        self.waits = 0

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        self.waits += 1

    def record(self, stream=None):
        pass


def test_the_cuda_bookkeeping_keeps_two_in_flight_and_prefetches_in_backward_order(monkeypatch):
    """The CUDA branch with the streams and events stood in for: after the forward only the last two inputs are
    still held on the device (the others released once their copies were waited for), the backward takes those as
    they are and fetches the rest one layer ahead, last to first; the gradients are the resident ones."""
    import contextlib

    compute = _Recorder()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Recorder)
    model = _model(layers=5)
    model.model.checkpoint_layers = 5
    ids = torch.randint(0, 64, (2, 16))
    resident = _grads(model, ids)
    offload = ActivationOffload(torch.device("cpu"), in_flight=2)
    offload.cuda, offload.pin, offload.stream = True, False, _Recorder()
    fetched = []
    fetch = offload._fetch
    monkeypatch.setattr(offload, "_fetch", lambda s: (fetched.append(s.index), fetch(s)))
    model.model.activation_offload = offload
    model.zero_grad()
    hidden = model(ids)
    saved = offload.saved
    assert [s.index for s in offload.pending] == [3, 4] and all(s.device is not None for s in offload.pending)
    assert all(s.device is None and s.host is not None for s in saved[:3])  # copied, let go of
    assert compute.waits == 3  # the compute stream waited for each released copy before reusing its memory
    hidden.float().square().mean().backward()
    assert fetched == [2, 1, 0]  # each fetched while the layer after it recomputed, none twice
    assert all(s.device is None and s.fetched is None for s in saved) and not offload.pending
    moved = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(moved, resident))


def test_an_empty_placeholder_and_a_tensor_saved_twice_are_not_copied_twice():
    """Some torch versions' non-reentrant checkpoint saves an empty grad-requiring placeholder beside a layer's
    inputs, and one op may save the same input twice: neither takes a host copy of its own."""

    class SavesTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, empty):
            ctx.save_for_backward(x, x, empty)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            x, again, empty = ctx.saved_tensors
            assert again is x or torch.equal(again, x)
            return grad * 2, None

    offload = ActivationOffload(torch.device("cpu"), in_flight=2)
    x = torch.randn(3, 4, requires_grad=True)
    empty = torch.empty(0, requires_grad=True)
    with offload.layer(0):
        y = SavesTwice.apply(x, empty)
    assert offload.offloaded == 1 and offload.offloaded_bytes == x.numel() * x.element_size()
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def test_a_forward_without_grad_or_outside_training_moves_nothing():
    model = _model()
    model.model.checkpoint_layers = 4
    offload = ActivationOffload(torch.device("cpu"), in_flight=2)
    model.model.activation_offload = offload
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 8)))
    model.eval()
    model(torch.randint(0, 64, (1, 8)))
    assert offload.offloaded == 0


def test_the_budget_counts_the_inputs_in_flight_only():
    shape = ModelShape(7_615_616_512, 28, 3584, 18944, 4, 128, 152064, 2)
    layer = budget.layer_bytes(shape, True)["dense"][1]
    kept = budget.train_bytes_per_token(shape, True, True)
    moved = budget.train_bytes_per_token(shape, True, True, offload_activations=True)
    assert kept == int(28 * 3584 * 2 + layer)
    assert moved == int(budget.OFFLOAD_IN_FLIGHT * 3584 * 2 + layer)
    assert budget.train_bytes_per_token(shape, False, True, offload_activations=True) == \
        budget.train_bytes_per_token(shape, False, True)  # nothing checkpointed: nothing to move


def _long_1p5b(card_gb: float) -> PlanFacts:
    """A Qwen2.5-1.5B shape at 32k-token responses (64 per optimizer step), bf16, compiled, a separate reference."""
    n, L, h, inter, kv, hd, V = 1_543_714_304, 28, 1536, 8960, 2, 128, 151936
    return PlanFacts(shape=ModelShape(n, L, h, inter, kv, hd, V, 2), device_type="cuda",
                     budget_bytes=int((card_gb - 1.5) * GIB), actor_params=2 * n, actor_trainable=2 * n,
                     ref_bytes=2 * n, ref_layer_bytes=2 * n - 4 * V * h, sequence_tokens=33024,
                     mini_batch_sequences=64, compiled=True)


def _measures(plan) -> tuple:
    m = plan.measures
    return m.stream, m.layers, m.activations, m.offload


@pytest.mark.parametrize("card, expected", [
    (80, (True, 18, False, False)),  # checkpointing 18 layers is enough
    (48, (True, 24, False, False)),
    (28, (True, 27, True, False)),   # every layer but one checkpointed is not: the inputs go to the host
    (24, (True, 27, True, True)),    # and on a smaller card AdamW goes to the CPU as well
])
def test_the_plan_offloads_activations_only_where_checkpointing_does_not_fit(card, expected):
    f = _long_1p5b(card)
    plan = choose_plan(f)
    assert _measures(plan) == expected and plan.fits
    choice = plan.offload_activations
    assert choice.key == "actor.offload_activations" and choice.value == expected[2]
    if expected[2]:
        assert "checkpointing alone does not fit the step" in choice.why and "before the optimizer" in choice.why
        assert "their inputs in host memory" in plan.summary()
        alone = dataclasses.replace(plan.measures, activations=False, layers=28)
        target = 33024
        assert peak_bytes(f, alone, target) > peak_bytes(f, plan.measures, target)  # it is what made room
    else:
        assert choice.why.startswith("the step fits")


def test_the_plan_keeps_the_key_set_by_hand():
    f = _long_1p5b(80)
    on = choose_plan(f, Asked(offload_activations=True))
    assert on.measures.activations and on.offload_activations.why == "set in the config"
    assert on.peak_bytes < choose_plan(f).peak_bytes
    off = choose_plan(_long_1p5b(28), Asked(offload_activations=False))
    assert not off.measures.activations and off.measures.offload  # what it would have saved comes from AdamW
    hf = choose_plan(dataclasses.replace(_long_1p5b(28), selective=False), Asked(offload_activations=True))
    assert not hf.measures.activations and hf.offload_activations.why.startswith("ignored: the transformers path")
    cpu = choose_plan(dataclasses.replace(_long_1p5b(28), device_type="cpu"))
    assert cpu.measures == Measures() and not cpu.offload_activations.value


def test_the_key_is_checked_with_the_fix_named():
    assert load_config(None, []).actor.offload_activations is None
    assert load_config(None, ["actor.offload_activations=auto"]).actor.offload_activations is None
    assert load_config(None, ["actor.offload_activations=true"]).actor.offload_activations is True
    with pytest.raises(ConfigError, match="no layer is checkpointed"):
        load_config(None, ["actor.offload_activations=true", "actor.checkpoint_layers=0"])
    with pytest.raises(ConfigError, match="did you mean"):
        load_config(None, ["actor.offload_activation=true"])
    with pytest.raises(ConfigError, match="offload_activations"):
        load_config(None, ["actor.offload_activations=7"])
    with pytest.raises(ValueError, match="at least one copy"):
        ActivationOffload(torch.device("cpu"), in_flight=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_saved_inputs_leave_the_device_and_the_gradients_stay():
    """8 checkpointed layers of h = 2048 at 8192 tokens (bf16): 32 MiB of input each, 256 MiB in all; offloaded,
    the forward leaves at most two of them on the device (plus the output), and the gradients are equal."""
    torch.manual_seed(0)
    cfg = DecoderConfig(model_type="qwen2", vocab_size=1024, hidden_size=2048, intermediate_size=4096,
                        num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                        max_position_embeddings=8192, tie_word_embeddings=False)
    model = CausalLM(cfg).to("cuda", torch.bfloat16).train()
    model.model.checkpoint_layers = 8
    ids = torch.randint(0, 1024, (1, 8192), device="cuda")

    def run():
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        hidden = model(ids)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before  # what the forward left for backward (+ its output)
        hidden.float().square().mean().backward()
        torch.cuda.synchronize()
        return held, [p.grad.float().clone() for p in model.parameters() if p.grad is not None]

    held, resident = run()
    _, again = run()  # the resident run twice: what the kernels' own nondeterminism (atomic adds) gives, if any
    offload = ActivationOffload(torch.device("cuda"), in_flight=budget.OFFLOAD_IN_FLIGHT)
    model.model.activation_offload = offload
    held_moved, moved = run()
    one_input = 8192 * 2048 * 2
    assert offload.offloaded == 8
    assert held - held_moved >= (8 - budget.OFFLOAD_IN_FLIGHT - 0.5) * one_input, (held, held_moved)
    noise = max(float((a - b).abs().max()) for a, b in zip(again, resident))
    worst = max(float((a - b).abs().max()) for a, b in zip(moved, resident))
    assert worst <= 2 * noise, (worst, noise)  # the same bytes come back: the same gradients (exactly, if the
    # kernels are deterministic)
