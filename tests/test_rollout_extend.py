"""The static-shape extend pass (rollout/extend.py) against the eager one (ModelRunner._extend_pass).

From the same slot state, one pass over ragged items (different lengths, starts, non-contiguous slots, padded
to a rows bucket and a tokens bucket, the whole slot as context) must give what the eager pass gives: the
sampled tokens and log-probs, the KV at every position before each row's end, every other slot untouched, the
same slot state, the same MoE routes. Then whole sessions with extend_graphs on and off give the same turns,
and on a GPU the same with the graphs captured and replayed.
"""
import pytest
import torch
import transformers

from phaserl.config.auto import extend_graphs_rule
from phaserl.models import CausalLM
from phaserl.models.families import config_from_hf
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams
from phaserl.rollout import runner as runner_module
from phaserl.rollout.extend import StaticExtend, context_bucket, rows_bucket, tokens_bucket
from tests.test_moe_replay import tiny_moe
from tests.test_rollout_engine import PROMPTS, tiny_model
from tests.test_rollout_session import GEMMA4, dense_layouts, drive

torch.set_num_threads(1)

SLOTS, SLOT_LEN = 6, 64
# (slot, appended ids, start, cap): 3 rows -> a rows bucket of 4 (one padding row), longest 9 -> 16 tokens
ITEMS = [(4, [7, 8, 9], 5, 4), (0, [1, 2, 3, 4, 5, 6, 7, 8, 9], 2, 5), (2, [11], 1, 3)]
STATE = ("tokens", "pos", "n_gen", "max_new", "finished", "out_tokens", "out_logprobs")


def prefilled_runner(model, params, record_routes=False):
    """A runner whose SLOTS slots hold PROMPTS (prefilled), ready for an extend pass at ITEMS' starts."""
    engine = RolloutEngine(model, EngineConfig(max_slots=SLOTS, record_routes=record_routes))
    runner = engine.runner
    runner.begin(SLOTS, SLOT_LEN, 8, params, [])
    runner.prefill([(tuple(p), [s], [8], [s]) for s, p in enumerate(PROMPTS[:SLOTS])])
    return engine, runner


def snapshot(runner) -> dict:
    out = {name: getattr(runner.state, name).clone() for name in STATE}
    out["kv"] = [t.clone() for t in (*runner.keys, *runner.values)]  # [slots, Hkv, S, D] each (per layer: Gemma 4)
    if runner.routes is not None:
        out["routes"] = runner.routes.clone()
    recurrent = getattr(runner, "recurrent", None)  # Qwen3.5's HybridRunner: conv and DeltaNet state per slot
    if recurrent is not None:
        out["recurrent"] = [t.clone() for t in (*recurrent.conv, *recurrent.delta)]  # [slots, ...] each
    return out


def restore(runner, saved: dict) -> None:
    for name in STATE:
        getattr(runner.state, name).copy_(saved[name])
    for t, kept in zip((*runner.keys, *runner.values), saved["kv"]):
        t.copy_(kept)
    if runner.routes is not None:
        runner.routes.copy_(saved["routes"])
    if "recurrent" in saved:
        for t, kept in zip((*runner.recurrent.conv, *runner.recurrent.delta), saved["recurrent"]):
            t.copy_(kept)


def assert_same_pass(eager: dict, static: dict, runner, atol: float) -> None:
    """Everything a later step can read is equal: state, and KV / routes before each extended row's end."""
    torch.testing.assert_close(static["out_logprobs"], eager["out_logprobs"], atol=atol, rtol=0)
    for name in STATE:
        if name != "out_logprobs":
            assert torch.equal(static[name], eager[name]), name
    extended = {slot: start + len(ids) for slot, ids, start, _ in ITEMS}
    for slot in range(SLOTS):
        end = extended.get(slot, SLOT_LEN)  # a slot not extended: all of it, bitwise
        if slot in extended:
            for s, e in zip(static["kv"], eager["kv"]):
                torch.testing.assert_close(s[slot, :, :end], e[slot, :, :end], atol=atol, rtol=0)
        else:
            assert all(torch.equal(s[slot], e[slot]) for s, e in zip(static["kv"], eager["kv"])), slot
        if "routes" in eager:
            assert torch.equal(static["routes"][slot, :end], eager["routes"][slot, :end]), slot
        for s, e in zip(static.get("recurrent", ()), eager.get("recurrent", ())):  # the state after the row's end
            torch.testing.assert_close(s[slot], e[slot], atol=atol, rtol=0)


