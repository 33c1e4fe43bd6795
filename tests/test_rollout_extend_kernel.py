"""The extend pass's Triton kernels (rollout/extend_kernel.py) against the torch path they replace.

extend_attention must compute what torch_path.extend_attention computes over a gathered copy of the slots with
torch_path.extend_mask's mask: rows with different starts and lengths, padding tokens, grouped-query heads
(G = 1, 2, 7), head_dim 64 and 128, a sliding window, slots out of order and some unused, several query blocks and
key blocks per row; in float32 to ~1e-6, in bfloat16 within a tolerance that a one-key mask error exceeds. Keys no query
may see are poisoned with NaN: outputs stay as they were. write_kv writes what the index_put writes do. Then the
engine's extend passes (dense, sliding and Qwen3.5) with the kernels give the torch path's turns. On the CPU these
need Triton and TRITON_INTERPRET=1 (skipped otherwise); @pytest.mark.gpu runs the Qwen2-0.5B shapes in bf16 on CUDA,
and inside a CUDA graph.
"""
import pytest
import torch

from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams, extend_kernel, kernels, recurrent_state
from phaserl.rollout import runner as runner_module
from phaserl.rollout.layer_fns import EAGER
from phaserl.rollout.runner import extend_attention, extend_mask
from tests.test_rollout_engine import PROMPTS, tiny_model
from tests.test_rollout_extend import tiny_qwen35
from tests.test_rollout_session import drive

torch.set_num_threads(1)


def kernel_device() -> str:
    if not kernels.available(torch.device("cuda" if torch.cuda.is_available() else "cpu")):
        pytest.skip("needs Triton on CUDA (or TRITON_INTERPRET=1 with Triton installed)")
    return "cuda" if torch.cuda.is_available() else "cpu"


NUM_SLOTS, S = 7, 48
# Rows (slot, start, length), M = 9 tokens each (right-padded): slots out of order, 0, 2 and 4 unused; a row of
# one token, one whose padding runs past its end, and a padding row (position S - 1, length 0, the first row's
# slot) whose tokens sit past the context.
ROWS = [(5, 9, 6), (1, 0, 1), (3, 30, 9), (6, 17, 4), (5, S - 1, 0)]
M = 9


def case(heads, dtype, device, rows=ROWS, seed=0):
    """A cache with every position < S written (random), q [C * M, Hq, D], and the rows' device tensors."""
    Hq, Hkv, D = heads
    g = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(NUM_SLOTS, Hkv, S, D, generator=g).to(device, dtype) for _ in range(2))
    q = torch.randn(len(rows) * M, Hq, D, generator=g).to(device, dtype)
    slots, starts, lengths = (torch.tensor(c, device=device) for c in zip(*rows))
    pos = (starts[:, None] + torch.arange(M, device=device)).clamp(max=S - 1)  # [C, M], as _extend_forward
    return keys, values, q, slots, pos, lengths


def torch_attention(q, keys, values, slots, pos, lengths, context, scale, window):
    """The torch path of ModelRunner._extend_attention (reads the cache written before)."""
    C, Hq, D = pos.shape[0], q.shape[1], q.shape[2]
    return extend_attention(q.view(C, M, Hq, D), keys[slots, :, :context], values[slots, :, :context],
                            extend_mask(pos, lengths, context, window), scale)


def exact_context(rows=ROWS) -> int:
    return max(start + length for _, start, length in rows if length)  # the eager pass's: the longest row's end


