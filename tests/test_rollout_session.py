"""DecodeSession: a sequence continues in its slot after appended ids, with its KV kept.

The continued turn must be what a full forward over everything so far gives (greedy tokens and the
sampler's log-probs), while only the appended ids are prefilled; parked sequences wait without
changing, and freed slots take new sequences.
"""
import pytest
import torch

from phaserl.errors import DataError
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams
from tests.test_rollout_engine import PROMPTS, full_logits, greedy_reference, tiny_model

torch.set_num_threads(1)


# Gemma 4's layout: per-layer head shapes (global: 1 kv head of 16, v = k, proportional RoPE), soft-capped logits.
GEMMA4 = dict(head_dim=8, global_head_dim=16, global_kv_heads=1, attention_k_eq_v=True, sliding_window=6,
              layer_types=("sliding_attention", "full_attention"), local_rope_theta=100.0,
              rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.5}, layer_norms="sandwich",
              norm_style="olmo2", v_norm=True, layer_scalar=True, hidden_act="gelu_pytorch_tanh", embed_scale=5.0,
              query_pre_attn_scalar=1.0, final_logit_softcapping=5.0)


def drive(session, plan: dict, caps: dict, waiting=(), prompt=None) -> dict:
    """Run sequences whose appended ids after turn k come from plan[key][k] (None or past the end: release);
    keys in `waiting` start with `prompt[key]` as slots free up."""
    turns, waiting = {key: [] for key in plan}, list(waiting)
    while not session.idle or waiting:
        if waiting and session.free_slots:
            key = waiting.pop(0)
            session.start(key, prompt[key], caps[key])
        for turn in session.step():
            done = turns[turn.key]
            done.append(turn)
            nxt = plan[turn.key][len(done) - 1] if len(done) <= len(plan[turn.key]) else None
            if nxt is not None:
                session.extend(turn.key, nxt, caps[turn.key])
            else:
                session.release(turn.key)
    return turns


def dense_layouts(window: int):
    """parametrize(model_type, extra) over the engine's dense layouts: plain, qk-norm, sliding `window` on every
    other layer, Gemma 4's wider global layers (tiny_model's keyword overrides)."""
    sliding = dict(sliding_window=window, layer_types=("sliding_attention", "full_attention"))
    return pytest.mark.parametrize("model_type, extra", [("qwen2", {}), ("qwen3", {}), ("qwen2", sliding),
                                                         ("gemma4_text", GEMMA4)],
                                   ids=["qwen2", "qwen3", "qwen2-sliding", "gemma4-global-layers"])