def compare_passes(model, params, record_routes=False, seed=0):
    engine, runner = prefilled_runner(model, params, record_routes)
    with torch.inference_mode():
        before = snapshot(runner)
        torch.manual_seed(seed)
        runner._extend_pass(ITEMS)
        eager = snapshot(runner)
        restore(runner, before)
        torch.manual_seed(seed)
        StaticExtend(runner).run(ITEMS)
        static = snapshot(runner)
    assert not torch.equal(eager["kv"][0], before["kv"][0]) and not torch.equal(eager["tokens"], before["tokens"])
    return eager, static, runner


@dense_layouts(window=4)
def test_the_static_pass_gives_what_the_eager_pass_gives_for_ragged_items(model_type, extra):
    eager, static, runner = compare_passes(tiny_model(model_type, **extra), SamplingParams(max_new_tokens=8,
                                                                                           temperature=0.0))
    assert_same_pass(eager, static, runner, atol=1e-5)


def tiny_qwen35() -> CausalLM:
    config = getattr(transformers, "Qwen3_5TextConfig", None)
    if config is None:
        pytest.skip("this transformers has no Qwen3.5")
    torch.manual_seed(0)
    model = CausalLM(config_from_hf(config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                           linear_value_head_dim=8).to_dict()))
    with torch.no_grad():  # far from init (decays, conv taps): a state that leaked or was lost would show
        for name, p in model.named_parameters():
            p.add_(0.1 * torch.randn(p.shape))
    return model.eval()


def test_the_static_pass_gives_what_the_eager_pass_gives_for_qwen35():
    """The hybrid runner through the static pass: a linear layer's padding row (length 0) keeps its slot's old
    state, and its duplicate write used to race the real row's new one; every row now takes its source row's."""
    eager, static, runner = compare_passes(tiny_qwen35(), SamplingParams(max_new_tokens=8, temperature=0.0))
    assert "recurrent" in eager
    assert_same_pass(eager, static, runner, atol=1e-5)


def test_the_static_pass_samples_the_same_tokens_with_the_same_noise():
    """Sampled (T = 0.8): the padding rows' noise comes after the real rows' (the CPU sampler draws [R, V] in
    order), so the real rows draw the same tokens as in the eager pass."""
    eager, static, runner = compare_passes(tiny_model(), SamplingParams(max_new_tokens=8, temperature=0.8), seed=3)
    assert_same_pass(eager, static, runner, atol=1e-5)


def test_moe_routes_of_the_static_pass_equal_the_eager_pass():
    eager, static, runner = compare_passes(tiny_moe(), SamplingParams(max_new_tokens=8, temperature=0.0),
                                           record_routes=True)
    assert "routes" in eager and (eager["routes"] >= 0).any()
    assert_same_pass(eager, static, runner, atol=1e-5)


class CaptureGuard(torch.utils._python_dispatch.TorchDispatchMode):
    """What a CUDA graph capture refuses, seen on the CPU: a host scalar written by index (`t[idx] = 1` copies a
    0-dim host tensor to the device), a host value read back (`.item()`, `.tolist()`) or a shape that depends on
    the data (`nonzero`, boolean-mask indexing). The CPU cannot capture, so this is the CPU's check. (A 0-dim host
    tensor as an operand of arithmetic is fine: a scalar argument of the kernel, layers.embed's Gemma scale.)"""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("index_put_", "index_put", "_index_put_impl_"):
            values = args[2] if len(args) > 2 else kwargs["values"]
            assert values.dim() > 0, f"{func}: a host scalar written by index (use index_fill_ or a device tensor)"
        assert name not in ("_local_scalar_dense", "nonzero", "masked_select"), f"{func}: not capturable"
        return func(*args, **kwargs)


@pytest.mark.parametrize("model", ["qwen2", "gemma4", "qwen35", "moe"])
def test_the_static_pass_does_nothing_a_cuda_graph_capture_refuses(model):
    """The graphed extend pass on the GPU once failed at its first capture (`n_gen[slots] = 1` in SlotState.start):
    the forward the graph captures, run on the CPU under CaptureGuard, for every runner that takes it."""
    model = dict(qwen2=tiny_model, gemma4=lambda: tiny_model("gemma4_text", **GEMMA4), qwen35=tiny_qwen35,
                 moe=tiny_moe)[model]()
    engine, runner = prefilled_runner(model, SamplingParams(max_new_tokens=8, temperature=0.8),
                                      record_routes=hasattr(model.model.layers[0].mlp, "experts"))
    static = StaticExtend(runner)
    (num_slots, S, _) = runner.layout
    R, T = rows_bucket(len(ITEMS), num_slots), tokens_bucket(9, S)
    buffer = static.pack(ITEMS, R, T, S)
    with torch.inference_mode(), CaptureGuard():
        static.forward(buffer, R, T, 32)


