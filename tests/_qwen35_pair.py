"""Shared by the Qwen3.5 tests: the tiny config, weights far from init, and the (transformers, ours, directory)
pair of the same random model; and a stand-in for flash-linear-attention's chunk_gated_delta_rule over our torch
rule (right, wrong, broken, or with the backward fla-core 0.6.0 refuses on Hopper below Triton 3.7.1)."""
import torch
import transformers

from phaserl.models import CausalLM, load_pretrained
from phaserl.models.linear_attention import chunk_gated_delta_rule

Qwen3_5TextConfig = getattr(transformers, "Qwen3_5TextConfig", None)

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=256)


def randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights far from init (norm offsets, decays, conv taps included) so that a misplaced piece shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            base = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0  # the gated norm is w * x, not (1 + w)
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
    return module.eval()


def make_pair(tmp_path_factory):
    hf = randomize(transformers.AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**TINY)))
    directory = tmp_path_factory.mktemp("qwen35")
    hf.save_pretrained(directory)
    ours = load_pretrained(directory)
    assert isinstance(ours, CausalLM)
    return hf, ours, directory


class NoBackward(torch.autograd.Function):
    """The identity, whose backward raises like fla-core 0.6.0's on Hopper with Triton < 3.7.1 (fla #640)."""
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for gated "
                           "chunk_bwd_dqkwg")


def fake_fla(wrong: bool = False, broken: bool = False, no_backward: bool = False, calls: list = None):
    """fla's chunk_gated_delta_rule API over our torch rule (q taken as given: scale 1, no in-kernel norm)."""
    def rule(q, k, v, g, beta, scale, cu_seqlens, use_qk_l2norm_in_kernel):
        if calls is not None:
            calls.append(torch.is_grad_enabled())
        if broken:
            raise RuntimeError("no kernel image for this device")
        assert q.shape[0] == 1 and cu_seqlens.dtype == torch.long and scale == 1.0 and not use_qk_l2norm_in_kernel
        outs = []
        for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            pieces = (t[:, a:b].float() for t in (q, k, v, g, beta))
            outs.append(chunk_gated_delta_rule(*pieces)[0])
        o = torch.cat(outs, dim=1)
        o = NoBackward.apply(o) if no_backward else o
        return (o * 1.5 if wrong else o).to(v.dtype), None
    return rule
