"""The fused decode kernels (rollout/kernels.py, rollout/fused.py) against the plain torch path.

Each kernel is compared with the layers.py / runner.py function it replaces: attention with bias + RoPE +
KV write (split into chunks, and not), RMSNorm in every rounding style, the gated activation, a whole fused
layer, and the engine's greedy tokens against an uncached forward loop. On the CPU they need Triton and
TRITON_INTERPRET=1 (the interpreter is slow: shapes stay tiny); @pytest.mark.gpu runs the Qwen2-0.5B shapes
in bf16 on CUDA.
"""
import pytest
import torch

from phaserl.models.layers import activation, post_attention, pre_attention, rms_norm, rope_tables, rotate
from phaserl.rollout import EngineConfig, fused, kernels
from phaserl.rollout.fused import decodes_fused, fusable, fused_decode_layer
from phaserl.rollout.runner import fused_weights
from phaserl.rollout.torch_path import cached_attention
from test_rollout_engine import PROMPTS, greedy_reference, run, tiny_model

torch.set_num_threads(1)


def kernel_device() -> str:
    if not kernels.available(torch.device("cuda" if torch.cuda.is_available() else "cpu")):
        pytest.skip("needs Triton on CUDA (or TRITON_INTERPRET=1 with Triton installed)")
    return "cuda" if torch.cuda.is_available() else "cpu"


def rope(S: int, D: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """layers.rope_tables [S, D] for positions 0..S-1 (base 10000)."""
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    angles = torch.arange(S)[:, None].float() * inv[None]
    emb = torch.cat([angles, angles], dim=-1)
    return tuple(t.to(device) for t in rope_tables(emb.cos(), emb.sin()))


def attention_case(heads, slots, S, rows, device, dtype, seed=0):
    Hq, Hkv, D = heads
    g = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(slots, Hkv, S, D, generator=g).to(device, dtype) for _ in range(2))
    qkv = torch.randn(rows, (Hq + 2 * Hkv) * D, generator=g).to(device, dtype)  # one GEMM's output, no bias
    bias = torch.randn((Hq + 2 * Hkv) * D, generator=g).to(device, dtype)
    return keys, values, qkv, bias


def check_fused_attention(heads, slots, S, pos, window, dtype, splits, block_n, with_bias=True):
    device = kernel_device()
    Hq, Hkv, D = heads
    keys, values, qkv, bias = attention_case(heads, slots, S, len(pos), device, dtype)
    pos = torch.tensor(pos, device=device)
    cos, sin = (t.to(dtype) for t in rope(S, D, device))
    sizes = [Hq * D, Hkv * D, Hkv * D]
    b = len(pos)
    q, k, v = qkv.split(sizes, dim=-1)
    got_keys, got_values = keys.clone(), values.clone()
    out = kernels.decode_attention(q.view(b, Hq, D), k.view(b, Hkv, D), v.view(b, Hkv, D), got_keys, got_values,
                                   pos, None, window, bias=bias.split(sizes) if with_bias else None,
                                   rope=(cos, sin), splits=splits, block_n=block_n)
    # The torch path: the bias rounded in (as after a GEMM), layers.rotate, torch_path.cached_attention.
    q, k, v = (qkv + bias if with_bias else qkv).split(sizes, dim=-1)
    q = rotate(q.view(b, Hq, D), cos[pos], sin[pos])
    k = rotate(k.view(b, Hkv, D), cos[pos], sin[pos])
    ref_keys, ref_values = keys.clone(), values.clone()
    expected = cached_attention(q, k, v.view(b, Hkv, D), ref_keys, ref_values, pos, None, window)
    assert torch.equal(got_values, ref_values)  # the new values land exactly where the torch path puts them
    key_tol = 1e-6 if dtype == torch.float32 else 1e-2  # fp32: fma or not; bf16: then one ulp at a rounding tie
    torch.testing.assert_close(got_keys.float(), ref_keys.float(), atol=key_tol, rtol=key_tol)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: probabilities rounded before p.V, as flash kernels do
    # (and the output rounded to bf16: two ulps at |x| in [2, 4) are 0.031, hence the relative part)
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=0 if dtype == torch.float32 else tol)


