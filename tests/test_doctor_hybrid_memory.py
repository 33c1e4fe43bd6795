"""The doctor's count of what Qwen3.5's layers save for backward (memory/budget.py: delta_layer_bytes,
gated_attention_layer_bytes, train_bytes_per_token) equals what they save, measured on the CPU with
saved_tensors_hooks (benchmarks/saved_activations.py's held_bytes: the distinct storages still held when the
forward returns, less parameters, RoPE tables and the shared Segments).

Tiny shapes of several head counts and dims, chunk boundaries (sequences of 30, 64, 65, 70, 128, 200 tokens), packed
micro-batches, bf16 and float32, the whole stack with and without gradient checkpointing, the fla path's torch side,
and a regression at Qwen3.5-0.8B's layer shape, where the dense rule the doctor used before counted a Gated
DeltaNet layer ~5.8x low. The attention core is the flash-like stand-in of saved_activations.py (what the packed
varlen kernel saves), so the CPU measures what the GPU's update keeps.

What the tolerances leave room for: per-layer (not per-token) tensors the count leaves out (the chunk's c x c
causal mask, the norms' (1 + w), exp(A_log), each chunk's state decay): under 0.5% here; and for a micro-batch of
one sequence, the copies matmul then reads as views of whole tensors (delta_layer_bytes' docstring): 1-2%, and
at most a few percent more counted than kept for a single sequence of one chunk.
"""
import dataclasses
import os
import sys

import pytest
import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from phaserl.memory import budget  # noqa: E402
from phaserl.memory.budget import ModelShape  # noqa: E402
from phaserl.models import CausalLM, attention, linear_attention  # noqa: E402
from phaserl.models.families import config_from_hf  # noqa: E402
from saved_activations import flash_like, saved_bytes, stack_saved_bytes  # noqa: E402

torch.set_num_threads(1)
Qwen3_5TextConfig = getattr(transformers, "Qwen3_5TextConfig", None)
pytestmark = pytest.mark.skipif(Qwen3_5TextConfig is None, reason="this transformers has no Qwen3.5")

PACKED = 0.02  # packed micro-batches (several sequences): what the doctor models
SINGLE = 0.06  # one sequence per micro-batch: matmul's views keep a little more (or, within one chunk, less)

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=16, max_position_embeddings=512)
SHAPES = {  # name -> changes to BASE
    "base": {},
    "one-key-head": dict(hidden_size=48, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=32, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
                         linear_value_head_dim=8),
    "no-grouping": dict(linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=8,
                        linear_value_head_dim=8, linear_conv_kernel_dim=3),
    "wide-values": dict(num_attention_heads=8, num_key_value_heads=4, head_dim=8, linear_num_key_heads=2,
                        linear_num_value_heads=8, linear_key_head_dim=4, linear_value_head_dim=32),
    "big-state": dict(linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=64,
                      linear_value_head_dim=64),  # per-chunk states of 32 KB: a missed state term shows
}
# Qwen3.5-0.8B as benchmarks/families.py builds it, with 4 layers (3 Gated DeltaNet, 1 gated attention) and a small
# vocabulary: the layers' real sizes at a CPU cost.
QWEN35_08B = dict(vocab_size=1024, hidden_size=1024, intermediate_size=3584, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                  linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=32768)


VARLEN_ATTEND = attention.attend  # the real one, for the GPU tests


@pytest.fixture(autouse=True)
def flash_like_attention(monkeypatch):
    """hybrid.py calls attention.attend: the stand-in saves what the varlen flash kernel saves."""
    monkeypatch.setattr(attention, "attend", flash_like)


def model_of(dtype=torch.bfloat16, **changes) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(config_from_hf(Qwen3_5TextConfig(**{**BASE, **changes}).to_dict())).to(dtype).train()


def per_kind(model: CausalLM, tokens: int, seq_len, device: str = "cpu", varlen: bool = False):
    """kind -> (measured, counted) bytes per token of its first layer on one row of `tokens` (sequences of seq_len);
    varlen: the attention layers get packed boundaries (the real varlen kernel on CUDA)."""
    counted = budget.layer_bytes(ModelShape.of(model), sequence_tokens=seq_len or tokens)
    first = {"linear_attention": model.config.layer_types.index("linear_attention"),
             "gated_attention": model.config.layer_types.index("full_attention")}
    return {kind: (saved_bytes(model, tokens, torch.device(device), layer=i, seq_len=seq_len, varlen=varlen) / tokens,
                   counted[kind][1]) for kind, i in first.items()}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("seq_len,sequences", [(30, 5), (64, 2), (65, 2), (128, 2), (200, 2)])
