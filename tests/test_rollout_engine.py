"""RolloutEngine against a plain uncached forward loop: greedy tokens, refill, log-probs, stops, sleep/wake.

CPU tests run the engine's eager path on tiny float32 decoders; the GPU tests (@pytest.mark.gpu) run
the same code with CUDA graphs (and torch.compile) and compare bf16 log-probs with the trainer's.
"""
import logging

import pytest
import torch

from phaserl.algo import token_logprobs_from_hidden
from phaserl.errors import ConfigError, DataError
from phaserl.models import CausalLM, DecoderConfig
from phaserl.roles import HybridActor
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams, kernels, sample_kernel
from phaserl.rollout.runner import fused_weights
from phaserl.rollout.scheduler import Scheduler, Sequence
from phaserl.rollout.torch_path import cached_attention

torch.set_num_threads(1)
VOCAB = 40
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 8, 9, 10], [11], [12, 13, 14, 15], [3, 3], [20, 21, 22, 23, 24, 25]]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


def tiny_model(model_type: str = "qwen2", seed: int = 0, **overrides) -> CausalLM:
    """A random decoder whose next-token distributions are far from uniform (weights ~ 0.2 N(0, 1))."""
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg = DecoderConfig(model_type=model_type, attention_bias=model_type == "qwen2",
                        qk_norm=model_type in ("qwen3", "gemma4_text"), **{**shape, **overrides})
    model = CausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model(torch.tensor([ids], device=model.output_weight.device)))[0].float()  # [T, V]


def greedy_reference(model, prompt: list[int], n: int, stop=()) -> list[int]:
    """No cache, no batching: argmax of a full forward over everything so far, one token at a time."""
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(int(full_logits(model, seq)[-1].argmax()))
        seq.append(out[-1])
        if out[-1] in stop:
            break
    return out


def run(model, prompts, params=GREEDY, *, eos=(), config=None, **kwargs):
    engine = RolloutEngine(model, config or EngineConfig())
    return engine.generate(prompts, params, eos_token_ids=list(eos), pad_token_id=0, **kwargs), engine


# ------------------------------------------------------------------------------------------------ CPU
@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen3"])
def test_greedy_equals_the_uncached_forward_loop(model_type):
    model = tiny_model(model_type, seed=1)
    result, _ = run(model, PROMPTS)
    assert result.response_ids == [greedy_reference(model, p, 8) for p in PROMPTS]
    assert result.finish_reasons == ["length"] * len(PROMPTS)


def test_refill_with_more_prompts_than_slots_matches_one_at_a_time(model):
    # Different caps and a stop token make sequences finish at different steps, so freed slots are
    # refilled mid-flight and the drained batch gets compacted.
    caps = [8, 2, 5, 1, 7, 3]
    stop = greedy_reference(model, PROMPTS[0], 8)[3]
    together, engine = run(model, PROMPTS, eos=[stop], config=EngineConfig(max_slots=2), max_new_tokens=caps)
    for prompt, cap, got in zip(PROMPTS, caps, together.response_ids):
        alone, _ = run(model, [prompt], eos=[stop], max_new_tokens=[cap])
        assert got == alone.response_ids[0] == greedy_reference(model, prompt, cap, stop=[stop])
    assert engine.last_stats["slots"] == 2
    # static batching would need sum over pairs of the longer response; refill needs fewer steps
    lengths = [len(r) for r in together.response_ids]
    static_steps = sum(max(lengths[i:i + 2]) for i in range(0, len(lengths), 2))
    assert engine.last_stats["steps"] < static_steps + 3


def test_sampled_logprobs_equal_a_full_forward_log_softmax(model):
    params = SamplingParams(max_new_tokens=6, temperature=0.7, top_k=5, top_p=0.9)
    prompts = [p for p in PROMPTS for _ in range(3)]  # three samples per prompt share one prefill
    result, _ = run(model, prompts, params, generator=torch.Generator().manual_seed(3))
    for prompt, tokens, logprobs in zip(prompts, result.response_ids, result.logprobs):
        logits = full_logits(model, prompt + tokens)[len(prompt) - 1:-1]  # [R, V] predicting each token
        expected = (logits / 0.7).log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-5, rtol=0)
        top5 = logits.topk(5, dim=-1).indices  # top-k filtering: every draw is among the 5 most likely
        assert all(t in row for t, row in zip(tokens, top5.tolist()))
    assert len({tuple(r) for r in result.response_ids[:3]}) > 1  # samples of one prompt differ