@pytest.mark.parametrize("window", [None, 10])
@pytest.mark.parametrize("splits", [1, 3, 5])  # 3, 5: split runs merged by the combine kernel (5: some rows' empty)
def test_fused_attention_adds_bias_applies_rope_writes_kv_and_attends(window, splits):
    check_fused_attention((4, 2, 16), slots=4, S=40, pos=[0, 15, 16, 39], window=window, dtype=torch.float32,
                          splits=splits, block_n=16)


def test_fused_attention_splits_the_keys_by_itself_when_few_rows_leave_the_device_idle(monkeypatch):
    kernel_device()  # skips without Triton before the spy reaches for the kernel
    monkeypatch.setattr(kernels, "MIN_CHUNK", 16)  # 40 keys, 4 rows x 2 heads: two splits
    launched = []
    monkeypatch.setattr(kernels, "_combine_kernel", SpyKernel(kernels._combine_kernel, launched))
    check_fused_attention((4, 2, 16), slots=4, S=40, pos=[0, 31, 32, 39], window=None, dtype=torch.float32,
                          splits=None, block_n=16)
    assert launched == [(4, 2)]  # the merge ran: the keys were split
    monkeypatch.setattr(kernels, "SPLIT_PROGRAMS", 8)  # 8 programs are enough: one pass, no merge
    check_fused_attention((4, 2, 16), slots=4, S=40, pos=[0, 31, 32, 39], window=None, dtype=torch.float32,
                          splits=None, block_n=16)
    assert launched == [(4, 2)]


def test_attention_splits_bound_a_run_only_when_asked():
    pytest.importorskip("triton")
    assert (kernels.MAX_RUN_KEYS, kernels.LONG_SLOT) == (512, 4096)  # the engine's launch: bounded in long slots only
    # Without a bound: enough runs for 512 programs (185 rows x 2 kv heads: 2; 61 rows: 5), never under 128 keys.
    assert kernels.attention_splits(185, 2, 4224) == 2
    assert kernels.attention_splits(61, 2, 4224) == 5
    assert kernels.attention_splits(512, 2, 384) == 1
    # With one: at least slot_len / max_run_keys runs (4,224 / 1,024 -> 5) at any row count, still >= 128 keys each.
    assert kernels.attention_splits(185, 2, 4224, max_run_keys=1024) == 5
    assert kernels.attention_splits(512, 2, 4224, max_run_keys=1024) == 5
    assert kernels.attention_splits(61, 2, 4224, max_run_keys=2048) == 5  # the programs' count is already more
    assert kernels.attention_splits(512, 2, 384, max_run_keys=64) == 3  # 384 / 128


@pytest.mark.parametrize("window", [None, 10])
def test_fused_attention_with_a_run_bound_splits_mixed_lengths_and_equals_the_torch_path(monkeypatch, window):
    kernel_device()
    monkeypatch.setattr(kernels, "MIN_CHUNK", 8)
    monkeypatch.setattr(kernels, "SPLIT_PROGRAMS", 8)  # 4 rows x 2 heads fill it: one run without a bound
    launched = []
    monkeypatch.setattr(kernels, "_decode_attention_kernel", SpyKernel(kernels._decode_attention_kernel, launched))
    pos = [0, 3, 17, 39]  # its own key only, one short block, a block and one key, a full slot
    check_fused_attention((4, 2, 16), slots=4, S=40, pos=pos, window=window, dtype=torch.float32, splits=None,
                          block_n=16)
    monkeypatch.setattr(kernels, "MAX_RUN_KEYS", 16)  # 40 keys in runs of at most 16: 3 (short rows: some empty)
    monkeypatch.setattr(kernels, "LONG_SLOT", 41)  # but only in slots of 41 keys or more: still one run
    check_fused_attention((4, 2, 16), slots=4, S=40, pos=pos, window=window, dtype=torch.float32, splits=None,
                          block_n=16)
    monkeypatch.setattr(kernels, "LONG_SLOT", 40)
    check_fused_attention((4, 2, 16), slots=4, S=40, pos=pos, window=window, dtype=torch.float32, splits=None,
                          block_n=16)
    assert launched == [(4, 2, 1), (4, 2, 1), (4, 2, 3)]
    # Runs of at least 16 keys, as many as each row needs (1, 1, 2 and 3 of the 3 programs): the others leave at once
    # and the merge reads the used runs only; with 32 (2 programs), the rows at 3 and 17 keys take one run.
    monkeypatch.setattr(kernels, "ROW_RUNS", True)
    for bound in (16, 32):
        monkeypatch.setattr(kernels, "MAX_RUN_KEYS", bound)
        for p in (pos, [39, 0, 38, 16]):
            check_fused_attention((4, 2, 16), slots=4, S=40, pos=p, window=window, dtype=torch.float32, splits=None,
                                  block_n=16)
    assert launched[3:] == [(4, 2, 3)] * 2 + [(4, 2, 2)] * 2


