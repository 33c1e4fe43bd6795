"""The KV pool for models whose layers differ in width (Gemma 4: global layers of 1 kv head x 32 here, 512 at the 1B
shape; sliding layers of 2 x 8, 1 x 256 there): every layer's row is exactly its own kv heads x head_dim wide, the
pool's bytes are what the doctor counts, more slots fit the same memory than when every row took the widest layer's
width, and moving / exchanging slots (compaction, session packing) keeps every layer's KV exact.

Regression: the pool gave every layer the widest layer's row, 40% of it unused at the 1B shape.
"""
import pytest
import torch
import transformers

from _hf_pairs import greedy_reference, randomize
from phaserl.models import CausalLM, DecoderConfig
from phaserl.models.families import config_from_hf
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams
from phaserl.rollout.kv_pool import KVPool
from phaserl.rollout.slot_memory import slot_memory

torch.set_num_threads(1)

MIXED = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def gemma4_tiny() -> CausalLM:
    """Gemma 4 text, 4 layers: sliding ones 2 kv heads x 8 (rows of 16), global ones 1 x 32 with v = k (rows of 32)."""
    hf = transformers.Gemma4TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        hidden_size_per_layer_input=0, sliding_window=3, layer_types=MIXED, final_logit_softcapping=5.0,
        max_position_embeddings=256)
    torch.manual_seed(0)
    return randomize(CausalLM(config_from_hf(hf.to_dict())))


def gemma4_1b_config() -> DecoderConfig:
    """benchmarks/families.py's gemma4-1b shape: 26 layers, sliding 1 kv head x 256, global (5, 11, 17, 23, 25)
    1 x 512."""
    types = ["full_attention" if i in (5, 11, 17, 23, 25) else "sliding_attention" for i in range(26)]
    return DecoderConfig(model_type="gemma4_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                         num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                         global_head_dim=512, global_kv_heads=1, attention_k_eq_v=True, sliding_window=512,
                         layer_types=types, max_position_embeddings=32768)


def test_each_layers_row_is_its_own_width_and_the_buffer_holds_nothing_else():
    model = gemma4_tiny()
    pool = KVPool(model.config, torch.float32, "cpu", token_budget=3 * 64)
    keys, values = pool.layout(num_slots=3, slot_len=64)
    assert [tuple(k.shape) for k in keys] == [(3, 2, 64, 8), (3, 1, 64, 32)] * 2
    measured = pool.buffer.numel() * pool.buffer.element_size() // pool.capacity_tokens
    # K and V x (2 sliding layers x 2 heads x 8 + 2 global layers x 1 head x 32) x 4 bytes; the old rows: 2 x 4 x 32 x 4
    assert measured == 2 * (2 * 2 * 8 + 2 * 1 * 32) * 4 == 768
    assert KVPool.token_bytes(model.config, torch.float32) == pool.bytes_per_token == measured
    assert slot_memory(model.config, torch.float32).kv_per_token == measured  # what the doctor counts
    # The views tile the buffer: each layer's keys and values are their own memory, together all of it.
    assert sum(t.numel() for t in keys + values) == pool.buffer.numel()
    for i, t in enumerate(keys + values):
        t.fill_(i + 1)
    assert all((t == i + 1).all() for i, t in enumerate(keys + values))
    assert (pool.buffer != 0).all()
    # sleep() frees all of it, wake() takes the same bytes again (the hybrid actor's switches)
    assert pool.sleep() == 3 * 64 * 768 and not pool.awake and pool.regions == []
    assert pool.wake() == 3 * 64 * 768
    assert [tuple(k.shape) for k in pool.layout(3, 64)[0]] == [(3, 2, 64, 8), (3, 1, 64, 32)] * 2


def test_the_gemma4_1b_shape_takes_40_percent_less_and_fits_more_slots_in_the_same_memory(monkeypatch):
    cfg = gemma4_1b_config()
    meta = KVPool(cfg, torch.bfloat16, "meta", token_budget=1000)
    meta.wake()
    measured = meta.allocated_bytes // meta.capacity_tokens  # from the buffer's numel, on the meta device
    assert measured == 2 * (21 * 256 + 5 * 512) * 2 == 31744  # bf16; the widest-row rule took 2 x 26 x 512 x 2 = 53248
    assert 1 - measured / 53248 > 0.4
    # The same memory (40% of 100 GiB free) holds measured-sized tokens, not widest-row-sized ones.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * 2**30, 140 * 2**30))
    pool = KVPool(cfg, torch.bfloat16, "cuda", memory_fraction=0.4)
    budget = int(100 * 2**30 * 0.4)
    assert pool._target_tokens() == budget // measured
    slot_len = 384  # 128 + 256, families.py's run
    assert pool._target_tokens() // slot_len == 3523 > budget // 53248 // slot_len == 2100


def slot_contents(keys, values, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for t in keys + values]


