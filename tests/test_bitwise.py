"""The bitwise numerics mode (rollout.bitwise): each batch-invariant kernel gives a row the same bits whatever shares
the call, and the trainer's log-prob of every sampled token equals the rollout engine's exactly (0.0, not small):
every native dense family, padded and packed micro-batches, with grad, after refill and compaction, and in a GRPO run.
"""
import json
import os

import pytest
import torch

from _tiny_run import make_run_dir
from phaserl.batch import RolloutBatch, layout_ids, right_padded
from phaserl.config import load_config
from phaserl.errors import ConfigError
from phaserl.models import CausalLM, DecoderConfig, invariant, invariant_head, layers
from phaserl.roles.forward import rows_logprobs
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams


@pytest.fixture(autouse=True)
def default_numerics_after():
    """A run that turned the mode on (the builder does) must not leave it on for the next test."""
    yield
    invariant.enable(False)


def _rows_alike(f, x: torch.Tensor) -> None:
    """f's rows of x computed with the whole batch equal f's rows computed alone, in pairs and in other orders."""
    whole = f(x)
    for idx in ([0], [3], [1, 2], [4, 0, 2], list(range(x.shape[0]))[::-1]):
        assert torch.equal(f(x[idx]), whole[idx]), idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_kernel_gives_a_row_the_same_bits_whatever_shares_the_call(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=g).to(dtype)
    w, b = torch.randn(80, 96, generator=g).to(dtype), torch.randn(80, generator=g).to(dtype)
    norm = torch.randn(96, generator=g).to(dtype)
    table = torch.randn(37, 96, generator=g).to(dtype)
    _rows_alike(lambda t: invariant.linear(t, w, b), x)
    for style in ("llama", "gemma", "olmo2"):
        _rows_alike(lambda t: invariant.rms_norm(t, norm, 1e-6, style, default=layers.rms_norm), x)
    for act in ("silu", "gelu_pytorch_tanh"):
        _rows_alike(lambda t: invariant.activation(t, act), x * 4)
    _rows_alike(lambda t: invariant_head.logsumexp(t.float()), x)
    heads = x.view(37, 6, 16)
    whole = invariant.rotate(heads, table[:, :16], table[:, 16:32])
    assert torch.equal(invariant.rotate(heads[5:9], table[5:9, :16], table[5:9, 16:32]), whole[5:9])


def test_attention_of_a_query_equals_in_decode_prefill_and_a_packed_training_row():
    """One sequence's queries: alone (training, L = its length), in a slot of 96 positions whose later keys are
    stale (decode), and packed after another sequence (training, packed): the same bits."""
    g = torch.Generator().manual_seed(1)
    L, Hq, Hkv, D = 40, 4, 2, 8
    q, k, v = torch.randn(1, L, Hq, D, generator=g), torch.randn(1, L, Hkv, D, generator=g), torch.randn(
        1, L, Hkv, D, generator=g)
    pos = torch.arange(L)[None]
    for window in (None, 7):
        alone = invariant.attention(q, pos, k, v, 0.3, window)  # [1, L, Hq, D]
        slot_k, slot_v = torch.randn(1, 96, Hkv, D, generator=g), torch.randn(1, 96, Hkv, D, generator=g)
        slot_k[:, :L], slot_v[:, :L] = k, v
        for t in (0, 17, L - 1):  # one decode query at position t
            step = invariant.attention(q[:, t:t + 1], torch.tensor([[t]]), slot_k, slot_v, 0.3, window)
            assert torch.equal(step[0, 0], alone[0, t]), (window, t)
        other = 13  # packed: another sequence of 13 tokens first, then ours
        qq = torch.cat([torch.randn(1, other, Hq, D, generator=g), q], 1)
        kk = torch.cat([torch.randn(1, other, Hkv, D, generator=g), k], 1)
        vv = torch.cat([torch.randn(1, other, Hkv, D, generator=g), v], 1)
        seq_ids = torch.tensor([[0] * other + [1] * L])
        positions = torch.cat([torch.arange(other), torch.arange(L)])[None]
        packed = invariant.Aligned.of(torch.ones(1, other + L), positions, seq_ids, window).attend(qq, kk, vv, 0.3)
        assert torch.equal(packed[0, other:], alone[0])


