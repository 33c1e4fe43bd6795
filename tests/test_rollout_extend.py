"""The eager extend pass (ModelRunner._extend_pass, multi-turn continuation) with padding tokens, and the tiny
Qwen3.5 the extend tests share.
"""
import pytest
import torch
import transformers

from phaserl.models import CausalLM
from phaserl.models.families import config_from_hf
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams
from phaserl.rollout import runner as runner_module
from tests.test_rollout_engine import tiny_model

torch.set_num_threads(1)


def tiny_qwen35() -> CausalLM:
    config = getattr(transformers, "Qwen3_5TextConfig", None)
    if config is None:
        pytest.skip("this transformers has no Qwen3.5")
    torch.manual_seed(0)
    model = CausalLM(config_from_hf(config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                           linear_value_head_dim=8).to_dict()))
    with torch.no_grad():  # far from init (decays, conv taps): a state that leaked or was lost would show
        for name, p in model.named_parameters():
            p.add_(0.1 * torch.randn(p.shape))
    return model.eval()



def test_a_padding_token_past_the_context_of_a_sliding_layer_writes_no_nan(monkeypatch):
    """Regression (found 2026-12-01): a short row starting past a long row's end has padding tokens past the
    eager pass's context; in a sliding layer their window held no key, softmax gave NaN, the next layer wrote
    NaN KV past the row's end, and the row's next decode step read it (0 * NaN): NaN log-probs, token 0."""
    model = tiny_model("qwen2", sliding_window=4, layer_types=("sliding_attention", "full_attention"),
                       max_position_embeddings=128)
    runner = RolloutEngine(model, EngineConfig(max_slots=4)).runner
    runner.begin(4, 128, 8, SamplingParams(max_new_tokens=8, temperature=0.0), [])
    runner.prefill([((1, 2), [0], [8], [0]), (tuple(i % 39 + 1 for i in range(40)), [1], [8], [1]),
                    ((3,), [2], [8], [2])])
    # row 1's padding tokens: positions 41..69
    items = [(0, [i % 39 + 1 for i in range(30)], 2, 4), (1, [5], 40, 4), (2, [6, 7], 1, 4)]
    attend, blind = runner_module.extend_attention, []
    monkeypatch.setattr(runner_module, "EXTEND_KERNEL", False)  # this checks the torch path's mask (the kernel's
    # padding tokens: tests/test_rollout_extend_kernel.py)

    def checked(q, keys, values, hidden, scale):  # a query that sees no key: NaN (on a GPU, whichever write wins)
        blind.append(int(hidden.all(-1).sum()))
        return attend(q, keys, values, hidden, scale)
    monkeypatch.setattr(runner_module, "extend_attention", checked)
    with torch.inference_mode():
        runner._extend_pass(items)
        for _ in range(3):
            runner.decode(4)
    assert blind == [0, 0]  # per layer
    assert not any(torch.isnan(t).any() for t in (*runner.keys, *runner.values))
    assert torch.isfinite(runner.state.out_logprobs[:, :4]).all()
