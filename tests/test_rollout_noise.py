"""Keyed sampling noise: a sequence's draws depend on (the call's seed, its key, the position), nothing else.

The noise itself (sampling.keyed_noise: splitmix64 against its published test vector and a pure-Python
twin), the sampler it feeds (frequencies over many keys against softmax(z / T), with and without top-k),
and what it buys: generate() gives the same samples whatever batch_size or refill do with the slots, and a
DecodeSession gives the same turns when its sequences take other slots, decode beside others and resume in
another order than a lock-step schedule. The Triton twins (sample_kernel.sample, sample_kernel.keyed_noise) run under
TRITON_INTERPRET=1 (or on CUDA).
"""
import random

import pytest
import torch

from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams, kernels, sample_kernel
from phaserl.rollout.sampling import GAMMA, keyed_noise, mix64
from phaserl.rollout.torch_path import sample_tokens
from tests.test_rollout_engine import PROMPTS, tiny_model

torch.set_num_threads(1)
U64 = (1 << 64) - 1


def splitmix64_reference(state: int) -> int:
    """splitmix64's next output from `state` (Vigna's C code, in Python's unbounded ints masked to 64 bits)."""
    z = (state + 0x9E3779B97F4A7C15) & U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return z ^ (z >> 31)


def signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def test_mix64_is_splitmix64_in_wrapping_int64_torch_ops():
    # splitmix64 seeded with 0 first returns 0xE220A8397B1DCDAF (the published test vector)
    assert mix64(torch.tensor([GAMMA])).item() == signed(0xE220A8397B1DCDAF) == signed(splitmix64_reference(0))
    states = [0, 1, 2**63 - 1, 2**63, U64, 0x0123456789ABCDEF]  # sign bits set and not: the shifts must be logical
    got = mix64(torch.tensor([signed(s) for s in states]) + GAMMA).tolist()
    assert got == [signed(splitmix64_reference(s)) for s in states]


def test_keyed_noise_is_exponential_and_a_function_of_key_and_position_only():
    seed = torch.tensor([987654321])
    keys, at = torch.arange(4000), torch.full((4000,), 7)
    noise = keyed_noise(seed, keys, at, 50)  # [4000, 50]
    assert (noise > 0).all() and noise.isfinite().all()
    assert abs(noise.mean().item() - 1) < 0.01 and abs(noise.var().item() - 1) < 0.03  # Exp(1): mean = var = 1
    # P(E > t) = exp(-t) at a few thresholds (200k draws: 4 sigma is < 0.005)
    for t in (0.1, 1.0, 3.0):
        assert abs((noise > t).float().mean().item() - torch.exp(torch.tensor(-t)).item()) < 0.005
    order = torch.randperm(4000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(keyed_noise(seed, keys[order], at[order], 50), noise[order])  # rows: any slot, same noise
    assert not torch.equal(keyed_noise(seed, keys, at + 1, 50), noise)  # the next position: other noise
    assert not torch.equal(keyed_noise(seed + 1, keys, at, 50), noise)  # another call's seed: other noise
    assert not torch.equal(noise[0], noise[1])  # another sequence: other noise


@pytest.mark.parametrize("T, top_k", [(1.0, 0), (1.5, 0), (0.7, 3)])
def test_sampling_with_keyed_noise_draws_from_softmax_over_temperature(T, top_k):
    z = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, 3.0, -30.0])
    rows = 4000
    logits = z.repeat(rows, 1)  # [rows, 7]: one distribution, one draw per key
    noise = keyed_noise(torch.tensor([42]), torch.arange(rows), torch.zeros(rows, dtype=torch.long), 7)
    tokens, logprobs = sample_tokens(logits, noise, False, T, top_k, 1.0)
    scaled = z / T
    kept = scaled.masked_fill(scaled < scaled.topk(top_k).values[-1], float("-inf")) if top_k else scaled
    probs = kept.softmax(-1)
    freq = torch.bincount(tokens, minlength=7).float() / rows
    assert (freq - probs).abs().max() < 4 * (0.25 / rows) ** 0.5  # 4 sigma of a binomial at p = 0.5
    # the log-prob stays under the unfiltered log_softmax(z / T), as the trainer recomputes it
    torch.testing.assert_close(logprobs, scaled.log_softmax(-1)[tokens], atol=1e-6, rtol=0)


