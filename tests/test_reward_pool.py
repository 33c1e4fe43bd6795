"""Rule rewards in worker processes (reward.workers): the same scores as in the main process whatever order the
calls finish in, the time limit and a killed worker reported with the function and the row, a fresh worker
after either, user files loaded in the workers, lambdas kept in the main process, and the auto rule."""
import logging
import os
import signal
import textwrap
import time

import pytest
import torch

from phaserl.batch import Scores
from phaserl.config import load_config
from phaserl.config.auto import reward_workers_rule
from phaserl.errors import ConfigError, RewardError
from phaserl.rewards import RewardSources, RuleRewards

USER_FILE = '''
import os, sys, time

def slow_first(prompt, response, ground_truth, **row):
    """Slow on ground truth 0, so the calls of the first rows finish last."""
    time.sleep(0.05 if ground_truth == 0 else 0.0)
    return float(ground_truth) * 10 + len(response)

def pid(prompt, response, ground_truth, **row):
    return float(os.getpid())

def has_torch(prompt, response, ground_truth, **row):
    return float("torch" in sys.modules)

def hangs_on_2(prompt, response, ground_truth, **row):
    if ground_truth == 2:
        time.sleep(60)
    return 1.0

def dies_on_1(prompt, response, ground_truth, **row):
    if ground_truth == 1:
        os.kill(os.getpid(), 9)
    return 1.0

def waits_to_be_killed(prompt, response, ground_truth, pid_file, **row):
    if ground_truth == 1:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
    return 1.0

def divides(prompt, response, ground_truth, **row):
    return 1.0 / (len(response) < 5)

def a_list(prompt, response, ground_truth, **row):
    return [1.0]
'''


@pytest.fixture
def user_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text(USER_FILE)
    return "my_rewards.py"


def _inputs(n: int):
    responses = [f"so the answer is \\boxed{{{i % 5}}}" if i % 3 else f"#### {i % 5}" for i in range(n)]
    truths = [i % 4 for i in range(n)]
    rows = [{"__source__": f"train.jsonl row {100 + i}", "data_source": "digits"} for i in range(n)]
    return ["q"] * n, responses, truths, rows


def test_workers_give_exactly_the_main_process_scores_in_row_order(user_file):
    specs = [("gsm8k", 0.5, {"format_score": 0.1}), ("format", 0.25, {}), ("tiny_exact", 1.0, {}),
             (f"{user_file}:slow_first", 0.01, {})]
    prompts, responses, _, rows = _inputs(24)
    truths = [0] * 8 + [1 + i % 7 for i in range(16)]  # the first chunk of 8 is the slow one
    here = RuleRewards(specs).score(prompts, responses, truths, rows)
    pooled = RuleRewards(specs, workers=2)
    try:
        assert pooled.score(prompts, responses, truths, rows) == here
        assert here[1]["slow_first"] == [t * 10 + len(r) for t, r in zip(truths, responses)]
        assert len(set(here[1]["gsm8k"])) == 3  # right, formatted but wrong, and unformatted answers
    finally:
        pooled.close()


@pytest.mark.slow
def test_math_verify_scores_in_workers_equal_the_main_process():
    prompts, responses, truths, rows = _inputs(32)
    responses = [r.replace("boxed{0}", "boxed{\\frac{0}{2}}") for r in responses]
    here = RuleRewards([("boxed_math", 1.0, {})]).score(prompts, responses, truths, rows)
    pooled = RuleRewards([("boxed_math", 1.0, {})], workers=2)
    try:
        assert pooled.score(prompts, responses, truths, rows) == here and len(set(here[0])) == 2
    finally:
        pooled.close()


def test_a_user_file_runs_in_workers_without_torch_and_close_stops_them(user_file):
    rules = RuleRewards([(f"{user_file}:pid", 1.0, {}), (f"{user_file}:has_torch", 1.0, {})], workers=2)
    prompts, responses, truths, rows = _inputs(8)
    _, raw = rules.score(prompts, responses, truths, rows)
    pids = {int(p) for p in raw["pid"]}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2
    assert raw["has_torch"] == [0.0] * 8  # a worker imports what its functions import, not torch
    rules.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    _, again = rules.score(prompts, responses, truths, rows)  # a later submit starts new workers
    assert not pids & {int(p) for p in again["pid"]}
    rules.close()


def test_submit_returns_at_once_and_done_says_when_result_will_not_wait(user_file):
    rules = RuleRewards([(f"{user_file}:slow_first", 1.0, {})], workers=1)
    prompts, responses, _, rows = _inputs(4)
    try:
        t0 = time.monotonic()
        pending = rules.submit(prompts, responses, [0, 0, 0, 0], rows)  # 4 x 50 ms in the worker
        assert time.monotonic() - t0 < 0.05 and not pending.done()
        totals, _ = pending.result()
        assert pending.done() and totals == [float(len(r)) for r in responses]
    finally:
        rules.close()