def test_greedy_logprob_is_the_temperature_one_log_softmax(model):
    result, _ = run(model, PROMPTS[:2])
    for prompt, tokens, logprobs in zip(PROMPTS, result.response_ids, result.logprobs):
        logits = full_logits(model, prompt + tokens)[len(prompt) - 1:-1]
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-5, rtol=0)


def test_a_seeded_generator_reproduces_samples(model):
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    a, _ = run(model, PROMPTS, params, generator=torch.Generator().manual_seed(7))
    b, _ = run(model, PROMPTS, params, generator=torch.Generator().manual_seed(7))
    c, _ = run(model, PROMPTS, params, generator=torch.Generator().manual_seed(8))
    assert a.response_ids == b.response_ids != c.response_ids


def test_eos_and_stop_tokens_end_a_response_and_max_new_tokens_caps_it(model):
    expected = greedy_reference(model, PROMPTS[1], 8)
    eos = expected[2]  # the third greedy token of prompt 1
    result, _ = run(model, PROMPTS, eos=[eos])
    assert result.response_ids[1] == expected[:expected.index(eos) + 1]  # the EOS token is kept
    assert result.finish_reasons[1] == "stop"
    for tokens, reason in zip(result.response_ids, result.finish_reasons):
        assert (reason == "stop") == (eos in tokens) and len(tokens) <= 8
        assert reason == "stop" or len(tokens) == 8
    by_stop_id, _ = run(model, PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(eos,)))
    assert by_stop_id.response_ids == result.response_ids
    ignored, _ = run(model, PROMPTS, eos=[eos], ignore_eos=True)
    assert ignored.response_ids[1] == expected and ignored.finish_reasons == ["length"] * len(PROMPTS)


def test_sleep_frees_the_kv_cache_and_wake_reallocates_it(model):
    engine = RolloutEngine(model, EngineConfig(token_budget=1024))
    per_token = 2 * 2 * 2 * 8 * 4  # k+v, 2 layers, 2 kv heads, head_dim 8, float32
    assert engine.wake() == 1024 * per_token and engine.pool.awake
    first = engine.generate(PROMPTS, GREEDY, eos_token_ids=[], pad_token_id=0)
    assert engine.sleep() == 1024 * per_token and not engine.pool.awake and engine.runner.graphs == {}
    assert engine.wake() == 1024 * per_token
    again = engine.generate(PROMPTS, GREEDY, eos_token_ids=[], pad_token_id=0)
    assert again.response_ids == first.response_ids


def test_keep_awake_sleep_keeps_the_cache_and_follows_in_place_weight_updates():
    model = tiny_model("qwen2", seed=4)
    engine = RolloutEngine(model, EngineConfig(token_budget=1024, keep_awake=True))
    engine.wake()
    first = engine.generate(PROMPTS, GREEDY, eos_token_ids=[], pad_token_id=0)
    assert engine.sleep() == 0 and engine.pool.awake  # kept for the next rollout
    with torch.no_grad():  # a training step: parameters change in place, at the same addresses
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.wake()
    again = engine.generate(PROMPTS, GREEDY, eos_token_ids=[], pad_token_id=0)
    assert again.response_ids == [greedy_reference(model, p, 8) for p in PROMPTS]
    assert again.response_ids != first.response_ids  # the kept engine saw the update
    assert engine.release() > 0 and not engine.pool.awake


def test_a_small_token_budget_means_fewer_slots_and_too_small_is_an_error(model):
    result, engine = run(model, PROMPTS, config=EngineConfig(token_budget=2 * 64))  # 2 slots of 64 positions
    assert engine.last_stats["slots"] == 2
    assert result.response_ids == [greedy_reference(model, p, 8) for p in PROMPTS]
    with pytest.raises(ConfigError, match="token_budget"):
        run(model, PROMPTS, config=EngineConfig(token_budget=32))


def test_bad_per_prompt_caps_and_prompts_are_rejected(model):
    with pytest.raises(DataError, match="outside"):
        run(model, PROMPTS[:2], max_new_tokens=[3, 9])
    with pytest.raises(DataError, match="empty"):
        run(model, [[1], []])