def test_each_layer_kind_saves_what_the_doctor_counts_for_packed_sequences(shape, seq_len, sequences):
    model = model_of(**SHAPES[shape])
    for kind, (measured, counted) in per_kind(model, seq_len * sequences, seq_len).items():
        assert counted == pytest.approx(measured, rel=PACKED), kind


def test_float32_layers_count_their_own_copies():
    # In float32 the .float() copies are the tensors themselves, and the gated attention's q norm keeps the whole
    # q_proj output (gate rows too): the count follows each tensor's dtype, not a fixed multiple of b.
    model = model_of(torch.float32)
    for kind, (measured, counted) in per_kind(model, 2 * 70, 70).items():
        assert counted == pytest.approx(measured, rel=PACKED), kind


@pytest.mark.parametrize("tokens", [64, 65, 200])
def test_a_single_sequence_is_counted_within_the_views_matmul_keeps(tokens):
    for kind, (measured, counted) in per_kind(model_of(), tokens, None).items():
        assert counted == pytest.approx(measured, rel=SINGLE), kind


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_whole_stack_is_what_train_bytes_per_token_counts(checkpointing):
    model = model_of(**SHAPES["one-key-head"])
    shape, tokens, seq_len = ModelShape.of(model), 3 * 70, 70
    counted = budget.train_bytes_per_token(shape, checkpointing, sequence_tokens=seq_len)
    if not checkpointing:
        measured = stack_saved_bytes(model, tokens, torch.device("cpu"), seq_len) / tokens
    else:
        # Checkpointed: the forward keeps each layer's input; backward recomputes one layer at a time.
        model.model.gradient_checkpointing = True
        kept = stack_saved_bytes(model, tokens, torch.device("cpu"), seq_len) / tokens
        assert kept == pytest.approx(shape.num_layers * shape.hidden_size * shape.param_bytes, rel=0.01)
        largest = max(measured for measured, _ in per_kind(model, tokens, seq_len).values())
        measured = kept + largest + budget.SEGMENTS_BYTES
    assert counted == pytest.approx(measured, rel=PACKED)


def test_checkpointing_keeps_a_fraction_of_what_the_stack_saves():
    shape = ModelShape.of(model_of())
    whole, checkpointed = (budget.train_bytes_per_token(shape, c, sequence_tokens=128) for c in (False, True))
    largest = max(each for _, each in budget.layer_bytes(shape, sequence_tokens=128).values())
    assert checkpointed == pytest.approx(shape.num_layers * shape.hidden_size * 2 + largest + 9, abs=1)
    assert checkpointed < whole / 2


def test_regression_the_dense_rule_counted_a_qwen35_08b_deltanet_layer_about_6x_low():
    """Bug: the doctor counted Qwen3.5's layers as eager dense layers (8h + 4I + 2 Hkv D values each), ~5.8x less
    than a Gated DeltaNet layer saves on the torch rule at the 0.8B shape, so micro-batches that did not fit
    passed and `rollout.engine_keep_awake=auto` saw memory that was not there."""
    model = model_of(**QWEN35_08B)
    shape = ModelShape.of(model)
    dense_rule = (8 * shape.hidden_size + 4 * shape.intermediate_size + 2 * shape.num_kv_heads * shape.head_dim) * 2
    measured = per_kind(model, 2 * 128, 128)
    linear, attn = measured["linear_attention"], measured["gated_attention"]
    assert linear[0] > 5 * dense_rule and attn[0] > 1.5 * dense_rule  # what the old count missed
    assert linear[1] == pytest.approx(linear[0], rel=PACKED) and attn[1] == pytest.approx(attn[0], rel=PACKED)


def test_compile_changes_nothing_for_hybrid_layers():
    shape = ModelShape.of(model_of())
    assert budget.layer_bytes(shape, compiled=True) == budget.layer_bytes(shape)
    assert budget.train_bytes_per_token(shape, False, compiled=True) == budget.train_bytes_per_token(shape, False)


# ---- the fla path: its torch side measured, the kernel's saves as fla 0.6.0's autograd Function makes them ----