def fake_graphs(runner, monkeypatch) -> tuple[list, list]:
    """The CPU cannot capture: `_capture` runs the step (its eager run is the pass, as in ModelRunner._capture)
    and stores it as the graph, whose replay runs it again. -> (captured keys, replays), filled as they happen."""
    captured, replays = [], []

    class Recorded:
        def __init__(self, step):
            self.step = step

        def replay(self):
            replays.append(1)
            self.step()

    def capture(key, step):
        captured.append(key)
        step()
        runner.graphs[key] = Recorded(step)

    monkeypatch.setattr(runner, "use_graphs", True)
    monkeypatch.setattr(runner, "_capture", capture)
    return captured, replays


def test_a_bucket_is_captured_at_its_second_pass_and_replayed_after(monkeypatch):
    """CAPTURE_AT = 2: a bucket's first pass runs eagerly (no capture), its second is captured, the third replays;
    each gives the eager pass's result."""
    from phaserl.rollout import extend

    engine, runner = prefilled_runner(tiny_model(), SamplingParams(max_new_tokens=8, temperature=0.0))
    captured, replays = fake_graphs(runner, monkeypatch)
    static = StaticExtend(runner)
    with torch.inference_mode():
        before = snapshot(runner)
        runner._extend_pass(ITEMS)
        eager = snapshot(runner)
        for n in range(3):
            restore(runner, before)
            static.run(ITEMS)
            assert (len(captured), len(replays)) == [(0, 0), (1, 0), (1, 1)][n]
            assert_same_pass(eager, snapshot(runner), runner, atol=1e-5)
    assert extend.CAPTURE_AT == 2 and list(static.seen.values()) == [3]


def test_buckets_and_chunks_keep_the_padded_pass_within_prefill_tokens():
    assert [tokens_bucket(n, 512) for n in (1, 8, 9, 33, 64, 65, 97, 129, 200, 300)] == [8, 8, 16, 64, 64, 128, 128,
                                                                                          256, 256, 512]
    assert tokens_bucket(100, 96) == 96  # never past the slot
    assert [rows_bucket(n, 300) for n in (1, 3, 5, 57, 64, 65, 97, 300)] == [2, 4, 8, 64, 64, 128, 128, 300]
    assert [context_bucket(end, 1000) for end in (1, 64, 65, 224, 320, 416, 999)] == [64, 64, 128, 256, 512, 512, 1000]
    model = tiny_model()
    engine = RolloutEngine(model, EngineConfig(max_slots=8, prefill_tokens=32))
    engine.runner.begin(8, SLOT_LEN, 8, SamplingParams(max_new_tokens=8, temperature=0.0), [])
    static = StaticExtend(engine.runner)
    shapes = []
    static.run = lambda items: shapes.append((len(items), max(len(t) for _, t, _, _ in items)))
    static.extend([(s, [1] * n, 1, 2) for s, n in enumerate([3, 5, 2, 9, 1, 20])])
    # every item in exactly one pass; each padded pass within 32 tokens unless one item alone is larger
    assert sum(n for n, _ in shapes) == 6 and len(shapes) > 1
    for rows, longest in shapes:
        assert rows == 1 or rows_bucket(rows, 8) * tokens_bucket(longest, SLOT_LEN) <= 32


@pytest.mark.parametrize("model_type, extra", [("qwen2", {}), ("gemma4_text", GEMMA4), ("qwen3_5_text", None)],
                         ids=["qwen2", "gemma4-global-layers", "qwen35-hybrid"])
