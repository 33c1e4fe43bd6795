"""The native families beyond Llama/Qwen (Mistral, Ministral, Gemma 3 and 4 text, OLMo 2, Phi-3), each against
transformers' own class: fp32 logits both ways through Hugging Face directories, packed == padded, the engine's greedy
decode == the uncached loop, and sliding windows honoured by every attention core (mask, engine torch path,
Triton decode kernel)."""
import pytest
import torch
import transformers

from _hf_pairs import (
    PROMPTS,
    assert_engine_greedy_matches,
    assert_export_matches,
    assert_graph_greedy_matches_on_gpu,
    assert_logits_match,
    assert_packing_matches,
    left_padded_batch,
    randomize,
)
from phaserl.models import CausalLM, load_pretrained, save_pretrained
from phaserl.models.families import config_from_hf, config_to_hf
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams, kernels
from phaserl.rollout.torch_path import cached_attention

torch.set_num_threads(1)

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
ALTERNATE = ["sliding_attention", "full_attention"] * 2
GEMMA4_ROPE = {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e4},
               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}


def family_configs():
    """(name, transformers config): each family with its distinguishing features switched on (window 3)."""
    gemma_rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
    return [
        ("mistral-sliding", transformers.MistralConfig(**TINY, sliding_window=3)),
        ("ministral-mixed", transformers.MinistralConfig(**TINY, head_dim=8, sliding_window=3, layer_types=ALTERNATE)),
        ("gemma3-local-global", transformers.Gemma3TextConfig(**TINY, head_dim=16, sliding_window=3,
                                                              query_pre_attn_scalar=24, layer_types=ALTERNATE,
                                                              rope_parameters=gemma_rope)),
        # Gemma 4: global layers with their own head_dim, kv heads, proportional RoPE and v = k; soft-capped logits.
        ("gemma4-global-k-eq-v", transformers.Gemma4TextConfig(
            **TINY, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
            hidden_size_per_layer_input=0, sliding_window=3, layer_types=ALTERNATE, final_logit_softcapping=5.0,
            rope_parameters=GEMMA4_ROPE)),
        ("gemma4-global-head-dim", transformers.Gemma4TextConfig(  # "vision": bidirectional for images only
            **TINY, head_dim=8, global_head_dim=16, hidden_size_per_layer_input=0, sliding_window=3,
            layer_types=ALTERNATE, rope_parameters=GEMMA4_ROPE, use_bidirectional_attention="vision")),
        # Gemma 4 E2B/E4B: per-layer inputs; the last 3 layers attend over layer 1's (sliding) or layer 2's (full)
        # keys and values, with MLPs twice as wide.
        ("gemma4-per-layer-inputs-shared-kv", transformers.Gemma4TextConfig(
            **{**TINY, "num_hidden_layers": 6}, head_dim=8, global_head_dim=16, sliding_window=3,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, final_logit_softcapping=5.0,
            rope_parameters=GEMMA4_ROPE, hidden_size_per_layer_input=8, vocab_size_per_layer_input=96,
            num_kv_shared_layers=3, use_double_wide_mlp=True)),
        ("olmo2-postnorm", transformers.Olmo2Config(**TINY)),
        ("phi3-fused-sliding", transformers.Phi3Config(**TINY, sliding_window=3, pad_token_id=0, eos_token_id=2)),
        ("qwen2-sliding-layers", transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=3,
                                                          max_window_layers=2)),
    ]


IDS = [n for n, _ in family_configs()]


@pytest.fixture(scope="module", params=family_configs(), ids=IDS)
def pair(request, tmp_path_factory):
    """(transformers model, ours loaded from its directory, the directory)."""
    name, hf_config = request.param
    hf = randomize(transformers.AutoModelForCausalLM.from_config(hf_config))
    directory = tmp_path_factory.mktemp(name)
    hf.save_pretrained(directory)
    ours = load_pretrained(directory)
    assert isinstance(ours, CausalLM), f"{name} should load natively"
    return hf, ours, directory


def test_logits_equal_transformers_in_float32(pair):
    hf, ours, _ = pair
    assert_logits_match(hf, ours, left_padded_batch(TINY["vocab_size"]))