@pytest.mark.parametrize("heads, window, scale, rows, block_n", [
    ((2, 2, 64), None, None, None, None),    # G = 1, one query block per row, one key block
    ((4, 2, 64), 5, None, 16, 16),           # G = 2, sliding: several query blocks (8 tokens) and key blocks
    ((14, 2, 64), None, 0.3, None, 16),      # G = 7 (Qwen2-0.5B's heads): 18 tokens a block, ragged tile rows
    ((14, 2, 64), 4, None, 32, 16),          # G = 7, sliding, 4 tokens a block
    ((4, 1, 128), 6, None, None, None),      # G = 4, head_dim 128, sliding
    ((7, 7, 128), None, None, 16, 32),       # G = 1, head_dim 128, 16 tokens a block
], ids=["g1", "g2-window", "g7-scale", "g7-window", "d128-window", "d128-g1"])
@pytest.mark.parametrize("context", ["exact", "slot"])
def test_the_kernel_equals_the_torch_path_in_float32(heads, window, scale, rows, block_n, context):
    device = kernel_device()
    keys, values, q, slots, pos, lengths = case(heads, torch.float32, device)
    ctx = exact_context() if context == "exact" else S  # "slot": the whole slot as context
    want = torch_attention(q, keys, values, slots, pos, lengths, ctx, scale, window)
    got = extend_kernel.extend_attention(q, keys, values, slots, pos, lengths, ctx, scale, window, rows=rows,
                                         block_n=block_n)
    assert got.shape == want.shape == (len(ROWS) * M, heads[0] * heads[2]) and got.dtype == torch.float32
    assert torch.isfinite(got).all()  # the padding tokens' too: they reach the next layer's KV
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 5])
def test_the_kernel_equals_the_torch_path_in_bfloat16_within_less_than_a_mask_error(window):
    device = kernel_device()
    heads = (14, 2, 64)
    keys, values, q, slots, pos, lengths = case(heads, torch.bfloat16, device)
    ctx = exact_context()
    # The reference in float32 from the same bf16 numbers; the kernel's p is rounded to bf16 for its PV dot.
    up = [t.float() for t in (q, keys, values)]
    want = torch_attention(up[0], up[1], up[2], slots, pos, lengths, ctx, None, window)
    got = extend_kernel.extend_attention(q, keys, values, slots, pos, lengths, ctx, None, window, block_n=16)
    assert got.dtype == torch.bfloat16
    atol = 3e-2
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)
    # A mask that lets every token see one key more (after its own) moves outputs far past that tolerance.
    C, Hq, D = len(ROWS), heads[0], heads[2]
    leaky = extend_attention(up[0].view(C, M, Hq, D), up[1][slots, :, :ctx], up[2][slots, :, :ctx],
                             extend_mask(pos + 1, lengths, ctx, window), None)
    assert (leaky - want).abs().max() > 10 * atol


@pytest.mark.parametrize("window", [None, 3])
def test_keys_no_query_may_see_are_never_read(window):
    """NaN in every unused slot, after each row's last token (no padding tokens here) and, for a sliding layer,
    before its first token's window: a kernel that read any of them (causality, the window, another slot) would
    give NaN. Without a window the positions before the window are seen: the outputs change."""
    device = kernel_device()
    rows = [(5, 9, M), (1, 0, M), (3, 30, M), (6, 17, M)]  # every token real
    keys, values, q, slots, pos, lengths = case((4, 2, 64), torch.float32, device, rows=rows)
    ctx = S
    clean = extend_kernel.extend_attention(q, keys, values, slots, pos, lengths, ctx, None, window, block_n=16)
    poisoned = [t.clone() for t in (keys, values)]
    for t in poisoned:
        for slot in set(range(NUM_SLOTS)) - {slot for slot, _, _ in rows}:
            t[slot] = float("nan")
        for slot, start, length in rows:
            t[slot, :, start + length:] = float("nan")
            t[slot, :, :max(0, start - 3 + 1)] = float("nan") if window else 1e4  # before the first window of 3
    got = extend_kernel.extend_attention(q, *poisoned, slots, pos, lengths, ctx, None, window, block_n=16)
    if window is None:
        assert torch.isfinite(got).all() and not torch.allclose(got, clean)  # the early keys are seen
    else:
        torch.testing.assert_close(got, clean, atol=0, rtol=0)


