"""Packed micro-batches (ppo.packing): same log-probs, entropies, values, gradients and run as the padded path."""
import json
import os

import pytest
import torch

from _tiny_run import make_run_dir
from phaserl.batch import RolloutBatch
from phaserl.config import load_config
from phaserl.models import CausalLM, DecoderConfig, KVCache, ValueModel
from phaserl.models.decoder import packed_boundaries
from phaserl.packing import pack_rows, split_packed_by_tokens
from phaserl.roles.forward import batch_logprobs, batch_values, rows_logprobs, rows_values
from phaserl.trainer import RLTrainer

V = 37


def _batch(prompt_lens, resp_lens, *, P=None, R=None, seed=0) -> RolloutBatch:
    """Prompts left-padded to P, responses right-padded to R, random token ids; 0 is the pad id."""
    P = P or max(prompt_lens)
    R = R or max(max(resp_lens), 1)
    g = torch.Generator().manual_seed(seed)
    B = len(prompt_lens)
    ids = torch.zeros(B, P + R, dtype=torch.long)
    attn = torch.zeros(B, P + R, dtype=torch.long)
    resp = torch.zeros(B, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        ids[i, P - p: P + r] = torch.randint(1, V, (p + r,), generator=g)
        attn[i, P - p: P + r] = 1
        resp[i, :r] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return RolloutBatch(input_ids=ids, attention_mask=attn, position_ids=pos, response_mask=resp, prompt_width=P,
                        group_ids=torch.arange(B), rollout_logprobs=torch.zeros(B, R), prompts=[""] * B,
                        response_texts=[""] * B, rows=[None] * B, finish_reasons=["stop"] * B)


def _model(seed=0) -> CausalLM:
    torch.manual_seed(seed)
    cfg = DecoderConfig(model_type="qwen2", vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        tie_word_embeddings=False, attention_bias=True)
    return CausalLM(cfg).float()


def _value_model(seed=1) -> ValueModel:
    vm = ValueModel(_model(seed))
    torch.nn.init.normal_(vm.score.weight, std=0.5)  # zero init would make every value 0: parity trivially true
    return vm


def test_pack_rows_lays_out_real_tokens_with_own_positions():
    # row 0: prompt [a b] (1 pad), response [c];  row 1: prompt [d e f], response [g h]
    ids = torch.tensor([[0, 11, 12, 13, 0], [14, 15, 16, 17, 18]])
    attn = (ids != 0).long()
    b = RolloutBatch(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                     response_mask=torch.tensor([[1, 0], [1, 1]]), prompt_width=3, group_ids=torch.arange(2),
                     rollout_logprobs=torch.zeros(2, 2), prompts=["", ""], response_texts=["", ""], rows=[None, None],
                     finish_reasons=["stop", "stop"])
    p = pack_rows(b, torch.arange(2))
    assert p.input_ids.tolist() == [[11, 12, 13, 14, 15, 16, 17, 18]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert p.seq_ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]]
    assert p.cu_seqlens.tolist() == [0, 3, 8]
    assert p.predict_index.tolist() == [1, 5, 6]  # b predicts c; f predicts g; g predicts h
    assert p.target_ids.tolist() == [13, 17, 18]
    assert p.unpack(torch.tensor([1.0, 2.0, 3.0])).tolist() == [[1.0, 0.0], [2.0, 3.0]]
    only_first = pack_rows(b, torch.tensor([0]))
    assert only_first.response_mask.shape == (1, 1)  # trimmed to the longest packed response
    # The layout was planned on the host: the varlen boundaries come with it, equal to the decoder's own.
    assert p.max_len == 5 and p.boundaries.cu_seqlens.tolist() == packed_boundaries(p.seq_ids).cu_seqlens.tolist()
    assert "attention_mask" in b._host and b.select(torch.tensor([1]))._host == {}  # a new batch, a new copy
    reordered = pack_rows(b, torch.tensor([1, 0]))  # rows in any order
    assert reordered.input_ids.tolist() == [[14, 15, 16, 17, 18, 11, 12, 13]]
    assert reordered.target_ids.tolist() == [17, 18, 13] and reordered.predict_index.tolist() == [2, 3, 6]


def test_split_packed_by_tokens_counts_real_tokens_and_balances_groups():
    b = _batch([2, 2, 2, 2, 2], [2, 2, 2, 2, 2], P=6, R=6)  # 4 real tokens per row, 12 columns
    groups = [g.tolist() for g in split_packed_by_tokens(b, 16)]
    # 20 tokens need 2 groups; dealt out longest first to the lightest group: 12 + 8, not 16 + 4
    assert groups == [[0, 2, 4], [1, 3]]
    # another rank needs 4 micro-batches: this one makes 4 as well, still balanced (8, 4, 4, 4)
    assert [g.tolist() for g in split_packed_by_tokens(b, 16, num_groups=4)] == [[0, 4], [1], [2], [3]]
    mixed = _batch([1, 9, 3, 6, 2], [12, 1, 5, 3, 8])  # real lengths 13, 10, 8, 9, 10
    # 50 tokens, budget 25: 13 + 9 = 22 and 10 + 8 + 10 = 28 > 25, so three groups: 13 | 10 + 9 | 10 + 8
    assert [g.tolist() for g in split_packed_by_tokens(mixed, 25)] == [[0], [1, 3], [2, 4]]
    long_row = _batch([2, 9, 2], [2, 9, 2])
    assert [g.tolist() for g in split_packed_by_tokens(long_row, 8)] == [[0], [1], [2]]  # 18 > 8 goes alone