def test_scheduler_groups_shared_prompts_refills_and_compacts():
    seqs = [Sequence(i, (i // 2,), 4) for i in range(6)]  # prompts 0,0,1,1,2,2
    s = Scheduler(seqs, 4, admit_threshold=2)
    groups = s.admit()
    assert [(p, [q.slot for q in g]) for p, g in groups] == [((0,), [0, 1]), ((1,), [2, 3])]
    s.finish(seqs[1])
    assert s.admit() == []  # one free slot < threshold 2
    s.finish(seqs[2])
    assert [[q.index for q in g] for _, g in s.admit()] == [[4, 5]] and seqs[4].slot == 1
    for q in (seqs[0], seqs[3], seqs[4]):
        s.finish(q)
    assert s.span == 3 and s.compact(1) == [(2, 0)] and seqs[5].slot == 0 and s.span == 1
    static = Scheduler([Sequence(i, (i,), 4) for i in range(3)], 2, refill=False)
    first = static.admit()
    static.finish(first[0][1][0])
    assert static.admit() == []  # static batching waits for the whole batch


def test_hybrid_actor_rolls_out_with_the_engine_and_logs_the_kv_cache(model, caplog):
    actor = HybridActor(model)
    with caplog.at_level(logging.INFO, logger="phaserl"), actor.rollout_mode():
        result = actor.generate(PROMPTS, GREEDY, eos_token_ids=[], pad_token_id=0, batch_size=4)
    assert isinstance(actor.engine, RolloutEngine) and not actor.engine.pool.awake  # slept on the way out
    assert result.response_ids == [greedy_reference(model, p, 8) for p in PROMPTS]
    assert "KV cache allocated" in caplog.text and "KV cache freed" in caplog.text
    model.eval()


def test_fused_weights_follow_in_place_updates_of_the_actor(model):
    # Training steps update the parameters in place (same addresses): the engine's fused [q; k; v] and
    # [gate; up] copies are refilled at every generate, so rollouts use the current weights.
    layer = model.model.layers[0]
    fused = fused_weights(layer)
    assert fused.qkv.shape == (32 + 16 + 16, 32) and fused.gate_up.shape == (96, 32)
    assert torch.equal(fused.qkv[32:48], layer.self_attn.k_proj.weight)
    assert torch.equal(fused.gate_up[48:], layer.mlp.up_proj.weight)
    first, engine = run(model, PROMPTS[:2])
    with torch.no_grad():
        saved = [p.clone() for p in model.parameters()]
        for p in model.parameters():
            p.mul_(-1.0)
    try:
        changed = engine.generate(PROMPTS[:2], GREEDY, eos_token_ids=[], pad_token_id=0)
        assert changed.response_ids == [greedy_reference(model, p, 8) for p in PROMPTS[:2]]
        assert changed.response_ids != first.response_ids
    finally:
        with torch.no_grad():
            for p, old in zip(model.parameters(), saved):
                p.copy_(old)


# ------------------------------------------------------------------ Triton kernels (CUDA, or the interpreter)
def kernel_device() -> str:
    if not kernels.available(torch.device("cuda" if torch.cuda.is_available() else "cpu")):
        pytest.skip("needs Triton on CUDA (or TRITON_INTERPRET=1 with Triton installed)")
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(14, 2, 64), (4, 2, 8)])  # Qwen2-0.5B's GQA 7:1 and the tiny test model
def test_triton_decode_attention_equals_the_torch_path(dtype, heads):
    device = kernel_device()
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's interpreter computes bf16 tl.dot wrongly")
    Hq, Hkv, D = heads
    g = torch.Generator().manual_seed(0)
    slots, S = 6, 200
    keys, values = (torch.randn(slots, Hkv, S, D, generator=g).to(device, dtype) for _ in range(2))
    q = torch.randn(5, Hq, D, generator=g).to(device, dtype)
    k, v = (torch.randn(5, Hkv, D, generator=g).to(device, dtype) for _ in range(2))
    pos = torch.tensor([0, 1, 63, 64, 199], device=device)  # first position, block edges, the slot's end
    ref_keys, ref_values = keys.float(), values.float()  # copies for bf16; cached_attention writes into them
    if dtype == torch.float32:
        ref_keys, ref_values = ref_keys.clone(), ref_values.clone()
    out = kernels.decode_attention(q, k, v, keys, values, pos)
    expected = cached_attention(q.float(), k.float(), v.float(), ref_keys, ref_values, pos)
    assert torch.equal(keys, ref_keys.to(dtype)) and torch.equal(values, ref_values.to(dtype))  # k/v written
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: probabilities rounded before p.V, as flash kernels do
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=0)


