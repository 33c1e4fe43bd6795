"""Training throughput features: micro-batches equal in number on every rank and balanced by tokens,
the varlen attention kernel, compiled layers, activation checkpointing, fused log-prob kernels, perf/ metrics.

Every speed feature must leave the numbers alone: each is compared with the plain path. CUDA-only checks are
marked `gpu` (run on the lent H200; benchmarks/train_step.py measures the speed).
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from phaserl.batching import split_by_tokens
from phaserl.metrics import FlopModel, device_peak_flops
from phaserl.models import CausalLM, DecoderConfig, attention, decoder
from phaserl.packing import split_packed_by_tokens
from phaserl.roles import forward
from phaserl.roles.forward import rows_logprobs, split_rows
from test_packing import PROMPTS, RESPONSES, _batch

V = 37


def _model(seed=0, **kw) -> CausalLM:
    torch.manual_seed(seed)
    cfg = DecoderConfig(model_type="qwen2", vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        tie_word_embeddings=False, attention_bias=True, **kw)
    return CausalLM(cfg).float()


def _loss_and_grads(model, batch, *, packing, budget=1000):
    """A PPO-shaped loss over every micro-batch; returns (loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(5)).to(
        batch.input_ids.device)
    total = 0.0
    for idx in split_rows(batch, budget, packing=packing):
        logp, ent, mask = rows_logprobs(model, batch, idx, packing=packing, temperature=0.8, with_entropy=True)
        w = weights[idx][:, : mask.shape[1]] * mask
        loss = (logp * w).sum() - 0.1 * (ent * mask).sum()
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(a: dict, b: dict, rel: float) -> None:
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        err = (a[name] - b[name]).norm() / b[name].norm().clamp(min=1e-12)
        assert err < rel, (name, float(err))


# ----- micro-batches: as many on every rank, balanced by tokens --------------------------------------------
def test_split_rows_runs_as_many_micro_batches_as_the_busiest_rank(monkeypatch):
    b = _batch([5, 4, 4, 2, 2, 1], [5, 5, 4, 2, 1, 1])  # real lengths 10, 9, 8, 4, 3, 2: 36 tokens
    assert len(split_rows(b, 40, packing=True)) == 1  # alone, one micro-batch fits
    # the other rank of two needs 4 micro-batches for its rows (FSDP: every rank must call forward as often)
    monkeypatch.setattr(forward, "rank_and_world", lambda: (0, 2))
    monkeypatch.setattr(forward, "all_reduce_sum", lambda t: t + torch.tensor([0.0, 4.0]))
    packed = [g.tolist() for g in split_rows(b, 40, packing=True)]
    # dealt longest first to the lightest group: 10 | 9 | 8 | 4 + 3 + 2 = 9
    assert packed == [[0], [1], [2], [3, 4, 5]]
    padded = [g.tolist() for g in split_rows(b, 40, packing=False)]
    assert len(padded) == 4 and sorted(sum(padded, [])) == list(range(6))  # the same rows, only regrouped


def test_padded_micro_batches_put_rows_of_similar_length_together():
    b = _batch([2, 8, 2, 8], [2, 8, 2, 8])  # short, long, short, long
    # in batch order, 2 rows x 16 columns twice = 64 padded tokens; by length, 2 x 16 + 2 x 4 = 40
    assert [g.tolist() for g in split_by_tokens(b, 40)] == [[0, 2], [1, 3]]
    assert [g.tolist() for g in split_by_tokens(b, 40, num_groups=3)] == [[0, 2], [1], [3]]


def test_split_never_makes_an_empty_micro_batch():
    b = _batch([2, 2], [2, 2])
    with pytest.raises(ValueError, match="non-empty"):
        split_packed_by_tokens(b, 100, num_groups=3)


def test_the_update_is_the_same_however_the_rows_are_grouped():
    # 1 micro-batch, the budget's own grouping, and 5 forced groups (as another rank would ask): one gradient
    b = _batch(PROMPTS, RESPONSES)
    for packing in (True, False):
        ref_loss, ref = _loss_and_grads(_model(), b, packing=packing, budget=10_000)
        loss, grads = _loss_and_grads(_model(), b, packing=packing, budget=25)
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        _assert_grads_close(grads, ref, 1e-5)


