"""Gemma 4 E2B/E4B's two extras in the native decoder and engine: per-layer inputs (a second embedding table and a
projection of the token embeddings give every layer a small input of its own) and key/value sharing (the last
layers attend over an earlier layer's keys and values and keep none of their own).

The float32 parity with transformers, packing, export, the engine's greedy decode and its log-probs for this layout
run with the other families in test_model_families.py (gemma4-per-layer-inputs-shared-kv). Here: which layer each
layer reads (checked against transformers' own rule), the KV pool holding rows for the writing layers only, the
parity being able to fail, checkpoints that still carry the sharing layers' key/value tensors, what stays refused,
the training paths (checkpointing, compile, packing), LoRA, the KV-cache generate path and multi-turn sessions.
"""
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from _hf_pairs import PROMPTS, greedy_reference, left_padded_batch, randomize
from phaserl.errors import ConfigError
from phaserl.models import CausalLM, load_pretrained
from phaserl.models.decoder import enable_compile
from phaserl.models.families import config_from_hf
from phaserl.models.lora import LoRASettings, apply_lora
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams, generate
from phaserl.rollout.kv_pool import KVPool

torch.set_num_threads(1)

LAYERS = ["sliding_attention", "sliding_attention", "full_attention"] * 2
ROPE = {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e4},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}


def tiny_config(**overrides) -> transformers.Gemma4TextConfig:
    """6 layers (sliding, sliding, full) x 2; the last 3 read layer 1's (sliding) or layer 2's (full) keys/values."""
    return transformers.Gemma4TextConfig(**{
        **dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=3, layer_types=LAYERS,
               max_position_embeddings=128, final_logit_softcapping=5.0, rope_parameters=ROPE,
               hidden_size_per_layer_input=8, vocab_size_per_layer_input=96, num_kv_shared_layers=3,
               use_double_wide_mlp=True), **overrides})


@pytest.fixture(scope="module")
def model() -> CausalLM:
    torch.manual_seed(0)
    return randomize(CausalLM(config_from_hf(tiny_config().to_dict())))