def test_a_hung_call_is_stopped_at_the_time_limit_with_its_row_and_a_fresh_worker_follows(user_file):
    rules = RuleRewards([(f"{user_file}:hangs_on_2", 1.0, {})], timeout_s=0.5, workers=1)
    prompts, responses, truths, rows = _inputs(4)
    try:
        t0 = time.monotonic()
        with pytest.raises(RewardError, match=r"'my_rewards.py:hangs_on_2' did not return within 0.5 s on row 2 of "
                                              r"the batch \(train.jsonl row 102\).*its worker process was stopped"
                                              r".*raise reward.timeout_s"):
            rules.score(prompts, responses, truths, rows)
        assert time.monotonic() - t0 < 10
        assert rules.score(prompts[:2], responses[:2], [0, 1], rows[:2])[0] == [1.0, 1.0]
    finally:
        rules.close()


def test_a_worker_that_dies_in_a_call_is_named_with_the_row_and_replaced(user_file):
    rules = RuleRewards([(f"{user_file}:dies_on_1", 1.0, {})], workers=1)
    prompts, responses, truths, rows = _inputs(4)
    try:
        with pytest.raises(RewardError, match=r"'my_rewards.py:dies_on_1' ended its worker process \(killed by "
                                              r"SIGKILL\) on row 1 of the batch \(train.jsonl row 101\)"):
            rules.score(prompts, responses, truths, rows)
        assert rules.score(prompts[:1], responses[:1], [0], rows[:1])[0] == [1.0]
    finally:
        rules.close()


def test_a_worker_killed_from_outside_mid_call_is_named_with_the_row(user_file, tmp_path):
    pid_file = str(tmp_path / "busy.pid")
    rules = RuleRewards([(f"{user_file}:waits_to_be_killed", 1.0, {"pid_file": pid_file})], workers=1)
    prompts, responses, truths, rows = _inputs(3)
    try:
        pending = rules.submit(prompts, responses, truths, rows)
        deadline = time.monotonic() + 20
        while not os.path.exists(pid_file) or not open(pid_file).read():
            assert time.monotonic() < deadline, "the worker never reached row 1"
            time.sleep(0.02)
        os.kill(int(open(pid_file).read()), signal.SIGTERM)
        with pytest.raises(RewardError, match=r"ended its worker process \(killed by SIGTERM\) on row 1 of the "
                                              r"batch \(train.jsonl row 101\)"):
            pending.result()
    finally:
        rules.close()


def test_an_exception_or_a_non_number_in_a_worker_reads_as_in_the_main_process(user_file):
    prompts, responses, truths, rows = ["q", "q"], ["ok", "a much longer response"], [1, 1], _inputs(2)[3]
    messages = {}
    for fn in ("divides", "a_list"):
        for workers in (0, 1):
            rules = RuleRewards([(f"{user_file}:{fn}", 1.0, {})], workers=workers)
            with pytest.raises(RewardError) as info:
                rules.score(prompts, responses, truths, rows)
            rules.close()
            messages.setdefault(fn, set()).add(str(info.value))
    assert messages == {
        "divides": {"reward function 'my_rewards.py:divides' raised ZeroDivisionError on row 1 of the batch "
                    "(train.jsonl row 101), response 'a much longer response', ground truth 1: float division by zero"},
        "a_list": {"reward function 'my_rewards.py:a_list' returned list '[1.0]' on row 0 of the batch (train.jsonl "
                   "row 100); it must return one number (a float)."}}


def test_the_remote_exception_keeps_its_type_and_the_workers_traceback(user_file):
    rules = RuleRewards([(f"{user_file}:divides", 1.0, {})], workers=1)
    try:
        with pytest.raises(RewardError, match=r"raised ZeroDivisionError on row 1 of the batch \(train.jsonl row "
                                              r"101\), response 'a much longer response'") as info:
            rules.score(["q", "q"], ["ok", "a much longer response"], [1, 1], _inputs(2)[3])
        cause = info.value.__cause__
        assert isinstance(cause, ZeroDivisionError) and "in divides" in str(cause.__cause__)
    finally:
        rules.close()