def test_move_and_swap_slots_keep_every_layers_kv_exact_on_a_mixed_width_pool():
    engine = RolloutEngine(gemma4_tiny(), EngineConfig(max_slots=4))
    runner, params = engine.runner, SamplingParams(max_new_tokens=8, temperature=0.0)
    with torch.inference_mode():  # as generate() runs it
        runner.begin(4, 64, 8, params, [])
        assert len(engine.pool.slot_rows(4, 64)) == 2  # one index copy per width group, not one per layer
        g = torch.Generator().manual_seed(0)
        for t in runner.keys + runner.values:
            t.copy_(torch.randn(t.shape, generator=g))
        before = [slot_contents(runner.keys, runner.values, s) for s in range(4)]

        runner.move([(3, 0)])  # compaction: slot 3's sequence moves down to 0, 3 keeps a stale copy
        after = [slot_contents(runner.keys, runner.values, s) for s in range(4)]
        for now, then in zip(after, [before[3], before[1], before[2], before[3]]):
            for a, b in zip(now, then):
                torch.testing.assert_close(a, b, rtol=0, atol=0)

        runner.swap_slots([(0, 2), (1, 3)])  # session packing: both pairs exchanged
        swapped = [slot_contents(runner.keys, runner.values, s) for s in range(4)]
        for now, then in zip(swapped, [after[2], after[3], after[0], after[1]]):
            for a, b in zip(now, then):
                torch.testing.assert_close(a, b, rtol=0, atol=0)

        # A call with the same layout keeps the same views (CUDA graphs captured on them stay valid).
        pointers = [t.data_ptr() for t in runner.keys + runner.values]
        runner.begin(4, 64, 8, params, [])
        assert [t.data_ptr() for t in runner.keys + runner.values] == pointers


LADDER = [[5, 6, 7], [1, 2, 3, 4, 8, 9, 10], [11], [12, 13, 14, 15, 16], [20, 21], [30, 31, 32, 33, 34, 35, 36]]


def spy_moves(runner) -> list:
    """Record every compaction the engine makes (runner.move's pairs), still moving the slots."""
    moves, move = [], runner.move
    runner.move = lambda pairs: (moves.append(list(pairs)), move(pairs))[1]
    return moves


def test_gemma4_greedy_after_compaction_equals_the_uncached_loop():
    # Slot i's response is shorter than slot i + 1's: as the short ones finish, the long ones move down
    # (5 -> 0, 4 -> 1, 3 -> 2) and go on decoding from the moved KV of both width groups.
    model = gemma4_tiny()
    engine = RolloutEngine(model, EngineConfig(max_slots=6))
    moves = spy_moves(engine.runner)
    caps = [2, 4, 6, 8, 10, 24]
    result = engine.generate(LADDER, SamplingParams(max_new_tokens=24, temperature=0.0), eos_token_ids=[],
                             pad_token_id=0, max_new_tokens=caps)
    assert len(moves) >= 2, "the test must compact: long sequences have to move down"
    assert result.response_ids == [greedy_reference(model, p, n) for p, n in zip(LADDER, caps)]


def test_gemma4_sequences_resumed_into_parked_slots_continue_exactly():
    # A multi-turn session: each resumed sequence moves down into the lowest slot not decoding, its KV of both
    # width groups exchanged with the parked sequence there (runner.swap_slots); every turn is still what the whole
    # conversation gives.
    model = gemma4_tiny()
    engine = RolloutEngine(model, EngineConfig(max_slots=4))
    observations = {0: [20, 21], 1: [22], 2: [23, 24, 25], 3: [26]}
    with engine.session(SamplingParams(max_new_tokens=6, temperature=0.0), slot_len=64, eos_token_ids=[]) as s:
        for key in observations:
            s.start(key, LADDER[key], cap=6)
        first, second = {}, {}
        while len(first) < 4:
            first.update({t.key: t for t in s.step()})
        for key in (3, 1, 2, 0):  # highest slot first: 3 takes slot 0 from the parked 0, ...
            s.extend(key, observations[key], 6)
            while key not in second:
                second.update({t.key: t for t in s.step()})
        assert s.stats.swaps >= 1
    for key, obs in observations.items():
        assert first[key].token_ids == greedy_reference(model, LADDER[key], 6)
        assert second[key].token_ids == greedy_reference(model, LADDER[key] + first[key].token_ids + obs, 6)


@pytest.mark.gpu
def test_gpu_gemma4_pool_from_memory_fraction_is_exact_and_graph_greedy_survives_compaction():
    cpu = gemma4_tiny()
    model = CausalLM(cpu.config).cuda()
    model.load_state_dict(cpu.state_dict())
    model.eval()
    engine = RolloutEngine(model, EngineConfig(max_slots=8, memory_fraction=0.01))
    moves = spy_moves(engine.runner)
    prompts, caps = LADDER + [[40, 41], [50, 51, 52]], [2, 4, 6, 8, 10, 12, 14, 24]
    result = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.0), eos_token_ids=[],
                             pad_token_id=0, max_new_tokens=caps)
    pool = engine.pool
    assert pool.allocated_bytes == pool.capacity_tokens * 2 * (2 * 2 * 8 + 2 * 1 * 32) * 4
    assert moves and engine.last_stats["graphs"] > 1
    assert result.response_ids == [greedy_reference(model, p, n) for p, n in zip(prompts, caps)]