def test_packed_sequences_do_not_see_each_other():
    model = _model().eval()
    b = _batch([3, 5], [4, 2])
    p = pack_rows(b, torch.arange(2))
    with torch.no_grad():
        packed = model(p.input_ids, position_ids=p.position_ids, seq_ids=p.seq_ids)[0]  # [N, H]
        for k in range(2):
            lo, hi = int(p.cu_seqlens[k]), int(p.cu_seqlens[k + 1])
            alone = model(p.input_ids[:, lo:hi], position_ids=p.position_ids[:, lo:hi])[0]
            torch.testing.assert_close(packed[lo:hi], alone, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="no kv_cache"):
        model(p.input_ids, position_ids=p.position_ids, seq_ids=p.seq_ids,
              kv_cache=KVCache.allocate(model.config, 1, 32, torch.float32, "cpu"))


# rows of very different lengths, including a one-token response and a long one
PROMPTS, RESPONSES = [1, 9, 3, 6, 2], [12, 1, 5, 3, 8]


@pytest.mark.parametrize("budget", [10, 25, 1000])
def test_packed_logprobs_and_values_equal_the_padded_path(budget):
    b = _batch(PROMPTS, RESPONSES, R=14)
    model, critic = _model().eval(), _value_model().eval()
    for fn, kw in ((batch_logprobs, dict(model=model, temperature=0.7)), (batch_values, dict(value_model=critic))):
        padded = fn(batch=b, token_budget=budget, packing=False, **kw)
        packed = fn(batch=b, token_budget=budget, packing=True, **kw)
        assert packed.shape == (5, 14)
        assert packed.abs().sum() > 0
        torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    idx = torch.tensor([0, 2, 3])
    lp_pad, ent_pad, m_pad = rows_logprobs(model, b, idx, packing=False, temperature=1.0, with_entropy=True)
    lp_pk, ent_pk, m_pk = rows_logprobs(model, b, idx, packing=True, temperature=1.0, with_entropy=True)
    assert torch.equal(m_pk, m_pad)
    torch.testing.assert_close(lp_pk, lp_pad, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_pk, ent_pad, atol=1e-5, rtol=0)


def test_packed_micro_batch_gradients_equal_the_padded_ones():
    b = _batch(PROMPTS, RESPONSES)
    idx = torch.arange(5)
    weights = torch.randn(5, max(RESPONSES), generator=torch.Generator().manual_seed(3))

    def grads(packing):
        model, critic = _model(), _value_model()
        logp, ent, mask = rows_logprobs(model, b, idx, packing=packing, temperature=1.0, with_entropy=True)
        values, _ = rows_values(critic, b, idx, packing=packing)
        w = weights[:, : mask.shape[1]] * mask
        ((logp * w).sum() - 0.1 * (ent * mask).sum() + (values * w).sum()).backward()
        named = list(model.named_parameters()) + [("critic." + n, p) for n, p in critic.named_parameters()]
        return {n: p.grad.clone() for n, p in named if p.grad is not None}

    padded, packed = grads(False), grads(True)
    assert padded.keys() == packed.keys() and len(padded) > 10
    for name in padded:
        torch.testing.assert_close(packed[name], padded[name], atol=1e-5, rtol=1e-4, msg=name)


def _first_step(tmp_path, packing):
    torch.manual_seed(0)
    cfg = load_config(None, make_run_dir(str(tmp_path)) + [
        "trainer.loggers=[jsonl]", "trainer.total_steps=1", "data.val_files=[]", "algorithm.adv_estimator=gae",
        "algorithm.kl_placement=loss", "algorithm.kl_coef=0.1", "ppo.micro_batch_tokens=40",
        f"ppo.packing={str(packing).lower()}"])
    trainer = RLTrainer.from_config(cfg)
    assert trainer.actor.packing is packing and trainer.critic.packing is packing
    assert trainer.ref_policy.packing is packing
    trainer.fit()
    lines = [json.loads(line) for line in open(os.path.join(tmp_path, "logs", "metrics.jsonl"))]
    return {k: v for k, v in lines[-1].items() if isinstance(v, (int, float))
            and not k.startswith(("timing_s/", "perf/", "hybrid/to_"))}


@pytest.mark.slow
def test_a_packed_run_logs_the_same_first_step_as_a_padded_one(tmp_path):
    padded = _first_step(tmp_path / "padded", False)
    packed = _first_step(tmp_path / "packed", True)
    assert padded.keys() == packed.keys()
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm", "critic/vf_loss"):
        assert key in padded, key
    for key in padded:
        assert packed[key] == pytest.approx(padded[key], abs=1e-5), key


def test_packing_defaults_to_auto_which_is_padded_on_the_cpu(tmp_path):
    """null = auto: on where the varlen kernel runs (CUDA, bf16/fp16); the CPU's dense block mask is slower."""
    from phaserl.config.schema import PPOConfig

    assert PPOConfig().packing is None
    trainer = RLTrainer.from_config(load_config(None, make_run_dir(str(tmp_path)) + ["algorithm.adv_estimator=gae"]))
    assert trainer.actor.packing is False and trainer.critic.packing is False and trainer.ref_policy.packing is False
