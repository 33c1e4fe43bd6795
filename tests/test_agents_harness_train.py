"""An external harness (agent.harness, examples/agent_harness.py) as the episode source of `phaserl train`:
the config keys and their errors, exact groups, the run's sampling winning over a request's, and an
end-to-end run whose batch holds exactly the ids and log-probs the endpoint sampled."""
import dataclasses
import json
import os

import pytest
import torch

from phaserl.agents.completion import FakeBackend
from phaserl.agents.env import Episode, Segment
from phaserl.config import load_config
from phaserl.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "agent_harness.yaml")
HARNESS = os.path.join(ROOT, "examples", "agent_harness.py")


def _config(tmp_path, *extra):
    return load_config(EXAMPLE, [f"agent.harness={HARNESS}:harness", f"trainer.log_dir={tmp_path / 'logs'}",
                                 f"trainer.checkpoint_path={tmp_path / 'ckpt'}", "trainer.loggers=[jsonl]",
                                 "rollout.prompts_per_step=4", "rollout.batch_size=4", "rollout.n=2",
                                 "data.val_max_prompts=4", "trainer.val_interval=0", *extra])


def test_env_and_harness_together_is_an_error_naming_both_keys(tmp_path):
    from phaserl.config.validate import validate

    with pytest.raises(ConfigError) as err:
        validate(_config(tmp_path, "agent.env=phaserl.world.agent_task:RetryArithmetic"))
    assert "agent.env" in str(err.value) and "agent.harness" in str(err.value) and "exactly one" in str(err.value)


def test_harness_spec_errors_name_the_key_and_what_is_there(tmp_path):
    from phaserl.agents.loader import load_harness_function

    mine = tmp_path / "mine.py"  # not the example: it imports openai, which only the `agents` extra installs
    mine.write_text("def harness(base_url, row):\n    return 0.0\n")
    with pytest.raises(ConfigError, match=r"agent.harness=.*defines no 'nope'.*functions defined there: harness"):
        load_harness_function(f"{mine}:nope")
    with pytest.raises(ConfigError, match=r"agent.harness=.*file .*missing.py not found"):
        load_harness_function(str(tmp_path / "missing.py") + ":harness")
    bad = tmp_path / "bad.py"
    bad.write_text("def harness(base_url):\n    return 0.0\n")
    with pytest.raises(ConfigError, match=r"harness\(base_url, row\)"):
        load_harness_function(f"{bad}:harness")
    assert load_harness_function(f"{mine}:harness").__name__ == "harness"


def test_the_harness_endpoint_gets_the_runs_episode_limits(tmp_path):
    """agent.max_turns and the episode budget reach the harness phase's ChatServer (server tests: the refusal)."""
    pytest.importorskip("openai")
    from phaserl.trainer.agent_phase import harness_settings

    cfg = _config(tmp_path, "agent.max_turns=3", "agent.max_episode_tokens=200")
    h = harness_settings(cfg, model_context=1000)
    assert (h.max_turns, h.max_episode_tokens, h.context_reason) == (3, 200, "max_tokens")
    h = harness_settings(cfg, model_context=150)  # the model's context is the tighter limit
    assert (h.max_episode_tokens, h.context_reason) == (150, "context")


def _item(i):
    from phaserl.data.rows import PromptRow

    row = PromptRow(prompt=f"q{i}", data_source="t", ground_truth="1", extra_info={}, source=f"t:row {i}",
                    index=i, raw={})
    return type("Item", (), {"row": row, "prompt_ids": [10 + i, 11 + i]})()


def test_exact_groups_keeps_the_last_piece_and_fills_a_missing_conversation():
    from phaserl.trainer.harness_phase import exact_groups

    items = [_item(0), _item(0), _item(1), _item(1)]

    def ep(row, ids):
        return Episode(row=row, segments=[Segment("prompt", [1, 2]), Segment("model", ids, [-0.5] * len(ids))],
                       turn_rewards=[1.0], num_turns=1)

    first, last = ep(items[2].row, [3]), ep(items[2].row, [4, 5])
    out = exact_groups([[ep(items[0].row, [7])], [], [first, last], [ep(items[3].row, [8])]], items)
    assert len(out) == 4 and out[2] is last
    assert [e.metrics["harness_dropped_pieces"] for e in out] == [0.0, 0.0, 1.0, 0.0]
    missing = out[1]
    assert missing.finish_reason == "env_error" and missing.reward == 0.0 and missing.metrics["harness_missing"] == 1.0
    assert missing.prompt_ids == [10, 11] and missing.response_ids() == [] and missing.row is items[1].row