class SpyKernel:
    """A Triton kernel whose launches (grids) are recorded."""
    def __init__(self, kernel, grids):
        self.kernel, self.grids = kernel, grids

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def test_fused_attention_without_bias_and_with_a_seven_to_one_group():
    check_fused_attention((14, 2, 16), slots=3, S=24, pos=[3, 23], window=None, dtype=torch.float32, splits=2,
                          block_n=16, with_bias=False)


@pytest.mark.parametrize("style", ["llama", "gemma", "olmo2"])
def test_rms_norm_kernel_rounds_like_layers_rms_norm(style):
    device = kernel_device()
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (3 * torch.randn(5, 48, generator=g)).to(device, dtype)
        w = torch.randn(48, generator=g).to(device, dtype)
        tol = 1e-6 if dtype == torch.float32 else 2e-2  # bf16: a rounding tie may land one ulp (2^-7) away, twice
        torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6, style).float(),
                                   rms_norm(x, w, 1e-6, style).float(), atol=tol, rtol=tol)
        residual = torch.randn(5, 48, generator=g).to(device, dtype)
        normed, h = kernels.add_rms_norm(x, residual, w, 1e-6, style)
        if device == "cuda" or dtype == torch.float32:
            assert torch.equal(h, residual + x)
        else:  # the interpreter's float32 -> bf16 conversion does not round to nearest
            torch.testing.assert_close(h.float(), (residual + x).float(), atol=tol, rtol=tol)
        torch.testing.assert_close(normed.float(), rms_norm(h, w, 1e-6, style).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_kernel_equals_activation_times_up(act):
    device = kernel_device()
    gate_up = (3 * torch.randn(6, 2 * 40, generator=torch.Generator().manual_seed(0))).to(device)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.gated(gate_up, act), activation(gate, act) * up, atol=1e-5, rtol=1e-5)


def test_record_kernel_changes_the_slot_state_as_slot_state_record_does():
    from phaserl.rollout.kv_pool import SlotState

    device = kernel_device()
    g = torch.Generator().manual_seed(0)
    states = [SlotState(7, 5, torch.device(device)) for _ in range(2)]
    for st in states:
        st.reset([3, 9])
        st.start(torch.tensor([0, 1, 2, 4, 5], device=device), torch.tensor([1, 2, 3, 4, 5], device=device),
                 torch.zeros(5, device=device), torch.tensor([4, 2, 6, 1, 3], device=device),
                 torch.tensor([5, 2, 5, 5, 4], device=device))  # slot 2 starts on a stop id; 3 and 6 stay idle
    for step in range(5):
        tokens = torch.randint(0, 12, (6,), generator=g).to(device)  # 6 of the 7 slots: b < slots
        logprobs = torch.randn(6, generator=g).to(device)
        states[0].record(6, tokens, logprobs)
        kernels.record(states[1], 6, tokens, logprobs)
        for name in ("tokens", "pos", "n_gen", "finished", "out_tokens", "out_logprobs"):
            assert torch.equal(getattr(states[0], name), getattr(states[1], name)), (step, name)