# ----- the varlen path, with a reference kernel standing in for flash on CPU ---------------------------------
def _reference_varlen(calls):
    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size):
        """What the flash varlen kernel computes: causal attention inside each [cu[i], cu[i + 1]) run."""
        assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and k.shape[1] == q.shape[1]
        calls.append((cu_q.tolist(), max_q))
        out = torch.empty_like(q)  # [N, Hq, D]
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                      v[a:b].transpose(0, 1), is_causal=True).transpose(0, 1)
        return out
    return varlen_attn


def test_the_varlen_path_passes_sequence_boundaries_and_matches_the_padded_path(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "_VARLEN", (_reference_varlen(calls), {"window_size": (-1, 0)}, False))
    monkeypatch.setattr(attention, "_GQA_PROBED", {})  # this kernel wants equal heads: the probe says no
    monkeypatch.setattr(decoder, "use_varlen", lambda device, dtype: True)
    model = _model()
    # one packed row of three sequences, lengths 5, 5, 3
    hidden = model(*[x[None] for x in (torch.arange(1, 14), torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2]))],
                   seq_ids=torch.tensor([[0] * 5 + [1] * 5 + [2] * 3]))
    assert hidden.shape == (1, 13, 32)
    assert calls[0] == ([0, 5, 10, 13], 5)  # one call per layer, boundaries as cumulative lengths
    assert len(calls) == 2 and attention._GQA_PROBED == {torch.device("cpu"): False}
    ref_loss, ref = _loss_and_grads(_model(), _batch(PROMPTS, RESPONSES), packing=False, budget=25)
    loss, grads = _loss_and_grads(_model(), _batch(PROMPTS, RESPONSES), packing=True, budget=25)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_close(grads, ref, 1e-5)


def test_a_varlen_kernel_that_takes_fewer_kv_heads_gets_them_unrepeated(monkeypatch):
    heads_seen = []

    def gqa_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size):
        heads_seen.append(k.shape[1])
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return _reference_varlen([])(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window_size)

    monkeypatch.setattr(attention, "_VARLEN", (gqa_varlen, {"window_size": (-1, 0)}, False))
    monkeypatch.setattr(attention, "_GQA_PROBED", {})
    monkeypatch.setattr(decoder, "use_varlen", lambda device, dtype: True)
    ref_loss, ref = _loss_and_grads(_model(), _batch(PROMPTS, RESPONSES), packing=False, budget=25)
    loss, grads = _loss_and_grads(_model(), _batch(PROMPTS, RESPONSES), packing=True, budget=25)
    assert attention._GQA_PROBED == {torch.device("cpu"): True}  # the probe's forward + backward agreed
    assert heads_seen[-1] == 2  # the model's 2 kv heads went in as they are (4 query heads)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_close(grads, ref, 1e-5)


def test_the_gqa_probe_says_yes_when_its_first_call_comes_from_an_inference_mode_pass(monkeypatch):
    # Bug (found on the H200, 2026-12-04): the reference's pass runs under torch.inference_mode() and was the probe's
    # first caller; its tensors were made there, the kernel's autograd could not save them, the probe failed on that
    # and answered no for good, so every packed forward repeated k and v. This stand-in saves its inputs for backward,
    # as the flash kernel's autograd does.
    def reference(q, k, v, cu):
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return _reference_varlen([])(q, k, v, cu, cu, 0, 0, window_size=(-1, 0))

    class SavingVarlen(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, cu):
            ctx.save_for_backward(q, k, v, cu)
            return reference(q, k, v, cu)

        @staticmethod
        def backward(ctx, grad):
            q, k, v, cu = ctx.saved_tensors
            with torch.enable_grad():
                q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
                return (*torch.autograd.grad(reference(q, k, v, cu), (q, k, v), grad), None)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size):
        return SavingVarlen.apply(q, k, v, cu_q)

    monkeypatch.setattr(attention, "_VARLEN", (varlen, {"window_size": (-1, 0)}, False))
    monkeypatch.setattr(attention, "_GQA_PROBED", {})
    with torch.inference_mode():
        assert attention._varlen_takes_gqa(torch.device("cpu"))