def test_the_runs_sampling_wins_over_the_requests():
    from transformers import AutoTokenizer

    from phaserl.agents.server import ChatServer
    from phaserl.world import prepare_tiny_world

    tok = AutoTokenizer.from_pretrained(prepare_tiny_world().tokenizer_dir)
    backend = FakeBackend(lambda ids: tok("7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                          eos_token_ids=(tok.eos_token_id,))
    server = ChatServer(backend, tok, sampling=(0.7, 0.9, 5), default_max_tokens=3)
    server.chat({"messages": [{"role": "user", "content": "1+1="}], "temperature": 1.5, "top_p": 0.2})
    server.chat({"messages": [{"role": "user", "content": "1+2="}]})
    assert [(r.temperature, r.top_p, r.top_k, r.max_tokens) for r in backend.requests] == [(0.7, 0.9, 5, 3)] * 2
    free = FakeBackend(backend.reply, eos_token_ids=(tok.eos_token_id,))
    ChatServer(free, tok).chat({"messages": [{"role": "user", "content": "1+1="}], "temperature": 1.5})
    assert (free.requests[0].temperature, free.requests[0].top_k) == (1.5, 0)  # no run settings: the request's


@pytest.mark.slow  # two trainer steps, then a resumed third (about 15 s on 2 cores)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_train_with_the_example_harness_trains_on_the_recorded_ids_and_resumes(tmp_path, monkeypatch, device):
    pytest.importorskip("openai", reason="the example harness drives the endpoint through the openai client "
                                         "(the `agents` extra)")
    from phaserl.agents import completion
    from phaserl.trainer import RLTrainer, harness_phase

    recorded = []  # (prompt ids, Completion) of every request the endpoint served

    class RecordingBackend(completion.GenerateBackend):
        def complete(self, request):
            out = super().complete(request)
            recorded.append((list(request.prompt_ids), out))
            return out
    monkeypatch.setattr(harness_phase, "GenerateBackend", RecordingBackend)

    torch.manual_seed(0)
    trainer = RLTrainer.from_config(_config(tmp_path, "trainer.total_steps=2", "trainer.save_interval=1",
                                            f"trainer.device={device}"))
    batches, phase = [], trainer.run.rollout_phase

    def keeping(tr, items, params, n):
        batch = phase(tr, items, params, n)
        if params is tr.run.sampling:
            batches.append(batch)
        return batch
    trainer.run = dataclasses.replace(trainer.run, rollout_phase=keeping)
    trainer.fit()

    assert len(batches) == 2
    # Several requests can record the same prompt + completion ids (n = 2 samples of a tiny model agree often), each
    # with its own log-probs: batch composition moves the last digits. A row must match one of them exactly.
    completions: dict = {}
    for p, c in recorded:
        completions.setdefault(tuple(p + c.token_ids), []).append((len(p), c.logprobs))
    two_turn = 0  # rows whose response holds an observation between two sampled turns
    for batch in batches:
        assert batch.group_ids.tolist() == sorted(batch.group_ids.tolist()) and len(batch.rows) == 8
        # n = 2 rows per prompt, in order
        assert [r.index for r in batch.rows][::2] == [r.index for r in batch.rows][1::2]
        P = batch.prompt_width
        for i in range(len(batch.rows)):
            ids = batch.input_ids[i][batch.attention_mask[i].bool()].tolist()  # prompt + response, unpadded
            start = int(batch.attention_mask[i, :P].sum())                    # the prompt's length
            R = len(ids) - start
            want_mask = [0] * R
            got_lp = batch.rollout_logprobs[i, :R].cpu()
            assert tuple(ids) in completions, "the trained sequence is not a recorded prompt + completion"
            for end in range(len(ids) + 1):  # every recorded completion inside this sequence
                hits = completions.get(tuple(ids[:end]), [])
                for p_len, _ in hits:
                    want_mask[p_len - start:end - start] = [1] * (end - p_len)
                if hits:
                    assert any(torch.allclose(got_lp[pl - start:end - start], torch.tensor(lps)) for pl, lps in hits), \
                        "a turn's rollout log-probs are not the ones its completion recorded"
            assert batch.loss_mask[i, :R].tolist() == want_mask and batch.loss_mask[i, R:].sum() == 0
            assert (got_lp[torch.tensor(want_mask) == 0] == 0).all()  # observation tokens carry no log-prob
            two_turn += 0 in want_mask[want_mask.index(1):len(want_mask) - want_mask[::-1].index(1)]
    assert two_turn > 0, "no episode had a second turn: the observation mask went untested"
    lines = [json.loads(line) for line in open(tmp_path / "logs" / "metrics.jsonl")]
    lines = [line for line in lines if "train/reward_mean" in line]  # (step 0: validation before training)
    assert [line["step"] for line in lines] == [1, 2]
    for key in ("agent/requests_mean", "agent/turns_mean", "agent/harness_missing_mean", "agent/prefix_mismatches_mean",
                "agent/observation_tokens_mean", "train/reward_mean"):
        assert all(key in line for line in lines), key
    assert lines[-1]["agent/requests_mean"] >= 1 and lines[-1]["agent/harness_missing_mean"] == 0.0

    resumed = RLTrainer.from_config(_config(tmp_path, "trainer.total_steps=3", "trainer.save_interval=1",
                                            f"trainer.device={device}"))
    resumed.fit()
    assert resumed.step_num == 3 and os.path.basename(str(resumed.last_checkpoint)) == "step_3"
    lines = [json.loads(line) for line in open(tmp_path / "logs" / "metrics.jsonl")]
    lines = [line for line in lines if "train/reward_mean" in line]
    assert [line["step"] for line in lines] == [1, 2, 3] and "agent/requests_mean" in lines[-1]


def _doctor_line(tmp_path, harness: str):
    from phaserl.doctor import load_doctor_config, run_doctor

    cfg = load_doctor_config(EXAMPLE, [f"agent.harness={harness}", f"trainer.log_dir={tmp_path / 'logs'}",
                                       f"trainer.checkpoint_path={tmp_path / 'ckpt'}"])
    return next(r for r in run_doctor(cfg) if r.name == "agent episode")


@pytest.mark.slow  # the whole doctor (about 5 s)
def test_the_doctor_runs_one_harness_conversation(tmp_path):
    pytest.importorskip("openai", reason="the example harness uses the openai client (the `agents` extra)")
    from phaserl.doctor.report import FAIL, OK

    line = _doctor_line(tmp_path, f"{HARNESS}:harness")
    assert line.status == OK and "request(s)" in line.message and "model turn(s) recorded" in line.message
    assert "the loss sees" in line.details[0]
    broken = tmp_path / "broken.py"
    broken.write_text("def harness(base_url, row):\n    raise RuntimeError('no such tool')\n")
    line = _doctor_line(tmp_path, f"{broken}:harness")
    assert line.status == FAIL and "no such tool" in line.message
