"""Qwen3-MoE natively (models/moe.py): fp32 logits equal transformers' Qwen3MoeForCausalLM both ways through
Hugging Face directories (per-expert tensors in the files, stacked experts in memory), packed == padded, the
grouped-GEMM expert mixture equals the readable loop, the auxiliary loss equals transformers', and the rollout
engine's greedy decode equals the uncached loop. Routing replay: tests/test_moe_replay.py."""
import pytest
import torch
import transformers
from safetensors import safe_open

from _hf_pairs import (
    PROMPTS,
    assert_engine_greedy_matches,
    assert_export_matches,
    assert_graph_greedy_matches_on_gpu,
    assert_logits_match,
    assert_packing_matches,
    greedy_reference,
    left_padded_batch,
    randomize,
)
from phaserl.errors import ConfigError
from phaserl.models import CausalLM, load_pretrained, moe
from phaserl.models.families import config_from_hf
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams

torch.set_num_threads(1)

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
            num_experts=8, num_experts_per_tok=3)


def hf_config(kind: str = "norm_topk", **changes):
    """qwen3_moe with renormalized or raw top-k weights, or qwen2_moe (q/k/v bias, a shared expert). Layer 1 is a
    dense MLP (mlp_only_layers), so a mixed stack is what every test sees."""
    if kind == "qwen2_shared":
        return transformers.Qwen2MoeConfig(**{**TINY, "mlp_only_layers": [1], "shared_expert_intermediate_size": 24,
                                              **changes})
    return transformers.Qwen3MoeConfig(**{**TINY, "norm_topk_prob": kind == "norm_topk", "mlp_only_layers": [1],
                                          **changes})


@pytest.fixture(scope="module", params=["norm_topk", "raw_topk", "qwen2_shared"])
def pair(request, tmp_path_factory):
    """(transformers model, ours loaded from the directory transformers wrote)."""
    hf = randomize(transformers.AutoModelForCausalLM.from_config(hf_config(request.param)))
    directory = tmp_path_factory.mktemp("qwen3moe")
    hf.save_pretrained(directory)
    ours = load_pretrained(directory)
    assert isinstance(ours, CausalLM)
    return hf, ours, directory


