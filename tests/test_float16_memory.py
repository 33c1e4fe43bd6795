"""The memory count of float16 training: AdamW steps float32 masters of float16 weights (a master and two moments,
12 bytes a parameter, roles/loss_scale.py), one formula (memory.budget.adamw_state_bytes) that the run's count
(trainer/speed.py), the memory plan and the doctor all use; and the plan never moves that AdamW to the CPU (the
offloaded step does not run on the masters), saying why, while a hand-set actor.optimizer_offload=true stops at
the config."""
import pytest
import torch

from _tiny_run import make_run_dir
from phaserl.config import load_config
from phaserl.errors import ConfigError
from phaserl.memory import budget
from phaserl.memory.budget import ModelShape, adamw_state_bytes
from phaserl.memory.plan import Measures, PlanFacts, choose_plan, fixed_bytes

GIB = 2**30


def test_adamw_state_is_two_moments_or_float32_masters_and_moments_for_float16():
    assert adamw_state_bytes(1000, "bfloat16") == adamw_state_bytes(1000, None) == 2000
    assert adamw_state_bytes(1000, "float16") == adamw_state_bytes(1000, torch.float16) == 6000
    assert adamw_state_bytes(4000, "float32") == 8000
    kw = dict(trainable=True, strategy="NO_SHARD", world_size=1, cpu_offload=False)
    # 1000 float16 params: 2 kB of weights, 2 kB of gradients, 12 kB of masters + moments
    assert budget.role_memory(1000, 2, dtype="float16", **kw) == budget.RoleMemory(2000, 2000, 12000)
    assert budget.role_memory(1000, 2, dtype="bfloat16", **kw) == budget.RoleMemory(2000, 2000, 4000)
    assert budget.role_memory(1000, 2, dtype="float16", **{**kw, "strategy": "FULL_SHARD", "world_size": 2}) == \
        budget.RoleMemory(1000, 1000, 6000)


def _qwen_7b(card_gb: float, **over) -> PlanFacts:
    """Qwen2.5-7B's shape, a separate reference, the GRPO benchmark's sequences (tests/test_memory_plan.py)."""
    n, V, h = 7_615_616_512, 152064, 3584
    shape = ModelShape(n, 28, h, 18944, 4, 128, V, 2)
    return PlanFacts(shape=shape, device_type="cuda", budget_bytes=int((card_gb - 1.5) * GIB), actor_params=2 * n,
                     actor_trainable=2 * n, ref_bytes=2 * n, ref_layer_bytes=2 * n - 4 * V * h, sequence_tokens=768,
                     mini_batch_sequences=128, compiled=True, **over)


def test_the_plan_counts_float32_masters_and_never_offloads_them():
    bf16, fp16 = _qwen_7b(48), _qwen_7b(48, trained_dtype="float16")
    trainable = bf16.actor_trainable
    assert fixed_bytes(fp16, Measures()) - fixed_bytes(bf16, Measures()) == 4 * trainable  # 6x against 2x
    assert choose_plan(bf16).measures.offload  # bf16 on a 48 GB card: AdamW goes to the CPU
    plan = choose_plan(fp16)
    offload = plan.optimizer_offload
    assert not plan.measures.offload and offload.value is False and offload.asked is None
    assert "float16 weights: AdamW steps their float32 masters on the device" in offload.why
    # the 7B run in float16 does not fit a 48 GB card (its masters alone are 85 GiB): the plan says so, it does not
    # pick a setting that stops the run
    assert not plan.fits and "more than the" in plan.problem


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run_dir(str(tmp_path_factory.mktemp("fp16mem")))


def test_the_run_and_the_doctor_count_float16_adamw_alike(run_dir, monkeypatch):
    from phaserl.config.validate import sequence_tokens
    from phaserl.doctor import load_doctor_config, run_doctor
    from phaserl.memory.budget import fmt_bytes
    from phaserl.trainer import RLTrainer
    from phaserl.trainer.settings import Roles
    from phaserl.trainer.speed import UpdateCount

    over = run_dir + ["trainer.loggers=[]", "model.dtype=float16", "algorithm.kl_placement=none"]
    cfg = load_config(None, over)
    t = RLTrainer.from_config(cfg)
    roles = Roles(actor=t.actor, critic=None, ref_policy=None, reward=t.run.reward, tokenizer=t.run.tokenizer)
    count = UpdateCount.of(cfg, roles, free_bytes=10**6, held_bytes=0, compiled=False,
                           sequence_tokens=sequence_tokens(cfg))
    weights = sum(p.numel() for p in t.actor.model.parameters()) * 2
    facts = count.facts(kept=False)
    assert facts.trained_dtype == "float16" and count.actor_adamw == 6 * weights and facts.other_bytes == 0
    assert fixed_bytes(facts, Measures()) == weights + weights + 6 * weights

    monkeypatch.setattr("phaserl.doctor.checks.free_memory_bytes", lambda device: 10**9)
    memory = {r.name: r for r in run_doctor(load_doctor_config(None, over), world_size=1)}["memory"]
    line = next(d for d in memory.details if d.startswith("actor "))
    assert f"params {fmt_bytes(weights)} + grads {fmt_bytes(weights)} + AdamW {fmt_bytes(6 * weights)}" in line


def test_optimizer_offload_set_by_hand_with_float16_weights_stops_at_the_config(run_dir):
    with pytest.raises(ConfigError, match="actor.optimizer_offload = true with model.dtype = float16"):
        load_config(None, run_dir + ["model.dtype=float16", "actor.optimizer_offload=true"])
    # LoRA adapters are float32 whatever the base: their AdamW may go to the CPU
    cfg = load_config(None, run_dir + ["model.dtype=float16", "actor.optimizer_offload=true", "actor.lora.rank=4",
                                       "actor.lora.alpha=8"])
    assert cfg.actor.optimizer_offload is True


def test_a_lora_run_on_a_float16_base_counts_its_float32_adapters(run_dir):
    from phaserl.trainer import RLTrainer
    from phaserl.trainer.speed import _trained_dtype

    cfg = load_config(None, run_dir + ["trainer.loggers=[]", "model.dtype=float16", "actor.lora.rank=4",
                                       "actor.lora.alpha=8"])
    t = RLTrainer.from_config(cfg)
    assert _trained_dtype(t.actor.model) == "float32" and t.actor.optimizer.half is None
