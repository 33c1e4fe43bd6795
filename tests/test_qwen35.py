"""Qwen3.5 (Gated DeltaNet linear attention + gated full attention) on the native decoder, against transformers'
own Qwen3_5ForCausalLM: fp32 logits, HF directories both ways, packed sequences that never share state (the
recurrent state and the short conv both restart at a boundary), and the chunked rule against the recurrent one."""
import pytest
import torch
import transformers

from _hf_pairs import (
    PROMPTS,
    assert_engine_greedy_matches,
    assert_export_matches,
    assert_packing_matches,
    greedy_reference,
)
from _qwen35_pair import TINY, Qwen3_5TextConfig, make_pair, randomize
from phaserl.errors import ConfigError
from phaserl.models import CausalLM, load_pretrained
from phaserl.models.families import config_from_hf, config_to_hf
from phaserl.models.linear_attention import chunk_gated_delta_rule, recurrent_step_

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(Qwen3_5TextConfig is None, reason="this transformers has no Qwen3.5")

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory)


def padded_batch(T: int = 70):
    """Rows longer than one 64-token chunk, left padding of different widths."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (3, T), generator=g)
    mask = torch.ones(3, T, dtype=torch.long)
    mask[0, :4], mask[2, :1] = 0, 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def test_the_config_reads_the_hybrid_layout(pair):
    _, ours, _ = pair
    cfg = ours.config
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)  # transformers' default: every 4th
    assert cfg.rotary_dim == 4 and cfg.attn_output_gate and cfg.num_kv_layers == 1  # partial_rotary_factor 0.25
    assert cfg.linear_attention.conv_dim == 2 * 2 * 8 + 4 * 8
    back = config_from_hf(config_to_hf(cfg))
    assert back == cfg


def test_logits_equal_transformers_in_float32(pair):
    # Each row alone: transformers' own left-padded rows shift its 64-token chunks and round differently
    # (1e-5 apart from its unpadded logits), so the reference is every row without its padding.
    hf, ours, _ = pair
    ids, mask, _ = padded_batch()
    with torch.no_grad():
        got = ours.logits(ours(ids, attention_mask=mask))
        for row in range(len(ids)):
            real = mask[row].bool()
            expected = hf(input_ids=ids[row:row + 1, real]).logits[0]
            torch.testing.assert_close(got[row, real], expected, atol=1e-5, rtol=1e-5)


def test_export_loads_in_transformers_with_the_same_logits(pair, tmp_path):
    hf, ours, _ = pair
    assert_export_matches(hf, ours, tmp_path / "out", padded_batch())


def _pack(rows):
    packed = torch.cat(rows)[None]  # [1, N]
    positions = torch.cat([torch.arange(len(r)) for r in rows])[None]
    seq_ids = torch.cat([torch.full((len(r),), i) for i, r in enumerate(rows)])[None]
    return packed, positions, seq_ids


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_hybrid_layers_give_the_eager_outputs_and_gradients(pair, monkeypatch, backend):
    # hybrid.COMPILE_HYBRID (off until measured on the H200): the layers through torch.compile with the attention
    # core and the delta rule left eager. aot_eager traces the backward too (no code generation on the CPU).
    import copy

    from phaserl.models import decoder, hybrid

    _, ours, _ = pair
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(0, 96, (n,), generator=g) for n in (37, 80, 5)]
    packed, positions, seq_ids = _pack(rows)

    def run(model):
        model.zero_grad()
        hidden = model(packed, position_ids=positions, seq_ids=seq_ids)
        hidden.square().mean().backward()
        return hidden.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    eager_out, eager_grads = run(ours)
    model = copy.deepcopy(ours)
    decoder.enable_compile(model, backend=backend)
    assert decoder.is_compiled(model) is None  # off by default: the hybrid layers stay eager
    monkeypatch.setattr(hybrid, "COMPILE_HYBRID", True)
    decoder.enable_compile(model, backend=backend)
    assert decoder.is_compiled(model) == backend and all(layer.compiled for layer in model.model.layers)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    out, grads = run(model)
    assert counters["stats"]["unique_graphs"] >= 2  # dynamo compiled them: a graph per layer kind at least
    torch.testing.assert_close(out, eager_out, atol=1e-5, rtol=1e-5)
    assert len(grads) == len(eager_grads)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_packed_sequences_share_no_state(pair):
    # Two sequences in one row (the second starts mid-chunk) must give exactly what each gives alone: the
    # DeltaNet state and the conv's last K-1 inputs restart at the boundary.
    _, ours, _ = pair
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 96, (n,), generator=g) for n in (37, 45)]
    packed, positions, seq_ids = _pack(rows)
    with torch.no_grad():
        alone = torch.cat([ours(r[None])[0] for r in rows])  # [N, H]
        got = ours(packed, position_ids=positions, seq_ids=seq_ids)[0]
        leaked = ours(packed, position_ids=positions, seq_ids=torch.zeros_like(seq_ids))[0]  # one sequence
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
    # The comparison can fail: had the state crossed the boundary, the second sequence would differ.
    assert (leaked[37:] - alone[37:]).abs().max() > 1e-2


def test_packed_rows_equal_padded_rows(pair):
    _, ours, _ = pair
    assert_packing_matches(ours, padded_batch(20))


@pytest.mark.parametrize("triangular, chunk", [("solve", 16), ("blocked", 16), ("blocked", 64)])
def test_chunked_rule_equals_the_token_by_token_recurrence(monkeypatch, triangular, chunk):
    from phaserl.models import linear_attention

    monkeypatch.setattr(linear_attention, "TRIANGULAR", triangular)
    g = torch.Generator().manual_seed(0)
    n, L, H, Dk, Dv = 2, 150, 3, 8, 4
    q, k = (torch.nn.functional.normalize(torch.randn(n, L, H, Dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(n, L, H, Dv, generator=g)
    decay, beta = -torch.rand(n, L, H, generator=g), torch.rand(n, L, H, generator=g)
    start = torch.randn(n, H, Dk, Dv, generator=g)
    out, final = chunk_gated_delta_rule(q, k, v, decay, beta, start, chunk=chunk)
    state, steps = start.clone(), []
    for t in range(L):
        steps.append(recurrent_step_(q[:, t], k[:, t], v[:, t], decay[:, t], beta[:, t], state))
    torch.testing.assert_close(out, torch.stack(steps, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, state, atol=1e-5, rtol=1e-5)


def test_the_blocked_inverse_gives_the_triangular_solves_answer_and_gradients_for_alike_keys(monkeypatch):
    """TRIANGULAR = "blocked" (batched matmuls, no trsm): the same outputs and gradients as the solves, also when
    every key of a chunk is nearly the same (the system's strict part close to all ones, slow decay), where a
    product of powers of it would have cancelled catastrophically."""
    from phaserl.models import linear_attention

    g = torch.Generator().manual_seed(1)
    n, L, H, D = 2, 128, 2, 16
    base = torch.randn(1, 1, H, D, generator=g)
    k = torch.nn.functional.normalize(base + 0.02 * torch.randn(n, L, H, D, generator=g), dim=-1)
    q = torch.nn.functional.normalize(torch.randn(n, L, H, D, generator=g), dim=-1)
    v = torch.randn(n, L, H, D, generator=g)
    decay, beta = -0.01 * torch.rand(n, L, H, generator=g), 0.5 + 0.5 * torch.rand(n, L, H, generator=g)
    results = []
    for triangular in ("solve", "blocked"):
        monkeypatch.setattr(linear_attention, "TRIANGULAR", triangular)
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v, decay, beta)]
        out, final = chunk_gated_delta_rule(*inputs)
        (out.square().sum() + final.square().sum()).backward()
        results.append((out.detach(), final.detach(), [t.grad for t in inputs]))
    (out_s, final_s, grads_s), (out_b, final_b, grads_b) = results
    torch.testing.assert_close(out_b, out_s, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final_b, final_s, atol=1e-4, rtol=1e-4)
    for a, b in zip(grads_b, grads_s):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


def test_the_composite_vision_language_model_is_refused_natively_with_the_way_out(tmp_path):
    # transformers' Qwen3_5ForCausalLM reads the composite checkpoint's text model (same logits) and saves it as
    # qwen3_5_text: the message gives that recipe; `auto` keeps the composite on the transformers path.
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": dict(TINY)}))
    with pytest.raises(ConfigError, match=r"Qwen3_5ForCausalLM.from_pretrained\(path\).save_pretrained"):
        load_pretrained(tmp_path, implementation="native")


def test_trains_with_gradients_through_the_chunked_rule(pair):
    _, ours, _ = pair
    model = CausalLM(ours.config)
    model.load_state_dict(ours.state_dict())
    ids, mask, _ = padded_batch(20)
    model.logits(model(ids, attention_mask=mask)).logsumexp(-1).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name in ("model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.conv1d.weight",
                 "model.layers.3.self_attn.q_proj.weight"):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name


def test_a_qwen35_critic_round_trips_through_sequence_classification(pair, tmp_path):
    from phaserl.models import ValueModel, load_value_model
    from phaserl.models.hf_io import save_value_model

    _, ours, _ = pair
    value = ValueModel(CausalLM(ours.config.replace(pad_token_id=0)))  # transformers needs a pad id for B > 1
    value.model.load_state_dict(ours.model.state_dict())
    torch.nn.init.normal_(value.score.weight, std=0.5)
    save_value_model(value, tmp_path / "critic")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "critic").eval()
    ids = torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        values = value(ids)
        torch.testing.assert_close(hf(input_ids=ids).logits[:, 0], values[:, -1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(load_value_model(tmp_path / "critic")(ids), values)

# ----- the rollout engine -------------------------------------------------------------------------------
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402


def test_engine_greedy_equals_the_uncached_loop(pair):
    _, ours, _ = pair
    assert_engine_greedy_matches(ours)


def test_a_config_whose_layers_are_all_full_attention_decodes_in_the_engine():
    """layer_types may leave out linear_attention (no recurrent state at all): the engine used to crash reading
    the linear layers' shape (AttributeError on None) before its first step."""
    torch.manual_seed(0)
    ours = randomize(CausalLM(config_from_hf(Qwen3_5TextConfig(**TINY, layer_types=["full_attention"] * 4)
                                             .to_dict())))
    assert ours.config.linear_attention is None
    assert_engine_greedy_matches(ours)


def test_refilled_and_compacted_slots_start_from_a_fresh_state(pair):
    # 12 sequences of different lengths through 4 slots: every slot is refilled several times (a leaked
    # state would change the next sequence's tokens) and, as the batch drains, compaction moves running
    # sequences to lower slots (three moves with these caps): their state must move with their KV.
    _, ours, _ = pair
    prompts = PROMPTS * 3
    caps = [3, 9, 5, 2, 7, 4, 9, 1, 6, 8, 2, 5]
    engine = RolloutEngine(ours, EngineConfig(max_slots=4))
    result = engine.generate(prompts, SamplingParams(max_new_tokens=9, temperature=0.0), eos_token_ids=[],
                             pad_token_id=0, max_new_tokens=caps)
    assert result.response_ids == [greedy_reference(ours, p, c) for p, c in zip(prompts, caps)]


def test_engine_logprobs_equal_the_trainers_log_softmax(pair):
    from phaserl.roles.forward import head_logprobs

    _, ours, _ = pair
    prompts = [p for p in PROMPTS for _ in range(2)]
    result = RolloutEngine(ours, EngineConfig()).generate(
        prompts, SamplingParams(max_new_tokens=6, temperature=0.8), eos_token_ids=[], pad_token_id=0,
        generator=torch.Generator().manual_seed(0))
    for prompt, tokens, logprobs in zip(prompts, result.response_ids, result.logprobs):
        with torch.no_grad():
            hidden = ours(torch.tensor([prompt + tokens]))[0, len(prompt) - 1:-1]
            expected, _ = head_logprobs(ours, hidden, torch.tensor(tokens), temperature=0.8, chunk_size=4,
                                        with_entropy=False)
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-5, rtol=0)