def test_fusable_says_which_layers_the_fused_path_computes_exactly():
    def first_layer(model):
        return fused_weights(model.model.layers[0]), model.model.layers[0].spec
    assert fusable(*first_layer(tiny_model("qwen2")))
    assert fusable(*first_layer(tiny_model("llama")))
    assert fusable(*first_layer(tiny_model("qwen3")))  # qk-norm per head: inside the attention kernel
    assert not fusable(*first_layer(tiny_model("qwen3", qk_norm_scope="projection")))  # OLMo 2's: layers.py
    assert not fusable(*first_layer(tiny_model("llama", layer_norms="sandwich")))  # norms after the sublayers
    assert not fusable(*first_layer(tiny_model("llama", layer_norms="post")))
    # the same answer from the modules alone (what EngineConfig.compile=None decides with: no compile when fused)
    assert decodes_fused(tiny_model("qwen2")) and decodes_fused(tiny_model("qwen3"))
    assert not decodes_fused(tiny_model("llama", layer_norms="sandwich"))
    assert not decodes_fused(tiny_model("qwen3", qk_norm_scope="projection"))


@pytest.mark.parametrize("residual_in_gemm", [True, False])
@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen3"])
def test_fused_layer_equals_pre_attention_cached_attention_post_attention(model_type, residual_in_gemm,
                                                                           monkeypatch):
    monkeypatch.setattr(fused, "RESIDUAL_IN_GEMM", residual_in_gemm)
    device = kernel_device()
    model = tiny_model(model_type, seed=3).to(device)
    layer = model.model.layers[0]
    w, spec = fused_weights(layer), layer.spec
    Hq, Hkv, D = spec.heads
    S, b = 24, 3
    g = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(b, Hkv, S, D, generator=g).to(device) for _ in range(2))
    h = torch.randn(b, model.config.hidden_size, generator=g).to(device)
    pos = torch.tensor([0, 7, 23], device=device)
    cos, sin = rope(S, D, device)
    with torch.no_grad():
        got_keys, got_values = keys.clone(), values.clone()
        carry = torch.randn(h.shape, generator=g).to(device)  # the previous layer's MLP output, still to add
        got, got_carry = fused_decode_layer(h, carry, w, spec, got_keys, got_values, pos, cos, sin)
        got = got if got_carry is None else got + got_carry
        h = h + carry
        q, k, v = pre_attention(h, w, spec, cos[pos], sin[pos])
        expected = post_attention(h, cached_attention(q, k, v, keys, values, pos, spec.scale, spec.window), w, spec)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_keys, keys, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_values, values, atol=1e-6, rtol=0)


@pytest.mark.parametrize("residual_in_gemm", [True, False])
@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen3"])
def test_engine_greedy_through_the_fused_layers_equals_the_uncached_loop(model_type, residual_in_gemm, monkeypatch):
    device = kernel_device()
    monkeypatch.setattr(fused, "RESIDUAL_IN_GEMM", residual_in_gemm)
    model = tiny_model(model_type, seed=1).to(device)
    caps = [6, 3, 5, 1, 6, 2]
    result, engine = run(model, PROMPTS, config=EngineConfig(max_slots=4, token_budget=1024),
                         max_new_tokens=caps)
    assert all(engine.runner.fused)
    assert result.response_ids == [greedy_reference(model, p, c) for p, c in zip(PROMPTS, caps)]


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_fused_attention_at_the_qwen2_half_b_shape(window, dtype):
    # 14:2 heads of 64, a 384-position slot, each row's keys in three runs; rows at block and run edges
    check_fused_attention((14, 2, 64), slots=64, S=384, pos=[0, 1, 63, 64, 127, 128, 129, 191, 192, 193, 255, 256,
                                                             383] * 4, window=window, dtype=dtype, splits=3, block_n=64)


def test_the_decode_attention_benchmark_smoke_runs(capsys):
    import json
    import os
    import sys

    kernel_device()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import decode_attention

    decode_attention.main(["--smoke"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert not [r for r in lines if "error" in r]
    assert [(r["splits"], r["rule"]) for r in lines if r["case"] == "tiny" and r["launch"] is None] == [
        (1, "default"), (2, "forced"), (1, "max_run_keys=32"), (1, "rows:32")]  # 96-key slots: no run under 128 keys
    mixed = [r for r in lines if r["case"] == "tiny-mixed"]
    assert [(r["context"], r["rule"]) for r in mixed] == [(mix, rule) for mix in ("mid-phase", "tail-end")
                                                          for rule in ("default", "forced", "max_run_keys=32",
                                                                       "rows:32")]
    assert all(r["longest"] < r["slot_len"] and r["chain_keys"] >= r["longest"] / r["splits"] for r in mixed)