def test_gradients_are_the_default_kernels_gradients():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 16, generator=g, requires_grad=True), torch.randn(8, 16, generator=g, requires_grad=True)
    invariant.linear(x, w).square().sum().backward()
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    torch.nn.functional.linear(x, w).square().sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)
    # the head: log-probs and entropies, their gradients the default head's (algo.token_logprobs_from_hidden)
    from phaserl.algo import token_logprobs_from_hidden

    h, w.grad = torch.randn(7, 16, generator=g, requires_grad=True), None
    targets = torch.randint(0, 8, (7,), generator=g)
    grads = []
    for head in (invariant_head.token_logprobs, token_logprobs_from_hidden):
        logp, ent = head(h, w, targets, temperature=0.7, with_entropy=True)
        (logp.square().sum() + ent.sum()).backward()
        grads.append((logp.detach(), ent.detach(), h.grad, w.grad))
        h.grad = w.grad = None
    for mine, default in zip(*grads):
        torch.testing.assert_close(mine, default)


# ----- the engine against the trainer's forward -----------------------------------------------------------
# Gemma 4's text layout (tests/test_rollout_session.py's): global layers with 1 kv head of 16 whose values are the
# keys, proportional RoPE, value norm, layer scalar, soft-capped logits.
GEMMA4 = dict(head_dim=8, global_head_dim=16, global_kv_heads=1, attention_k_eq_v=True, sliding_window=6,
              layer_types=["sliding_attention", "full_attention"], local_rope_theta=100.0,
              rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.5}, layer_norms="sandwich",
              norm_style="olmo2", v_norm=True, layer_scalar=True, hidden_act="gelu_pytorch_tanh", embed_scale=5.0,
              query_pre_attn_scalar=1.0, final_logit_softcapping=5.0)


def _families():
    base = dict(vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128)
    return {
        "qwen2": DecoderConfig(model_type="qwen2", attention_bias=True, **base),
        "llama": DecoderConfig(model_type="llama", **base),
        "qwen3": DecoderConfig(model_type="qwen3", qk_norm=True, **base),
        "mistral-sliding": DecoderConfig(model_type="mistral", sliding_window=5, **base),
        "gemma3-local-global": DecoderConfig(
            model_type="gemma3_text", head_dim=16, qk_norm=True, layer_norms="sandwich", norm_style="gemma",
            hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=24, sliding_window=5, local_rope_theta=100.0,
            layer_types=["sliding_attention", "full_attention"], embed_scale=32 ** 0.5, tie_word_embeddings=True,
            final_logit_softcapping=5.0, **base),
        "olmo2": DecoderConfig(model_type="olmo2", qk_norm=True, qk_norm_scope="projection", layer_norms="post",
                               norm_style="olmo2", **base),
        "phi3": DecoderConfig(model_type="phi3", sliding_window=6, **base),
        "gemma4-global-layers": DecoderConfig(model_type="gemma4_text", **{**base, **GEMMA4}),
    }


def _model(cfg: DecoderConfig, dtype=torch.float32, device="cpu") -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((0.0 if cfg.norm_style == "gemma" or not name.endswith("norm.weight") else 1.0)
                    + 0.3 * torch.randn(p.shape))
    return model.to(device=device, dtype=dtype).eval()


PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 8, 9, 10, 11, 12], [11], [12, 13, 14, 15], [3, 3], [20, 21, 22, 23, 24, 25, 26]]


def _sample(model, n_per_prompt=2, max_slots=3, new_tokens=12):
    """Sampled responses through the engine: more sequences than slots (refill) and varied caps (compaction)."""
    prompts = [p for p in PROMPTS for _ in range(n_per_prompt)]
    caps = [new_tokens - (i % 5) for i in range(len(prompts))]
    engine = RolloutEngine(model, EngineConfig(max_slots=max_slots))
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.8, top_k=20)
    result = engine.generate(prompts, params, eos_token_ids=[], pad_token_id=0, max_new_tokens=caps,
                             generator=torch.Generator(device=model.output_weight.device).manual_seed(3))
    return prompts, result