def test_generate_samples_the_same_whatever_the_batch_size_and_refill():
    """Each sequence's noise is keyed by its index in the call: slots, refill and compaction do not change it."""
    model = tiny_model()
    prompts = PROMPTS * 3  # 18 sequences; repeats of one prompt still draw their own samples
    caps = [8, 3, 6, 1, 5, 8] * 3
    params = SamplingParams(max_new_tokens=8, temperature=1.0)

    def sample(batch_size, refill=True, seed=3):
        engine = RolloutEngine(model, EngineConfig(max_slots=32, refill=refill))
        return engine.generate(prompts, params, eos_token_ids=[], pad_token_id=0, batch_size=batch_size,
                               max_new_tokens=caps, generator=torch.Generator().manual_seed(seed))

    whole = sample(None)
    for other in (sample(2), sample(5), sample(4, refill=False)):
        assert other.response_ids == whole.response_ids
        for a, b in zip(other.logprobs, whole.logprobs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    assert whole.response_ids[0] != whole.response_ids[6]  # the same prompt, another key: another sample
    assert sample(None, seed=4).response_ids != whole.response_ids


OBS = {k: [[30 + k, 31], [32 + k], [33]] for k in range(6)}  # appended after turns 1, 2, 3; then released


def scrambled(session, prompts, caps, seed: int) -> dict:
    """Fewer slots than sequences (they wait, start in reverse order), each turn's observation arrives after a
    random number of steps, and sequences resume in whatever order their observations arrive."""
    rng = random.Random(seed)
    turns, waiting, held, step = {k: [] for k in prompts}, sorted(prompts, reverse=True), [], 0
    while waiting or held or not session.idle:
        while waiting and session.free_slots:
            key = waiting.pop(0)
            session.start(key, prompts[key], caps[key])
        due = [h for h in held if h[0] <= step]
        rng.shuffle(due)
        for h in due:
            held.remove(h)
            session.extend(h[1], h[2], caps[h[1]])
        for turn in session.step():
            done = turns[turn.key]
            done.append(turn)
            if len(done) <= len(OBS[turn.key]):
                held.append((step + rng.randint(0, 4), turn.key, OBS[turn.key][len(done) - 1]))
            else:
                session.release(turn.key)
        step += 1
    return turns


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)],
                         ids=["T1", "topk-topp"])
def test_a_sequence_samples_the_same_turns_in_any_slot_batch_and_order_of_resumption(settings):
    model = tiny_model()
    params = SamplingParams(max_new_tokens=5, **settings)
    prompts = {k: PROMPTS[k % len(PROMPTS)] for k in OBS}
    caps = {k: 3 + k % 3 for k in OBS}
    results = []
    for slots, schedule in ((6, None), (3, 1), (4, 2)):
        engine = RolloutEngine(model, EngineConfig(max_slots=slots))
        with engine.session(params, slot_len=48, eos_token_ids=[], generator=torch.Generator().manual_seed(9)) as s:
            results.append(drive_lock_step(s, prompts, caps) if schedule is None else scrambled(s, prompts, caps,
                                                                                                 schedule))
            if schedule is not None:
                assert s.stats.swaps > 0  # sequences really moved to other slots
    reference = results[0]
    assert all(len(reference[k]) == len(OBS[k]) + 1 for k in OBS)
    for other in results[1:]:
        for key in OBS:
            assert [t.token_ids for t in other[key]] == [t.token_ids for t in reference[key]], key
            for a, b in zip(other[key], reference[key]):
                torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert len({tuple(t.token_ids) for k in OBS for t in reference[k]}) > 3  # samples, not one repeated answer