@pytest.mark.parametrize("block", [4096, 2])  # 2: four vocabulary blocks, the two-level draw at work
@pytest.mark.parametrize("programs", [1, 10**6])  # one program per row; or a program per block and a merge
def test_triton_sampler_draws_from_softmax_over_temperature_with_exact_logprobs(block, programs, monkeypatch):
    device = kernel_device()
    monkeypatch.setattr(sample_kernel, "SAMPLE_BLOCK", block)
    monkeypatch.setattr(sample_kernel, "SAMPLE_PROGRAMS", programs)
    z = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, 3.0, -30.0])
    rows, T = 3000, 1.5
    logits = z.repeat(rows, 1).to(device)  # [rows, 7]: many independent draws from one distribution
    seed = torch.tensor([1234], device=device)
    keys, at = torch.arange(rows, device=device), torch.zeros(rows, dtype=torch.long, device=device)  # one per row
    tokens, logprobs = sample_kernel.sample(logits, seed, keys, at, False, T)
    probs = (z / T).softmax(-1)
    freq = torch.bincount(tokens.cpu(), minlength=7).float() / rows
    assert (freq - probs).abs().max() < 4 * (0.25 / rows) ** 0.5  # 4 sigma of a binomial at p = 0.5
    torch.testing.assert_close(logprobs.cpu(), probs.log()[tokens.cpu()], atol=1e-5, rtol=0)
    again, _ = sample_kernel.sample(logits, seed, keys, at, False, T)
    assert torch.equal(again, tokens)  # same seed, same draws
    seed += 1
    assert not torch.equal(sample_kernel.sample(logits, seed, keys, at, False, T)[0], tokens)
    wide = torch.randn(4, 10000, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    greedy, greedy_lp = sample_kernel.sample(wide, seed, keys[:4], at[:4], True, 1.0)  # several blocks per row
    assert torch.equal(greedy.cpu(), wide.float().argmax(-1).cpu())
    torch.testing.assert_close(greedy_lp.cpu(), wide.float().log_softmax(-1).amax(-1).cpu(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("greedy", [False, True])
def test_the_split_sampler_draws_what_the_one_program_sampler_draws(greedy, monkeypatch):
    device = kernel_device()
    monkeypatch.setattr(sample_kernel, "SAMPLE_BLOCK", 64)  # 1000 columns: 16 blocks, the last one partial
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(6, 1000, generator=g)).to(device)
    logits[2, 130] = logits[2, 900] = logits[2].max() + 5  # a tie across splits: the first column wins greedily
    seed = torch.tensor([77], device=device)
    keys, at = torch.arange(6, device=device) * 11, torch.arange(6, device=device)
    draws = {}
    for programs in (1, 6 * 3, 6 * 5, 6 * 16):  # 1 split; 3 (spans of 6, the last of 4); 5 asked: 4 spans of 4; 16
        monkeypatch.setattr(sample_kernel, "SAMPLE_PROGRAMS", programs)
        draws[sample_kernel.sample_splits(6, 16)] = sample_kernel.sample(logits, seed, keys, at, greedy, 0.8)
    assert sorted(draws) == [1, 3, 5, 16]
    tokens, logprobs = draws[1]
    for splits, (t, lp) in draws.items():
        assert torch.equal(t, tokens), splits
        torch.testing.assert_close(lp, logprobs, atol=1e-5, rtol=0)
    if greedy:
        assert tokens[2].item() == 130


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_gpu_greedy_float32_with_cuda_graphs_equals_the_uncached_loop(compile):
    model = tiny_model("qwen2", seed=2).cuda()
    prompts = PROMPTS * 6  # 36 sequences through 16 slots: refill, several buckets, compaction
    caps = [8, 3, 6, 1, 5, 8] * 6
    config = EngineConfig(max_slots=16, compile=compile, token_budget=4096)
    result, engine = run(model, prompts, config=config, max_new_tokens=caps)
    assert engine.last_stats["graphs"] > 1
    assert result.response_ids == [greedy_reference(model, p, c) for p, c in zip(prompts, caps)]
    engine.sleep()  # regression: recapturing after sleep()/wake() reused the dead graph memory pool
    engine.wake()
    again = engine.generate(prompts, GREEDY, eos_token_ids=[], pad_token_id=0, max_new_tokens=caps)
    assert again.response_ids == result.response_ids


@pytest.mark.gpu
def test_gpu_keep_awake_replays_the_same_graphs_after_an_in_place_update():
    model = tiny_model("qwen2", seed=2).cuda()
    engine = RolloutEngine(model, EngineConfig(max_slots=16, compile=False, token_budget=4096, keep_awake=True))
    engine.generate(PROMPTS, GREEDY, eos_token_ids=[], pad_token_id=0)
    graphs = dict(engine.runner.graphs)
    engine.sleep()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.wake()
    result = engine.generate(PROMPTS, GREEDY, eos_token_ids=[], pad_token_id=0)
    assert all(engine.runner.graphs[k] is g for k, g in graphs.items())  # replayed, not re-captured
    assert result.response_ids == [greedy_reference(model, p, 8) for p in PROMPTS]


# Rollout (incremental decode, graph-captured, bf16) and training (one full forward) round differently in
# bf16; the documented tolerance on |rollout - trainer| log-prob is mean <= 0.03 and max <= 0.3 nats
# (the same comparison on the CPU in bf16 gives mean 0.010, max 0.042).
BF16_MEAN_TOL, BF16_MAX_TOL = 0.03, 0.3


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_gpu_bf16_sampled_logprobs_match_the_trainer(compile):
    torch.manual_seed(0)
    cfg = DecoderConfig(model_type="qwen2", vocab_size=4096, hidden_size=256, intermediate_size=768,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, attention_bias=True,
                        max_position_embeddings=1024)
    model = CausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.1)  # logits std ~1.6: mean log-prob ~ -6.4 of a uniform -8.3
    model = model.to("cuda", torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 64, (16,), generator=g).tolist()
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in lengths]
    prompts = [p for p in prompts for _ in range(4)]
    T = 0.8
    result, _ = run(model, prompts, SamplingParams(max_new_tokens=48, temperature=T),
                    config=EngineConfig(compile=compile, token_budget=16384),
                    generator=torch.Generator("cuda").manual_seed(1))
    diffs = []
    with torch.no_grad():
        for prompt, tokens, logprobs in zip(prompts, result.response_ids, result.logprobs):
            hidden = model(torch.tensor([prompt + tokens], device="cuda"))[0]  # [T, H]
            trainer = token_logprobs_from_hidden(hidden[len(prompt) - 1:-1], model.output_weight,
                                                 torch.tensor(tokens, device="cuda"), temperature=T)[0]
            diffs.append((trainer.cpu() - torch.tensor(logprobs)).abs())
    diffs = torch.cat(diffs)
    print(f"bf16 rollout vs trainer log-probs (compile={compile}): mean |diff| {diffs.mean():.5f}, "
          f"max {diffs.max():.5f} over {diffs.numel()} tokens")
    assert diffs.mean() <= BF16_MEAN_TOL and diffs.max() <= BF16_MAX_TOL