def e2b_like_config() -> transformers.Gemma4TextConfig:
    """E2B's layout without its weights: 35 layers, every 5th full, the last 20 sharing, 1 kv head of 256 / 512."""
    return transformers.Gemma4TextConfig(
        vocab_size=262144, hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
        num_key_value_heads=1, head_dim=256, global_head_dim=512, sliding_window=512,
        layer_types=["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(35)],
        hidden_size_per_layer_input=256, num_kv_shared_layers=20, use_double_wide_mlp=True)


def test_sharing_layers_read_the_last_earlier_layer_of_their_kind_as_transformers_does():
    hf = e2b_like_config()
    cfg = config_from_hf(hf.to_dict())
    sources = [cfg.kv_source(i) for i in range(35)]
    assert sources[:15] == list(range(15))
    assert {sources[i] for i in range(15, 35) if i % 5 == 4} == {14} and {
        sources[i] for i in range(15, 35) if i % 5 != 4} == {13}
    assert [cfg.mlp_width(i) for i in (14, 15)] == [6144, 12288]  # double-wide in the sharing layers only
    assert cfg.num_kv_layers == 15 and cfg.per_layer_input_size == 256 and cfg.per_layer_vocab_size == 262144
    modes = getattr(hf, "kv_sharing_modes", None)  # transformers' own rule, where this version names it
    if modes is not None:
        assert [i for i, m in enumerate(modes) if m == "reuse"] == list(range(15, 35))
        assert sorted({sources[i] for i in range(15, 35)}) == [i for i, m in enumerate(modes) if m == "store"]


def test_the_pool_keeps_rows_for_the_writing_layers_only():
    # E2B's layout in bf16: 15 writing layers (3 full of 512, 12 sliding of 256) instead of 35, 2.3x the slots.
    cfg = config_from_hf(e2b_like_config().to_dict())
    assert KVPool.token_bytes(cfg, torch.bfloat16) == 2 * (3 * 512 + 12 * 256) * 2
    unshared = cfg.replace(kv_shared_layers=0, double_wide_mlp=False)
    assert KVPool.token_bytes(unshared, torch.bfloat16) == 2 * (7 * 512 + 28 * 256) * 2


def test_a_sharing_layer_gets_its_sources_cache_views(model):
    pool = KVPool(model.config, torch.float32, "cpu")
    keys, values = pool.layout(num_slots=2, slot_len=5)
    assert pool.num_layers == 3 and pool.bytes_per_token == 2 * (16 + 16 + 32) * 4
    assert len(keys) == 6
    for layer, source in ((3, 1), (4, 1), (5, 2)):
        assert keys[layer].data_ptr() == keys[source].data_ptr()
        assert values[layer].data_ptr() == values[source].data_ptr()
    assert len({k.data_ptr() for k in keys[:3]}) == 3


def logits(m, batch):
    ids, mask, _ = batch
    with torch.no_grad():
        return m.logits(m(ids, attention_mask=mask))[mask.bool()]


def test_the_per_layer_inputs_and_the_kv_source_are_what_make_the_logits_equal(model):
    # The transformers parity (test_model_families.py) must be able to fail: without the per-layer inputs, or with a
    # sharing layer reading another layer's keys/values, the logits differ.
    batch = left_padded_batch(96)
    expected = logits(model, batch)
    without = CausalLM(model.config)
    without.load_state_dict(model.state_dict())
    with torch.no_grad():
        without.model.embed_tokens_per_layer.weight.zero_()
        without.model.per_layer_model_projection.weight.zero_()
    assert (logits(without, batch) - expected).abs().max() > 1e-2
    elsewhere = CausalLM(model.config)
    elsewhere.load_state_dict(model.state_dict())
    elsewhere.model.layers[3].kv_source, elsewhere.model.layers[0].kv_store = 0, True  # layer 0 is sliding too
    assert (logits(elsewhere, batch) - expected).abs().max() > 1e-3


def test_key_value_tensors_of_sharing_layers_in_a_checkpoint_are_skipped(tmp_path):
    # Checkpoints may hold k_proj/v_proj/k_norm of the sharing layers (transformers skips them on load): so do we.
    hf = randomize(transformers.AutoModelForCausalLM.from_config(tiny_config()))
    hf.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    assert not any(k.startswith("model.layers.3.self_attn.k_") for k in state)
    for layer in (3, 4, 5):
        for name, rows in (("k_proj", 16 if layer < 5 else 32), ("v_proj", 16 if layer < 5 else 32)):
            state[f"model.layers.{layer}.self_attn.{name}.weight"] = torch.randn(rows, 32)
        state[f"model.layers.{layer}.self_attn.k_norm.weight"] = torch.randn(8 if layer < 5 else 16)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = load_pretrained(tmp_path)
    batch = left_padded_batch(96)
    ids, mask, positions = batch
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits[mask.bool()]
    torch.testing.assert_close(logits(ours, batch), expected, atol=1e-5, rtol=1e-5)
    assert "model.layers.3.self_attn.k_proj.weight" not in ours.state_dict()


def test_every_layer_sharing_is_refused_with_the_key(tmp_path):
    d = tiny_config().to_dict()
    d["num_kv_shared_layers"] = 6  # an assistant model: it reads another model's keys and values
    with pytest.raises(ConfigError, match="num_kv_shared_layers=6 of 6 layers: every layer reads another model's"):
        config_from_hf(d)


def _loss_and_grads(m, ids, **kwargs):
    m.zero_grad()
    hidden = m(ids, **kwargs)
    loss = m.logits(hidden).float().logsumexp(-1).mean()  # per position: packing keeps it
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.slow  # torch.compile tracing
def test_checkpointing_compile_and_packing_give_the_same_gradients(model):
    m = CausalLM(model.config)
    m.load_state_dict(model.state_dict())
    m.train()
    ids = torch.tensor([[3, 7, 1, 12, 5, 9, 40, 2], [2, 2, 8, 30, 11, 4, 17, 60]])
    ref_loss, ref_grads = _loss_and_grads(m, ids)
    shared_source = "model.layers.1.self_attn.k_proj.weight"  # read by layers 3 and 4 too: their gradient flows here
    assert ref_grads[shared_source].abs().sum() > 0 and ref_grads["model.embed_tokens_per_layer.weight"].abs().sum() > 0
    m.gradient_checkpointing = True
    enable_compile(m, backend="eager")  # traces the layer (dynamo), no code generation
    try:
        loss, grads = _loss_and_grads(m, ids)
    finally:
        enable_compile(m, False)
        m.gradient_checkpointing = False
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-6, rtol=1e-5)
    T = ids.shape[1]
    packed, pos = ids.reshape(1, -1), torch.arange(T).repeat(2)[None]
    loss, grads = _loss_and_grads(m, packed, position_ids=pos, seq_ids=torch.arange(2).repeat_interleave(T)[None])
    torch.testing.assert_close(loss, ref_loss)
    for n in ref_grads:  # float32: the packed row's sums run in another order
        torch.testing.assert_close(grads[n], ref_grads[n], atol=5e-6, rtol=1e-5)


