"""The memory plan (phaserl/memory/plan.py): which card sizes choose which measures, cheapest first, and the pieces
each measure rests on (selective checkpointing's count and the decoder that does it; the keys set by hand).

The shapes are Qwen2.5's (0.5B, 7B, 14B: layers, widths, kv heads, vocabulary), bf16, compiled layers, a separate
reference; the cards are the usual 24 / 48 / 80 / 141 GB less 1.5 GiB of CUDA context.
"""
import dataclasses

import pytest
import torch

from phaserl.config import load_config
from phaserl.errors import ConfigError
from phaserl.memory import budget
from phaserl.memory.budget import ModelShape
from phaserl.memory.plan import Asked, Measures, PlanFacts, choose_plan, fixed_bytes, peak_bytes, tighter_plan

GIB = 2**30
QWEN = {"0.5b": (494_032_768, 24, 896, 4864, 2, 64, 151936), "7b": (7_615_616_512, 28, 3584, 18944, 4, 128, 152064),
        "14b": (14_770_033_664, 48, 5120, 13824, 8, 128, 152064)}
GRPO = {"0.5b": (384, 512), "7b": (768, 128), "14b": (768, 128)}  # the benchmarks' shapes: tokens, sequences/step


def facts(model: str, card_gb: float, *, seq=None, mini=None, device="cuda", **over) -> PlanFacts:
    n, L, h, inter, kv, hd, V = QWEN[model]
    shape = ModelShape(n, L, h, inter, kv, hd, V, 2)
    weights = 2 * n
    T, S = GRPO[model]
    f = PlanFacts(shape=shape, device_type=device, budget_bytes=int((card_gb - 1.5) * GIB), actor_params=weights,
                  actor_trainable=weights, ref_bytes=weights, ref_layer_bytes=weights - 2 * 2 * V * h,
                  sequence_tokens=seq or T, mini_batch_sequences=mini or S, compiled=True)
    return dataclasses.replace(f, **over)


def measures(plan) -> tuple:
    m = plan.measures
    return m.stream, m.layers, m.offload


@pytest.mark.parametrize("model, card, expected", [
    ("0.5b", 24, (False, 0, False)), ("0.5b", 80, (False, 0, False)), ("0.5b", 141, (False, 0, False)),
    ("7b", 141, (False, 0, False)),   # everything on the device: the H200's 98 GiB of the benchmarks
    ("7b", 80, (True, 21, False)),    # the reference streamed, then 21 of 28 layers recomputed
    ("7b", 48, (True, 23, True)),     # AdamW on the CPU too, and with it fewer layers than all
    ("14b", 141, (True, 38, False)), ("14b", 80, (True, 42, True)),
])
def test_card_sizes_choose_the_measures_cheapest_first(model, card, expected):
    plan = choose_plan(facts(model, card))
    assert measures(plan) == expected
    assert plan.fits and plan.peak_bytes <= plan.budget_bytes
    chosen = {c.key: c for c in plan.all()}
    assert chosen["ref.stream_weights"].why and chosen["actor.checkpoint_layers"].why
    if expected[1]:
        assert f"{expected[1]} of {QWEN[model][1]} layers recompute" in chosen["actor.checkpoint_layers"].why


def test_each_measure_is_the_fewest_that_fits():
    f = facts("7b", 80)
    plan = choose_plan(f)
    s = plan.measures
    target = 6 * 768  # 4096 tokens rounded up to whole sequences
    room = lambda m: fixed_bytes(f, m) + 0.4 * (f.budget_bytes - fixed_bytes(f, m))  # noqa: E731
    assert peak_bytes(f, s, target) <= room(s)
    one_less = dataclasses.replace(s, layers=s.layers - 1)
    assert peak_bytes(f, one_less, target) > room(one_less)
    resident = Measures(stream=False, layers=s.layers, offload=False)
    assert peak_bytes(f, resident, target) > room(resident)  # streaming was needed too


