"""LoRA: adapters on the decoder's projections, the reference as the base with adapters off, rollout with the
adapters merged into the engine's copies (the base never written), adapter-only checkpoints and the exports.

CPU tests on tiny float32 decoders and the tiny random run of tests/_tiny_run.py; the GPU tests (bf16, CUDA
graphs, optimizer offload) are marked @pytest.mark.gpu.
"""
import json
import os

import pytest
import torch

from phaserl.config import load_config
from phaserl.config.schema import LORA_TARGETS
from phaserl.errors import ConfigError
from phaserl.models import CausalLM, DecoderConfig, ValueModel, load_pretrained
from phaserl.models.decoder import enable_compile
from phaserl.models.lora import (
    ALIASES,
    PROJECTIONS,
    LoRALinear,
    LoRASettings,
    adapters_disabled,
    apply_lora,
    engine_weight,
    resolve_targets,
)
from phaserl.roles import ReferencePolicy
from phaserl.rollout import RolloutEngine, SamplingParams

torch.set_num_threads(1)
R4 = LoRASettings(rank=4, alpha=8.0)


def tiny_decoder(seed: int = 0, model_type: str = "qwen2") -> CausalLM:
    torch.manual_seed(seed)
    cfg = DecoderConfig(model_type=model_type, vocab_size=40, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        attention_bias=model_type == "qwen2", qk_norm=model_type == "qwen3")
    model = CausalLM(cfg)
    with torch.no_grad():  # far-from-uniform distributions, so that greedy tokens are stable
        for name, p in model.named_parameters():
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.2 * torch.randn(p.shape))
    return model