def test_sessions_with_extend_graphs_give_the_same_turns(model_type, extra):
    """Several turns, more sequences than slots (refill), the static pass on the CPU (eager): the same greedy
    turns and log-probs as the eager extend pass."""
    model = tiny_qwen35() if model_type == "qwen3_5_text" else tiny_model(model_type, **extra)
    plan = {0: [[30, 31], [32]], 1: [[33, 34, 35], None], 2: [[], [36, 37]], 3: [[38] * 9, [1]], 4: [None]}
    results = []
    for extend_graphs in (False, True):
        engine = RolloutEngine(model, EngineConfig(max_slots=3, extend_graphs=extend_graphs))
        assert (engine.runner.extender is not None) == extend_graphs
        with engine.session(SamplingParams(max_new_tokens=5, temperature=0.0), slot_len=48, eos_token_ids=[]) as s:
            for key in (0, 1, 2):
                s.start(key, PROMPTS[key], cap=5)
            results.append(drive(s, plan, {k: 5 for k in plan}, waiting=[3, 4], prompt=PROMPTS))
        if extend_graphs:
            assert engine.runner.extender.passes >= 3
    eager, static = results
    for key in plan:
        assert [t.token_ids for t in static[key]] == [t.token_ids for t in eager[key]]
        for a, b in zip(static[key], eager[key]):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_two_like_sessions_capture_every_bucket_and_a_third_only_replays(monkeypatch):
    """What the GPU test checks, with fake graphs (the decode steps stay eager): the same sessions three times on
    one engine; after two, every bucket met is captured; the third captures nothing; the turns never change."""
    model = tiny_model()
    plan = {0: [[30, 31], [32]], 1: [[33, 34, 35], None], 2: [[], [36, 37]], 3: [[38] * 9, [1]], 4: [None]}
    engine = RolloutEngine(model, EngineConfig(max_slots=3, extend_graphs=True))
    captured, replays = fake_graphs(engine.runner, monkeypatch)  # decode steps get fake graphs too

    def session():
        with engine.session(SamplingParams(max_new_tokens=5, temperature=0.0), slot_len=48, eos_token_ids=[]) as s:
            for key in (0, 1, 2):
                s.start(key, PROMPTS[key], cap=5)
            return drive(s, plan, {k: 5 for k in plan}, waiting=[3, 4], prompt=PROMPTS)

    first, second = session(), session()
    keys = {k for k in engine.runner.graphs if k[0] == "extend"}
    extend_captures = [k for k in captured if k[0] == "extend"]
    assert keys and keys == set(engine.runner.extender.seen) and sorted(extend_captures) == sorted(keys)
    before = len(replays)
    third = session()
    assert [k for k in captured if k[0] == "extend"] == extend_captures and len(replays) > before
    for key in plan:
        assert [t.token_ids for t in second[key]] == [t.token_ids for t in first[key]]
        assert [t.token_ids for t in third[key]] == [t.token_ids for t in first[key]]


def test_a_moe_session_records_the_same_routes_with_extend_graphs():
    """Routing replay over a multi-turn session (DecodeSession.routes of each parked sequence, read before its
    release): the static passes record what the eager passes record, at every position the slot holds."""
    model = tiny_moe()
    plan = {0: [[30, 31, 32]], 1: [[33] * 9], 2: [[34]]}
    recorded = []
    for extend_graphs in (False, True):
        engine = RolloutEngine(model, EngineConfig(max_slots=4, record_routes=True, extend_graphs=extend_graphs))
        routes, turns = {}, {key: 0 for key in plan}
        with engine.session(SamplingParams(max_new_tokens=4, temperature=0.0), slot_len=48, eos_token_ids=[]) as s:
            for key in plan:
                s.start(key, PROMPTS[key], cap=4)
            while not s.idle:
                for turn in s.step():
                    turns[turn.key] += 1
                    if turns[turn.key] <= len(plan[turn.key]):
                        s.extend(turn.key, plan[turn.key][turns[turn.key] - 1], 4)
                    else:
                        routes[turn.key] = s.routes(turn.key)
                        s.release(turn.key)
        recorded.append(routes)
    eager, static = recorded
    for key in plan:
        assert (eager[key][:-1] >= 0).all() and torch.equal(static[key], eager[key]), key


def test_extend_graphs_stay_off_by_default_and_the_hybrid_runner_takes_them_when_asked():
    assert RolloutEngine(tiny_model(), EngineConfig()).runner.extender is None  # auto: off, as the rule says
    for facts in (dict(device_type="cuda", cuda_graphs=True), dict(device_type="cpu", cuda_graphs=True),
                  dict(device_type="cuda", cuda_graphs=False)):
        on, why = extend_graphs_rule(engine_runs=True, **facts)
        assert not on and why
    assert "0.90-1.11x of the eager passes on the H200" in extend_graphs_rule(engine_runs=True, device_type="cuda", cuda_graphs=True)[1]
    assert RolloutEngine(tiny_qwen35(), EngineConfig(extend_graphs=True)).runner.extender is not None


@pytest.mark.gpu
@pytest.mark.parametrize("compile, window", [(False, None), (True, None), (False, 16), (False, "qwen35")],
                         ids=["eager-layers", "compiled-layers", "sliding", "qwen35-hybrid"])