def test_the_kv_cache_is_capped_at_what_the_run_can_use(monkeypatch):
    """memory_fraction of free memory, but never more than max_slots slots of the longest sequence."""
    from phaserl.rollout.kv_pool import KVPool

    cfg = DecoderConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * 2**30, 140 * 2**30))
    per_token = 2 * 2 * 2 * 8 * 2  # K and V x 2 layers x 2 kv heads x head_dim 8 x 2 bytes (bf16)
    uncapped = KVPool(cfg, torch.bfloat16, "cuda", memory_fraction=0.4)
    assert uncapped._target_tokens() == int(100 * 2**30 * 0.4) // per_token
    capped = KVPool(cfg, torch.bfloat16, "cuda", memory_fraction=0.4, max_tokens=512 * 64)
    assert capped._target_tokens() == 512 * 64
    engine_cap = EngineConfig(max_slots=8, max_seq_tokens=70)  # slots are rounded up to 64 positions: 128
    assert RolloutEngine(CausalLM(cfg), engine_cap).pool.max_tokens == 8 * 128


def test_engine_compile_raises_dynamo_recompile_limit_for_many_layer_specs():
    """Regression (H200, 2026-12-01): dynamo keeps one entry per layer spec / dtype / present weights for each
    engine function, 8 at most per process by default; with fullgraph=True the ninth model's engine failed with
    "recompile limit exceeded" (12 GPU tests in one pytest process). compile_layer_fn raises the limit.
    config.patch, not monkeypatch.setattr: monkeypatch's undo left the config entry hidden ("recompile_limit does
    not exist"), and every later torch.compile in the process failed (test_train_perf in the full suite)."""
    from phaserl.rollout import layer_fns as runner

    with torch._dynamo.config.patch(recompile_limit=8):
        compiled = runner.compile_layer_fn(lambda x, kind: x + len(kind))
        for k in range(12):  # twelve string constants (like spec.qk_norm): twelve entries for one code object
            assert compiled(torch.zeros(2), "h" * k).tolist() == [k, k]
        assert torch._dynamo.config.recompile_limit >= runner.ENGINE_RECOMPILE_LIMIT
