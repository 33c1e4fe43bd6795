"""The memory plan's two offloads, on the CPU: the reference streamed layer by layer gives the resident reference's
log-probs with at most two layers in flight (roles/streaming.py), and AdamW stepped on the host gives the on-device
optimizer's weights, schedule and checkpoint state (roles/optim.py, roles/checkpointed.py)."""
import copy

import pytest
import torch

from phaserl.batch import RolloutBatch
from phaserl.models import CausalLM, DecoderConfig
from phaserl.roles import ReferencePolicy
from phaserl.roles.checkpointed import CheckpointedRole
from phaserl.roles.optim import Optimizer, OptimSettings
from phaserl.roles.streaming import StreamedLayers


def tiny_model(seed: int = 0, layers: int = 4) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(DecoderConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, tie_word_embeddings=False))


def rollout_batch(lengths=((5, 7), (3, 4), (4, 7)), P: int = 5, R: int = 7, V: int = 64) -> RolloutBatch:
    """Left-padded prompts and right-padded responses of the given (prompt, response) lengths."""
    g = torch.Generator().manual_seed(1)
    B = len(lengths)
    ids = torch.zeros(B, P + R, dtype=torch.long)
    attn = torch.zeros(B, P + R, dtype=torch.long)
    resp = torch.zeros(B, R, dtype=torch.long)
    for i, (p, r) in enumerate(lengths):
        ids[i, P - p: P + r] = torch.randint(1, V, (p + r,), generator=g)
        attn[i, P - p: P + r] = 1
        resp[i, :r] = 1
    return RolloutBatch(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                        response_mask=resp, prompt_width=P, group_ids=torch.arange(B),
                        rollout_logprobs=torch.zeros(B, R), prompts=[""] * B, response_texts=[""] * B,
                        rows=[None] * B, finish_reasons=["stop"] * B)


# ----- the streamed reference ----------------------------------------------------------------------------------
def test_the_streamed_reference_equals_the_resident_one():
    model = tiny_model()
    resident, streamed = ReferencePolicy(model), ReferencePolicy(copy.deepcopy(model))
    taken = streamed.stream_weights(torch.device("cpu"))
    layers = streamed.model.model.layers
    assert taken == sum(p.numel() * p.element_size() for p in layers.parameters())
    host = [p.data_ptr() for p in layers.parameters()]
    batch = rollout_batch()
    for budget in (64, 16):  # one pass, then several micro-batches (one pass each)
        expected = resident.compute_logprobs(batch, temperature=1.0, token_budget=budget)
        got = streamed.compute_logprobs(batch, temperature=1.0, token_budget=budget)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert streamed.streamed.most_on_device == 2  # the layer that computes and the next one, crossing
    assert [p.data_ptr() for p in layers.parameters()] == host  # between passes: the host weights


def test_a_pass_that_raises_midway_leaves_no_layer_on_the_device():
    ref = ReferencePolicy(tiny_model())
    ref.stream_weights(torch.device("cpu"))
    host = [p.data_ptr() for p in ref.model.model.layers.parameters()]

    def fail(module, args):
        raise torch.OutOfMemoryError("simulated")
    handle = ref.model.model.layers[2].register_forward_pre_hook(fail)
    with pytest.raises(torch.OutOfMemoryError):
        ref.compute_logprobs(rollout_batch(), temperature=1.0, token_budget=64)
    handle.remove()
    assert not ref.streamed.copies and [p.data_ptr() for p in ref.model.model.layers.parameters()] == host


def test_only_a_frozen_model_streams():
    with pytest.raises(ValueError, match="frozen"):
        StreamedLayers(tiny_model(), torch.device("cpu"))


# ----- AdamW on the host ---------------------------------------------------------------------------------------
class _Role(CheckpointedRole):
    role = "actor"

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer


SETTINGS = OptimSettings(lr=1e-2, weight_decay=0.1, grad_clip=0.5, warmup_steps=2, lr_schedule="cosine",
                         total_steps=6)


def _train(model, optimizer, steps: int, seed: int = 3) -> list:
    norms = []
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 9), generator=g)
        model.logits(model(ids)).float().logsumexp(-1).mean().backward()
        norms.append(optimizer.step())
    return norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_optimizer_steps_equal_the_on_device_ones(dtype):
    on_device, offloaded = tiny_model().to(dtype), tiny_model().to(dtype)
    a, b = Optimizer(on_device.parameters(), SETTINGS), Optimizer(offloaded.parameters(), SETTINGS)
    b.offload_step()
    assert b.offloaded and all(w.device.type == "cpu" and w is not p for w, p in zip(b.host.weights, b.params))
    assert _train(on_device, a, 4) == _train(offloaded, b, 4)  # the clipped norms too
    for p, q in zip(on_device.parameters(), offloaded.parameters()):
        assert torch.equal(p, q) and q.grad is None
    assert a.lr == b.lr and a.sched.state_dict()["last_epoch"] == b.sched.state_dict()["last_epoch"] == 4


def test_an_offloaded_optimizer_saves_and_resumes_the_on_device_state():
    """Same names and values as get_optimizer_state_dict's, so a checkpoint resumes with the offload on or off."""
    on_device, offloaded = tiny_model(), tiny_model()
    a, b = Optimizer(on_device.parameters(), SETTINGS), Optimizer(offloaded.parameters(), SETTINGS)
    b.offload_step()
    _train(on_device, a, 2)
    _train(offloaded, b, 2)
    saved_a, saved_b = _Role(on_device, a).checkpoint_state_dicts(), _Role(offloaded, b).checkpoint_state_dicts()
    assert saved_a["optim"]["state"].keys() == saved_b["optim"]["state"].keys()
    for name, st in saved_a["optim"]["state"].items():
        for key, value in st.items():
            assert torch.equal(value.cpu(), saved_b["optim"]["state"][name][key]), (name, key)
    assert saved_a["optim"]["param_groups"][0]["params"] == saved_b["optim"]["param_groups"][0]["params"]

    resumed_model = tiny_model(seed=9)  # other weights: the checkpoint fills them, and the host copies follow
    resumed = Optimizer(resumed_model.parameters(), SETTINGS)
    resumed.offload_step()
    role = _Role(resumed_model, resumed)
    template = role.checkpoint_state_dicts()  # an unstepped offloaded optimizer still offers tensors to fill
    assert template["optim"]["state"].keys() == saved_a["optim"]["state"].keys()
    role.load_checkpoint_state_dicts(copy.deepcopy(saved_a))  # written by the on-device run
    assert _train(on_device, a, 2, seed=5) == _train(resumed_model, resumed, 2, seed=5)
    for p, q in zip(on_device.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)


def test_the_offload_comes_before_the_first_step():
    model = tiny_model()
    opt = Optimizer(model.parameters(), SETTINGS)
    _train(model, opt, 1)
    with pytest.raises(RuntimeError, match="before the first step"):
        opt.offload_step()
