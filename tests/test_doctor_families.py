"""The doctor's memory count for the families beyond the dense decoder equals what the rollout engine allocates:
tiny Qwen3.5 (linear-attention layers hold a fixed recurrent state, no KV), Gemma 4 (global layers with their own
head_dim and kv heads, k_eq_v), Mistral (sliding window) and Qwen3-MoE (routing replay's record), each run through
the real engine on the CPU and its tensors' bytes measured; dense Llama / Qwen2 keep the dense rule's numbers; and
the update's activations of MoE and compiled layers by hand."""
import pytest
import torch
import transformers

from phaserl.memory import budget
from phaserl.memory.budget import ExpertShape, ModelShape
from phaserl.models import CausalLM
from phaserl.models.families import config_from_hf
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams

torch.set_num_threads(1)

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
ALTERNATE = ["sliding_attention", "full_attention"] * 2


def hf_configs():
    """(name, transformers config), built as tests/test_qwen35.py, test_model_families.py and test_moe.py do."""
    configs = [
        ("gemma4-global-k-eq-v", transformers.Gemma4TextConfig(
            **TINY, head_dim=8, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
            hidden_size_per_layer_input=0, sliding_window=3, layer_types=ALTERNATE, final_logit_softcapping=5.0)),
        ("mistral-sliding", transformers.MistralConfig(**TINY, sliding_window=3)),
        ("qwen3-moe", transformers.Qwen3MoeConfig(**{**TINY, "num_hidden_layers": 3}, head_dim=8,
                                                  moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3,
                                                  norm_topk_prob=True, mlp_only_layers=[1])),
        ("llama", transformers.LlamaConfig(**TINY)),
        ("qwen2", transformers.Qwen2Config(**TINY)),
    ]
    if hasattr(transformers, "Qwen3_5TextConfig"):
        configs.insert(0, ("qwen35", transformers.Qwen3_5TextConfig(
            **TINY, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8)))
    return configs


CONFIGS = dict(hf_configs())


def native(name: str) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(config_from_hf(CONFIGS[name].to_dict())).eval()


def allocated(model: CausalLM, *, slots: int, routes: bool) -> tuple[int, int, int, int]:
    """Run the engine on `slots` prompts at once; (slot_len, KV pool bytes, recurrent-state bytes, route bytes)
    of the tensors it holds afterwards (on the CPU the pool is sized to exactly the layout)."""
    engine = RolloutEngine(model, EngineConfig(max_slots=slots, record_routes=routes))
    prompts = [[1 + i, 2, 3, 4, 5] for i in range(slots)]
    engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.0), eos_token_ids=[], pad_token_id=0)
    runner = engine.runner
    state = getattr(runner, "recurrent", None)
    state_bytes = 0 if state is None else sum(t.nbytes for t in (*state.conv, *state.delta))
    route_bytes = 0 if runner.routes is None else runner.routes.nbytes
    return runner.layout[1], engine.pool.allocated_bytes, state_bytes, route_bytes


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_doctors_slot_bytes_equal_what_the_engine_allocates(name):
    model = native(name)
    shape = ModelShape.of(model)
    replay = shape.moe is not None
    S, pool, state, routes = allocated(model, slots=3, routes=replay)
    assert pool == 3 * S * shape.slot.kv_per_token
    assert state == 3 * shape.slot.state_per_slot
    assert routes == (3 * S * shape.slot.routes_per_token if replay else 0)
    assert pool + state + routes == 3 * budget.kv_cache_bytes_per_sequence(shape, S, routes=replay)


def test_qwen35_linear_layers_hold_a_fixed_state_and_no_kv():
    if "qwen35" not in CONFIGS:
        pytest.skip("this transformers has no Qwen3.5")
    shape = ModelShape.of(native("qwen35"))
    # 1 full-attention layer of 4 (every 4th): K and V, 2 kv heads x 16, float32
    assert shape.slot.kv_per_token == 2 * 1 * 2 * 16 * 4
    # 3 linear layers: conv [C = 2*2*8 + 4*8 = 64, K-1 = 3] float32 + DeltaNet state [4, 8, 8] float32
    assert shape.slot.state_per_slot == 3 * (64 * 3 * 4 + 4 * 8 * 8 * 4)
    one, many = (budget.kv_cache_bytes_per_sequence(shape, T) for T in (1, 1001))
    assert many - one == 1000 * shape.slot.kv_per_token  # the state does not grow with the sequence
    dense = 2 * 4 * 2 * 16 * 4 * 1001  # the old rule: every layer's KV
    assert budget.kv_cache_bytes_per_sequence(shape, 1001) < dense / 3