def test_a_multi_turn_session_continues_the_state_instead_of_starting_over(pair):
    # Turn 1 stops at a stop token; extend appends an observation; turn 2 must equal greedy decoding of the
    # whole conversation so far (prompt + turn 1 + observation) from scratch.
    _, ours, _ = pair
    prompt, observation = [5, 6, 7, 8], [20, 21, 22]
    first = greedy_reference(ours, prompt, 4)
    stop = first[2]  # the third greedy token ends turn 1 (if an earlier one equals it, turn 1 ends there)
    engine = RolloutEngine(ours, EngineConfig())
    with engine.session(SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=[stop]), slot_len=64,
                        eos_token_ids=[]) as session:
        session.start("a", prompt, 6)
        turns = []
        while not turns:
            turns = session.step()
        turn1 = turns[0].token_ids
        assert turn1 == first[:first.index(stop) + 1]
        session.extend("a", observation, 5)
        turns = []
        while not turns:
            turns = session.step()
    conversation = prompt + turn1 + observation
    assert turns[0].token_ids[:5] == greedy_reference(ours, conversation, 5)[:len(turns[0].token_ids)]


def test_lora_adapters_act_in_the_engine_and_switch_off_for_the_reference(pair):
    # The hybrid layers call their projection modules (training and engine alike), so LoRA wrappers count.
    from phaserl.models.lora import LoRASettings, adapters_disabled, apply_lora

    _, ours, _ = pair
    model = CausalLM(ours.config)
    model.load_state_dict(ours.state_dict())
    model.eval()
    base = [greedy_reference(model, p, 6) for p in PROMPTS]
    apply_lora(model, LoRASettings(rank=4, alpha=8.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(std=0.5, generator=torch.Generator().manual_seed(len(name)))
    adapted = [greedy_reference(model, p, 6) for p in PROMPTS]
    assert adapted != base  # the adapters change what the model says
    engine = RolloutEngine(model, EngineConfig())
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    assert engine.generate(PROMPTS, params, eos_token_ids=[], pad_token_id=0).response_ids == adapted
    with adapters_disabled(model):
        assert engine.generate(PROMPTS, params, eos_token_ids=[], pad_token_id=0).response_ids == base


def test_all_linear_lora_adapts_the_deltanet_projections_and_exports_for_peft(pair, tmp_path):
    """'all-linear' used to mean the seven dense projections only: on Qwen3.5 three layers in four (the Gated
    DeltaNet ones) kept their token mixing frozen, unlike PEFT's all-linear. Their in_proj_* / out_proj now get
    adapters, the record names only what the model has, and the PEFT adapter dir gives the adapted logits."""
    peft = pytest.importorskip("peft")
    from phaserl.checkpoint.lora_export import write_peft_adapter
    from phaserl.models.lora import LINEAR_ATTENTION_PROJECTIONS, LoRASettings, apply_lora, merge_lora, resolve_targets

    _, ours, directory = pair
    model = CausalLM(ours.config)
    model.load_state_dict(ours.state_dict())
    torch.manual_seed(0)  # the adapters' A init
    names = apply_lora(model, LoRASettings(rank=4, alpha=8.0, target_modules=resolve_targets(["all-linear"])))
    assert {n.rsplit(".", 1)[-1] for n in names if ".linear_attn." in n} == set(LINEAR_ATTENTION_PROJECTIONS)
    assert sum(".linear_attn." in n for n in names) == 5 * 3  # every projection of the three DeltaNet layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(std=0.1, generator=torch.Generator().manual_seed(len(name)))
    model.eval()
    ids, mask, positions = padded_batch()
    with torch.no_grad():
        want = model.logits(model(ids, attention_mask=mask, position_ids=positions)).float()
        base_logits = ours.logits(ours(ids, attention_mask=mask, position_ids=positions))
    assert (want - base_logits)[mask.bool()].abs().max() > 0.05  # the exported adapters matter
    adapter_dir = write_peft_adapter(model, str(tmp_path / "adapter"), str(directory))
    base = transformers.AutoModelForCausalLM.from_pretrained(directory)
    with_adapter = peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        got = with_adapter(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    # PEFT scales the adapter's output, ours scales B first, a merge rounds W + sBA once: float32 roundings differ
    # (up to 4e-5 seen); a missing or misplaced adapter differs by the adapters' effect (> 0.05, asserted above)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-4, rtol=1e-5)
    merged = merge_lora(model)
    with torch.no_grad():
        torch.testing.assert_close(merged.logits(merged(ids, attention_mask=mask, position_ids=positions))[mask.bool()],
                                   want[mask.bool()], atol=1e-4, rtol=1e-5)


def test_rollout_engine_hf_is_refused_at_build_for_the_native_qwen35(pair):
    """Its recurrent state lives in the engine: rollout.engine=hf used to build and then fail at the first rollout
    with NotImplementedError."""
    from phaserl.roles import HybridActor

    _, ours, _ = pair
    with pytest.raises(ConfigError, match="rollout.engine=auto, or model.implementation=transformers"):
        HybridActor(ours).configure_rollout("hf")


def _kernel_device() -> str:
    from phaserl.rollout import kernels

    if not kernels.available(torch.device("cuda" if torch.cuda.is_available() else "cpu")):
        pytest.skip("needs Triton on CUDA (or TRITON_INTERPRET=1 with Triton installed)")
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape", [(3, 2, 8, 8), (5, 3, 16, 40), (2, 1, 12, 24)])
def test_triton_delta_step_equals_the_torch_step(shape):
    from phaserl.rollout.delta_kernel import delta_step_

    device = _kernel_device()
    b, H, Dk, Dv = shape
    g = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(b, H, Dk, generator=g), dim=-1) for _ in range(2))
    v, state = torch.randn(b, H, Dv, generator=g), torch.randn(b, H, Dk, Dv, generator=g)
    decay, beta = -torch.rand(b, H, generator=g), torch.rand(b, H, generator=g)
    decay[0], beta[0] = 0.0, 0.0  # a row that is not running keeps its state
    expected_state = state.clone()
    expected = recurrent_step_(q, k, v, decay, beta, expected_state)
    got_state = state.to(device)
    got = delta_step_(*(t.to(device) for t in (q, k, v, decay, beta)), got_state)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state.cpu(), expected_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state[0].cpu(), state[0])