def test_the_sliding_window_is_what_makes_them_equal(pair):
    # The parity above must be able to fail: the same weights with full attention everywhere differ.
    hf, ours, _ = pair
    if ours.config.layer_types is None:
        pytest.skip("no sliding layers in this family's test config")
    # A window wider than any test sequence: the same layers (shapes, RoPE tables), only the window differs.
    full = CausalLM(ours.config.replace(sliding_window=10_000))
    full.load_state_dict(ours.state_dict())
    ids, mask, _ = left_padded_batch(TINY["vocab_size"])
    with torch.no_grad():
        a, b = ours.logits(ours(ids, attention_mask=mask)), full.logits(full(ids, attention_mask=mask))
    assert (a - b)[mask.bool()].abs().max() > 1e-3


def test_export_loads_in_transformers_with_the_same_logits(pair, tmp_path):
    hf, ours, _ = pair
    assert_export_matches(hf, ours, tmp_path / "out", left_padded_batch(TINY["vocab_size"]))


def test_packed_rows_equal_padded_rows(pair):
    _, ours, _ = pair
    assert_packing_matches(ours, left_padded_batch(TINY["vocab_size"]))


def test_engine_greedy_equals_the_uncached_loop(pair):
    # Prompts longer than the window and 8 new tokens: prefill and decode both cross it.
    _, ours, _ = pair
    assert_engine_greedy_matches(ours)


def kernel_device() -> str:
    if not kernels.available(torch.device("cuda" if torch.cuda.is_available() else "cpu")):
        pytest.skip("needs Triton on CUDA (or TRITON_INTERPRET=1 with Triton installed)")
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("window", [None, 1, 5, 70])
def test_triton_decode_attention_honours_the_window_and_scale(window):
    device = kernel_device()
    g = torch.Generator().manual_seed(0)
    Hq, Hkv, D, slots, S = 4, 2, 16, 6, 200
    keys, values = (torch.randn(slots, Hkv, S, D, generator=g).to(device) for _ in range(2))
    q = torch.randn(5, Hq, D, generator=g).to(device)
    k, v = (torch.randn(5, Hkv, D, generator=g).to(device) for _ in range(2))
    pos = torch.tensor([0, 4, 63, 64, 199], device=device)  # inside, at and across the window and block edges
    ref_keys, ref_values = keys.clone(), values.clone()
    out = kernels.decode_attention(q, k, v, keys, values, pos, 0.3, window)
    expected = cached_attention(q, k, v, ref_keys, ref_values, pos, 0.3, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    if window is not None and window < 64:
        full = cached_attention(q, k, v, ref_keys.clone(), ref_values.clone(), pos, 0.3, None)
        assert (full - expected)[2:].abs().max() > 1e-3  # the window changed the answer where it cuts


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_gpu_greedy_with_cuda_graphs_and_triton_equals_the_uncached_loop(pair, compile):
    _, ours, _ = pair
    assert_graph_greedy_matches_on_gpu(ours, compile=compile)


def test_engine_logprobs_equal_the_trainers_log_softmax(pair):
    # What the engine reports for each sampled token is what the trainer computes from a full forward.
    from phaserl.roles.forward import head_logprobs

    _, ours, _ = pair
    prompts = [p for p in PROMPTS for _ in range(2)]
    engine = RolloutEngine(ours, EngineConfig())
    result = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.8), eos_token_ids=[],
                             pad_token_id=0, generator=torch.Generator().manual_seed(0))
    for prompt, tokens, logprobs in zip(prompts, result.response_ids, result.logprobs):
        with torch.no_grad():
            hidden = ours(torch.tensor([prompt + tokens]))[0, len(prompt) - 1:-1]  # [R, H] predicting each token
            expected, _ = head_logprobs(ours, hidden, torch.tensor(tokens), temperature=0.8, chunk_size=4,
                                        with_entropy=False)
        # float32: the deepest stack here (6 Gemma 4 layers with per-layer inputs) differs by up to ~1.3e-5 at
        # |log p| ~ 6 between the engine's and the trainer's summation orders (float64: equal).
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-5, rtol=4e-6)