def test_a_card_too_small_says_so_with_every_measure_taken():
    plan = choose_plan(facts("14b", 48))
    assert measures(plan) == (True, 48, True) and not plan.fits
    assert "more than the 46.50 GB this process has" in plan.problem


def test_long_responses_plan_checkpointing_instead_of_failing():
    """1.5B-like shape at 32k responses: one sequence's activations are more than the card; checkpointing fits it."""
    n, L, h, inter, kv, hd, V = 1_543_714_304, 28, 1536, 8960, 2, 128, 151936
    shape = ModelShape(n, L, h, inter, kv, hd, V, 2)
    f = PlanFacts(shape=shape, device_type="cuda", budget_bytes=int(78.5 * GIB), actor_params=2 * n,
                  actor_trainable=2 * n, ref_bytes=2 * n, ref_layer_bytes=2 * n - 4 * V * h, sequence_tokens=33024,
                  mini_batch_sequences=64, compiled=True)
    assert peak_bytes(f, Measures(), 33024) > f.budget_bytes  # as it was: out of memory
    plan = choose_plan(f)
    assert plan.fits and 0 < plan.measures.layers < L and plan.micro_batch_tokens.value == 33024
    assert 1 <= plan.kv_sequences < 64  # the KV budget holds fewer than the step's 64: the rest wait for a slot


def test_settings_made_by_hand_are_kept_and_the_plan_works_around_them():
    f = facts("7b", 80)
    plan = choose_plan(f, Asked(stream_reference=False))
    assert plan.stream_reference.value is False and plan.stream_reference.why == "set in the config"
    assert plan.measures.layers > 21 or plan.measures.offload  # what streaming saved comes from elsewhere
    plan = choose_plan(f, Asked(checkpoint_layers=0, stream_reference=True, micro_batch_tokens=768))
    assert plan.checkpoint_layers.value == 0 and plan.micro_batch_tokens.value == 768
    assert plan.overrides() == ["ref.stream_weights=true", "actor.checkpoint_layers=0",  # no layers: AdamW goes
                                "actor.offload_activations=false", "actor.optimizer_offload=true",
                                "ppo.micro_batch_tokens=768"]


def test_nothing_is_planned_off_cuda_or_where_a_measure_cannot_run():
    plan = choose_plan(facts("7b", 80, device="cpu"))
    assert measures(plan) == (False, 0, False) and plan.fits and plan.kv_sequences == -1
    assert plan.micro_batch_tokens.value == 16384 and "CPU" in plan.stream_reference.why
    two_ranks = choose_plan(facts("7b", 80, world_size=2))
    assert not two_ranks.measures.stream and "ref.fsdp.cpu_offload" in two_ranks.stream_reference.why
    lora = choose_plan(facts("7b", 80, ref_bytes=0, ref_layer_bytes=0, actor_trainable=40 * 2**20))
    assert not lora.measures.stream and lora.stream_reference.why == "no separate reference policy on the device"
    hf = choose_plan(facts("7b", 80, selective=False))  # the transformers path checkpoints all layers or none
    assert hf.measures.layers in (0, 28) and hf.fits


def test_a_tighter_plan_after_an_out_of_memory_stop():
    f = facts("7b", 80)
    plan = choose_plan(f)
    tighter = tighter_plan(f, predicted_bytes=plan.peak_bytes, measured_bytes=int(plan.peak_bytes * 1.3))
    assert tighter.measures.layers > plan.measures.layers or tighter.measures.offload
    assert tighter.peak_bytes < plan.peak_bytes


# ----- selective checkpointing: the count and the decoder ------------------------------------------------------
def test_selective_checkpointing_counts_between_none_and_all():
    shape = ModelShape(*QWEN["7b"], 2)
    counts = [budget.train_bytes_per_token(shape, False, True, checkpoint_layers=k) for k in range(29)]
    assert counts[0] == budget.train_bytes_per_token(shape, False, True)
    assert counts[28] == budget.train_bytes_per_token(shape, True, True)
    assert all(a > b for a, b in zip(counts[:28], counts[1:28]))  # each layer recomputed saves its activations
    layer = budget.layer_bytes(shape, True)["dense"][1]
    assert counts[10] == int(10 * 3584 * 2 + 18 * layer)  # 10 inputs, 18 whole layers (freed before any recompute)
    assert counts[28] == int(28 * 3584 * 2 + layer)  # every input, one layer recomputed at a time