def test_transformers_files_hold_one_tensor_per_expert(pair):
    # What phaserl must read: transformers 5 stacks experts in memory but writes them one by one.
    _, _, directory = pair
    with safe_open(directory / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in names
    assert not any(n.endswith("experts.gate_up_proj") for n in names)


def test_logits_equal_transformers_in_float32(pair):
    hf, ours, _ = pair
    assert_logits_match(hf, ours, left_padded_batch(TINY["vocab_size"]))


def test_routing_is_what_makes_them_equal(pair):
    # The parity above can fail: routing every token to its lowest-probability experts changes the logits.
    hf, ours, _ = pair
    ids, mask, _ = left_padded_batch(TINY["vocab_size"])
    E, k = TINY["num_experts"], TINY["num_experts_per_tok"]
    worst = torch.arange(E - k, E).expand(3, 9, 2, k)  # ids E-k.. for both MoE layers
    with torch.no_grad():
        normal = ours.logits(ours(ids, attention_mask=mask))
        forced = ours.logits(ours(ids, attention_mask=mask, routing=moe.Routing(replay=worst)))
    assert (normal - forced)[mask.bool()].abs().max() > 1e-3


def test_export_loads_in_transformers_with_the_same_logits(pair, tmp_path):
    hf, ours, _ = pair
    assert_export_matches(hf, ours, tmp_path / "out", left_padded_batch(TINY["vocab_size"]))
    assert load_pretrained(tmp_path / "out").config == ours.config


def test_packed_rows_equal_padded_rows(pair):
    _, ours, _ = pair
    assert_packing_matches(ours, left_padded_batch(TINY["vocab_size"]))


def expert_case(seed=0, N=37, H=16, inter=8, E=6, k=2):
    g = torch.Generator().manual_seed(seed)
    w = moe.MoEWeights(torch.randn(E, H, generator=g), torch.randn(E, 2 * inter, H, generator=g) * 0.3,
                       torch.randn(E, H, inter, generator=g) * 0.3)
    x = torch.randn(N, H, generator=g)
    ids, weights, _ = moe.route_tokens(x, w.router, moe.MoESpec(E, k, True))
    return x, ids, weights, w


@pytest.mark.skipif(not moe.grouped_mm_available(), reason="this torch has no grouped_mm")
def test_grouped_gemm_mixture_equals_the_loop_on_the_cpu():
    x, ids, weights, w = expert_case()
    ids[:5] = 0  # a crowded expert; expert 5 gets nobody (an empty group)
    ids = torch.where(ids == 5, 4, ids)
    try:
        grouped = moe.experts_grouped(x, ids, weights, w)
    except (RuntimeError, NotImplementedError) as e:  # torch < 2.10 has no CPU kernel
        pytest.skip(f"grouped_mm does not run on this CPU build: {e}")
    torch.testing.assert_close(grouped, moe.experts_loop(x, ids, weights, w), atol=1e-5, rtol=1e-5)


def mixture_grads(fn, x, ids, weights, w):
    """Gradients of a fixed linear functional of fn's output w.r.t. x, the gate weights and the experts."""
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    experts = [t.clone().requires_grad_() for t in (w.gate_up, w.down)]
    out = fn(x, ids, weights, moe.MoEWeights(w.router, *experts))
    (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum().backward()
    return [x.grad, weights.grad] + [t.grad for t in experts]


@pytest.mark.parametrize("mixture", ["experts_grouped", "experts_gathered"])
def test_every_mixture_has_the_loops_gradients(mixture):
    if mixture == "experts_grouped" and not moe.grouped_mm_available():
        pytest.skip("this torch has no grouped_mm")
    case = expert_case(seed=4)
    try:
        got = mixture_grads(getattr(moe, mixture), *case)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"{mixture} does not run backward on this CPU build: {e}")
    for g, expected in zip(got, mixture_grads(moe.experts_loop, *case)):
        torch.testing.assert_close(g, expected, atol=1e-5, rtol=1e-5)


def test_the_mixture_is_picked_by_device_dtype_and_size():
    x, _, _, w = expert_case()  # CPU
    assert moe.pick_mixture(x, w, 2) is moe.experts_loop
    assert moe.pick_mixture(x.bfloat16(), w, 2) is moe.experts_loop  # no grouped kernel on the CPU


def test_gathered_mixture_equals_the_loop():
    x, ids, weights, w = expert_case(seed=2)
    torch.testing.assert_close(moe.experts_gathered(x, ids, weights, w), moe.experts_loop(x, ids, weights, w),
                               atol=1e-5, rtol=1e-5)


def test_the_auxiliary_loss_equals_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(3)
    logits = [torch.randn(12, 8, generator=g) for _ in range(3)]  # 3 layers, 2 rows x 6 tokens
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    expected = load_balancing_loss_func(tuple(logits), 8, 2, mask)
    torch.testing.assert_close(moe.load_balancing_loss(logits, 2, mask), expected)
    torch.testing.assert_close(moe.load_balancing_loss(logits, 2), load_balancing_loss_func(tuple(logits), 8, 2))


def test_a_forwards_aux_loss_equals_the_one_transformers_reports(pair):
    hf, ours, _ = pair
    ids, mask, positions = left_padded_batch(TINY["vocab_size"])
    routing = moe.Routing(mask=mask)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=positions, output_router_logits=True).aux_loss
        ours(ids, attention_mask=mask, routing=routing)
    assert len(routing.routes) == 2  # the two MoE layers, not the dense one
    torch.testing.assert_close(routing.aux_loss(TINY["num_experts_per_tok"]), expected, atol=1e-6, rtol=1e-5)


def test_config_reads_transformers_keys_and_refuses_what_it_lacks(pair):

    _, ours, _ = pair
    cfg = ours.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_layers) == (8, 3, [0, 2])
    assert cfg.router_aux_loss_coef == 0.0  # transformers adds it only with output_router_logits
    d = hf_config(output_router_logits=True, router_aux_loss_coef=0.02).to_dict()  # qwen3_moe
    assert config_from_hf(d).router_aux_loss_coef == 0.02
    with pytest.raises(ConfigError, match="use_sliding_window"):
        config_from_hf({**d, "use_sliding_window": True})
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        config_from_hf({**d, "num_experts_per_tok": None})