def _batch(prompts, result, device) -> RolloutBatch:
    input_ids, attention_mask, P = layout_ids(prompts, result.response_ids, 0)
    R = input_ids.shape[1] - P
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    return RolloutBatch(input_ids=input_ids, attention_mask=attention_mask,
                        position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0),
                        response_mask=attention_mask[:, P:].contiguous(), prompt_width=P,
                        group_ids=torch.arange(len(prompts), device=device),
                        rollout_logprobs=right_padded(result.logprobs, R, torch.float32).to(device),
                        prompts=[None] * len(prompts), response_texts=[""] * len(prompts), rows=[None] * len(prompts),
                        finish_reasons=list(result.finish_reasons))


def _trainer_vs_engine(model, device="cpu") -> list:
    """max |trainer - engine| over every sampled token, for padded and packed micro-batches of 1, 3 and all rows,
    without and with autograd."""
    with invariant.bitwise():
        prompts, result = _sample(model)
        batch = _batch(prompts, result, device)
        diffs = []
        for packing in (False, True):
            for size in (1, 3, len(prompts)):
                for grad in (False, True):
                    with torch.set_grad_enabled(grad):
                        for start in range(0, len(prompts), size):
                            idx = torch.arange(start, min(start + size, len(prompts)))
                            logp, _, mask = rows_logprobs(model, batch, idx, packing=packing, temperature=0.8,
                                                          with_entropy=grad)
                            R = mask.shape[1]
                            diff = (logp - batch.rollout_logprobs[idx, :R]).abs() * mask
                            diffs.append(float(diff.detach().max()))
    return diffs


@pytest.mark.parametrize("family", list(_families()))
def test_trainer_logprobs_equal_the_engines_bit_for_bit(family):
    diffs = _trainer_vs_engine(_model(_families()[family]))
    assert max(diffs) == 0.0, diffs