@dense_layouts(window=6)
def test_a_continued_turn_equals_the_full_forward_and_prefills_only_the_new_ids(model_type, extra):
    model = tiny_model(model_type, **extra)
    engine = RolloutEngine(model, EngineConfig(max_slots=3))
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    observations = {0: [[30, 31], [32]], 1: [[33, 34, 35], None], 2: [[], [36, 37]], 3: [None]}
    with engine.session(params, slot_len=48, eos_token_ids=[]) as session:
        for key in (0, 1, 2):  # 3 slots; sequence 3 waits for a free one
            session.start(key, PROMPTS[key], cap=5)
        turns = drive(session, observations, {k: 5 for k in observations}, waiting=[3], prompt=PROMPTS)
    for key, obs in observations.items():
        seq = list(PROMPTS[key])
        for k, turn in enumerate(turns[key]):
            assert turn.token_ids == greedy_reference(model, seq, 5)  # what the whole conversation gives
            logits = full_logits(model, seq + turn.token_ids)[len(seq) - 1:-1]
            expected = logits.log_softmax(-1).gather(-1, torch.tensor(turn.token_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(turn.logprobs), expected, atol=1e-5, rtol=0)
            seq += turn.token_ids + (obs[k] or [] if k < len(obs) else [])
        assert len(turns[key]) == next((i for i, o in enumerate(obs) if o is None), len(obs)) + 1
    stats = engine.last_stats
    assert stats["extend_tokens"] == sum(len(o) for obs in observations.values() for o in obs if o)
    assert stats["prefill_tokens"] == sum(len(PROMPTS[k]) for k in observations)  # the conversation is not re-read


def test_resumed_sequences_move_down_into_parked_slots_and_continue_exactly():
    """Sequences resume one at a time while the others stay parked: each resumed one takes the lowest slot
    not decoding (KV exchanged with the parked one there), and every turn is still what the whole
    conversation gives; the decode steps span only the decoding slots."""
    model = tiny_model()
    engine = RolloutEngine(model, EngineConfig(max_slots=4))
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    obs = {0: [20, 21], 1: [22], 2: [23, 24, 25], 3: [26]}
    spans = []
    with engine.session(params, slot_len=40, eos_token_ids=[]) as s:
        real = s.runner.decode
        s.runner.decode = lambda b: (spans.append(b), real(b))
        for key in obs:
            s.start(key, PROMPTS[key], cap=3)
        first = {}
        while len(first) < 4:
            first.update({t.key: t for t in s.step()})
        second = {}
        for key in (3, 1, 2, 0):  # highest slot first: 3 takes slot 0 from the parked 0, then 1 stays, ...
            s.extend(key, obs[key], 3)
            spans.clear()
            while key not in second:
                second.update({t.key: t for t in s.step()})
            if key == 3:
                assert s.live[3].slot == 0 and s.live[0].slot == 3 and set(spans) == {1}  # one slot stepped
        assert s.stats.swaps >= 1
    for key in obs:
        seq = list(PROMPTS[key])
        assert first[key].token_ids == greedy_reference(model, seq, 3)
        seq += first[key].token_ids + obs[key]
        assert second[key].token_ids == greedy_reference(model, seq, 3)
        logits = full_logits(model, seq + second[key].token_ids)[len(seq) - 1:-1]
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(second[key].token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(second[key].logprobs), expected, atol=1e-5, rtol=0)


def test_sequences_move_down_only_when_that_shrinks_the_steps_and_keep_every_token():
    """A long turn left decoding alone in the top slot (the others parked) moves down mid-turn, exchanging KV with a
    parked sequence: the step covers 1 row, not 4, and its tokens are the unmoved greedy ones. Then all four resume
    together: the steps span every slot wherever they sit, so nothing moves, and each continuation (the parked
    sequence that was moved up included) is its whole conversation's."""
    model = tiny_model()
    engine = RolloutEngine(model, EngineConfig(max_slots=4))
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    with engine.session(params, slot_len=64, eos_token_ids=[]) as s:
        for key in range(3):
            s.start(key, PROMPTS[key], cap=2)  # slots 0-2
        s.start("busy", PROMPTS[3], cap=16)   # slot 3: decodes on
        first = {}
        while len(first) < 4:
            first.update({t.key: t for t in s.step()})
        assert s.stats.swaps == 1 and s.live["busy"].slot == 0 and s.live[0].slot == 3
        assert first["busy"].token_ids == greedy_reference(model, list(PROMPTS[3]), 16)
        for key, obs in zip(first, (20, 21, 22, 23)):
            s.extend(key, [obs], cap=3)
        second = {}
        while len(second) < 4:
            second.update({t.key: t for t in s.step()})
        assert s.stats.swaps == 1 and [s.live[k].slot for k in (0, 1, 2, "busy")] == [3, 1, 2, 0]
    for (key, turn), obs in zip(first.items(), (20, 21, 22, 23)):
        prompt = list(PROMPTS[3 if key == "busy" else key])
        assert second[key].token_ids == greedy_reference(model, prompt + turn.token_ids + [obs], 3)


def test_sampled_continuations_report_the_full_forward_logprobs():
    model = tiny_model()
    engine = RolloutEngine(model)
    params = SamplingParams(max_new_tokens=4, temperature=0.8)
    plan = {k: [[25 + k, 26], [27]] for k in range(4)}
    with engine.session(params, slot_len=40, eos_token_ids=[], generator=torch.Generator().manual_seed(1)) as s:
        for key in plan:
            s.start(key, PROMPTS[0], cap=4)  # one shared prompt: one prefill, four different samples
        turns = drive(s, plan, {k: 4 for k in plan})
    for key, obs in plan.items():
        seq = list(PROMPTS[0])
        for k, turn in enumerate(turns[key]):
            logits = full_logits(model, seq + turn.token_ids)[len(seq) - 1:-1] / 0.8
            expected = logits.log_softmax(-1).gather(-1, torch.tensor(turn.token_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(turn.logprobs), expected, atol=1e-5, rtol=0)
            seq += turn.token_ids + (obs[k] if k < len(obs) else [])
    assert len({tuple(tuple(t.token_ids) for t in turns[k]) for k in plan}) > 1


def test_stop_tokens_end_a_turn_and_the_slot_limits_are_checked():
    model = tiny_model()
    stop = greedy_reference(model, PROMPTS[1], 3)[2]
    engine = RolloutEngine(model)
    with engine.session(SamplingParams(max_new_tokens=6, temperature=0.0), slot_len=20, eos_token_ids=[stop]) as s:
        s.start("a", PROMPTS[1], cap=6)
        ended = []
        while not ended:
            ended = s.step()
        assert ended[0].stopped and ended[0].token_ids[-1] == stop and len(ended[0].token_ids) <= 3
        assert s.room("a") == 64 - len(PROMPTS[1]) - len(ended[0].token_ids)  # slots round up to 64
        with pytest.raises(DataError, match="exceed"):
            s.extend("a", [1] * s.room("a"), 1)
        with pytest.raises(DataError, match="vocabulary"):
            s.extend("a", [99], 1)
        s.release("a")
        assert s.idle and s.free_slots == s.num_slots


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_gpu_continued_turns_match_the_trainer_in_bf16_with_graphs(compile):
    """CUDA graphs, Triton decode attention and (optionally) compiled layers; the appended ids go through
    the prefill-at-offset pass. The tolerance is the single-turn engine's (test_rollout_engine)."""
    from phaserl.algo import token_logprobs_from_hidden
    from phaserl.models import CausalLM, DecoderConfig
    from tests.test_rollout_engine import BF16_MAX_TOL, BF16_MEAN_TOL

    torch.manual_seed(0)
    cfg = DecoderConfig(model_type="qwen2", vocab_size=4096, hidden_size=256, intermediate_size=768,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, attention_bias=True,
                        max_position_embeddings=1024)
    model = CausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.1)
    model = model.to("cuda", torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    prompts = {k: torch.randint(0, 4096, (int(n),), generator=g).tolist()
               for k, n in enumerate(torch.randint(8, 64, (24,), generator=g))}
    plan = {k: [torch.randint(0, 4096, (int(n),), generator=g).tolist()
                for n in torch.randint(0, 40, (2,), generator=g)]
            for k in prompts}
    engine = RolloutEngine(model, EngineConfig(compile=compile, token_budget=32768, max_slots=16))
    params = SamplingParams(max_new_tokens=32, temperature=0.8)
    with engine.session(params, slot_len=256, eos_token_ids=[], generator=torch.Generator("cuda").manual_seed(1)) as s:
        turns = drive(s, plan, {k: 32 for k in plan}, waiting=list(prompts), prompt=prompts)  # 24 episodes, 16 slots
    diffs = []
    with torch.no_grad():
        for key, obs in plan.items():
            seq = list(prompts[key])
            for k, turn in enumerate(turns[key]):
                hidden = model(torch.tensor([seq + turn.token_ids], device="cuda"))[0]
                trainer = token_logprobs_from_hidden(hidden[len(seq) - 1:-1], model.output_weight,
                                                     torch.tensor(turn.token_ids, device="cuda"), temperature=0.8)[0]
                diffs.append((trainer.float().cpu() - torch.tensor(turn.logprobs)).abs())
                seq += turn.token_ids + (obs[k] if k < len(obs) else [])
            assert len(turns[key]) == 3
    diffs = torch.cat(diffs)
    print(f"bf16 multi-turn rollout vs trainer (compile={compile}): mean {diffs.mean():.5f}, max {diffs.max():.5f}")
    assert diffs.mean() <= BF16_MEAN_TOL and diffs.max() <= BF16_MAX_TOL


def qwen35_model():
    """A tiny random Qwen3.5 (linear-attention layers: a recurrent state per slot beside the KV)."""
    from transformers import Qwen3_5TextConfig

    from phaserl.models import CausalLM
    from phaserl.models.families import config_from_hf
    from tests.test_qwen35 import TINY, randomize

    torch.manual_seed(0)
    return randomize(CausalLM(config_from_hf(Qwen3_5TextConfig(**TINY).to_dict()))).eval()


@pytest.mark.parametrize("make", [tiny_model, qwen35_model], ids=["qwen2", "qwen3_5"])
def test_a_parked_sequence_moved_up_by_a_resumed_one_keeps_its_kv(make):
    """Regression (found by the keyed-noise schedule tests, 2026-12-02): a resumed sequence moves down into a parked
    one's slot and the two exchange KV; the parked one's new slot kept the resumed one's old decode state
    (finished, at the resumed one's shorter position), and every decode step that spans it wrote that token's KV
    into the parked sequence's context; Qwen3.5's recurrent state did not move at all. Its next turn must still be
    what the whole conversation gives. (The move halves the steps' rows, so the session makes it: _pack's rule.)"""
    model = make()
    engine = RolloutEngine(model, EngineConfig(max_slots=3))
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    long, short = PROMPTS[5] + PROMPTS[1], PROMPTS[2]  # 13 and 1 ids: the short one's position is inside the long one
    with engine.session(params, slot_len=64, eos_token_ids=[]) as s:
        s.start("long", long, cap=2)   # slot 0
        s.start("short", short, cap=2)  # slot 1
        first = {}
        while len(first) < 2:
            first.update({t.key: t for t in s.step()})
        s.extend("short", [20], cap=2)  # moves down into slot 0 at the next step; "long" goes up to slot 1
        ended = {t.key: t for t in s.step()}
        assert s.live["short"].slot == 0 and s.live["long"].slot == 1
        s.start("busy", PROMPTS[0], cap=12)  # slot 2: decodes on, so the steps span slots 0-2
        while "busy" not in ended:  # steps over slot 1 while "long" waits there
            ended.update({t.key: t for t in s.step()})
        s.extend("long", [21], cap=4)
        while "long" not in ended:
            ended.update({t.key: t for t in s.step()})
    seq = long + first["long"].token_ids + [21]
    assert ended["long"].token_ids == greedy_reference(model, seq, 4)
    logits = full_logits(model, seq + ended["long"].token_ids)[len(seq) - 1:-1]
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(ended["long"].token_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(ended["long"].logprobs), expected, atol=1e-5, rtol=0)