def test_experts_spread_over_shard_files_stack_like_one_file(pair, tmp_path):
    # Released checkpoints split a layer's experts over shards (transformers 5 keeps a layer's experts together).
    import json

    from safetensors.torch import save_file

    _, ours, directory = pair
    with safe_open(directory / "model.safetensors", "pt") as f:
        names = sorted(f.keys())
        shards = {f"model-0000{i + 1}-of-00002.safetensors": {n: f.get_tensor(n) for n in names[i::2]}
                  for i in range(2)}
    for file, tensors in shards.items():
        save_file(tensors, tmp_path / file)
    weight_map = {n: file for file, tensors in shards.items() for n in tensors}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    assert len({weight_map[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] for e in range(8)}) == 2
    sharded = load_pretrained(tmp_path)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(sharded.state_dict()[name], tensor), name


def test_a_missing_expert_in_the_files_is_named(pair, tmp_path):
    from safetensors.torch import save_file

    _, _, directory = pair
    with safe_open(directory / "model.safetensors", "pt") as f:
        state = {n: f.get_tensor(n) for n in f.keys() if n != "model.layers.2.mlp.experts.5.gate_proj.weight"}
    out = tmp_path / "broken"
    out.mkdir()
    (out / "config.json").write_text((directory / "config.json").read_text())
    save_file(state, out / "model.safetensors")
    with pytest.raises(ConfigError, match="5.gate_proj"):
        load_pretrained(out)


def test_engine_greedy_equals_the_uncached_loop(pair):
    _, ours, _ = pair
    result = assert_engine_greedy_matches(ours, EngineConfig(max_slots=3))  # 4 prompts through 3 slots: refill too
    assert result.routes is None  # recorded only when asked (routing replay)


def test_engine_keeps_the_expert_weights_in_place(pair):
    _, ours, _ = pair
    engine = RolloutEngine(ours, EngineConfig())
    engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, temperature=0.0), eos_token_ids=[], pad_token_id=0)
    w = engine.runner.weights[0].moe
    assert w.gate_up.data_ptr() == ours.model.layers[0].mlp.experts.gate_up_proj.data_ptr()
    assert w.down.data_ptr() == ours.model.layers[0].mlp.experts.down_proj.data_ptr()


