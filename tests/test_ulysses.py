"""Ulysses sequence parallelism (parallel/ulysses.py): k gloo ranks, each holding 1/k of every sequence's tokens,
give the single-process log-probs, entropies and (summed over the ranks) gradients, for a Qwen2-like tiny model
with fewer kv heads than ranks (each repeated) and with as many or more; padded and packed micro-batches; a length
k does not divide. Tolerance: float32, 1e-5 absolute (the split changes only the order of the sums in attention's
output projection and the head's chunking). Bad settings are ConfigErrors."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _multiproc import free_port, start_method
from phaserl.errors import ConfigError
from phaserl.models import CausalLM, DecoderConfig
from phaserl.parallel.ulysses import SequenceParallel, check_heads, check_model, check_world, kv_repeat

TOL = dict(rtol=1e-4, atol=1e-5)


def _model(heads: int, kv_heads: int) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(DecoderConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                  max_position_embeddings=64, attention_bias=True)).train()


def _pass(model, batch, packing: bool):
    """Log-probs and entropies of every response token, and the gradients of a loss of both."""
    from phaserl.roles.forward import rows_logprobs

    model.zero_grad(set_to_none=True)
    idx = torch.arange(batch.input_ids.shape[0])
    logp, ent, mask = rows_logprobs(model, batch, idx, packing=packing, temperature=1.0, with_entropy=True)
    loss = (logp * mask).sum() / mask.sum() - 0.1 * (ent * mask).sum() / mask.sum()
    loss.backward()
    return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rank(rank: int, world: int, port: int, heads: int, kv_heads: int) -> None:
    from test_memory_offload import rollout_batch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        batch = rollout_batch(lengths=((5, 8), (2, 6), (4, 8)), P=5, R=8)  # 13 tokens a row: k does not divide it
        model = _model(heads, kv_heads)
        for packing in (False, True):
            model.model.sequence_parallel = None
            want = _pass(model, batch, packing)
            model.model.sequence_parallel = SequenceParallel()
            got = _pass(model, batch, packing)
            torch.testing.assert_close(got[0], want[0], **TOL)
            torch.testing.assert_close(got[1], want[1], **TOL)
            assert got[2].keys() == want[2].keys()
            for name, grad in got[2].items():
                dist.all_reduce(grad)  # each rank holds its tokens' share: the sum is the whole
                torch.testing.assert_close(grad, want[2][name], **TOL, msg=lambda m: f"{name}, packing={packing}: {m}")
    finally:
        dist.destroy_process_group()


def _spawn(world: int, heads: int, kv_heads: int) -> None:
    mp.start_processes(_rank, args=(world, free_port(), heads, kv_heads), nprocs=world, join=True,
                       start_method=start_method())


@pytest.mark.slow
@pytest.mark.parametrize("world, heads, kv_heads", [
    (2, 4, 2),   # kv heads >= ranks: split as they are
    (4, 4, 2),   # kv heads < ranks: each repeated twice
    (4, 8, 2),   # two query heads a rank, one kv head (of two repeats)
])
def test_ranks_give_the_single_process_logprobs_and_gradients(world, heads, kv_heads):
    _spawn(world, heads, kv_heads)


def test_two_ranks_with_one_kv_head_give_the_single_process_logprobs():
    """The quick lane's case: 2 ranks, one kv head (repeated on both)."""
    _spawn(2, 2, 1)


def test_the_split_of_tokens_and_heads_on_one_rank():
    sp = SequenceParallel(k=3, rank=2)
    x = torch.arange(7.0)[None, :, None]  # [1, 7, 1]
    assert sp.chunk(7) == 3 and sp.split(x)[0, :, 0].tolist() == [6.0, 0.0, 0.0]  # the last slice, zero-padded
    assert sp.owned(7).tolist() == [False] * 6 + [True]
    assert sp.place(sp.split(x), 7)[0, :, 0].tolist() == [0.0] * 6 + [6.0]
    assert [kv_repeat(kv, 4) for kv in (1, 2, 4, 8, 6)] == [4, 2, 1, 1, 2]


def test_the_key_is_checked_against_the_launch():
    from phaserl.config import load_config

    base = ["rollout.prompts_per_step=4", "rollout.batch_size=1"]
    assert load_config(None, []).actor.sequence_parallel == 1
    assert load_config(None, base + ["actor.sequence_parallel=2"], world_size=4).actor.sequence_parallel == 2
    with pytest.raises(ConfigError, match="must divide the world size"):
        load_config(None, base + ["actor.sequence_parallel=3"], world_size=4)
    with pytest.raises(ConfigError, match="must divide the world size"):
        load_config(None, ["actor.sequence_parallel=2"])  # one process
    with pytest.raises(ConfigError, match="actor.sequence_parallel"):
        load_config(None, ["actor.sequence_parallel=0"])


def test_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match="divide the world size"):
        check_world(3, 4)
    with pytest.raises(ConfigError, match="14 query heads, which do not split over 4 ranks.*2, 7, 14"):
        check_heads([(14, 2)], 4)
    check_heads([(12, 2), (12, 2)], 4)  # 2 kv heads over 4 ranks: repeated, allowed
    with pytest.raises(ConfigError, match="12 query heads"):
        check_model(_model(4, 2).config.replace(num_attention_heads=12, num_key_value_heads=4), 8)
    moe = DecoderConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=16)
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        check_model(moe, 2)
