"""Chunked log-probs from hidden states: same values and gradients as the naive path, without [N, V]."""
import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

from phaserl.algo import entropy_from_logits, token_logprobs_from_hidden, token_logprobs_from_logits
from phaserl.algo.logprobs import _ChunkedLinearLogprobs


def test_logprobs_and_entropy_from_logits_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0)]])  # softmax = [1/4, 3/4]
    assert torch.allclose(token_logprobs_from_logits(logits, torch.tensor([1])), torch.tensor([math.log(0.75)]))
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert torch.allclose(entropy_from_logits(logits), torch.tensor([entropy]))
    # temperature 0.5 doubles the logits: softmax = [1/10, 9/10]
    assert torch.allclose(token_logprobs_from_logits(logits, torch.tensor([0]), temperature=0.5),
                          torch.tensor([math.log(0.1)]))


def _inputs(n, h, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_matches_naive_values_and_gradients_float64(with_entropy):
    hidden, weight, targets = _inputs(n=7, h=5, v=11, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    up_logp, up_ent = torch.randn(7, generator=g, dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64)

    logp, ent = token_logprobs_from_hidden(hidden, weight, targets, temperature=0.7, chunk_size=3,
                                           with_entropy=with_entropy)  # chunks of 3, 3, 1
    out = (logp * up_logp).sum() + ((ent * up_ent).sum() if with_entropy else 0.0)
    grad_h, grad_w = torch.autograd.grad(out, (hidden, weight))

    logits = hidden @ weight.t()
    naive_logp = token_logprobs_from_logits(logits, targets, temperature=0.7)
    naive = (naive_logp * up_logp).sum()
    if with_entropy:
        naive_ent = entropy_from_logits(logits, temperature=0.7)
        naive = naive + (naive_ent * up_ent).sum()
        assert torch.allclose(ent, naive_ent, atol=1e-12)
    else:
        assert ent is None
    naive_h, naive_w = torch.autograd.grad(naive, (hidden, weight))
    assert torch.allclose(logp, naive_logp, atol=1e-12)
    assert torch.allclose(grad_h, naive_h, atol=1e-10)
    assert torch.allclose(grad_w, naive_w, atol=1e-10)


def test_gradcheck_of_the_autograd_function():
    hidden, weight, targets = _inputs(n=4, h=3, v=5, dtype=torch.float64, seed=2)
    assert torch.autograd.gradcheck(
        lambda h, w: _ChunkedLinearLogprobs.apply(h, w, targets, 1.3, 3, True), (hidden, weight))


def test_no_float32_n_by_v_tensor_is_saved_for_backward():
    n, h, v = 64, 8, 100
    hidden, weight, targets = _inputs(n, h, v, dtype=torch.float32)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs_from_hidden(hidden, weight, targets, chunk_size=16, with_entropy=True)
    assert saved and max(saved) < n * v  # hidden, weight, targets, logsumexp only

    saved.clear()  # the naive path does keep [N, V]: the check above can fail
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs_from_logits(hidden @ weight.t(), targets)
    assert max(saved) >= n * v


def test_bfloat16_inputs_give_float32_outputs_close_to_float32_math():
    hidden, weight, targets = _inputs(n=10, h=16, v=32, dtype=torch.float32)
    hb, wb = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    logp, ent = token_logprobs_from_hidden(hb, wb, targets, chunk_size=4, with_entropy=True)
    assert logp.dtype == ent.dtype == torch.float32
    ref = token_logprobs_from_logits(hb.float() @ wb.float().t(), targets)
    assert torch.allclose(logp, ref, atol=0.1)
    logp.sum().backward()
    assert hb.grad.dtype == wb.grad.dtype == torch.bfloat16


def test_frozen_weight_gets_no_gradient_and_inference_mode_works():
    hidden, weight, targets = _inputs(n=5, h=3, v=6, dtype=torch.float32)
    frozen = weight.detach()
    logp, _ = token_logprobs_from_hidden(hidden, frozen, targets, chunk_size=2)
    logp.sum().backward()
    assert hidden.grad is not None and frozen.grad is None
    with torch.inference_mode():
        again, _ = token_logprobs_from_hidden(hidden, weight, targets, chunk_size=2)
    assert torch.allclose(again, logp)


def test_bad_shapes_are_reported():
    hidden, weight, targets = _inputs(n=5, h=3, v=6, dtype=torch.float32)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs_from_hidden(hidden, weight, targets[:4])


def test_save_logits_needs_the_triton_kernels_and_an_unused_entropy_costs_no_gradient():
    h = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 4, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 11, (6,))
    with pytest.raises(ValueError, match="save_logits needs the Triton kernels"):
        token_logprobs_from_hidden(h, w, t, save_logits=True)
    from phaserl.algo.logprobs import can_save_logits  # what the roles ask before asking for it

    assert not can_save_logits(True, h) and not can_save_logits(False, h) and not can_save_logits("inductor", h)
    with pytest.raises(ValueError, match="fused='triton' needs a CUDA device"):
        token_logprobs_from_hidden(h, w, t, fused="triton")
    # entropy returned but left out of the loss: the gradient is that of the log-probs alone
    lp, ent = token_logprobs_from_hidden(h, w, t, with_entropy=True, chunk_size=4)
    (lp * torch.arange(6.0, dtype=torch.float64)).sum().backward()
    weighted = token_logprobs_from_logits(h @ w.t(), t) * torch.arange(6.0, dtype=torch.float64)
    expected = torch.autograd.grad(weighted.sum(), (h, w))
    torch.testing.assert_close(h.grad, expected[0])
    torch.testing.assert_close(w.grad, expected[1])


INTERPRETED_KERNELS = """
import torch
from phaserl.algo import logprob_kernels

z = torch.randn(3, 5000) * 3  # two blocks of 4096, the second partly masked
t = torch.tensor([0, 4097, 4999])
logp, lse, mean_z = logprob_kernels.row_stats(z, t, 0.5, True)
zz = z / 0.5
torch.testing.assert_close(lse, torch.logsumexp(zz, -1))
torch.testing.assert_close(logp, zz.log_softmax(-1).gather(1, t[:, None])[:, 0])
torch.testing.assert_close(mean_z, (zz.softmax(-1) * zz).sum(-1), rtol=1e-4, atol=1e-4)
g_logp, g_ent = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.3, 0.0, -1.0])
leaf = zz.clone().requires_grad_(True)
lp_ref = leaf.log_softmax(-1).gather(1, t[:, None])[:, 0]
ent_ref = -(leaf.softmax(-1) * leaf.log_softmax(-1)).sum(-1)
(lp_ref * g_logp + ent_ref * g_ent).sum().backward()
grad = logprob_kernels.row_grad_(z.clone(), t, lse, mean_z, g_logp, g_ent, 0.5)
torch.testing.assert_close(grad, leaf.grad / 0.5, rtol=1e-4, atol=1e-5)
"""


@pytest.mark.slow  # a fresh interpreter that imports torch and Triton
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its CPU interpreter)")
def test_triton_kernels_in_the_interpreter_match_torch():
    """In a fresh process: Triton reads TRITON_INTERPRET once, so in a session that has already imported
    Triton (phaserl.rollout.kernels does) setting it later has no effect and the kernels cannot run."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", INTERPRETED_KERNELS], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