# ----- compile and activation checkpointing: the same loss and gradients ----------------------------------
@pytest.mark.slow
def test_compiled_layers_and_checkpointing_give_the_same_loss_and_gradients():
    b = _batch(PROMPTS, RESPONSES)
    ref_loss, ref = _loss_and_grads(_model(), b, packing=True, budget=25)
    model = _model()
    decoder.enable_compile(model, backend="eager")  # dynamo's tracing and graph break, no code generation
    assert model.compiled
    for checkpointing, packing in ((False, True), (True, False)):
        model.gradient_checkpointing = checkpointing
        loss, grads = _loss_and_grads(model, b, packing=packing, budget=25)
        assert loss == pytest.approx(ref_loss, rel=1e-5), (checkpointing, packing)
        _assert_grads_close(grads, ref, 1e-5)
    clone = copy.deepcopy(model)  # only a flag lives on the layers: a copy is compiled too, and itself
    assert clone.compiled and all(layer.compiled == "eager" for layer in clone.model.layers)
    decoder.enable_compile(clone, enabled=False)
    assert not clone.compiled and model.compiled


def test_config_switches_reach_the_models(tmp_path):
    from _tiny_run import make_run_dir
    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer

    cfg = load_config(None, make_run_dir(str(tmp_path)) + [
        "trainer.loggers=[]", "data.val_files=[]", "algorithm.adv_estimator=gae", "actor.compile=true",
        "actor.gradient_checkpointing=true", "critic.gradient_checkpointing=true"])
    trainer = RLTrainer.from_config(cfg)
    assert trainer.actor.model.compiled and trainer.ref_policy.model.compiled
    assert not trainer.critic.model.compiled  # critic.compile stays off
    assert trainer.actor.model.gradient_checkpointing and trainer.critic.model.gradient_checkpointing
    decoder.enable_compile(trainer.actor.model, enabled=False)  # nothing was run compiled: keep the suite fast


# ----- perf/ metrics ---------------------------------------------------------------------------------------
def test_flop_model_counts_by_hand():
    model = _model()  # H 32, V 37, 2 layers, 4 heads of 8, untied LM head
    fm = FlopModel.of(model)
    # per layer: q 32*32+32, k and v 32*16+16 each, o 32*32, MLP 3*32*64, 2 norms of 32 = 9344; final norm 32
    assert (fm.body_params, fm.head_params, fm.attn_width) == (2 * 9344 + 32, 37 * 32, 2 * 4 * 8)
    # rows of 3 and 5 real tokens, 4 of them scored: 2*18720*8 + 2*1184*4 + 2*64*(9 + 25)
    assert fm.forward_flops(torch.tensor([3, 5]), 4) == 299520 + 9472 + 4352
    assert FlopModel.of(model, lm_head=False).head_params == 0
    assert device_peak_flops(torch.device("cpu")) is None  # no perf/mfu on CPU



def test_flop_model_counts_each_layers_own_head_shape():
    # Gemma 4: 2 sliding layers with 4 heads of 8, 2 global layers with 4 heads of 16.
    from phaserl.models import CausalLM, DecoderConfig

    cfg = DecoderConfig(model_type="gemma4_text", vocab_size=37, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        global_head_dim=16, sliding_window=3, layer_types=["sliding_attention", "full_attention"] * 2)
    assert FlopModel.of(CausalLM(cfg)).attn_width == 2 * 4 * 8 + 2 * 4 * 16


def test_flop_model_reads_transformers_per_layer_configs_and_skips_linear_attention():
    """Regression (H200, 2026-12-01): a Gemma 4 GRPO step on the transformers path crashed in perf/mfu, reading
    `config.head_dim` (transformers raises for per-layer attributes). Qwen3.5's DeltaNet layers have no
    quadratic attention term."""
    import transformers

    gemma = transformers.Gemma4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
        hidden_size_per_layer_input=0, sliding_window=4, max_position_embeddings=64,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    model = transformers.AutoModelForCausalLM.from_config(gemma)
    assert FlopModel.of(model).attn_width == 2 * 4 * 8 + 4 * 16
    qwen35 = transformers.Qwen3_5TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, max_position_embeddings=64)
    assert qwen35.layer_types.count("full_attention") == 1
    assert FlopModel.of(transformers.AutoModelForCausalLM.from_config(qwen35)).attn_width == 4 * 16


