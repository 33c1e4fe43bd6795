"""benchmarks/async_learning.py --tail (tail_learning.py): the long-tail arithmetic world's learning runs.

The tail variant keeps the world's held-out validation (EOS ends the answer, the world's 4-token cap, no drawn
lengths), scores a training response by its text before the first EOS only, and reports per run the held-out
series with its training clocks and the time to reach the synchronous final score."""
import contextlib
import io
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["rollout.prompts_per_step=4", "rollout.batch_size=4", "rollout.n=4", "data.val_max_prompts=16"]


def _bench(name):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def test_rewards_read_the_answer_before_the_first_eos_only():
    from phaserl.trainer import rollout_phase, stream
    from phaserl.world import build_tokenizer

    tail_learning = _bench("tail_learning")
    tok = build_tokenizer()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = [tok.convert_tokens_to_ids(c) for c in "68"] + [eos] + [tok.convert_tokens_to_ids(c) for c in "12"]
    decode = rollout_phase.decode_responses
    assert decode(tok, [ids]) == ["6812"]  # what tiny_exact would read with EOS ignored: a wrong answer
    with tail_learning.answers_before_eos([eos]):
        assert rollout_phase.decode_responses(tok, [ids, ids[:2]]) == ["68", "68"]
        assert stream.decode_responses(tok, [ids]) == ["68"]
    assert rollout_phase.decode_responses is decode and stream.decode_responses is decode


def test_the_tail_runs_validation_as_the_plain_world_does(tmp_path):
    """ignore_eos and the drawn caps are off while validating: the step-0 held-out score and response lengths equal
    the plain quickstart world's (with EOS ignored the answers would run on to the cap and score 0)."""
    from phaserl.cli import QUICKSTART_CONFIGS
    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer

    tail_learning = _bench("tail_learning")
    trainer, answer = tail_learning.build(0, 0, 24, 1, 1, TINY, str(tmp_path / "tail"))
    with trainer.actor.rollout_mode():
        trainer.actor._ensure_engine()
    tail = tail_learning.AnswerThenTail(trainer, answer=answer, longest=24, seed=0)
    tail.on()
    series = []
    tail_learning.plain_validation(trainer, tail, answer, tail_learning.TrainClock(), series)
    with tail_learning.answers_before_eos(trainer.run.eos_token_ids):
        got = trainer.validate()
    plain = RLTrainer.from_config(load_config(QUICKSTART_CONFIGS["arith"], [
        *TINY, f"trainer.log_dir={tmp_path}/plain", f"trainer.checkpoint_path={tmp_path}/plain_ckpt"])).validate()
    assert got["val/score_mean"] == plain["val/score_mean"] > 0
    assert got["val/response_length_mean"] == plain["val/response_length_mean"] <= answer
    assert tail.lengths == [] and series == [dict(step=0, wall_s=0.0, cpu_s=0.0, val=round(got["val/score_mean"], 4))]
    assert trainer.run.ignore_eos and trainer.actor.engine.generate is not tail.generate  # the tail is back on


@pytest.mark.slow
def test_the_tail_mode_reports_each_run_and_a_summary_per_bound():
    async_learning = _bench("async_learning")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        async_learning.main(["--tail", "12", "--seeds", "0", "--ks", "1", "0", "--steps", "3", "--val-interval", "1",
                             *[arg for item in TINY for arg in ("--set", item)]])
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    runs = [m for m in lines if m["measure"] == "tail_run"]
    assert [r["max_staleness"] for r in runs] == [0, 1]  # the synchronous run first: the others are timed against it
    for r in runs:
        assert [p["step"] for p in r["series"]] == [0, 1, 2, 3]
        walls = [p["wall_s"] for p in r["series"]]
        assert walls == sorted(walls) and r["train_wall_s"] == walls[-1] > 0
        assert r["val_final"] == r["series"][-1]["val"]
        assert r["per_step"]["decode_steps"] >= 1 and r["tail_mean_length"] > 4  # the answer's room and a tail
    sync, k1 = runs
    assert sync["reach_sync_wall_s"] is not None and sync["reach_sync_wall_s"] <= sync["train_wall_s"]
    assert k1["per_step"]["staleness"] > 0 and sync["per_step"]["staleness"] == 0
    summaries = {m["max_staleness"]: m for m in lines if m["measure"] == "tail_summary"}
    assert set(summaries) == {0, 1} and summaries[0]["reached"] == 1


def test_the_tail_mode_needs_the_synchronous_run():
    with pytest.raises(ValueError, match="needs a 0"):
        _bench("async_learning").main(["--tail", "12", "--ks", "1"])