def test_qwen35_layers_are_never_compiled_so_get_no_compiled_discount():
    if "qwen35" not in CONFIGS:
        pytest.skip("this transformers has no Qwen3.5")
    shape = ModelShape.of(native("qwen35"))
    assert shape.hybrid and not ModelShape.of(native("llama")).hybrid
    assert budget.train_bytes_per_token(shape, False, compiled=True) == budget.train_bytes_per_token(shape, False)


def test_gemma4_rows_are_each_layers_own_width_and_k_eq_v_stores_values():
    shape = ModelShape.of(native("gemma4-global-k-eq-v"))
    # 2 sliding layers of 2 kv heads x 8 and 2 global layers of 1 x 32, each row its own width (not every row the
    # global layers' 32: the 40% once unused at the 1B shape); K and V both, float32
    assert shape.slot.kv_per_token == 2 * (2 * 2 * 8 + 2 * 1 * 32) * 4 and shape.slot.state_per_slot == 0
    assert shape.slot.kv_rows == ((2, 16), (2, 32))
    assert shape.head_dim == 8 and shape.num_kv_heads == 2  # what the dense rule read: half of it


def test_mistral_sliding_layers_take_the_whole_slot_not_the_window():
    shape = ModelShape.of(native("mistral-sliding"))
    assert budget.kv_cache_bytes_per_sequence(shape, 100) == 2 * 4 * 2 * 8 * 4 * 100  # window 3 changes nothing


def test_qwen3_moe_routing_replay_records_k_int16_ids_per_moe_layer():
    shape = ModelShape.of(native("qwen3-moe"))
    assert shape.moe == ExpertShape(layers=2, top_k=3, width=16, experts=8, shared_width=0, hidden=32)  # layer 1 dense
    assert shape.slot.routes_per_token == 2 * 3 * 2
    assert (budget.kv_cache_bytes_per_sequence(shape, 10, routes=True)
            - budget.kv_cache_bytes_per_sequence(shape, 10)) == 10 * 12


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_dense_decoders_keep_the_dense_rules_numbers(name):
    shape = ModelShape.of(native(name))
    assert shape.slot.state_per_slot == 0 and shape.moe is None
    by_hand = dict(shape.__dict__, slot=None, dense=None)  # without the engine's and the layers' layout: dense rules
    dense = ModelShape(**by_hand)
    for T in (1, 36, 384):
        assert budget.kv_cache_bytes_per_sequence(shape, T) == budget.kv_cache_bytes_per_sequence(dense, T) \
            == 2 * 4 * 2 * 8 * 4 * T
    assert budget.train_bytes_per_token(dense, False) == 4 * (8 * 32 + 4 * 48 + 2 * 2 * 8) * 4
    # float32 with Hq x D = h: the per-layer count is the dense rule plus each layer's two norm statistics (measured:
    # tests/test_doctor_activations.py)
    assert budget.train_bytes_per_token(shape, False) == budget.train_bytes_per_token(dense, False) + 4 * 2 * 4
    assert budget.kept_engine_bytes(shape, 3, 64, kv_limit=10**9) == budget.kept_engine_bytes(dense, 3, 64)


def test_the_update_counts_top_k_expert_widths_in_moe_layers():
    shape = ModelShape.of(native("qwen3-moe"))
    h, q, kv = 32, 4 * 8, 2 * 8
    # the dense layer (memory/activations.py, float32 bytes): two norms (input, statistic, normed, output), the
    # per-head qk-norms (input, statistic, normed), q, k, v and the attention output, gate, act, up, product
    dense = 2 * (12 * h + 4) + (8 * q + 4 * 4) + (8 * kv + 4 * 2) + 4 * (2 * q + 2 * kv) + 4 * 4 * 48
    # k x expert width; k gathered inputs, outputs and their unsorted copy; float32 router probs, int64 expert ids
    moe = 8 * h + 4 * 3 * 16 + 3 * 3 * h + 2 * 8 + 4 * 3 + 2 * kv
    assert budget.train_bytes_per_token(shape, False) == dense + 2 * moe * 4
    assert budget.train_bytes_per_token(shape, True) == 3 * h * 4 + max(dense, moe * 4)