def randomize_adapters(model, scale: float = 0.3, seed: int = 1) -> None:
    """B starts at 0 (the adapted model equals the base); give it values, as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".lora_B"):
                p.copy_(scale * torch.randn(p.shape, generator=g))


def logits(model, ids):
    with torch.no_grad():
        return model.logits(model(ids))  # [B, T, V]


IDS = torch.tensor([[3, 7, 1, 12, 5, 9], [2, 2, 8, 30, 11, 4]])


# ----- the module ------------------------------------------------------------------------------------------
def test_adapters_start_at_zero_and_switch_off_to_the_exact_base():
    model = tiny_decoder()
    base = logits(model, IDS)
    names = apply_lora(model, R4)
    assert len(names) == 2 * 7 and "model.layers.0.self_attn.q_proj" in names
    assert torch.equal(logits(model, IDS), base)  # B = 0
    randomize_adapters(model)
    adapted = logits(model, IDS)
    assert (adapted - base).abs().max() > 1e-2
    with adapters_disabled(model):
        assert torch.equal(logits(model, IDS), base)
    assert torch.equal(logits(model, IDS), adapted)  # back on after the block


def test_only_adapters_train_and_base_names_are_unchanged():
    model = tiny_decoder()
    before = set(model.state_dict())
    apply_lora(model, LoRASettings(rank=2, alpha=4.0, target_modules=resolve_targets(["q", "v_proj"])))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"model.layers.{i}.self_attn.{p}_proj.lora_{ab}" for i in (0, 1) for p in "qv" for ab in "AB"}
    assert before <= set(model.state_dict())  # the base keeps its names: HF files load into it
    assert isinstance(model.model.layers[0].self_attn.q_proj, LoRALinear)
    assert isinstance(model.model.layers[0].self_attn.k_proj, torch.nn.Linear)


def test_the_critic_keeps_its_value_head_trainable():
    critic = ValueModel(tiny_decoder())
    apply_lora(critic, R4, trainable=("score",))
    trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert "score.weight" in trainable and all(n == "score.weight" or ".lora_" in n for n in trainable)


def test_unknown_targets_and_rank_zero_are_errors_naming_the_fix():
    with pytest.raises(ConfigError, match="unknown projection.*qkv"):
        resolve_targets(["qkv"])
    with pytest.raises(ConfigError, match="at least 1"):
        apply_lora(tiny_decoder(), LoRASettings(rank=0, alpha=1.0))
    with pytest.raises(ConfigError, match="actor.lora.target_modules\\[0\\] = 'attn'"):
        load_config(None, ["actor.lora.rank=4", "actor.lora.target_modules=[attn]"])
    with pytest.raises(ConfigError, match="alpha = 0"):
        load_config(None, ["actor.lora.rank=4", "actor.lora.alpha=0"])


def test_the_config_choices_are_the_names_lora_resolves():
    assert set(LORA_TARGETS) == {"all-linear", *PROJECTIONS, *ALIASES}
    assert resolve_targets(["all-linear"]) == PROJECTIONS
    assert resolve_targets(["down", "q"]) == ("q_proj", "down_proj")


def _loss_and_grads(model, ids, **forward):
    model.zero_grad(set_to_none=True)
    hidden = model(ids, **forward)
    loss = model.logits(hidden).float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.slow  # trainer steps / torch.compile tracing: the full lane
def test_all_linear_on_a_dense_model_records_the_projections_it_has():
    """all-linear also names Qwen3.5's linear-attention projections; a dense model's record (and so its PEFT
    adapter_config.json) lists only the seven it has."""
    from phaserl.models.lora import DENSE_PROJECTIONS

    model = tiny_decoder()
    apply_lora(model, LoRASettings(rank=2, alpha=4.0, target_modules=resolve_targets(["all-linear"])))
    assert model.lora_settings.target_modules == DENSE_PROJECTIONS


def test_compile_checkpointing_and_packing_give_the_same_adapter_gradients():
    model = tiny_decoder()
    apply_lora(model, LoRASettings(rank=4, alpha=8.0, dropout=0.0))
    randomize_adapters(model)
    model.train()
    ref_loss, ref_grads = _loss_and_grads(model, IDS)
    assert set(ref_grads) == {n for n, _ in model.named_parameters() if ".lora_" in n}
    assert all(g.abs().sum() > 0 for g in ref_grads.values())
    model.gradient_checkpointing = True
    enable_compile(model, backend="eager")  # traces the layer (dynamo), no code generation
    try:
        loss, grads = _loss_and_grads(model, IDS)
    finally:
        enable_compile(model, False)
        model.gradient_checkpointing = False
    torch.testing.assert_close(loss, ref_loss)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-6, rtol=1e-5)
    # two rows packed into one: the same sequences, so the same loss and gradients (token-mean over equal lengths)
    T = IDS.shape[1]
    packed, pos = IDS.reshape(1, -1), torch.arange(T).repeat(2)[None]
    seq_ids = torch.arange(2).repeat_interleave(T)[None]
    loss, grads = _loss_and_grads(model, packed, position_ids=pos, seq_ids=seq_ids)
    torch.testing.assert_close(loss, ref_loss)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-6, rtol=1e-5)


def test_mfu_counts_no_weight_gradients_for_a_frozen_base():
    from phaserl.metrics import FlopModel

    model = tiny_decoder()
    assert FlopModel.of(model).update_passes == 3
    apply_lora(model, R4)
    fm = FlopModel.of(model)
    adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    total = sum(p.numel() for p in model.parameters())
    assert fm.update_passes == 2 + adapters / total  # weight gradients for the adapters only
    assert fm.body_params == FlopModel.of(tiny_decoder()).body_params + adapters


def test_the_shared_reference_fails_when_a_base_weight_becomes_trainable():
    from phaserl.errors import PreflightError

    with pytest.raises(PreflightError, match="needs a model with LoRA adapters"):
        ReferencePolicy.base_of(tiny_decoder())
    model = tiny_decoder()
    apply_lora(model, R4)
    ref = ReferencePolicy.base_of(model)
    ref.check_frozen()  # adapters train: that is the actor's business, not the reference's
    model.model.layers[1].mlp.down_proj.weight.requires_grad_(True)
    with pytest.raises(PreflightError, match="model.layers.1.mlp.down_proj.weight"):
        ref.check_frozen()


# ----- rollout: the engine multiplies merged copies ------------------------------------------------------------
def test_the_engine_samples_from_the_adapted_model_and_never_writes_the_base():
    model = tiny_decoder(model_type="qwen3")
    apply_lora(model, R4)
    randomize_adapters(model)
    model.eval()
    base = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}
    engine = RolloutEngine(model)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    prompts = [[5, 6, 7], [1, 2, 3, 4], [11]]
    for round_ in range(3):  # weights refilled each call: a new adapter value must show in the next rollout
        out = engine.generate(prompts, params, eos_token_ids=[], pad_token_id=0)
        for prompt, response, lps in zip(prompts, out.response_ids, out.logprobs):
            seq = torch.tensor([prompt + response])
            full = logits(model, seq)[0].float().log_softmax(-1)  # [T, V]: the adapted model, unmerged
            assert response == full[len(prompt) - 1:-1].argmax(-1).tolist()
            expected = full[len(prompt) - 1:-1].gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(lps), expected, atol=1e-4, rtol=1e-4)
        engine.sleep()
        randomize_adapters(model, seed=10 + round_)
    for n, p in model.named_parameters():
        if ".lora_" not in n:
            assert torch.equal(p, base[n]), f"{n} changed"


def test_the_engine_merge_is_one_rounding_of_w_plus_the_bf16_factors_product_into_the_engines_buffer():
    """engine_weight writes W + (s B)·A straight into the engine's buffer (no float32 [out, in] temporaries), equal
    to the exact sum rounded once to bf16 (within one bf16 step); the base is not written."""
    torch.manual_seed(0)
    m = LoRALinear(torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16), rank=8, alpha=16.0)
    with torch.no_grad():
        m.lora_B.normal_(std=0.05)
    base = m.weight.detach().clone()
    buffer = torch.empty_like(m.weight)
    with torch.inference_mode():
        merged = engine_weight(m, buffer)
        fresh = engine_weight(m)  # no buffer (the fused q/k/v, gate/up parts): a new tensor
    assert merged.data_ptr() == buffer.data_ptr() and fresh.data_ptr() != m.weight.data_ptr()
    exact = (m.weight.double() + m.scaled_B(torch.bfloat16).double() @ m.lora_A.to(torch.bfloat16).double())
    torch.testing.assert_close(merged.double(), exact.to(torch.bfloat16).double(), atol=0, rtol=2 ** -7)
    assert torch.equal(merged, fresh) and torch.equal(m.weight, base)
    with adapters_disabled(m):
        assert engine_weight(m, buffer) is m.weight  # off: the base, read in place


# ----- the trainer: reference for free, base bit-identical, checkpoints ----------------------------------------
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from _tiny_run import make_run_dir

    root = tmp_path_factory.mktemp("lora")
    reward = root / "spread.py"  # varied rewards, so that advantages (and the adapters' gradients) are not 0
    reward.write_text("def spread(prompt, response, ground_truth, **row):\n"
                      "    return sum(ord(c) for c in response) % 7 / 7\n")
    return str(root), make_run_dir(str(root)) + [f"reward.functions=[{{name: '{reward}:spread'}}]"]


LORA = ["actor.lora.rank=4", "actor.lora.alpha=8", "algorithm.kl_placement=loss", "algorithm.kl_coef=0.1",
        "trainer.loggers=[]", "actor.optim.lr=3e-2", "ppo.num_mini_batches=2"]


def _trainer(run_dir, tmp_path, extra=()):
    from phaserl.trainer import RLTrainer

    _, overrides = run_dir
    cfg = load_config(None, overrides + LORA + [f"trainer.log_dir={tmp_path}/logs",
                                                  f"trainer.checkpoint_path={tmp_path}/ckpt", *extra])
    return RLTrainer.from_config(cfg), cfg


@pytest.mark.slow  # trainer steps / torch.compile tracing: the full lane
def test_the_reference_is_the_actors_base_and_equals_a_separately_loaded_base(run_dir, tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="phaserl"):
        trainer, cfg = _trainer(run_dir, tmp_path)
    assert trainer.ref_policy.shares_actor_base and trainer.ref_policy.model is trainer.actor.model
    assert "reference = the actor's base weights with LoRA adapters off (no second copy)" in caplog.text
    base = {n: p.detach().clone() for n, p in trainer.actor.model.named_parameters() if ".lora_" not in n}
    batches = []
    generate = trainer._generate
    trainer._generate = lambda *a: batches.append(generate(*a)) or batches[-1]
    for _ in range(3):  # three rollout/training switches, six optimizer steps
        trainer.train_step()
        trainer.step_num += 1
    for n, p in trainer.actor.model.named_parameters():  # never merged into, never trained: bit-identical
        if ".lora_" not in n:
            assert torch.equal(p, base[n]), f"base weight {n} changed"
    separate = ReferencePolicy(load_pretrained(cfg.model.path))
    run = trainer.run
    got = trainer.ref_policy.compute_logprobs(batches[-1], temperature=run.temperature, token_budget=128)
    want = separate.compute_logprobs(batches[-1], temperature=run.temperature, token_budget=128)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    actor = trainer.actor.compute_logprobs(batches[-1], token_budget=128)
    mask = batches[-1].response_mask.bool()
    assert (actor - got)[mask].abs().max() > 1e-3  # the adapters did move the policy away from the reference
    assert all(p.requires_grad for n, p in trainer.actor.model.named_parameters() if ".lora_" in n)


@pytest.mark.slow  # trainer steps: the full lane
def test_one_optimizer_step_with_lora_runs_the_reference_pass_alone(run_dir, tmp_path):
    """1 epoch x 1 mini-batch: the old log-probs are the update's own (no pass of their own), as for a full
    fine-tune; the forward phase is the reference (the base, adapters off) once."""
    trainer, _ = _trainer(run_dir, tmp_path, ["ppo.num_mini_batches=1"])
    calls = {"old": 0, "ref": 0}
    old, ref = trainer.actor.compute_logprobs, trainer.ref_policy.compute_logprobs
    trainer.actor.compute_logprobs = lambda *a, **k: calls.__setitem__("old", calls["old"] + 1) or old(*a, **k)
    trainer.ref_policy.compute_logprobs = lambda *a, **k: calls.__setitem__("ref", calls["ref"] + 1) or ref(*a, **k)
    metrics = trainer.train_step()
    assert calls == {"old": 0, "ref": 1} and metrics["actor/grad_norm"] > 0


@pytest.mark.slow  # trainer steps / torch.compile tracing: the full lane
def test_a_lora_checkpoint_holds_adapters_only_and_resumes_them(run_dir, tmp_path, caplog):
    import logging

    from torch.distributed.checkpoint import FileSystemReader

    trainer, _ = _trainer(run_dir, tmp_path, ["trainer.total_steps=2", "trainer.save_interval=2"])
    with caplog.at_level(logging.INFO, logger="phaserl"):
        trainer.fit()
    assert "actor adapters + optimizer state only" in caplog.text
    step = os.path.join(str(tmp_path), "ckpt", "step_2")
    keys = list(FileSystemReader(os.path.join(step, "dcp")).read_metadata().state_dict_metadata)
    weights = [k for k in keys if k.startswith("actor/model/")]  # checkpoint/state.py's keys: role/model/name
    assert weights and all(".lora_" in k for k in weights), weights
    arch = json.load(open(os.path.join(step, "architecture", "actor.json")))
    assert arch["lora"]["rank"] == 4 and os.path.isdir(arch["lora"]["base_path"])
    resumed, _ = _trainer(run_dir, tmp_path, ["trainer.total_steps=2"])
    resumed.run.checkpointer.resume(resumed.checkpoint_state())
    for (n, a), b in zip(trainer.actor.model.state_dict().items(), resumed.actor.model.state_dict().values()):
        assert torch.equal(a, b), n
    sa, sb = trainer.actor.optimizer.state_dict(), resumed.actor.optimizer.state_dict()
    assert sa["scheduler"] == sb["scheduler"] and len(sa["optimizer"]["state"]) == 2 * 2 * 7
    for pid, st in sa["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sb["optimizer"]["state"][pid][k])


@pytest.mark.slow  # trainer steps / torch.compile tracing: the full lane
def test_export_merged_and_as_a_peft_adapter_give_the_actors_logits(run_dir, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from phaserl.checkpoint import export_checkpoint

    trainer, cfg = _trainer(run_dir, tmp_path, ["trainer.total_steps=1", "trainer.save_interval=1",
                                                "trainer.export_hf=true"])
    trainer.fit()
    model = trainer.actor.model.eval()
    ids = IDS % model.config.vocab_size
    want = logits(model, ids)
    with adapters_disabled(model):
        base_logits = logits(model, ids)
    assert (want - base_logits).abs().max() > 1e-3  # the exported adapters matter
    step = os.path.join(str(tmp_path), "ckpt", "step_1")
    merged = AutoModelForCausalLM.from_pretrained(export_checkpoint(step, str(tmp_path / "merged"))).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    at_save = AutoModelForCausalLM.from_pretrained(os.path.join(step, "hf")).eval()  # trainer.export_hf: merged too
    with torch.no_grad():
        torch.testing.assert_close(at_save(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    adapter_dir = export_checkpoint(step, str(tmp_path / "adapter"), adapter=True)
    assert sorted(os.listdir(adapter_dir)) == ["adapter_config.json", "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(cfg.model.path)
    with_adapter = peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="without LoRA"):
        full, _ = _trainer(run_dir, tmp_path / "full", ["actor.lora.rank=0", "trainer.total_steps=1",
                                                        "trainer.save_interval=1"])
        full.fit()
        export_checkpoint(str(tmp_path / "full" / "ckpt"), str(tmp_path / "nope"), adapter=True)


def test_a_transformers_fallback_model_gets_peft_adapters(tmp_path):
    pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    from phaserl.models.hf_fallback import HFCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2))
    model = HFCausalLM(hf).eval()
    base = logits(model, IDS)
    apply_lora(model, LoRASettings(rank=4, alpha=8.0, target_modules=resolve_targets(["q", "v"])))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    randomize_peft = [p for n, p in model.named_parameters() if ".lora_B" in n]
    with torch.no_grad():
        for p in randomize_peft:
            p.normal_(0, 0.3)
    assert (logits(model, IDS) - base).abs().max() > 1e-3
    with adapters_disabled(model):
        torch.testing.assert_close(logits(model, IDS), base)
    ref = ReferencePolicy.base_of(model)
    ref.check_frozen()  # adapters train, nothing else


def test_the_doctor_counts_adapter_state_and_no_reference_copy():
    from phaserl.doctor import run_doctor
    from phaserl.memory.budget import fmt_bytes
    from phaserl.models.lora import adapter_parameter_count
    from phaserl.world import prepare_tiny_world

    cfg = load_config(None, ["actor.lora.rank=8", "trainer.device=cpu"])
    results = {r.name: r for r in run_doctor(cfg)}
    assert "adapters off (no second copy)" in results["reference frozen"].message
    text = "\n".join(results["memory"].details)
    assert "ref          0 B: the actor's base with adapters off (no copy)" in text, text
    adapters = adapter_parameter_count(load_pretrained(prepare_tiny_world().model_dir), LoRASettings(8, 16.0))
    actor = next(line for line in text.splitlines() if line.startswith("actor"))
    assert f"grads {fmt_bytes(4 * adapters)} + AdamW {fmt_bytes(8 * adapters)}" in actor, actor  # float32 adapters


# ----- learning ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_quickstart_with_lora_raises_the_held_out_score_by_20_points(tmp_path):
    from phaserl.cli import main

    out = tmp_path / "qs"
    assert main(["quickstart", "--out", str(out), "actor.lora.rank=16", "actor.lora.alpha=32",
                 "actor.optim.lr=1e-2", "trainer.loggers=[jsonl]"]) == 0
    vals = [record["val/score_mean"] for record in map(json.loads, open(out / "metrics.jsonl"))
            if "val/score_mean" in record]
    assert vals[-1] - vals[0] >= 0.20, vals


# ----- GPU -----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_bf16_lora_on_cuda_rollout_matches_training_and_the_base_stays_bit_identical(run_dir, tmp_path):
    trainer, _ = _trainer(run_dir, tmp_path, ["trainer.device=cuda", "model.dtype=bfloat16",
                                              "actor.hybrid_engine.offload_optimizer=true",
                                              "rollout.engine_keep_awake=true"])
    model = trainer.actor.model
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if ".lora_" not in n)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if ".lora_" in n)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}
    for _ in range(4):
        metrics = trainer.train_step()
        trainer.step_num += 1
    assert metrics["actor/grad_norm"] > 0
    for n, p in model.named_parameters():
        if ".lora_" not in n:
            assert torch.equal(p, base[n]), f"base weight {n} changed"
    state = trainer.actor.optimizer.opt.state
    assert len(state) == 2 * 2 * 7 and all(s["exp_avg"].is_cuda for s in state.values())  # offloaded and back


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_gpu_bf16_rollout_with_merged_adapters_matches_the_unmerged_trainer(compile):
    """The engine multiplies W + s·BA rounded once to bf16; training computes W x + s·B(A x). The documented
    rollout/trainer tolerance of tests/test_rollout_engine.py (mean <= 0.03, max <= 0.3 nats) must still hold."""
    from phaserl.algo import token_logprobs_from_hidden
    from phaserl.rollout import EngineConfig

    torch.manual_seed(0)
    cfg = DecoderConfig(model_type="qwen2", vocab_size=4096, hidden_size=256, intermediate_size=768,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, attention_bias=True,
                        max_position_embeddings=1024)
    model = CausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.1)
    model = model.to("cuda", torch.bfloat16)
    apply_lora(model, LoRASettings(rank=16, alpha=32.0))
    randomize_adapters(model, scale=0.02)
    model.eval()
    base = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4096, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 64, (16,), generator=g)]
    prompts = [p for p in prompts for _ in range(4)]
    engine = RolloutEngine(model, EngineConfig(compile=compile, token_budget=16384))
    result = engine.generate(prompts, SamplingParams(max_new_tokens=48, temperature=0.8), eos_token_ids=[],
                             pad_token_id=0, generator=torch.Generator("cuda").manual_seed(1))
    diffs = []
    with torch.no_grad():
        for prompt, tokens, logprobs in zip(prompts, result.response_ids, result.logprobs):
            hidden = model(torch.tensor([prompt + tokens], device="cuda"))[0]  # [T, H], adapters unmerged
            trainer = token_logprobs_from_hidden(hidden[len(prompt) - 1:-1], model.output_weight,
                                                 torch.tensor(tokens, device="cuda"), temperature=0.8)[0]
            diffs.append((trainer.cpu() - torch.tensor(logprobs)).abs())
    diffs = torch.cat(diffs)
    print(f"bf16 LoRA rollout (merged) vs trainer (unmerged), compile={compile}: mean {diffs.mean():.5f}, "
          f"max {diffs.max():.5f} over {diffs.numel()} tokens")
    assert diffs.mean() <= 0.03 and diffs.max() <= 0.3
    for n, p in model.named_parameters():
        if ".lora_" not in n:
            assert torch.equal(p, base[n]), f"{n} changed"


def test_a_phi3_peft_adapter_is_written_for_its_fused_projections(tmp_path):
    """Phi-3's checkpoint fuses q/k/v (qkv_proj) and gate/up (gate_up_proj); our decoder splits them, so its
    adapters sit on q_proj... which transformers' Phi3 does not have: peft loaded the adapter dir without them
    and gave the base model's logits (0.24 off after one step). The export now writes one exact adapter per fused
    module (A stacked, B block-diagonal, rank and alpha scaled together) and peft reproduces the adapted logits."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, Phi3Config

    from phaserl.checkpoint.lora_export import write_peft_adapter
    from phaserl.models import load_pretrained

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(Phi3Config(vocab_size=40, hidden_size=32, intermediate_size=48,
                                                     num_hidden_layers=2, num_attention_heads=4,
                                                     num_key_value_heads=2, max_position_embeddings=64,
                                                     pad_token_id=0, bos_token_id=None, eos_token_id=1))
    hf.save_pretrained(tmp_path / "base")
    model = load_pretrained(tmp_path / "base")
    apply_lora(model, LoRASettings(rank=2, alpha=4.0, target_modules=resolve_targets(["q", "v", "gate", "up", "o"])))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0.0, 0.3)
    model.eval()
    want = logits(model, IDS)
    out = write_peft_adapter(model, str(tmp_path / "adapter"), str(tmp_path / "base"))
    adapted = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), str(out)).eval()
    with torch.no_grad():
        got = adapted(input_ids=IDS).logits
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()(input_ids=IDS).logits
    assert (want - base).abs().max() > 1e-2  # the adapters matter
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