@pytest.mark.parametrize("window", [None, 3])
def test_packed_attention_wider_than_the_flash_kernel_runs_per_sequence_and_matches_the_mask(window):
    """Regression (H200, 2026-12-01): Gemma 4's global layers (head_dim 512) failed the packed GRPO step, the
    varlen flash kernel taking at most 256. Wider heads take SDPA per packed sequence: same outputs and
    gradients as the block-diagonal mask, GQA and sliding windows included."""
    torch.manual_seed(0)
    B, T, Hq, Hkv, D = 2, 7, 4, 2, attention.VARLEN_MAX_HEAD_DIM + 8
    seq_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [2, 2, 2, 2, 2, 3, 3]])  # [B, T]
    q = torch.randn(B, T, Hq, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, T, Hkv, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    packed = attention.packed_boundaries(seq_ids)
    packed = attention.PackedSeqs(packed.cu_seqlens, packed.max_len, window)
    got = attention.attend(q, k, v, packed, scale=0.3)
    mask = attention.block_diagonal(attention.build_attention_mask(torch.ones(B, T, dtype=torch.bool), 0, T,
                                                                   window), seq_ids)
    want = attention.attend(q, k, v, mask, scale=0.3)
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    for g, w in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v))):
        torch.testing.assert_close(g, w)
    # Inside a compiled layer (actor.compile): the per-sequence loop stays out of the graph, same answer.
    compiled = torch.compile(lambda *args: attention.attend(*args, scale=0.3), backend="eager", fullgraph=False)
    torch.testing.assert_close(compiled(q, k, v, packed), want)


# ----- GPU: the varlen kernel, compiled kernels ------------------------------------------------------------
def _gpu_model(dtype, seed=0) -> CausalLM:
    torch.manual_seed(seed)
    cfg = DecoderConfig(model_type="qwen2", vocab_size=1000, hidden_size=256, intermediate_size=512,
                        num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                        max_position_embeddings=1024, tie_word_embeddings=True, attention_bias=True)
    return CausalLM(cfg).to("cuda", dtype)


def _to_cuda(b):
    import dataclasses

    return dataclasses.replace(b, **{f.name: getattr(b, f.name).cuda() for f in dataclasses.fields(b)
                                     if isinstance(getattr(b, f.name), torch.Tensor)})


@pytest.mark.gpu
def test_varlen_kernel_matches_the_padded_path_on_gpu(monkeypatch):
    b = _to_cuda(_batch([7, 60, 3, 120, 33, 1], [90, 1, 40, 7, 64, 128], seed=3))
    model = _gpu_model(torch.bfloat16)
    assert decoder.use_varlen(torch.device("cuda"), torch.bfloat16), "torch.nn.attention.varlen unavailable"
    calls = []
    monkeypatch.setattr(decoder, "_attend", lambda q, k, v, attn, *rest: calls.append(type(attn).__name__)
                        or decoder.attend(q, k, v, attn, *rest))
    varlen_loss, varlen = _loss_and_grads(model, b, packing=True, budget=300)
    assert "PackedSeqs" in calls and "Tensor" not in calls  # no dense mask was built
    padded_loss, padded = _loss_and_grads(model, b, packing=False, budget=300)
    fp32_loss, fp32 = _loss_and_grads(_gpu_model(torch.float32), b, packing=False, budget=300)
    # bf16 both ways; each as far from the float32 result as the other
    assert varlen_loss == pytest.approx(fp32_loss, rel=2e-2, abs=0.5)
    assert abs(varlen_loss - fp32_loss) < 2 * abs(padded_loss - fp32_loss) + 0.05
    _assert_grads_close(varlen, fp32, 3e-2)
    _assert_grads_close(varlen, padded, 3e-2)


@pytest.mark.gpu
def test_inductor_compiled_layers_and_fused_logprobs_match_on_gpu():
    b = _to_cuda(_batch([7, 60, 3, 120, 33, 1], [90, 1, 40, 7, 64, 128], seed=3))
    for dtype, rel in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        ref_loss, ref = _loss_and_grads(_gpu_model(dtype), b, packing=True, budget=300)
        model = _gpu_model(dtype)
        decoder.enable_compile(model)
        for checkpointing in (False, True):
            model.gradient_checkpointing = checkpointing
            loss, grads = _loss_and_grads(model, b, packing=True, budget=300)
            assert loss == pytest.approx(ref_loss, rel=rel, abs=rel), (dtype, checkpointing)
            _assert_grads_close(grads, ref, rel)