def test_the_moe_count_is_what_the_expert_mixtures_save_for_backward():
    from phaserl.models import moe

    N, H, inter, E, k = 64, 32, 16, 8, 3
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, H, generator=g, requires_grad=True)
    shapes = ((E, H), (E, 2 * inter, H), (E, H, inter))
    w = moe.MoEWeights(*(torch.randn(*s, generator=g, requires_grad=True) for s in shapes), None)
    shape = ModelShape(num_params=1, num_layers=1, hidden_size=H, intermediate_size=0, num_kv_heads=1, head_dim=2,
                       vocab_size=1, param_bytes=4, moe=ExpertShape(1, k, inter, E, 0, H))
    predicted = budget.train_bytes_per_token(shape, False) // 4 - 8 * H - 2  # the MoE part, in values
    skip = {t.untyped_storage().data_ptr() for t in (x, *w[:3])}
    mixtures = [moe.experts_loop] + ([moe.experts_grouped] if moe.grouped_mm_available() else [])
    for mixture in mixtures:  # measured 513 float32 values per token for both, the count 510
        saved = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in skip:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            ids, weights, _ = moe.route_tokens(x, w.router, moe.MoESpec(E, k, True))
            mixture(x, ids, weights, w)
        values = sum(saved.values()) / N / 4  # float32 values per token
        assert abs(values - predicted) <= 0.02 * predicted, (mixture.__name__, values, predicted)


def test_compiled_layers_save_fewer_activations():
    shape = ModelShape(num_params=1000, num_layers=2, hidden_size=32, intermediate_size=64, num_kv_heads=2,
                       head_dim=8, vocab_size=100, param_bytes=2)
    assert budget.train_bytes_per_token(shape, False) == 2 * (8 * 32 + 4 * 64 + 32) * 2
    assert budget.train_bytes_per_token(shape, False, compiled=True) == 2 * (6 * 32 + 3 * 64 + 32) * 2


def test_a_kept_engine_counts_the_state_and_routes_of_the_slots_its_pool_holds():
    shape = ModelShape.of(native("qwen3-moe"))
    kv_slot = 64 * shape.slot.kv_per_token
    experts = 2 * 8 * 3 * 32 * 16  # 2 MoE layers x 8 experts x (gate, up, down) of 32 x 16: read in place, no copy
    model = native("qwen3-moe")
    assert experts == sum(layer.mlp.experts.gate_up_proj.numel() + layer.mlp.experts.down_proj.numel()
                          for layer in model.model.layers if layer.spec.moe is not None)
    weights = (shape.num_params - experts) * 4
    assert budget.kept_engine_bytes(shape, 4, 64, routes=True) == 4 * 64 * (shape.slot.kv_per_token + 12) + weights
    # a pool capped at 2.5 slots holds 2: their routes, not 4 slots' worth
    capped = budget.kept_engine_bytes(shape, 4, 64, kv_limit=int(2.5 * kv_slot), routes=True)
    assert capped == int(2.5 * kv_slot) + 2 * 64 * 12 + weights


def test_the_doctors_kv_line_shows_the_arithmetic_of_each_layout():
    from phaserl.doctor.memory import PhaseSizes
    from phaserl.doctor.probes import kv_line

    sizes = PhaseSizes(n=2, prompt_tokens=32, sequence_tokens=36, rollout_batch_size=4, prompts_per_rank=4,
                       rm_engine="transformers", rm_batch_size=16, rm_micro_batch_tokens=256, rm_packed=False,
                       rm_max_length=64, responses_per_rank=8, micro_batch_tokens=64, mini_batch_per_rank=8,
                       gradient_checkpointing=False, routing_replay=True)
    line = kv_line(ModelShape.of(native("llama")), sizes)
    assert line == "KV cache     2 × 4 layers × 2 kv heads × 8 head dim × 4 B × 36 tokens = 18.0 KB per sequence"
    line = kv_line(ModelShape.of(native("gemma4-global-k-eq-v")), sizes)
    assert line.startswith("KV cache     2 × (2 layers × 16 + 2 layers × 32) kv heads × head dim × 4 B × 36 tokens = "
                           "27.0 KB per sequence")
    line = kv_line(ModelShape.of(native("qwen3-moe")), sizes)
    assert line.endswith("+ routing replay's expert ids 12 B × 36 tokens = 13.9 KB per sequence")
    if "qwen35" in CONFIGS:
        line = kv_line(ModelShape.of(native("qwen35")), sizes)
        assert ("2 × 1 attention layers × 2 kv heads × 16 head dim × 4 B × 36 tokens + 3 linear-attention layers' "
                "recurrent state 5.2 KB (any length) = 14.2 KB per sequence") in line


