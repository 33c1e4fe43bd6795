"""Long responses: the log-prob and entropy head never holds full-vocabulary logits for a whole sequence. Every
path the roles take (padded and packed micro-batches, forward-only and training, the fused plain head and a model's
own soft-capped head) projects at most LOGPROB_CHUNK tokens onto the vocabulary at a time, forward and backward.

Every tensor any op makes is watched (a dispatch mode); the vocabulary (97) is no other width of the model."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from phaserl.batch import RolloutBatch
from phaserl.memory.budget import LOGPROB_CHUNK
from phaserl.models import CausalLM, DecoderConfig
from phaserl.roles.forward import batch_logprobs, rows_logprobs

V = 97
RESPONSE = 2 * LOGPROB_CHUNK + 300  # one response longer than two chunks


class _WidestLogits(TorchDispatchMode):
    """The most rows of any [..., V] tensor made while active."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == V:
                self.rows = max(self.rows, t.numel() // V)
        return out


def _model(softcap=None) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(DecoderConfig(model_type="qwen2", vocab_size=V, hidden_size=32, intermediate_size=48,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=4096, tie_word_embeddings=False,
                                  final_logit_softcapping=softcap))


def _batch(P: int = 8) -> RolloutBatch:
    lengths = [RESPONSE, 40]
    B, R = len(lengths), max(lengths)
    ids = torch.randint(1, V, (B, P + R), generator=torch.Generator().manual_seed(2))
    attn = torch.zeros(B, P + R, dtype=torch.long)
    resp = torch.zeros(B, R, dtype=torch.long)
    for i, r in enumerate(lengths):
        attn[i, : P + r] = 1
        resp[i, :r] = 1
    return RolloutBatch(input_ids=ids * attn, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                        response_mask=resp, prompt_width=P, group_ids=torch.arange(B),
                        rollout_logprobs=torch.zeros(B, R), prompts=[""] * B, response_texts=[""] * B,
                        rows=[None] * B, finish_reasons=["stop"] * B)


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("softcap", [None, 30.0])  # the fused plain head; the model's own (soft-capped) head
def test_training_never_projects_a_whole_sequence_onto_the_vocabulary(packing, softcap):
    model, batch = _model(softcap), _batch()
    assert model.plain_head == (softcap is None)
    watch = _WidestLogits()
    with watch:
        logp, entropy, mask = rows_logprobs(model, batch, torch.arange(2), packing=packing, temperature=0.7,
                                            with_entropy=True)
        (logp * mask).sum().add((entropy * mask).sum()).backward()
    assert logp.shape[1] == RESPONSE and bool(torch.isfinite(logp[mask.bool()]).all())
    assert 0 < watch.rows <= LOGPROB_CHUNK, f"a [{watch.rows}, {V}] logits tensor was made"


def test_the_forward_only_pass_never_projects_a_whole_sequence():
    watch = _WidestLogits()
    with watch:
        batch_logprobs(_model(), _batch(), temperature=1.0, token_budget=8192, packing=True)
    assert 0 < watch.rows <= LOGPROB_CHUNK