def test_the_engine_samples_the_lora_adapted_model(model):
    m = CausalLM(model.config)
    m.load_state_dict(model.state_dict())
    names = apply_lora(m, LoRASettings(rank=4, alpha=8.0))
    assert "model.layers.1.self_attn.k_proj" in names and "model.layers.3.self_attn.k_proj" not in names
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith(".lora_B"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    m.eval()
    engine = RolloutEngine(m, EngineConfig())
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0), eos_token_ids=[],
                          pad_token_id=0)
    for prompt, response, lps in zip(PROMPTS, out.response_ids, out.logprobs):
        with torch.no_grad():
            full = m.logits(m(torch.tensor([prompt + response])))[0].float().log_softmax(-1)  # [T, V] unmerged
        assert response == full[len(prompt) - 1:-1].argmax(-1).tolist()
        expected = full[len(prompt) - 1:-1].gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(lps), expected, atol=1e-4, rtol=1e-4)


def test_the_kv_cache_generate_path_equals_the_uncached_loop(model):
    result = generate(model, PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0), eos_token_ids=[],
                      pad_token_id=0)
    assert result.response_ids == [greedy_reference(model, p, 8) for p in PROMPTS]


def test_a_multi_turn_session_continues_exactly(model):
    # The extend pass: the observation's tokens go after the slot's KV; the sharing layers read their sources' rows.
    assert_session_continues_exactly(model)


@pytest.mark.gpu
def test_gpu_session_with_graphs_and_the_triton_kernels_continues_exactly(model):
    # On CUDA: the decode steps replay CUDA graphs over the Triton attention, the extend passes run extend_kernel.py.
    cuda = CausalLM(model.config).cuda()
    cuda.load_state_dict(model.state_dict())
    assert_session_continues_exactly(cuda.eval())


def assert_session_continues_exactly(model):
    engine = RolloutEngine(model, EngineConfig(max_slots=4))
    observations = {0: [20, 21], 1: [22], 2: [23, 24, 25], 3: [26]}
    with engine.session(SamplingParams(max_new_tokens=6, temperature=0.0), slot_len=64, eos_token_ids=[]) as s:
        for key in observations:
            s.start(key, PROMPTS[key], cap=6)
        first, second = {}, {}
        while len(first) < 4:
            first.update({t.key: t for t in s.step()})
        for key in (3, 1, 2, 0):
            s.extend(key, observations[key], 6)
            while key not in second:
                second.update({t.key: t for t in s.step()})
    for key, obs in observations.items():
        assert first[key].token_ids == greedy_reference(model, PROMPTS[key], 6)
        assert second[key].token_ids == greedy_reference(model, PROMPTS[key] + first[key].token_ids + obs, 6)


def test_fsdp_wrapped_layers_with_checkpointing_give_the_same_gradients(model, tmp_path):
    # FSDP2's hooks rebuild a layer's inputs (tensors that need gradients are swapped for hooked ones): the keys and
    # values a sharing layer reads travel as explicit inputs and outputs, never in a container the layers mutate.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    ids = torch.tensor([[3, 7, 1, 12, 5, 9, 40, 2]])
    plain = CausalLM(model.config)
    plain.load_state_dict(model.state_dict())
    plain.train()
    ref_loss, ref_grads = _loss_and_grads(plain, ids)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        sharded = CausalLM(model.config)
        sharded.load_state_dict(model.state_dict())
        mesh, mp = init_device_mesh("cpu", (1,)), MixedPrecisionPolicy(cast_forward_inputs=False)
        for layer in sharded.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(sharded, mesh=mesh, mp_policy=mp)
        sharded.gradient_checkpointing = True
        sharded.train()
        loss, grads = _loss_and_grads(sharded, ids)
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(loss, ref_loss)
    for n in ref_grads:
        torch.testing.assert_close(grads[n].full_tensor(), ref_grads[n], atol=1e-6, rtol=1e-5)
