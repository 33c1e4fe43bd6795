"""The memory plan's offloads on a CUDA device: the streamed reference frees its layers' device memory and gives the
resident log-probs; AdamW stepped on the host keeps no moments on the device and gives the on-device weights."""
import copy

import pytest
import torch

from phaserl.models import CausalLM, DecoderConfig
from phaserl.roles import ReferencePolicy
from phaserl.roles.optim import Optimizer, OptimSettings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _model(layers: int = 8) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(DecoderConfig(model_type="qwen2", vocab_size=1024, hidden_size=512, intermediate_size=1536,
                                  num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                                  max_position_embeddings=512, tie_word_embeddings=False)).to("cuda", torch.bfloat16)


def test_a_streamed_reference_frees_its_layers_and_gives_the_resident_log_probs():
    from test_memory_offload import rollout_batch

    model = _model()
    resident = ReferencePolicy(model)
    batch = rollout_batch(V=1024)
    batch = type(batch)(**{k: (v.cuda() if torch.is_tensor(v) else v) for k, v in vars(batch).items()
                           if not k.startswith("_")})
    expected = resident.compute_logprobs(batch, temperature=1.0, token_budget=64)
    streamed = ReferencePolicy(copy.deepcopy(model))
    del resident, model
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    taken = streamed.stream_weights(torch.device("cuda"))
    assert before - torch.cuda.memory_allocated() >= 0.95 * taken  # the layers left the device
    torch.cuda.reset_peak_memory_stats()
    got = streamed.compute_logprobs(batch, temperature=1.0, token_budget=64)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    layer = taken // 8
    assert torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated() < 3 * layer + 64 * 2**20
    assert streamed.streamed.most_on_device == 2


def test_an_offloaded_optimizer_keeps_no_moments_on_the_device_and_matches_the_on_device_one():
    a_model, b_model = _model(2), _model(2)
    settings = OptimSettings(lr=1e-3, grad_clip=1.0)
    a, b = Optimizer(a_model.parameters(), settings), Optimizer(b_model.parameters(), settings)
    b.offload_step()
    for step in range(3):
        ids = torch.randint(0, 1024, (4, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for model, opt in ((a_model, a), (b_model, b)):
            model.logits(model(ids)).float().logsumexp(-1).mean().backward()
            opt.step()
        if step == 0:
            # The fused CPU and CUDA AdamW kernels both do float32 math, but not in the same order: after one step a
            # weight may round to the neighbouring bf16 value (measured on an H200: 101 of 524,288 weights), no more.
            differ = 0
            for p, q in zip(a_model.parameters(), b_model.parameters()):
                ulp = torch.finfo(torch.bfloat16).eps * p.float().abs().clamp_min(2**-100)  # one bf16 step at |p|
                assert bool(((q.float() - p.float()).abs() <= ulp).all())
                differ += int((q != p).sum())
            assert differ <= 1e-3 * sum(p.numel() for p in a_model.parameters())
    assert all(v.device.type == "cpu" for st in b.opt.state.values() for v in st.values() if torch.is_tensor(v))
    # Later steps start from those few neighbouring weights, so their gradients differ a little too: each weight
    # stays within the updates' own size (Adam moves a weight about lr a step) and the moments agree as a whole.
    for p, q in zip(a_model.parameters(), b_model.parameters()):
        assert float((q.float() - p.float()).abs().max()) <= 4 * settings.lr
    for p, q in zip(a.opt.param_groups[0]["params"], b.opt.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            want, got = a.opt.state[p][key].float(), b.opt.state[q][key].cuda().float()
            assert float((got - want).norm()) <= 1e-2 * float(want.norm()), key