@pytest.mark.gpu
def test_gpu_varlen_with_sliding_windows_equals_the_dense_mask(pair, monkeypatch):
    from phaserl.models import attention

    _, ours, _ = pair
    model = CausalLM(ours.config).cuda().to(torch.bfloat16)
    model.load_state_dict(ours.state_dict())
    lengths = [9, 3, 12, 5]
    ids = torch.randint(0, TINY["vocab_size"], (1, sum(lengths)), device="cuda")
    positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    seq_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].cuda()
    assert attention.use_varlen(torch.device("cuda"), torch.bfloat16), "torch.nn.attention.varlen unavailable"
    calls = []
    original = attention.attend
    monkeypatch.setattr("phaserl.models.decoder._attend",
                        lambda q, k, v, attn, *rest: calls.append(attn) or original(q, k, v, attn, *rest))
    with torch.no_grad():
        varlen = model(ids, position_ids=positions, seq_ids=seq_ids).float()
        monkeypatch.setattr(attention, "USE_VARLEN", False)
        dense = model(ids, position_ids=positions, seq_ids=seq_ids).float()
    windows = {a.window for a in calls if isinstance(a, attention.PackedSeqs)}
    assert windows == {layer.spec.window for layer in model.model.layers}  # each layer kind took the kernel
    torch.testing.assert_close(varlen, dense, atol=3e-2, rtol=3e-2)


def test_what_a_family_has_and_we_do_not_is_refused_not_approximated(tmp_path):
    from phaserl.errors import ConfigError

    partial = transformers.Phi3Config(**TINY, pad_token_id=0, eos_token_id=2, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})  # Phi-4-mini's kind
    transformers.AutoModelForCausalLM.from_config(partial).save_pretrained(tmp_path / "phi")
    with pytest.raises(ConfigError, match="partial_rotary_factor=0.5 is not supported natively"):
        load_pretrained(tmp_path / "phi")
    assert load_pretrained(tmp_path / "phi", implementation="transformers").plain_head
    capped = transformers.Gemma3TextConfig(**TINY, head_dim=8, attn_logit_softcapping=50.0)
    transformers.AutoModelForCausalLM.from_config(capped).save_pretrained(tmp_path / "gemma")
    with pytest.raises(ConfigError, match="attn_logit_softcapping=50.0 is not implemented natively"):
        load_pretrained(tmp_path / "gemma")


def test_gemma3_with_final_logit_soft_capping_is_native_and_exact(tmp_path):
    hf = randomize(transformers.AutoModelForCausalLM.from_config(transformers.Gemma3TextConfig(
        **TINY, head_dim=8, sliding_window=3, layer_types=ALTERNATE, final_logit_softcapping=2.0)))
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    assert isinstance(ours, CausalLM) and not ours.plain_head
    ids, mask, positions = left_padded_batch(TINY["vocab_size"])
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = ours.logits(ours(ids, attention_mask=mask))
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=1e-5, rtol=1e-5)
    assert expected.abs().max() < 2.0  # the cap shaped these logits


def test_config_round_trips_through_config_json(pair):
    # Checkpoints store config_to_hf() and rebuild the model from it (resume, export): nothing may drift.

    _, ours, _ = pair
    assert config_from_hf(config_to_hf(ours.config)) == ours.config


GEMMA4_REFUSED = {
    "moe block": (dict(hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
                       moe_intermediate_size=16), "enable_moe_block=true"),
}


@pytest.mark.parametrize("part", list(GEMMA4_REFUSED))
def test_gemma4_parts_we_do_not_implement_are_refused_and_the_transformers_path_runs_them(tmp_path, part):
    from phaserl.errors import ConfigError

    extra, message = GEMMA4_REFUSED[part]
    config = transformers.Gemma4TextConfig(**TINY, head_dim=8, global_head_dim=16, sliding_window=3,
                                           layer_types=ALTERNATE, final_logit_softcapping=5.0, **extra)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=f"{message}.*model.implementation=transformers runs it exactly"):
        load_pretrained(tmp_path)
    exact = load_pretrained(tmp_path, implementation="transformers")  # its head probe passed: exact log-probs
    assert not exact.plain_head  # soft-capped: scored through the model's own head