# ----- GPU ------------------------------------------------------------------------------------------------
def _on_cuda(ours, dtype=torch.float32):
    model = CausalLM(ours.config).to("cuda")
    model.load_state_dict(ours.state_dict())
    return model.to(dtype).eval()


@pytest.mark.gpu
def test_gpu_bf16_engine_logprobs_match_the_trainer(pair):
    # The same bound as the dense families (tests/test_rollout_engine.py): mean <= 0.03, max <= 0.3 nats.
    from phaserl.roles.forward import head_logprobs

    _, ours, _ = pair
    model = _on_cuda(ours, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (int(n),), generator=g).tolist() for n in torch.randint(8, 80, (8,), generator=g)]
    prompts = [p for p in prompts for _ in range(4)]
    result = RolloutEngine(model, EngineConfig(token_budget=16384)).generate(
        prompts, SamplingParams(max_new_tokens=48, temperature=1.0), eos_token_ids=[], pad_token_id=0,
        generator=torch.Generator("cuda").manual_seed(1))
    diffs = []
    with torch.no_grad():
        for prompt, tokens, logprobs in zip(prompts, result.response_ids, result.logprobs):
            hidden = model(torch.tensor([prompt + tokens], device="cuda"))[0, len(prompt) - 1:-1]
            trainer, _ = head_logprobs(model, hidden, torch.tensor(tokens, device="cuda"), temperature=1.0,
                                       chunk_size=64, with_entropy=False)
            diffs.append((trainer.float().cpu() - torch.tensor(logprobs)).abs())
    diffs = torch.cat(diffs)
    print(f"Qwen3.5 bf16 engine vs trainer log-probs: mean |diff| {diffs.mean():.5f}, max {diffs.max():.5f}")
    assert diffs.mean() <= 0.03 and diffs.max() <= 0.3