def _saved_bytes(model, ids) -> int:
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = model(ids)
    hidden.float().square().mean().backward()
    return total[0]


def test_the_decoder_recomputes_its_first_k_layers_with_the_same_gradients():
    from phaserl.models import CausalLM, DecoderConfig

    torch.manual_seed(0)
    cfg = DecoderConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = CausalLM(cfg).train()
    ids = torch.randint(0, 64, (2, 16))
    saved, grads = [], []
    for k in (0, 2, 4):
        model.model.checkpoint_layers = k
        model.zero_grad()
        saved.append(_saved_bytes(model, ids))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert saved[0] > saved[1] > saved[2]  # the first pass of a checkpointed layer saves only its input
    torch.testing.assert_close(grads[1], grads[0])
    torch.testing.assert_close(grads[2], grads[0])
    model.gradient_checkpointing = True  # the old switch: every layer
    assert model.model.checkpoint_layers == 4 and model.gradient_checkpointing


# ----- the keys ------------------------------------------------------------------------------------------------
def test_the_keys_are_checked_with_the_fix_named():
    with pytest.raises(ConfigError, match="keep actor.checkpoint_layers"):
        load_config(None, ["actor.gradient_checkpointing=true", "actor.checkpoint_layers=3"])
    with pytest.raises(ConfigError, match="FULL_SHARD spreads AdamW"):
        load_config(None, ["actor.optimizer_offload=true", "rollout.prompts_per_step=4", "rollout.batch_size=2"],
                    world_size=2)
    with pytest.raises(ConfigError, match="ref.fsdp.cpu_offload = true"):
        load_config(None, ["ref.stream_weights=true", "rollout.prompts_per_step=4", "rollout.batch_size=2"],
                    world_size=2)
    with pytest.raises(ConfigError, match="did you mean"):
        load_config(None, ["actor.checkpoint_layer=3"])
    cfg = load_config(None, ["actor.checkpoint_layers=auto", "ref.stream_weights=auto", "actor.optimizer_offload=true"])
    assert cfg.actor.checkpoint_layers is None and cfg.ref.stream_weights is None and cfg.actor.optimizer_offload


def test_32k_responses_need_no_forward_budget_by_hand():
    """Regression: the forward-only budget was a fixed 32768 tokens, so a 32,768-token response (plus its prompt)
    stopped a run with nothing set at the config check."""
    from phaserl.config.validate import derive
    long = load_config(None, ["data.max_prompt_length=256", "rollout.max_new_tokens=32768"])
    assert long.ppo.forward_micro_batch_tokens is None
    assert derive(long, world_size=1).forward_micro_batch_tokens == 256 + 32768
    assert derive(load_config(None, []), world_size=1).forward_micro_batch_tokens == 32768
    asked = load_config(None, ["ppo.forward_micro_batch_tokens=4096", "rollout.max_new_tokens=1024"])
    assert derive(asked, world_size=1).forward_micro_batch_tokens == 4096
    with pytest.raises(ConfigError, match="forward_micro_batch_tokens >= 33024"):
        load_config(None, ["data.max_prompt_length=256", "rollout.max_new_tokens=32768",
                           "ppo.forward_micro_batch_tokens=32768"])