def test_soft_capping_is_what_makes_gemma4_logits_equal(pair):
    # The soft-capped parity above must be able to fail: the same model without the cap differs.
    _, ours, _ = pair
    if ours.config.final_logit_softcapping is None:
        pytest.skip("no soft-capping in this family's test config")
    assert not ours.plain_head
    plain = CausalLM(ours.config.replace(final_logit_softcapping=None))
    plain.load_state_dict(ours.state_dict())
    assert plain.plain_head
    ids, mask, _ = left_padded_batch(TINY["vocab_size"])
    with torch.no_grad():
        a, b = ours.logits(ours(ids, attention_mask=mask)), plain.logits(plain(ids, attention_mask=mask))
    assert (a - b)[mask.bool()].abs().max() > 1e-2


def test_kv_pool_lays_out_per_layer_head_shapes_and_moves_whole_slots():
    # Gemma 4: sliding layers 2 kv heads of 8, global layers 1 of 16 (the same row width: one group); every layer's
    # slot moves with one copy. Widths that differ: tests/test_kv_pool_widths.py.
    from phaserl.models import DecoderConfig
    from phaserl.rollout.kv_pool import KVPool

    cfg = DecoderConfig(model_type="gemma4_text", **TINY, head_dim=8, global_head_dim=16, global_kv_heads=1,
                        sliding_window=3, layer_types=ALTERNATE)
    pool = KVPool(cfg, torch.float32, "cpu")
    keys, values = pool.layout(num_slots=3, slot_len=5)
    assert [tuple(k.shape) for k in keys] == [(3, 2, 5, 8), (3, 1, 5, 16)] * 2
    assert pool.bytes_per_token == 2 * 4 * 16 * 4  # K and V, 4 layers of 16 elements each (2 x 8 or 1 x 16), fp32
    g = torch.Generator().manual_seed(0)
    for t in keys + values:
        t.copy_(torch.randn(t.shape, generator=g))
    before = [t.clone() for t in keys + values]
    (rows,) = pool.slot_rows(3, 5)  # [L, 2, slots, S * 16]
    rows[:, :, torch.tensor([0])] = rows[:, :, torch.tensor([2])]
    for old, new in zip(before, keys + values):
        torch.testing.assert_close(new[0], old[2], rtol=0, atol=0)
        torch.testing.assert_close(new[1:], old[1:], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, window", [(256, None), (512, None), (512, 100)])
def test_gpu_triton_decode_attention_at_gemma_head_dims(head_dim, window):
    # Gemma 4's global layers have head_dim 512: the kernel takes smaller key blocks there (shared memory).
    g = torch.Generator().manual_seed(0)
    Hq, Hkv, slots, S = 8, 1, 4, 700
    keys, values = (torch.randn(slots, Hkv, S, head_dim, generator=g).cuda().bfloat16() for _ in range(2))
    q = torch.randn(4, Hq, head_dim, generator=g).cuda().bfloat16()
    k, v = (torch.randn(4, Hkv, head_dim, generator=g).cuda().bfloat16() for _ in range(2))
    pos = torch.tensor([0, 63, 300, 699], device="cuda")
    ref_keys, ref_values = keys.clone(), values.clone()
    out = kernels.decode_attention(q, k, v, keys, values, pos, 1.0 / 16, window)
    expected = cached_attention(q.float(), k.float(), v.float(), ref_keys.float(), ref_values.float(), pos, 1.0 / 16,
                                window)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_gemma4_without_sliding_layers_exports_a_config_transformers_accepts(tmp_path):
    # Every layer global: each takes global_head_dim; transformers' config still wants an int sliding_window.
    hf = randomize(transformers.AutoModelForCausalLM.from_config(transformers.Gemma4TextConfig(
        **TINY, head_dim=8, global_head_dim=16, hidden_size_per_layer_input=0, layer_types=["full_attention"] * 4)))
    hf.save_pretrained(tmp_path / "in")
    ours = load_pretrained(tmp_path / "in")
    assert ours.config.layer_types is None and ours.config.heads(0) == (4, 2, 16)
    save_pretrained(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids, mask, positions = left_padded_batch(TINY["vocab_size"])
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = back(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=1e-6, rtol=1e-6)