def test_a_lambda_stays_in_the_main_process_with_one_log_line(user_file, caplog):
    rules = RuleRewards([(lambda prompt, response, ground_truth, **row: float(os.getpid()), 1.0, {}),
                         (f"{user_file}:pid", 1.0, {})], workers=1)
    prompts, responses, truths, rows = _inputs(3)
    try:
        with caplog.at_level(logging.INFO, logger="phaserl.rewards.registry"):
            _, raw = rules.score(prompts, responses, truths, rows)
            rules.score(prompts, responses, truths, rows)
        assert raw["<lambda>"] == [float(os.getpid())] * 3 and os.getpid() not in raw["pid"]
        lines = [r.getMessage() for r in caplog.records if "runs in the main process" in r.getMessage()]
        assert len(lines) == 1 and "lambda" in lines[0] and "1 reward worker(s)" in lines[0]
    finally:
        rules.close()


def test_reward_sources_collect_scores_groups_in_order_with_one_reward_model_call(user_file):
    class Row:
        def __init__(self, i):
            self.raw, self.source, self.ground_truth = {"data_source": "digits"}, f"train.jsonl row {i}", i

    class CountingRM:
        calls = []

        def score(self, prompts, responses):
            self.calls.append(len(responses))
            return torch.tensor([float(len(r)) for r in responses])

    sources = RewardSources(rules=RuleRewards([(f"{user_file}:slow_first", 1.0, {})], workers=2),
                            reward_model=CountingRM(), reward_model_weight=0.5)
    responses = ["a", "bb", "ccc", "dddd", "e", "ff"]
    rows = [Row(i) for i in range(6)]
    try:
        groups = [sources.submit(["q"] * 2, responses[s:s + 2], rows[s:s + 2]) for s in (0, 2, 4)]
        merged = sources.collect(groups, device="cpu")
        assert CountingRM.calls == [6]
        whole = sources.score_texts(["q"] * 6, responses, rows, device="cpu")
        assert isinstance(merged, Scores) and torch.equal(merged.total, whole.total)
        assert torch.equal(merged.by_source["slow_first"],
                           torch.tensor([10.0 * i + len(r) for i, r in enumerate(responses)]))
        assert torch.equal(merged.by_source["reward_model"], torch.tensor([1.0, 2, 3, 4, 1, 2]))
    finally:
        sources.close()


def test_reward_workers_config_and_its_auto_rule(user_file):
    with pytest.raises(ConfigError, match=r"reward.workers = -1: expected an integer >= 0, or auto"):
        load_config(None, ["reward.workers=-1"])
    with pytest.raises(ConfigError, match="reward.workers must be a whole number >= 0"):
        RuleRewards([("tiny_exact", 1.0, {})], workers=1.5)
    assert reward_workers_rule(functions=["tiny_exact", "gsm8k"], cpus=64, ranks_here=1)[0] == 0
    assert reward_workers_rule(functions=["boxed_math"], cpus=16, ranks_here=1)[0] == 4
    assert reward_workers_rule(functions=["my.py:score"], cpus=3, ranks_here=1)[0] == 2
    assert reward_workers_rule(functions=["boxed_math"], cpus=8, ranks_here=8) == (
        0, "one CPU core per rank: none to spare for workers")


@pytest.mark.slow
def test_a_training_run_scores_in_workers_and_stops_them_at_the_end(user_file, tmp_path):
    from _tiny_run import make_run_dir
    from phaserl.trainer import RLTrainer

    cfg = load_config(None, make_run_dir(str(tmp_path)) + [
        "trainer.loggers=[]", "trainer.total_steps=1", "reward.workers=1",
        f"reward.functions=[{{name: '{user_file}:pid', weight: 0.0}}, tiny_exact]"])
    trainer = RLTrainer.from_config(cfg)
    seen = []
    trainer.add_hook("on_step_end", lambda t: seen.append(t.run.reward.rules._pool._workers[0].process.pid))
    trainer.fit()
    assert trainer.metrics["train/reward/pid"] == float(seen[0]) != float(os.getpid())
    assert trainer.run.reward.rules._pool is None
    with pytest.raises(ProcessLookupError):
        os.kill(seen[0], 0)


def test_workers_exit_when_the_trainer_process_dies_mid_call(user_file, tmp_path):
    import subprocess
    import sys

    script = textwrap.dedent(f"""
        import os, sys, time
        from phaserl.rewards import RuleRewards
        rules = RuleRewards([("{user_file}:waits_to_be_killed", 1.0, {{"pid_file": "busy.pid"}})], workers=1)
        rules.submit(["q", "q"], ["a", "b"], [0, 1], [{{}}, {{}}])
        while not (os.path.exists("busy.pid") and open("busy.pid").read()):
            time.sleep(0.02)
        os._exit(0)  # as a second Ctrl-C does: no cleanup runs
    """)
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True, timeout=60)
    worker = int((tmp_path / "busy.pid").read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(worker, signal.SIGKILL)
    raise AssertionError("the reward worker outlived the process that started it")