def test_write_kv_writes_what_the_index_writes_write():
    device = kernel_device()
    Hkv, D = 2, 24  # head_dim not a power of two: masked lanes
    keys, values, _, slots, pos, _ = case((2, Hkv, D), torch.float32, device)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(len(ROWS) * M, 5 * Hkv * D, generator=g).to(device)  # k/v as strided views of one GEMM output
    k, v = qkv[:, Hkv * D:2 * Hkv * D].view(-1, Hkv, D), qkv[:, 3 * Hkv * D:4 * Hkv * D].view(-1, Hkv, D)
    want_k, want_v = keys.clone(), values.clone()
    want_k[slots[:, None], :, pos] = k.view(len(ROWS), M, Hkv, D)
    want_v[slots[:, None], :, pos] = v.view(len(ROWS), M, Hkv, D)
    extend_kernel.write_kv(k, v, keys, values, slots, pos)
    # Position S - 1 takes clamped padding tokens twice over (either write may win, in both paths)
    torch.testing.assert_close(keys[..., :S - 1, :], want_k[..., :S - 1, :], atol=0, rtol=0)
    torch.testing.assert_close(values[..., :S - 1, :], want_v[..., :S - 1, :], atol=0, rtol=0)


@pytest.mark.parametrize("residual_in_gemm", [True, False])
@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen3", "qwen2-sliding"])
def test_the_fused_extend_layer_equals_pre_attention_torch_attention_post_attention(model_type, residual_in_gemm,
                                                                                    monkeypatch):
    """fused.fused_extend_layer (rms_norm, [q; k; v] GEMM, prepare: bias + qk-norm + RoPE + KV write, the extend
    attention, o GEMM, norm, [gate; up], gated, down) against layers.pre_attention -> index writes + the torch
    extend attention -> layers.post_attention, on the rows of ROWS (padding, a row past the context) in float32."""
    from phaserl.models.layers import post_attention, pre_attention
    from phaserl.rollout import fused
    from phaserl.rollout.runner import fused_weights
    from tests.test_rollout_fused import rope

    monkeypatch.setattr(fused, "RESIDUAL_IN_GEMM", residual_in_gemm)
    device = kernel_device()
    extra = (dict(sliding_window=4, layer_types=("sliding_attention", "full_attention")) if "sliding" in model_type
             else {})
    model = tiny_model(model_type.split("-")[0], seed=3, **extra).to(device)
    layer = model.model.layers[0]
    w, spec = fused_weights(layer), layer.spec
    assert fused.fusable(w, spec) and (spec.window is not None) == ("sliding" in model_type)
    Hq, Hkv, D = spec.heads
    keys, values, _, slots, pos, lengths = case(spec.heads, torch.float32, device)
    C, context = pos.shape[0], exact_context()
    g = torch.Generator().manual_seed(1)
    h = torch.randn(C * M, model.config.hidden_size, generator=g).to(device)
    carry = torch.randn(h.shape, generator=g).to(device)  # the previous layer's MLP output, still to add
    cos, sin = rope(S, D, device)
    with torch.no_grad():
        got_keys, got_values = keys.clone(), values.clone()
        got, got_carry = fused.fused_extend_layer(h, carry, w, spec, got_keys, got_values, slots, pos, lengths,
                                                  context, cos, sin)
        got = got if got_carry is None else got + got_carry
        h = h + carry
        flat = pos.view(-1)
        q, k, v = pre_attention(h, w, spec, cos[flat], sin[flat])
        keys[slots[:, None], :, pos] = k.view(C, M, Hkv, D)
        values[slots[:, None], :, pos] = v.view(C, M, Hkv, D)
        attn = torch_attention(q, keys, values, slots, pos, lengths, context, spec.scale, spec.window)
        expected = post_attention(h, attn, w, spec)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_keys, keys, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_values, values, atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_sessions_with_fused_decode_and_fused_extend_layers_give_the_torch_paths_turns(model_type, monkeypatch):
    """The whole engine on its fused path (decode steps through fused_decode_layer, extend passes through
    fused_extend_layer) against the fused decode with the extend pass on the torch path: the same greedy turns."""
    kernel_device()
    from phaserl.rollout import fused

    model = tiny_model(model_type)
    calls, layer = [], fused.fused_extend_layer
    monkeypatch.setattr(runner_module, "fused_extend_layer", lambda *a, **k: calls.append(1) or layer(*a, **k))
    with_kernel = session_turns(model, False, True, monkeypatch)
    assert len(calls) >= 4 * len(model.model.layers)  # every extend pass, every layer
    without = session_turns(model, False, False, monkeypatch)
    for key in without:
        assert [t.token_ids for t in with_kernel[key]] == [t.token_ids for t in without[key]]
        for a, b in zip(with_kernel[key], without[key]):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_head_dims_past_the_kernel_take_the_torch_path():
    assert extend_kernel.supports(256) and not extend_kernel.supports(512)  # Gemma 4's global layers: torch