@pytest.mark.gpu
@pytest.mark.parametrize("fused,save_logits", [("triton", False), ("triton", True), ("inductor", False)])
@pytest.mark.parametrize("entropy_in_loss", [True, False])
def test_fused_logprob_kernels_match_the_unfused_ones_on_gpu(fused, save_logits, entropy_in_loss):
    from phaserl.algo import token_logprobs_from_hidden

    g = torch.Generator(device="cuda").manual_seed(0)
    h = (0.3 * torch.randn(3000, 64, device="cuda", generator=g)).requires_grad_(True)  # logits of a few units
    w = (0.3 * torch.randn(5003, 64, device="cuda", generator=g)).requires_grad_(True)  # V not a block multiple
    t = torch.randint(0, 5003, (3000,), device="cuda", generator=g)
    out = []
    for kernel, save in ((False, False), (fused, save_logits)):
        h.grad = w.grad = None
        lp, ent = token_logprobs_from_hidden(h, w, t, temperature=0.7, chunk_size=1024, with_entropy=True,
                                             fused=kernel, save_logits=save)
        loss = (lp * torch.linspace(-1, 1, 3000, device="cuda")).sum()
        (loss + 0.1 * ent.sum() if entropy_in_loss else loss).backward()
        out.append((lp.detach(), ent.detach(), h.grad.clone(), w.grad.clone()))
    for a, b in zip(*out):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=2e-5)


@pytest.mark.gpu
def test_triton_logprob_kernels_in_bf16_at_a_qwen_vocabulary():
    from phaserl.algo import token_logprobs_from_hidden

    g = torch.Generator(device="cuda").manual_seed(1)
    h32 = torch.randn(700, 128, device="cuda", generator=g)
    w32 = 0.1 * torch.randn(151936, 128, device="cuda", generator=g)
    t = torch.randint(0, 151936, (700,), device="cuda", generator=g)
    grads = []
    for dtype, fused in ((torch.float32, False), (torch.bfloat16, "triton")):
        h, w = (x.to(dtype).detach().requires_grad_(True) for x in (h32, w32))  # fresh leaves
        lp, ent = token_logprobs_from_hidden(h, w, t, with_entropy=True, fused=fused, chunk_size=256)
        (lp.sum() + 0.01 * ent.sum()).backward()
        grads.append((lp.detach(), ent.detach(), h.grad.float(), w.grad.float()))
    (lp32, ent32, gh32, gw32), (lp16, ent16, gh16, gw16) = grads
    # bf16 logits carry ~3 significant digits: log-probs of ~-12 within a few hundredths
    assert (lp16 - lp32).abs().max() < 0.1 and (ent16 - ent32).abs().max() < 0.1
    for a, b in ((gh16, gh32), (gw16, gw32)):
        assert (a - b).norm() / b.norm() < 2e-2


@pytest.mark.gpu
def test_a_gpu_step_logs_mfu_and_peak_memory(tmp_path):
    import json
    import os

    from _tiny_run import make_run_dir
    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer

    cfg = load_config(None, make_run_dir(str(tmp_path)) + [
        "trainer.loggers=[jsonl]", "trainer.total_steps=1", "data.val_files=[]", "trainer.device=cuda",
        "rollout.engine_compile=false", "ppo.packing=true"])
    RLTrainer.from_config(cfg).fit()
    line = [json.loads(x) for x in open(os.path.join(tmp_path, "logs", "metrics.jsonl"))][-1]
    assert 0 < line["perf/mfu"] < 1 and line["perf/peak_memory_gb"] > 0


@pytest.mark.gpu
def test_gpu_the_gqa_probe_answers_alike_inside_and_outside_inference_mode(monkeypatch):
    assert attention._VARLEN is not None, "torch.nn.attention.varlen unavailable"
    device = torch.device("cuda")
    monkeypatch.setattr(attention, "_GQA_PROBED", {})
    with torch.inference_mode():  # as the reference's pass calls it first
        inside = attention._varlen_takes_gqa(device)
    monkeypatch.setattr(attention, "_GQA_PROBED", {})
    assert attention._varlen_takes_gqa(device) == inside