# ----- the run and the doctor show the plan ---------------------------------------------------------------------
def test_the_run_applies_the_plan_set_by_hand_and_prints_it(tmp_path):
    """Set by hand on the CPU (where nothing is planned): the builder applies each measure and a step trains."""
    from _tiny_run import make_run_dir
    from phaserl.trainer import RLTrainer
    from phaserl.trainer.summary import run_summary

    cfg = load_config(None, make_run_dir(str(tmp_path)) + [
        "trainer.loggers=[]", "trainer.total_steps=1", "actor.checkpoint_layers=1", "actor.optimizer_offload=true",
        "ref.stream_weights=true", "trainer.val_before_train=false", "actor.entropy_coef=0.01",  # a gradient
        "actor.offload_activations=true"])
    trainer = RLTrainer.from_config(cfg)
    assert trainer.actor.model.model.checkpoint_layers == 1 and trainer.actor.optimizer.offloaded
    offload = trainer.actor.model.model.activation_offload
    assert offload is not None and offload.in_flight == budget.OFFLOAD_IN_FLIGHT
    assert trainer.ref_policy.streamed is not None
    summary = run_summary(trainer)
    for line in ("actor.checkpoint_layers=1 -> 1: set in the config", "actor.optimizer_offload=true -> on: set in the "
                 "config", "ref.stream_weights=true -> on: set in the config", "actor.offload_activations=true -> on: "
                 "set in the config", "memory     memory plan: reference streamed, 1 layer(s) checkpointed, their "
                 "inputs in host memory, optimizer state on the CPU; micro-batch 64 tokens"):
        assert line in summary, line
    before = [p.detach().clone() for p in trainer.actor.model.parameters()]
    trainer.fit()
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.actor.model.parameters()))  # AdamW on the host
    assert offload.offloaded == 1  # the checkpointed layer's input went through the hooks in the update


def test_the_doctor_shows_the_plan_the_run_will_choose():
    from phaserl.doctor.memory import PhaseSizes, plan_for

    f = facts("7b", 80)
    roles = {"actor": budget.RoleMemory(f.actor_params, f.actor_trainable, 2 * f.actor_trainable),
             "ref": budget.RoleMemory(f.ref_bytes, 0, 0)}
    sizes = PhaseSizes(n=8, prompt_tokens=256, sequence_tokens=768, rollout_batch_size=16, prompts_per_rank=16,
                       rm_engine="phaserl", rm_batch_size=16, rm_micro_batch_tokens=16384, rm_packed=True,
                       rm_max_length=512, responses_per_rank=128, micro_batch_tokens=16384, mini_batch_per_rank=128,
                       gradient_checkpointing=False, compiled=True)
    doctor_facts, plan = plan_for(f.shape, sizes, roles, Asked(), free_bytes=f.budget_bytes, device_type="cuda",
                                  world_size=1, kept=0, layer_share=f.ref_layer_bytes / f.ref_bytes, selective=True,
                                  kv_fraction=0.4)
    assert plan == choose_plan(f)
    assert "reference streamed, 21 layer(s) checkpointed" in plan.summary()


def test_the_benchmark_runs_a_long_synthetic_step_on_the_cpu(capsys):
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import memory_plan

    memory_plan.main(["--tiny", "--long", "--synthetic-rollout"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    summary = lines[-1]
    assert summary["measure"] == "summary" and summary["long"] and summary["s_per_step_median"] > 0
    assert next(x for x in lines if x["measure"] == "plan")["plan"].startswith("memory plan: nothing planned off CUDA")


@pytest.mark.slow
def test_the_benchmark_times_each_measure_alone_in_its_own_process(capsys):
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import memory_plan

    assert memory_plan.cost_overrides("all_checkpointed_offloaded", 28) == [
        "ref.stream_weights=false", "actor.checkpoint_layers=28", "actor.optimizer_offload=false",
        "actor.offload_activations=true"]
    memory_plan.main(["--tiny", "--synthetic-rollout", "--costs"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    plans = [x for x in lines if x["measure"] == "plan"]
    assert [p["overrides"] for p in plans] == [memory_plan.cost_overrides(name, 2) for name in memory_plan.COSTS]
    costs = lines[-1]
    assert costs["measure"] == "costs" and list(costs["costs"]) == list(memory_plan.COSTS)
    assert all(c["s_per_step_median"] > 0 and "error" not in c for c in costs["costs"].values())
    assert costs["costs"]["none"]["vs_none"] == 1.0