def decode_in_torch(monkeypatch) -> None:
    """Engines built after this decode (and step the DeltaNet state) on the torch path, so that only the extend
    pass runs Triton: the interpreter's decode kernels take ~20 s a session."""
    monkeypatch.setattr(runner_module, "FUSED_DECODE", False)
    monkeypatch.setattr(runner_module, "layer_fns", lambda device, compile: EAGER)
    monkeypatch.setattr(recurrent_state, "USE_DELTA_KERNEL", False)


def session_turns(model, kernel: bool, monkeypatch, torch_decode: bool = False) -> dict:
    """Greedy turns of a few sequences over 3 slots; the extend pass's attention through the kernel or not
    (torch_decode: decode_in_torch)."""
    monkeypatch.setattr(runner_module, "EXTEND_KERNEL", kernel)
    if torch_decode:
        decode_in_torch(monkeypatch)
    plan = {0: [[30, 31], [32]], 1: [[33, 34, 35], None], 2: [[], [36, 37]], 3: [[38] * 9, [1]], 4: [None]}
    engine = RolloutEngine(model, EngineConfig(max_slots=3, token_budget=4096))
    with engine.session(SamplingParams(max_new_tokens=4, temperature=0.0), slot_len=48, eos_token_ids=[]) as s:
        for key in (0, 1, 2):
            s.start(key, PROMPTS[key], cap=4)
        return drive(s, plan, {k: 4 for k in plan}, waiting=[3, 4], prompt=PROMPTS)


def session_model(model_type: str):
    """The session tests' models: Qwen2, Qwen2 with a sliding layer, Qwen3.5 (its full-attention layers)."""
    if model_type == "qwen35":
        return tiny_qwen35()
    if model_type == "qwen2-sliding":
        return tiny_model("qwen2", sliding_window=4, layer_types=("sliding_attention", "full_attention"))
    return tiny_model("qwen2")