@pytest.mark.gpu
def test_gpu_grouped_gemm_equals_the_cpu_loop():
    x, ids, weights, w = expert_case(N=64, H=64, inter=32, E=8, k=2)
    ids[:9] = 3  # a crowded expert
    ids = torch.where(ids == 7, 6, ids)  # an empty one
    on = lambda t: t.cuda().bfloat16()  # noqa: E731
    moe.prepare_device(torch.device("cuda"))
    assert moe.pick_mixture(on(x), w, 2) is moe.experts_grouped, "the H200 in bf16 must take the grouped kernel"
    grouped = moe.experts_grouped(on(x), ids.cuda(), on(weights), moe.MoEWeights(*map(on, w[:3]))).float().cpu()
    # bf16 rounds gate/up, the product and each expert's output (0.4% of the norm here, on the CPU as on the
    # H200); a wrong group or weight is O(1). Elementwise, the bf16 loop rounds at the same points.
    loop = moe.experts_loop(x.bfloat16().float(), ids, weights.bfloat16().float(),
                            moe.MoEWeights(*(t.bfloat16().float() for t in w[:3])))
    assert (grouped - loop).norm() <= 1e-2 * loop.norm()
    loop_bf16 = moe.experts_loop(on(x), ids.cuda(), on(weights), moe.MoEWeights(*map(on, w[:3]))).float().cpu()
    torch.testing.assert_close(grouped, loop_bf16, atol=2e-2 * float(loop.abs().max()), rtol=2e-2)
    # and its backward (training runs it): bf16 gradients against the fp32 loop's, relative to their scale
    got = mixture_grads(moe.experts_grouped, on(x), ids.cuda(), on(weights), moe.MoEWeights(*map(on, w[:3])))
    rounded = [t.bfloat16().float() for t in (x, weights)]
    expected = mixture_grads(moe.experts_loop, rounded[0], ids, rounded[1],
                             moe.MoEWeights(*(t.bfloat16().float() for t in w[:3])))
    for g, e in zip(got, expected):
        assert (g.float().cpu() - e).norm() <= 2e-2 * e.norm()
    gathered = moe.experts_gathered(x.cuda(), ids.cuda(), weights.cuda(), moe.MoEWeights(*(t.cuda() for t in w[:3])))
    torch.testing.assert_close(gathered.cpu(), moe.experts_loop(x, ids, weights, w), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_bf16_engine_under_cuda_graphs_equals_the_engine_without(pair):
    # The grouped kernel (bf16) captured in decode graphs computes what it computes eagerly.
    _, ours, _ = pair
    model = CausalLM(ours.config).cuda()
    model.load_state_dict(ours.state_dict())
    model = model.bfloat16().eval()
    runs = []
    for graphs in (True, False):
        engine = RolloutEngine(model, EngineConfig(max_slots=8, token_budget=4096, cuda_graphs=graphs,
                                                   record_routes=True))
        result = engine.generate(PROMPTS * 5, SamplingParams(max_new_tokens=8, temperature=0.0), eos_token_ids=[],
                                 pad_token_id=0)
        runs.append((result.response_ids, [r.cpu() for r in result.routes]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


@pytest.mark.gpu
def test_gpu_greedy_with_cuda_graphs_equals_the_uncached_loop(pair):
    _, ours, _ = pair
    assert_graph_greedy_matches_on_gpu(ours)


def test_lora_puts_adapters_on_attention_and_leaves_the_experts_frozen(pair):
    import copy

    from phaserl.models.lora import LoRASettings, apply_lora

    _, ours, _ = pair
    model = copy.deepcopy(ours)
    apply_lora(model, LoRASettings(rank=4, alpha=8, target_modules=("all-linear",)))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("self_attn.q_proj.lora_A" in n for n in trainable)
    assert not any(".experts." in n or ".mlp.gate." in n for n in trainable)
    with torch.no_grad():  # adapters that change the output, so the engine must merge them to agree
        for m in model.modules():
            if hasattr(m, "lora_B"):
                m.lora_B.normal_(0.0, 0.3)
    assert_engine_greedy_matches(model, new_tokens=6)


def test_model_flops_count_the_active_experts_only(pair):
    from phaserl.metrics import FlopModel

    _, ours, _ = pair
    cfg = ours.config
    H, inter, E, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    dense = FlopModel.of(ours).body_params
    total = sum(p.numel() for p in ours.parameters()) - 2 * cfg.vocab_size * H  # untied head
    expert_params = 2 * E * 3 * inter * H  # two MoE layers
    assert dense == total - expert_params + expert_params * k // E


def test_a_continued_turn_extends_the_slot_like_the_full_forward(pair):
    # The engine's extend pass (multi-turn: appended ids prefilled at an offset) through MoE layers.
    from tests.test_rollout_session import drive

    _, ours, _ = pair
    engine = RolloutEngine(ours, EngineConfig(max_slots=2))
    observations = {0: [[30, 31], [32]], 1: [[33, 34, 35], None], 2: [None]}
    with engine.session(SamplingParams(max_new_tokens=4, temperature=0.0), slot_len=48, eos_token_ids=[]) as session:
        for key in (0, 1):
            session.start(key, PROMPTS[key], cap=4)
        turns = drive(session, observations, {k: 4 for k in observations}, waiting=[2], prompt=PROMPTS)
    for key, obs in observations.items():
        seq = list(PROMPTS[key])
        for k, turn in enumerate(turns[key]):
            assert turn.token_ids == greedy_reference(ours, seq, 4)
            seq += turn.token_ids + (obs[k] or [] if k < len(obs) else [])
    assert engine.last_stats["extend_tokens"] == 6


@pytest.mark.slow  # dynamo tracing: ~10 s on 2 cores
def test_the_engines_layer_functions_compile_whole_graphs_through_moe_layers(pair):
    # fullgraph=True, as the engine compiles them on CUDA: routing, the expert mixture and the recorded experts
    # trace without a graph break (the eager backend: tracing only, no code generation on the CPU).
    import phaserl.rollout.layer_fns as runner  # the runner's layer functions
    from phaserl.models.layers import post_attention, pre_attention, rms_norm

    _, ours, _ = pair
    c = lambda fn: torch.compile(fn, dynamic=True, fullgraph=True, backend="eager")  # noqa: E731
    results = []
    for compiled in (True, False):
        engine = RolloutEngine(ours, EngineConfig(record_routes=True))
        if compiled:
            engine.runner.fns = runner.LayerFns(c(pre_attention), c(post_attention), c(rms_norm),
                                                runner.cached_attention, c(runner.sample_tokens), None)
        results.append(engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, temperature=0.0), eos_token_ids=[],
                                       pad_token_id=0))
    assert results[0].response_ids == results[1].response_ids
    assert all(torch.equal(a, b) for a, b in zip(results[0].routes, results[1].routes))