def test_gpu_greedy_multi_turn_with_extend_graphs_equals_without(compile, window):
    """float32 on CUDA, decode graphs on (the layer functions compiled; sliding layers), several turns with
    refill: extend graphs captured once per bucket (at its second pass) give the eager extend pass's tokens exactly
    and its log-probs closely, and a third session on the same engine replays them (no new capture) with the same
    turns."""
    from phaserl.models import DecoderConfig

    torch.manual_seed(0)
    if window == "qwen35":  # the hybrid runner: its recurrent state per slot through the captured pass
        config = getattr(transformers, "Qwen3_5TextConfig", None)
        if config is None:
            pytest.skip("this transformers has no Qwen3.5")
        cfg = config_from_hf(config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                    linear_value_head_dim=16, max_position_embeddings=1024,
                                    tie_word_embeddings=False).to_dict())
    else:
        sliding = {} if window is None else dict(sliding_window=window, layer_types=("sliding_attention",
                                                                                      "full_attention") * 2)
        cfg = DecoderConfig(model_type="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                            max_position_embeddings=1024, **sliding)
    model = CausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.3)
    model = model.to("cuda").eval()
    g = torch.Generator().manual_seed(0)
    prompts = {k: torch.randint(0, 512, (int(n),), generator=g).tolist()
               for k, n in enumerate(torch.randint(4, 40, (20,), generator=g))}
    plan = {k: [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in torch.randint(0, 30, (3,), generator=g)]
            for k in prompts}

    def session(engine):
        with engine.session(SamplingParams(max_new_tokens=12, temperature=0.0), slot_len=256, eos_token_ids=[]) as s:
            return drive(s, plan, {k: 12 for k in plan}, waiting=list(prompts), prompt=prompts)

    eager = session(RolloutEngine(model, EngineConfig(token_budget=16384, max_slots=8, compile=compile)))
    engine = RolloutEngine(model, EngineConfig(token_budget=16384, max_slots=8, compile=compile, extend_graphs=True))
    graphed = session(engine)  # a bucket's first pass runs the static pass eagerly, its second is captured
    second = session(engine)  # the same passes again: every bucket of the first session is captured by its end
    captured = {k for k in engine.runner.graphs if k[0] == "extend"}
    assert captured == set(engine.runner.extender.seen)
    again = session(engine)
    assert {k for k in engine.runner.graphs if k[0] == "extend"} == captured  # replayed only
    for key in plan:
        assert len(graphed[key]) == 4
        assert [t.token_ids for t in graphed[key]] == [t.token_ids for t in eager[key]]
        assert [t.token_ids for t in second[key]] == [t.token_ids for t in graphed[key]]
        assert [t.token_ids for t in again[key]] == [t.token_ids for t in graphed[key]]
        for a, b in zip(graphed[key], eager[key]):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=2e-4, rtol=0)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_a_padding_token_past_the_context_of_a_sliding_layer_writes_no_nan(static, monkeypatch):
    """Regression (found 2026-12-01): a short row starting past a long row's end has padding tokens past the
    eager pass's context; in a sliding layer their window held no key, softmax gave NaN, the next layer wrote
    NaN KV past the row's end, and the row's next decode step read it (0 * NaN): NaN log-probs, token 0."""
    model = tiny_model("qwen2", sliding_window=4, layer_types=("sliding_attention", "full_attention"),
                       max_position_embeddings=128)
    runner = RolloutEngine(model, EngineConfig(max_slots=4)).runner
    runner.begin(4, 128, 8, SamplingParams(max_new_tokens=8, temperature=0.0), [])
    runner.prefill([((1, 2), [0], [8], [0]), (tuple(i % 39 + 1 for i in range(40)), [1], [8], [1]), ((3,), [2], [8], [2])])
    # row 1's padding tokens: positions 41..69; the static pass's padding row (3 rows -> 4) sits at 127, past its
    # context bucket of 64 keys
    items = [(0, [i % 39 + 1 for i in range(30)], 2, 4), (1, [5], 40, 4), (2, [6, 7], 1, 4)]
    attend, blind = runner_module.extend_attention, []
    monkeypatch.setattr(runner_module, "EXTEND_KERNEL", False)  # this checks the torch path's mask (the kernel's
    # padding tokens: tests/test_rollout_extend_kernel.py)

    def checked(q, keys, values, hidden, scale):  # a query that sees no key: NaN (on a GPU, whichever write wins)
        blind.append(int(hidden.all(-1).sum()))
        return attend(q, keys, values, hidden, scale)
    monkeypatch.setattr(runner_module, "extend_attention", checked)
    with torch.inference_mode():
        (StaticExtend(runner).run if static else runner._extend_pass)(items)
        for _ in range(3):
            runner.decode(4)
    assert blind == [0, 0]  # per layer
    assert not any(torch.isnan(t).any() for t in (*runner.keys, *runner.values))
    assert torch.isfinite(runner.state.out_logprobs[:, :4]).all()