@pytest.mark.parametrize("model_type", ["qwen2", "qwen2-sliding", "qwen35"])
def test_sessions_with_the_extend_kernel_give_the_torch_paths_turns(model_type, monkeypatch):
    """Several turns with refill, the decode steps on the torch path either way: greedy tokens equal, log-probs
    close, whether the extend pass attends through extend_kernel.py or the torch path."""
    kernel_device()
    model = session_model(model_type)
    calls, attend = [], extend_kernel.extend_attention
    monkeypatch.setattr(extend_kernel, "extend_attention", lambda *a, **k: calls.append(1) or attend(*a, **k))
    with_kernel = session_turns(model, True, monkeypatch, torch_decode=True)
    launched = len(calls)
    assert launched >= 4  # every extend pass (4 or more), in every attention layer (Qwen3.5: 1 of 4 layers)
    without = session_turns(model, False, monkeypatch, torch_decode=True)
    assert len(calls) == launched and sum(len(turns) for turns in without.values()) == 12
    for key in without:
        assert [t.token_ids for t in with_kernel[key]] == [t.token_ids for t in without[key]]
        for a, b in zip(with_kernel[key], without[key]):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_padding_tokens_past_the_context_of_a_sliding_layer_write_no_nan_through_the_kernel(monkeypatch):
    """tests/test_rollout_extend.py's regression (padding tokens past the eager pass's context, in a sliding layer)
    with the extend pass through the kernel: finite KV, finite log-probs in the decode steps after it."""
    kernel_device()
    decode_in_torch(monkeypatch)
    model = tiny_model("qwen2", sliding_window=4, layer_types=("sliding_attention", "full_attention"),
                       max_position_embeddings=128)
    runner = RolloutEngine(model, EngineConfig(max_slots=4)).runner
    runner.begin(4, 128, 8, SamplingParams(max_new_tokens=8, temperature=0.0), [])
    runner.prefill([((1, 2), [0], [8], [0]), (tuple(i % 39 + 1 for i in range(40)), [1], [8], [1]),
                    ((3,), [2], [8], [2])])
    items = [(0, [i % 39 + 1 for i in range(30)], 2, 4), (1, [5], 40, 4), (2, [6, 7], 1, 4)]
    with torch.inference_mode():
        runner._extend_pass(items)
        for _ in range(3):
            runner.decode(4)
    assert not any(torch.isnan(t).any() for t in (*runner.keys, *runner.values))
    assert torch.isfinite(runner.state.out_logprobs[:, :4]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("heads, window", [((14, 2, 64), None), ((14, 2, 64), 128), ((8, 2, 256), None),
                                           ((28, 4, 128), None)], ids=["0.5b", "0.5b-sliding", "d256", "7b"])
def test_gpu_the_kernel_equals_the_torch_path_at_the_benchmark_shape(heads, window):
    """bf16 on CUDA at agent_rollout.py's extend pass (256 rows x 33 tokens, contexts up to ~480 of 512): the kernel
    against the torch path in bf16 (its own rounding: scores and probabilities in bf16) and against a float32
    reference; and replayed from a CUDA graph with other positions, the same as run eagerly."""
    Hq, Hkv, D = heads
    C, T, S_, slots_n = 256, 33, 512, 256
    g = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(slots_n, Hkv, S_, D, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    q = torch.randn(C * T, Hq, D, generator=g).to("cuda", torch.bfloat16)
    slots = torch.randperm(slots_n, generator=g)[:C].cuda()
    starts = torch.randint(100, 440, (C,), generator=g).cuda()
    lengths = torch.randint(1, T + 1, (C,), generator=g).cuda()
    pos = (starts[:, None] + torch.arange(T, device="cuda")).clamp(max=S_ - 1)
    context = int((starts + lengths).max())
    hidden = extend_mask(pos, lengths, context, window)
    got = extend_kernel.extend_attention(q, keys, values, slots, pos, lengths, context, None, window)
    bf16 = extend_attention(q.view(C, T, Hq, D), keys[slots, :, :context], values[slots, :, :context], hidden)
    f32 = extend_attention(q.float().view(C, T, Hq, D), keys[slots, :, :context].float(),
                           values[slots, :, :context].float(), hidden)
    torch.testing.assert_close(got.float(), f32, atol=2e-2, rtol=0)
    torch.testing.assert_close(got.float(), bf16.float(), atol=4e-2, rtol=0)
    # float32 scores and softmax (torch rounds both to bf16): on average no further from float32 (5% for noise)
    assert (got.float() - f32).abs().mean() <= 1.05 * (bf16.float() - f32).abs().mean()
    # Captured once, replayed with new positions: no host sync inside, the device tensors read at replay.
    starts_graph = starts.clone()
    pos_graph = (starts_graph[:, None] + torch.arange(T, device="cuda")).clamp(max=S_ - 1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        extend_kernel.extend_attention(q, keys, values, slots, pos_graph, lengths, S_, None, window)  # compile
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = extend_kernel.extend_attention(q, keys, values, slots, pos_graph, lengths, S_, None, window)
    pos_graph.copy_((starts[:, None] - 50 + torch.arange(T, device="cuda")).clamp(max=S_ - 1))
    graph.replay()
    eager = extend_kernel.extend_attention(q, keys, values, slots, pos_graph, lengths, S_, None, window)
    torch.testing.assert_close(replayed, eager, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_gpu_the_fused_extend_layer_in_bf16_is_as_close_to_float32_as_the_torch_path(model_type):
    """Qwen2-0.5B's layer shape (hidden 896, 14 / 2 heads of 64, MLP 4864), 256 rows x 33 tokens in bf16: the fused
    extend layer's distance from a float32 torch layer is no larger (10% for noise) than the bf16 torch path's."""
    from phaserl.models.layers import post_attention, pre_attention
    from phaserl.rollout import fused
    from phaserl.rollout.runner import fused_weights
    from tests.test_rollout_fused import rope

    model = tiny_model(model_type, seed=2, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                       num_key_value_heads=2, num_hidden_layers=1, max_position_embeddings=512)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(0.1)  # 0.02 N(0, 1): a trained model's scale, so bf16 stays meaningful
    C, T, S_ = 256, 33, 512
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(100, 440, (C,), generator=g).cuda()
    lengths = torch.randint(1, T + 1, (C,), generator=g).cuda()
    slots = torch.randperm(C, generator=g).cuda()
    pos = (starts[:, None] + torch.arange(T, device="cuda")).clamp(max=S_ - 1)
    context = int((starts + lengths).max())
    h32 = torch.randn(C * T, 896, generator=g).cuda()
    keys32, values32 = (torch.randn(C, 2, S_, 64, generator=g).cuda() for _ in range(2))
    cos32, sin32 = rope(S_, 64, "cuda")

    def torch_layer(layer, h, keys, values, cos, sin):
        w, spec = fused_weights(layer), layer.spec
        flat = pos.view(-1)
        q, k, v = pre_attention(h, w, spec, cos[flat], sin[flat])
        keys[slots[:, None], :, pos] = k.view(C, T, 2, 64)
        values[slots[:, None], :, pos] = v.view(C, T, 2, 64)
        attn = torch_attention_at(q, keys, values, context, spec)
        return post_attention(h, attn, w, spec)

    def torch_attention_at(q, keys, values, ctx, spec):
        return extend_attention(q.view(C, T, 14, 64), keys[slots, :, :ctx], values[slots, :, :ctx],
                                extend_mask(pos, lengths, ctx, spec.window), spec.scale)

    with torch.no_grad():
        layer32 = model.to("cuda").model.layers[0]
        want = torch_layer(layer32, h32, keys32.clone(), values32.clone(), cos32, sin32)
        layer16 = model.to(torch.bfloat16).model.layers[0]
        h, keys, values = h32.bfloat16(), keys32.bfloat16(), values32.bfloat16()
        cos, sin = cos32.bfloat16(), sin32.bfloat16()
        plain = torch_layer(layer16, h, keys.clone(), values.clone(), cos, sin)
        w, spec = fused_weights(layer16), layer16.spec
        assert fused.fusable(w, spec)
        got, carry = fused.fused_extend_layer(h, None, w, spec, keys, values, slots, pos, lengths, context, cos, sin)
        got = got if carry is None else got + carry
    real = (torch.arange(T, device="cuda")[None] < lengths[:, None]).view(-1)  # padding tokens' outputs are unused
    err_fused = (got.float() - want)[real].abs().mean()
    err_plain = (plain.float() - want)[real].abs().mean()
    assert err_fused <= 1.1 * err_plain, (float(err_fused), float(err_plain))


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen2", "qwen2-sliding", "qwen35"])
def test_gpu_sessions_with_the_extend_kernel_give_the_torch_paths_turns(model_type, monkeypatch):
    """float32 on CUDA (IEEE dots in the kernel): the same greedy turns and close log-probs with and without the
    kernel."""
    model = session_model(model_type).to("cuda")
    with_kernel = session_turns(model, True, monkeypatch)
    without = session_turns(model, False, monkeypatch)
    for key in without:
        assert [t.token_ids for t in with_kernel[key]] == [t.token_ids for t in without[key]]
        for a, b in zip(with_kernel[key], without[key]):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