class FlaLike(torch.autograd.Function):
    """Saves what fla-core 0.6.0's ChunkGatedDeltaRuleFunction saves (q, k, v, g's chunk-local cumsum in float32,
    beta, the [N, H, 64] block inverse A in k's dtype, cu_seqlens, chunk indices) and computes our torch rule per
    sequence, so that the layer around it runs exactly as with fla."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_seqlens):  # [1, N, H, D], g/beta [1, N, H]
        with torch.no_grad():
            outs = [linear_attention.chunk_gated_delta_rule(*(t[:, a:b].float() for t in (q, k, v, g, beta)))[0]
                    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
            cum = torch.cat([g[:, a:a + 64].cumsum(1) for a in range(0, g.shape[1], 64)], dim=1)
            A = k.new_zeros(*k.shape[:3], 64)
            chunks = torch.zeros(sum(-(-(b - a) // 64) for a, b in zip(cu_seqlens[:-1].tolist(),
                                                                      cu_seqlens[1:].tolist())), 2, dtype=torch.int32)
        ctx.save_for_backward(q, k, v, cum, beta, A, cu_seqlens, chunks)
        return torch.cat(outs, dim=1).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("a memory stand-in: only its forward's saved tensors are measured")


def fla_like(q, k, v, g, beta, *, scale, cu_seqlens, use_qk_l2norm_in_kernel):
    assert scale == 1.0 and not use_qk_l2norm_in_kernel  # how _fla_chunk calls fla
    return FlaLike.apply(q, k, v, g, beta, cu_seqlens), None


def test_the_fla_path_saves_what_the_doctor_counts_for_it(monkeypatch):
    monkeypatch.setattr(linear_attention, "_fla_usable", lambda device, grad=True: True)
    monkeypatch.setattr(linear_attention, "_fla_rule", lambda: fla_like)
    model = model_of()
    fla = ModelShape.of(model)
    assert fla.hybrid.delta_rule == "fla"  # the doctor asks the layer's own test, as training does
    tokens, seq_len = 3 * 70, 70
    measured = saved_bytes(model, tokens, torch.device("cpu"), layer=0, seq_len=seq_len) / tokens
    counted = budget.delta_layer_bytes(fla, seq_len)
    assert counted == pytest.approx(measured, rel=PACKED)
    torch_rule = dataclasses.replace(fla, hybrid=dataclasses.replace(fla.hybrid, delta_rule="torch"))
    assert counted < budget.delta_layer_bytes(torch_rule, seq_len) / 2  # no float32 c x c matrices nor states


def test_the_shape_takes_the_rule_training_runs_where_the_model_sits():
    shape = ModelShape.of(model_of())
    assert shape.hybrid.delta_rule == "torch"  # CPU: fla never runs here
    assert (shape.hybrid.linear_layers, shape.hybrid.value_heads, shape.hybrid.key_dim) == (3, 4, 8)
    assert shape.hybrid.chunk == linear_attention.CHUNK


def test_the_doctors_details_count_each_kind_and_warn_only_where_the_count_is_unmeasured():
    from phaserl.doctor.memory import PhaseSizes
    from phaserl.doctor.probes import hybrid_activation_line

    sizes = PhaseSizes(n=2, prompt_tokens=32, sequence_tokens=70, rollout_batch_size=4, prompts_per_rank=4,
                       rm_engine="transformers", rm_batch_size=16, rm_micro_batch_tokens=256, rm_packed=False,
                       rm_max_length=64, responses_per_rank=8, micro_batch_tokens=140, mini_batch_per_rank=8,
                       gradient_checkpointing=False)
    shape = ModelShape.of(model_of())
    line = hybrid_activation_line(shape, sizes)
    linear, attn = (budget.fmt_bytes(budget.layer_bytes(shape, sequence_tokens=70)[k][1])
                    for k in ("linear_attention", "gated_attention"))
    assert line == (f"activations  per token: 3 × {linear} (Gated DeltaNet, torch chunked rule) + 1 × {attn} "
                    "(gated attention)")
    assert "dense" not in line and "upper bound" not in line  # the old caveat is gone: the count is measured
    fla = dataclasses.replace(shape, hybrid=dataclasses.replace(shape.hybrid, delta_rule="fla"))
    assert "not yet measured on a GPU" in hybrid_activation_line(fla, sizes)


def test_the_doctor_sizes_a_qwen35_update_by_the_per_kind_count(tmp_path):
    from _tiny_run import make_run_dir
    from _tiny_tokenizer import build_tiny_tokenizer
    from phaserl.doctor import load_doctor_config, run_doctor
    from phaserl.models import save_pretrained

    tokenizer = build_tiny_tokenizer()
    model = model_of(torch.float32, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    save_pretrained(model, str(tmp_path / "qwen35"), tokenizer=tokenizer)
    overrides = [o for o in make_run_dir(str(tmp_path)) if not o.startswith("model.path=")]
    memory_check = {r.name: r for r in run_doctor(load_doctor_config(None, overrides + [
        f"model.path={tmp_path / 'qwen35'}"]), world_size=1)}["memory"]
    per_token = budget.train_bytes_per_token(ModelShape.of(model), False, sequence_tokens=32 + 4)  # prompt + new
    details = "\n".join(memory_check.details)
    assert "(Gated DeltaNet, torch chunked rule)" in details
    assert f"({budget.fmt_bytes(per_token)} per token)" in details  # the ppo.micro_batch_tokens line


@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["fla", "torch"])
def test_gpu_each_layer_kind_saves_what_the_doctor_counts_for_the_rule_cuda_runs(rule, monkeypatch):
    """On CUDA: fla's kernels (the count read from fla-core 0.6.0's source; this is its measurement) and the torch
    rule there (cuDNN's conv, the fused RMS norm), at the 0.8B layer shape, 4 sequences of 512 tokens; the gated
    attention layer through the real varlen flash kernel."""
    monkeypatch.setattr(linear_attention, "USE_FLA", rule == "fla")
    monkeypatch.setattr(attention, "attend", VARLEN_ATTEND)
    model = model_of(**QWEN35_08B).cuda()
    if ModelShape.of(model).hybrid.delta_rule != rule:
        pytest.skip("flash-linear-attention does not run here (not installed, or its probe disagreed: logged)")
    for kind, (measured, counted) in per_kind(model, 4 * 512, 512, device="cuda", varlen=True).items():
        assert counted == pytest.approx(measured, rel=0.05 if rule == "fla" else PACKED), kind


def transformers_saved_per_layer(hf_model, batch: int, tokens: int) -> list:
    """Bytes each decoder layer of a transformers model saves for backward per token (distinct storages that are
    not parameters), its own torch fallback running the delta rule (no flash-linear-attention in CI)."""
    params = {p.untyped_storage().data_ptr() for p in hf_model.parameters()}
    current, seen = [None], {}

    def pack(t):
        if current[0] is not None and t.untyped_storage().data_ptr() not in params:
            seen.setdefault(current[0], {})[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    hooks = []
    for i, layer in enumerate(hf_model.model.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
        hooks.append(layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)))
    ids = torch.randint(0, hf_model.config.vocab_size, (batch, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hf_model(input_ids=ids)
    for h in hooks:
        h.remove()
    return [sum(seen.get(i, {}).values()) / (batch * tokens) for i in range(len(hf_model.model.layers))]


def test_regression_a_transformers_path_qwen35_is_counted_by_its_layer_kinds_not_the_dense_rule():
    """Bug: a Qwen3.5 on model.implementation=transformers was counted by the dense rule (~47 kB a token for a
    0.8B-like Gated DeltaNet layer), while transformers' torch fallback saves ~238 kB: the auto micro-batch the
    count allowed ran an H200 out of memory at 64 x 384 tokens (2026-12-04). The shape now takes the native
    twin's per-kind count, which is within 15% of what transformers saves, layer by layer."""
    from phaserl.models.hf_fallback import HFCausalLM

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(**dict(QWEN35_08B))
    hf = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    shape = ModelShape.of(HFCausalLM(hf))
    assert shape.hybrid is not None and shape.hybrid.delta_rule == "torch"
    counted = budget.layer_bytes(shape, sequence_tokens=256)
    dense_rule = (8 * shape.hidden_size + 4 * shape.intermediate_size + 2 * shape.num_kv_heads * shape.head_dim) * 2
    saved = transformers_saved_per_layer(hf, batch=2, tokens=256)
    for kind, measured in zip(config.layer_types, saved):
        per_token = counted["linear_attention" if kind == "linear_attention" else "gated_attention"][1]
        assert measured == pytest.approx(per_token, rel=0.15), (kind, measured, per_token)
    assert saved[0] > 4 * dense_rule  # what the dense rule missed


def test_a_transformers_model_without_linear_attention_keeps_the_dense_rule():
    from phaserl.models.hf_fallback import HFCausalLM

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    shape = ModelShape.of(HFCausalLM(transformers.AutoModelForCausalLM.from_config(config)))
    assert shape.hybrid is None and set(budget.layer_bytes(shape)) == {"dense"}
