"""the [HybridEngine] switch lines were 2 of every 3 console lines of the CPU quickstart. The
console keeps the seed's line for the first switch each way, then only changed costs and a periodic summary;
every switch's time and memory stay in the step's metrics (hybrid/*)."""
import pytest

from phaserl.roles.switch_log import SUMMARY_EVERY, SwitchLog


def _switch(log, target, seconds=0.001, memory=None, kv=0.0):
    source = "training" if target == "rollout" else "rollout"
    return log.record(source, target, seconds=seconds, memory_after_gb=memory, kv_cache_gb=kv, detail="memory x")


def test_the_first_switch_each_way_is_shown_then_only_summaries():
    log = SwitchLog()
    lines = []
    for _ in range(2 * SUMMARY_EVERY):
        lines += [_switch(log, "rollout"), _switch(log, "training")]
    shown = [line for line in lines if line]
    assert shown[0].startswith("[HybridEngine] Switching actor from training to rollout mode (1.0 ms, memory x)")
    assert shown[1].startswith("[HybridEngine] Switching actor from rollout to training mode (1.0 ms, memory x)")
    assert len(shown) == 2 + 4  # and a summary every SUMMARY_EVERY switches each way
    assert all(line.startswith("[HybridEngine] Switching actor from ") for line in shown)
    assert f"{SUMMARY_EVERY} switches so far" in shown[2]


def test_a_switch_whose_cost_changed_is_shown():
    log = SwitchLog()
    assert _switch(log, "rollout", memory=10.0, kv=2.0)
    assert _switch(log, "rollout", memory=10.05, kv=2.0) is None   # the same cost
    assert "its cost changed" in _switch(log, "rollout", memory=12.0, kv=2.0)  # 2 GB more after it
    assert "its cost changed" in _switch(log, "rollout", memory=12.0, kv=4.0)  # a larger KV cache
    assert "its cost changed" in _switch(log, "rollout", seconds=0.5, memory=12.0, kv=4.0)  # 500x slower


def test_every_switch_is_in_the_metrics():
    log = SwitchLog()
    for seconds in (0.1, 0.2, 0.3):
        _switch(log, "rollout", seconds=seconds, memory=5.0 + seconds, kv=1.5)
        _switch(log, "training", seconds=seconds / 10, memory=3.0)
    metrics = log.drain()
    assert metrics["hybrid/switches"] == 6
    assert metrics["hybrid/to_rollout_s"] == pytest.approx(0.6)
    assert metrics["hybrid/to_training_s"] == pytest.approx(0.06)
    assert metrics["hybrid/memory_after_rollout_switch_gb"] == pytest.approx(5.3)
    assert metrics["hybrid/memory_after_training_switch_gb"] == 3.0 and metrics["hybrid/kv_cache_gb"] == 1.5
    assert log.drain() == {}  # drained: the next line counts its own switches


def test_on_the_cpu_there_is_no_memory_key():
    log = SwitchLog()
    _switch(log, "rollout")
    assert "hybrid/memory_after_rollout_switch_gb" not in log.drain()
