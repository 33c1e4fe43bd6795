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
    """Both optimizers step from the same gradients (computed once, on the first model, and copied: a GPU backward's
    atomic adds make two backward passes differ in the last bits, and AdamW's first steps move a weight by about lr
    whatever the size of its gradient, so a tiny gradient of the other sign would move it 2 lr the other way)."""
    a_model, b_model = _model(2), _model(2)
    settings = OptimSettings(lr=1e-3, grad_clip=1.0)
    a, b = Optimizer(a_model.parameters(), settings), Optimizer(b_model.parameters(), settings)
    b.offload_step()
    total = sum(p.numel() for p in a_model.parameters())
    for step in range(3):
        ids = torch.randint(0, 1024, (4, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        a_model.logits(a_model(ids)).float().logsumexp(-1).mean().backward()
        for p, q in zip(a_model.parameters(), b_model.parameters()):
            q.grad = p.grad.clone()
        last = {p: p.grad.float().abs() for p in a_model.parameters()}  # the step clears .grad
        a.step()
        b.step()
        # The fused CPU and CUDA AdamW kernels both do float32 math, but not in the same order, and keep the moments
        # in bf16: a weight may round to the neighbouring bf16 value (measured on an H200: 101 of 524,288 weights
        # after one step), and a moment one bf16 step apart moves the update by about eps * lr. So a weight may differ
        # by a bf16 step at the larger of its size and lr (a weight the step carried across zero is smaller than the
        # update that moved it), one such step per step taken, and few weights differ at all.
        differ = 0
        eps = torch.finfo(torch.bfloat16).eps
        for (name, p), q in zip(a_model.named_parameters(), b_model.parameters()):
            gap = (q.float() - p.float()).abs()
            tol = 2 * (step + 1) * eps * torch.maximum(p.float().abs(), torch.tensor(settings.lr, device=p.device))
            over = gap > tol
            assert not bool(over.any()), (step, name, int(over.sum()), float(gap.max()),
                                          float(p.float().abs()[over].min()))
            differ += int((q != p).sum())
        assert differ <= (step + 1) * 1e-3 * total, (step, differ)
    assert all(v.device.type == "cpu" for st in b.opt.state.values() for v in st.values() if torch.is_tensor(v))
    # The moments (kept in the weights' dtype, bf16) from the same gradients: m = b1 m' + (1 - b1) g and
    # v = b2 v' + (1 - b2) g^2, each rounded to bf16. Where the two terms of m nearly cancel, a bf16 step of m' is a
    # large share of m (measured on an H100: 2 of 524,288 moments 8% apart, 4.5e-7 absolute), so a moment may differ
    # by a bf16 step of its terms' size, not of its own, one such step per step taken.
    eps, (b1, b2) = torch.finfo(torch.bfloat16).eps, settings.betas
    pairs = [pq for ga, gb in zip(a.opt.param_groups, b.opt.param_groups) for pq in zip(ga["params"], gb["params"])]
    for p, q in pairs:
        g = last[p]  # the last step's gradient, as both optimizers read it
        for key, term in (("exp_avg", (1 - b1) * g), ("exp_avg_sq", (1 - b2) * g * g)):
            mine, theirs = b.opt.state[q][key].cuda().float(), a.opt.state[p][key].float()
            tol = 2 * 3 * eps * (theirs.abs() + term)
            over = (mine - theirs).abs() > tol
            assert not bool(over.any()), (key, int(over.sum()), float((mine - theirs).abs().max()))