@pytest.mark.parametrize("packing, checkpointed", [(False, 0), (True, 0), (True, 2)])
def test_the_training_forward_takes_the_default_kernels_gradient_at_the_exact_values(packing, checkpointed):
    """With autograd the bitwise mode's log-probs are the exact kernels' bits and its entropies the default mode's
    (nothing compares them with the engine: the exact pass skips them), and the parameters' gradient of a loss
    linear in both is the default mode's, bit for bit (the graph is the default forward's; a checkpointed layer
    recomputes in its forward's mode)."""
    model = _model(_families()["qwen2"]).train()
    model.model.checkpoint_layers = checkpointed
    with invariant.bitwise():
        prompts, result = _sample(model)
    batch = _batch(prompts, result, "cpu")
    idx = torch.arange(5)
    runs = {}
    for on in (True, False):
        with invariant.bitwise(on):
            logp, ent, mask = rows_logprobs(model, batch, idx, packing=packing, temperature=0.8, with_entropy=True)
            ((logp - 0.1 * ent) * mask).sum().backward()
            with torch.no_grad():
                plain = rows_logprobs(model, batch, idx, packing=packing, temperature=0.8, with_entropy=True)
        runs[on] = (logp.detach(), ent.detach(), plain, [p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    (logp, ent, plain, grads), (d_logp, d_ent, _, d_grads) = runs[True], runs[False]
    assert torch.equal(logp, plain[0])  # the no-grad exact values, bit for bit
    assert torch.equal(ent, d_ent)  # the default forward's entropy
    R = mask.shape[1]
    assert float(((logp - batch.rollout_logprobs[idx, :R]).abs() * mask).max()) == 0.0
    assert not torch.equal(logp, d_logp)  # the default kernels' values differ: the check above could fail
    assert all(torch.equal(a, b) for a, b in zip(grads, d_grads))


def test_the_critics_training_forward_takes_the_default_kernels_gradient_at_the_exact_values():
    """rows_values as rows_logprobs: with autograd the bitwise mode's values are the no-grad exact ones, and the
    gradient of a loss linear in them is the default mode's, bit for bit."""
    from phaserl.models import ValueModel
    from phaserl.roles.forward import rows_values

    critic = ValueModel(_model(_families()["llama"])).train()
    with torch.no_grad():
        critic.score.weight.normal_(generator=torch.Generator().manual_seed(1))  # not the zero init: values differ
    with invariant.bitwise():
        prompts, result = _sample(_model(_families()["llama"]))
    batch = _batch(prompts, result, "cpu")
    idx, runs = torch.arange(4), {}
    for on in (True, False):
        with invariant.bitwise(on):
            values, mask = rows_values(critic, batch, idx, packing=True)
            (values * mask).sum().backward()
            with torch.no_grad():
                plain = rows_values(critic, batch, idx, packing=True)[0]
        runs[on] = (values.detach(), plain, [p.grad.clone() for p in critic.parameters()])
        critic.zero_grad(set_to_none=True)
    (values, plain, grads), (d_values, _, d_grads) = runs[True], runs[False]
    assert torch.equal(values, plain) and not torch.equal(values, d_values)
    assert all(torch.equal(a, b) for a, b in zip(grads, d_grads))


@pytest.mark.slow
def test_every_native_family_loaded_from_a_transformers_checkpoint_is_exact(tmp_path):
    """The model-coverage configs (tests/test_model_families.py: sliding windows, Gemma 3/4 local and global layers,
    Gemma 4's per-layer inputs and shared keys/values, OLMo 2, Phi-3's fused projections), each saved by
    transformers and loaded natively: engine and trainer agree exactly."""
    import transformers

    from _hf_pairs import randomize
    from phaserl.models import load_pretrained
    from test_model_families import family_configs

    for name, hf_config in family_configs():
        randomize(transformers.AutoModelForCausalLM.from_config(hf_config)).save_pretrained(tmp_path / name)
        assert max(_trainer_vs_engine(load_pretrained(tmp_path / name).eval())) == 0.0, name


def test_without_the_mode_the_same_comparison_is_only_close():
    """The test above can fail: with the default kernels the packed forward's bits differ from the engine's."""
    model = _model(_families()["qwen2"])
    prompts, result = _sample(model)
    batch = _batch(prompts, result, "cpu")
    logp, _, mask = rows_logprobs(model, batch, torch.arange(len(prompts)), packing=True, temperature=0.8,
                                  with_entropy=False)
    diff = ((logp - batch.rollout_logprobs[:, :mask.shape[1]]).abs() * mask).max()
    assert 0.0 < diff < 1e-4


def test_multi_turn_sessions_extend_with_the_trainers_numbers():
    """A conversation continued in its slot (the engine's extend pass over appended observations): every turn's
    log-probs equal the trainer's forward over the whole conversation so far, bit for bit."""
    from phaserl.roles.forward import head_logprobs
    from test_rollout_session import drive

    model = _model(_families()["qwen3"])
    observations = {0: [[30, 31], [32]], 1: [[33, 34, 35], None], 2: [[], [36, 37]], 3: [None]}
    with invariant.bitwise():
        engine = RolloutEngine(model, EngineConfig(max_slots=3))
        params = SamplingParams(max_new_tokens=5, temperature=0.9)
        with engine.session(params, slot_len=48, eos_token_ids=[], generator=torch.Generator().manual_seed(0)) as s:
            for key in (0, 1, 2):
                s.start(key, PROMPTS[key], cap=5)
            turns = drive(s, observations, {k: 5 for k in observations}, waiting=[3], prompt=PROMPTS)
        worst = []
        for key, obs in observations.items():
            seq = list(PROMPTS[key])
            for k, turn in enumerate(turns[key]):
                with torch.no_grad():
                    hidden = model(torch.tensor([seq + turn.token_ids]))[0, len(seq) - 1:-1]  # [R, H]
                    logp, _ = head_logprobs(model, hidden, torch.tensor(turn.token_ids), temperature=0.9,
                                            chunk_size=1024, with_entropy=False)
                worst.append(float((logp - torch.tensor(turn.logprobs)).abs().max()))
                seq += turn.token_ids + (obs[k] or [] if k < len(obs) else [])
    assert len(worst) > 6 and max(worst) == 0.0, worst


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 512])
def test_gpu_triton_kernels_are_batch_invariant_and_close_to_torch(dtype, D):
    """On a GPU the matmul and the attention are invariant_triton's fixed-tile kernels: a row's bits do not depend
    on the row count, a decode query equals its training row, and both are torch's numbers within rounding."""
    from phaserl.models import invariant_triton

    if not invariant_triton.available(torch.device("cuda")):
        pytest.skip("needs Triton")
    g = torch.Generator(device="cuda").manual_seed(0)
    x, w = torch.randn(300, 896, generator=g, device="cuda").to(dtype), torch.randn(
        4864, 896, generator=g, device="cuda").to(dtype)
    whole = invariant.matmul(x, w)
    for idx in ([0], [3], [1, 2], [4, 0, 2], list(range(64)), list(range(65))):
        assert torch.equal(invariant.matmul(x[idx], w), whole[idx]), idx
    torch.testing.assert_close(whole, (x.float() @ w.float().T), atol=0.05 if dtype != torch.float32 else 1e-3,
                               rtol=1e-2)
    L, Hq, Hkv = 300, 14, 2
    q = torch.randn(1, L, Hq, D, generator=g, device="cuda").to(dtype)
    k, v = (torch.randn(1, L, Hkv, D, generator=g, device="cuda").to(dtype) for _ in range(2))
    pos = torch.arange(L, device="cuda")[None]
    for window in (None, 100):
        alone = invariant.attention(q, pos, k, v, 0.125, window)
        for t in (0, 31, 32, 200, L - 1):
            step = invariant.attention(q[:, t:t + 1], torch.tensor([[t]], device="cuda"), k, v, 0.125, window)
            assert torch.equal(step[0, 0], alone[0, t]), (window, t)
        torch.testing.assert_close(alone.float(), invariant._attention_default(q, pos, k, v, 0.125, window).float(),
                                   atol=0.02, rtol=0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3-local-global"])
def test_gpu_trainer_logprobs_equal_the_engines_bit_for_bit(family, dtype):
    model = _model(_families()[family], dtype=dtype, device="cuda")
    diffs = _trainer_vs_engine(model, device="cuda")
    assert max(diffs) == 0.0, diffs


# ----- the run ---------------------------------------------------------------------------------------------
def _grpo(tmp_path, *extra):
    from phaserl.trainer import RLTrainer

    cfg = load_config(None, make_run_dir(str(tmp_path)) + [
        "trainer.loggers=[jsonl]", "data.val_files=[]", "rollout.bitwise=true", "rollout.max_new_tokens=8",
        "rollout.engine_max_slots=3", "ppo.packing=true", "ppo.micro_batch_tokens=40", *extra])
    RLTrainer.from_config(cfg).fit()
    return [json.loads(raw) for raw in open(os.path.join(tmp_path, "logs", "metrics.jsonl"))]


@pytest.mark.slow
@pytest.mark.parametrize("mini_batches", [1, 2])
def test_a_grpo_run_in_bitwise_mode_logs_zero_mismatch_every_step(tmp_path, mini_batches):
    """8 responses a step through 3 engine slots (refill, compaction), packed micro-batches of 40 tokens; one
    mini-batch measures the mismatch in the update's forward (with grad), two in the old log-prob pass."""
    lines = _grpo(tmp_path, f"ppo.num_mini_batches={mini_batches}", "trainer.total_steps=3",
                  "algorithm.rollout_correction=tis")
    assert [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:
        assert line["mismatch/abs_diff_max"] == 0.0 and line["mismatch/k3"] == 0.0, line
        assert line["mismatch/correction_weight_mean"] == 1.0 and line["mismatch/correction_rejected_frac"] == 0.0


@pytest.mark.slow
def test_between_its_checks_the_update_takes_the_engines_logprobs_and_trains_the_same(tmp_path):
    """rollout.bitwise_check_every = 2: steps 1 and 3 recompute the exact log-probs (mismatch 0.0), steps 2 and 4
    take the engine's as the values, and every step's loss and gradient equal those of a run that checks every step
    (the engine's numbers are the exact ones, the graph is the default forward's in both)."""
    every = {k: _grpo(tmp_path / str(k), "trainer.total_steps=4", f"rollout.bitwise_check_every={k}",
                      "actor.entropy_coef=0.01",  # a gradient even where a group's rewards tie
                      "actor.checkpoint_layers=1") for k in (1, 2)}  # and a recomputed layer
    for line in every[1]:
        assert line["mismatch/abs_diff_max"] == 0.0, line
    checked = [line["step"] for line in every[2] if "mismatch/abs_diff_max" in line]
    assert checked == [1, 3], checked
    assert all(line["mismatch/abs_diff_max"] == 0.0 for line in every[2] if line["step"] in checked)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "critic/score_mean"):
        assert [line.get(key) for line in every[1]] == [line.get(key) for line in every[2]], key
    assert sum(line["actor/grad_norm"] > 0 for line in every[2] if line["step"] not in checked) >= 1  # trained


@pytest.mark.parametrize("setting, key", [
    ("model.implementation=transformers", "model.implementation"), ("rollout.engine=hf", "rollout.engine"),
    ("actor.compile=true", "actor.compile"), ("rollout.engine_compile=true", "rollout.engine_compile"),
    ("ppo.train_graphs=true", "ppo.train_graphs")])  # LoRA runs (its dropout is refused): test_bitwise_lora.py
def test_settings_that_would_run_other_kernels_are_config_errors_naming_the_key(setting, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, ["rollout.bitwise=true", setting])


def test_a_check_interval_without_the_mode_is_a_config_error():
    with pytest.raises(ConfigError, match=r"rollout\.bitwise_check_every = 4 .* rollout\.bitwise = true"):
        load_config(None, ["rollout.bitwise_check_every=4"])
    assert load_config(None, ["rollout.bitwise=true", "rollout.bitwise_check_every=4"]).rollout.bitwise_check_every == 4


def test_a_family_the_kernels_do_not_cover_is_a_config_error(tmp_path):
    from phaserl.trainer.build import set_numerics

    moe = DecoderConfig(model_type="qwen3_moe", vocab_size=48, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=16, qk_norm=True)
    with pytest.raises(ConfigError, match="rollout.bitwise"):
        set_numerics(True, CausalLM(moe))
    assert not invariant.enabled()


def test_the_doctor_says_which_numerics_run_and_that_corrections_are_no_ops(tmp_path):
    from phaserl.doctor import OK, load_doctor_config, run_doctor

    overrides = make_run_dir(str(tmp_path)) + ["rollout.temperature=0.7"]
    checks = {r.name: r for r in run_doctor(load_doctor_config(None, overrides + [
        "rollout.bitwise=true", "algorithm.rollout_correction=icepop"]))}
    result = checks["rollout/training mismatch"]
    assert result.status == OK and result.message.startswith("numerics: bitwise (rollout.bitwise)"), result
    assert "mismatch 0.0" in result.message and "rollout_correction = icepop is a no-op" in result.message
    assert not invariant.enabled()  # the probe's mode ends with it
    spaced = {r.name: r for r in run_doctor(load_doctor_config(None, overrides + [
        "rollout.bitwise=true", "rollout.bitwise_check_every=5"]))}["rollout/training mismatch"]
    assert spaced.status == OK and "every 5 steps" in spaced.message, spaced
    default = {r.name: r for r in run_doctor(load_doctor_config(None, overrides))}["rollout/training mismatch"]
    assert "numerics: default kernels" in default.message


def test_the_numerics_benchmark_measures_both_modes_and_a_zero_bitwise_mismatch():
    """benchmarks/numerics.py --smoke (CPU, tiny shape): a time line per mode, the bitwise mismatch exactly 0.0, the
    default one not, and the ratios of every part it reports."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "numerics.py"), "--smoke", "--repeats", "1"],
                         capture_output=True, text=True, timeout=300, cwd=root, check=True).stdout
    lines = [json.loads(raw) for raw in out.splitlines() if raw.startswith("{")]
    times = {line["mode"]: line for line in lines if line["measure"] == "time"}
    assert set(times) == {"default", "bitwise"} and "step_between_checks_s" in times["bitwise"]
    mismatch = {line["mode"]: line["mismatch/abs_diff_max"] for line in lines if line["measure"] == "mismatch"}
    assert mismatch["bitwise"] == 0.0 and mismatch["default"] > 0.0
    ratio = next(line for line in lines if line["measure"] == "ratio")
    parts = ("decode_step_s", "update_s", "step_s", "step_old_pass_s", "step_between_checks_s")
    assert all(ratio[k] > 0 for k in parts)