@pytest.mark.gpu
def test_gpu_packed_forward_equals_each_sequence_alone_in_bf16(pair):
    # On CUDA the packed forward takes the varlen kernel for the attention layers and, where fla imports,
    # fla's chunk rule with cu_seqlens for the linear ones: still no state may cross a boundary.
    _, ours, _ = pair
    model = _on_cuda(ours, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 96, (n,), generator=g).cuda() for n in (37, 100, 5)]
    packed, positions, seq_ids = (t.cuda() for t in _pack(rows))
    with torch.no_grad():
        alone = torch.cat([model(r[None])[0] for r in rows]).float()
        got = model(packed, position_ids=positions, seq_ids=seq_ids)[0].float()
    assert (got - alone).abs().max() < 0.05 * alone.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_gpu_greedy_with_cuda_graphs_equals_the_uncached_loop(pair, compile):
    _, ours, _ = pair
    model = _on_cuda(ours)
    prompts = PROMPTS * 5  # 20 sequences through 8 slots: refill, several buckets, compaction
    caps = [8, 3, 6, 1, 5] * 4
    engine = RolloutEngine(model, EngineConfig(max_slots=8, compile=compile, token_budget=4096))
    result = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0), eos_token_ids=[],
                             pad_token_id=0, max_new_tokens=caps)
    assert engine.last_stats["graphs"] > 1
    assert result.response_ids == [_greedy_cuda(model, p, c) for p, c in zip(prompts, caps)]


def _greedy_cuda(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            seq.append(int(model.logits(model(torch.tensor([seq], device="cuda")))[0, -1].argmax()))
    return seq[len(prompt):]