def test_the_builders_keep_awake_count_counts_compiled_activations(tmp_path):
    from _tiny_run import make_run_dir
    from phaserl.config import load_config
    from phaserl.config.validate import sequence_tokens
    from phaserl.trainer import RLTrainer
    from phaserl.trainer.settings import Roles
    from phaserl.trainer.speed import UpdateCount

    cfg = load_config(None, make_run_dir(str(tmp_path)) + ["trainer.loggers=[]"])
    t = RLTrainer.from_config(cfg)
    roles = Roles(actor=t.actor, critic=None, ref_policy=t.ref_policy, reward=t.run.reward, tokenizer=t.run.tokenizer)
    eager, compiled = (UpdateCount.of(cfg, roles, free_bytes=10**6, held_bytes=0, compiled=c,
                                                    sequence_tokens=sequence_tokens(cfg))
                       .peak(64, kept=True) for c in (False, True))
    shape = ModelShape.of(t.actor.model)
    per_token = budget.train_bytes_per_token(shape, False) - budget.train_bytes_per_token(shape, False, compiled=True)
    assert eager - compiled == 64 * per_token > 0  # ppo.micro_batch_tokens = 64


def test_the_doctor_sizes_the_update_of_a_compiled_actor_by_the_compiled_count(tmp_path):
    from _tiny_run import make_run_dir
    from phaserl.doctor import load_doctor_config, run_doctor

    overrides = make_run_dir(str(tmp_path))
    per_token = {}
    for asked in ("false", "true"):  # on the CPU auto is off: the eager count
        results = {r.name: r for r in run_doctor(load_doctor_config(None, overrides + [f"actor.compile={asked}"]),
                                                 world_size=1)}
        line = next(d for d in results["memory"].details if d.startswith("ppo.micro_batch_tokens"))
        per_token[asked] = line.split("(")[1].split(" per token")[0]
    # the tiny float32 policy: 2 layers x ((8*32 + 4*64 + 2*2*8) x 4 B + two norm statistics) eager (4368 B),
    # 2 x (6*32 + 3*64 + 32) x 4 B compiled
    assert per_token == {"false": "4.3 KB", "true": "3.2 KB"}


def test_the_doctor_says_what_an_auto_micro_batch_becomes_and_sizes_the_update_with_it(tmp_path):
    from _tiny_run import make_run_dir
    from phaserl.doctor import load_doctor_config, run_doctor

    cfg = load_doctor_config(None, make_run_dir(str(tmp_path)) + ["ppo.micro_batch_tokens=auto"])
    results = {r.name: r for r in run_doctor(cfg, world_size=1)}
    details = results["memory"].details
    assert "ppo.micro_batch_tokens=auto -> 16384: CPU (the fixed default off CUDA)" in details
    line = next(d for d in details if d.startswith("ppo.micro_batch_tokens = "))
    assert line.startswith("ppo.micro_batch_tokens = 16384: uses at most")  # the memory line sizes the chosen value
    assert "micro-batch(es) of auto tokens (auto: decided on the machine" in results["batch sizes"].message + \
        " ".join(results["batch sizes"].details)


def test_a_transformers_gemma4_model_gets_an_estimate_not_a_crash():
    """Regression: transformers refuses `config.head_dim` / `num_key_value_heads` on Gemma 4 (per-layer
    attributes), so the doctor crashed on a Gemma 4 model run through model.implementation=transformers
   . The dense estimate takes the widest layer."""
    config = transformers.Gemma4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        hidden_size_per_layer_input=0, sliding_window=4, max_position_embeddings=64,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    shape = ModelShape.of(transformers.AutoModelForCausalLM.from_config(config))
    assert (shape.num_kv_heads, shape.head_dim) == (1, 32)  # the global layer: 1 x 32 > the sliding 2 x 8
    assert budget.kv_cache_bytes_per_sequence(shape, 10) == 2 * 3 * 1 * 32 * 4 * 10