def drive_lock_step(session, prompts, caps) -> dict:
    """All sequences start at once; when every one has ended its turn, all resume together in key order."""
    turns = {k: [] for k in prompts}
    for key in sorted(prompts):
        session.start(key, prompts[key], caps[key])
    while not session.idle:
        for turn in session.step():
            turns[turn.key].append(turn)
        if session.decoding == 0:
            for key in sorted(turns):
                if key not in session.live:
                    continue
                if len(turns[key]) <= len(OBS[key]):
                    session.extend(key, OBS[key][len(turns[key]) - 1], caps[key])
                else:
                    session.release(key)
    return turns


def test_noise_keys_follow_their_sequence_and_must_be_ints():
    model = tiny_model()
    engine = RolloutEngine(model, EngineConfig(max_slots=2))
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    firsts = []
    for keys in ((7, 8), (8, 7)):  # the same two sequences in swapped slots, named by their noise keys
        with engine.session(params, slot_len=40, eos_token_ids=[], generator=torch.Generator().manual_seed(1)) as s:
            for name, noise_key in zip("ab", keys):
                s.start(name, PROMPTS[0], 4, noise_key=noise_key)
            ended = {}
            while len(ended) < 2:
                ended.update({t.key: t.token_ids for t in s.step()})
            firsts.append(ended)
    assert firsts[0]["a"] == firsts[1]["b"] and firsts[0]["b"] == firsts[1]["a"] and firsts[0]["a"] != firsts[0]["b"]
    with engine.session(params, slot_len=40, eos_token_ids=[]) as s:
        with pytest.raises(TypeError, match="noise_key"):
            s.start("a", PROMPTS[0], 4, noise_key="a")


# ------------------------------------------------------------------ Triton twins (CUDA, or the interpreter)
def kernel_device() -> str:
    if not kernels.available(torch.device("cuda" if torch.cuda.is_available() else "cpu")):
        pytest.skip("needs Triton on CUDA (or TRITON_INTERPRET=1 with Triton installed)")
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("block", [4096, 2])  # 2: four vocabulary blocks, the two-level draw at work
def test_the_triton_sampler_draws_by_key_and_position_not_by_row(block, monkeypatch):
    device = kernel_device()
    monkeypatch.setattr(sample_kernel, "SAMPLE_BLOCK", block)
    z = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, 3.0, -30.0])
    rows, T = (3000 if device == "cuda" else 800), 1.5  # the interpreter runs each row's program in Python
    logits = z.repeat(rows, 1).to(device)
    seed, keys, at = (torch.tensor([77], device=device), torch.arange(rows, device=device),
                      torch.full((rows,), 5, device=device))
    tokens, logprobs = sample_kernel.sample(logits, seed, keys, at, False, T)
    probs = (z / T).softmax(-1)
    freq = torch.bincount(tokens.cpu(), minlength=7).float() / rows
    assert (freq - probs).abs().max() < 4 * (0.25 / rows) ** 0.5  # over keys, a draw from softmax(z / T)
    torch.testing.assert_close(logprobs.cpu(), probs.log()[tokens.cpu()], atol=1e-5, rtol=0)
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(0)).to(device)
    moved, _ = sample_kernel.sample(logits, seed, keys[order].contiguous(), at[order].contiguous(), False, T)
    assert torch.equal(moved, tokens[order])  # each (key, position) draws the same token in any row
    assert not torch.equal(sample_kernel.sample(logits, seed, keys, at + 1, False, T)[0], tokens)
    noise = sample_kernel.keyed_noise(seed, keys, at, 7)  # the torch sampler's noise (top-k / top-p) on CUDA
    assert (noise > 0).all() and abs(noise.mean().item() - 1) < 0.03
    moved = sample_kernel.keyed_noise(seed, keys[order].contiguous(), at[order].contiguous(), 7)
    assert torch.equal(moved, noise[order])
