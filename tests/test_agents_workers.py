"""Workers: threads start lazily up to the pool's size, stay across uses, and a hung call is abandoned."""
import threading
import time

import pytest

from phaserl.agents.workers import Workers


def test_threads_start_on_demand_up_to_the_size_and_are_reused():
    pool = Workers(3, name="t-lazy")
    assert pool.threads == 0                                   # nothing started before the first call
    assert pool.submit(lambda: 7).result(timeout=5) == 7
    assert pool.threads == 1                                   # one call, one thread
    gate = threading.Event()
    futures = [pool.submit(gate.wait, 5) for _ in range(5)]    # 5 blocking calls, at most 3 at once
    time.sleep(0.2)
    assert pool.threads == 3 and sum(f.running() for f in futures) == 3
    gate.set()
    assert all(f.result(timeout=5) for f in futures)
    started = pool._started
    for _ in range(10):                                        # idle threads take later calls: none started
        pool.submit(time.sleep, 0).result(timeout=5)
    assert pool._started == started
    pool.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(time.sleep, 0)


def test_an_abandoned_call_frees_its_place_and_its_thread_exits_when_it_returns():
    pool = Workers(1, name="t-abandon")
    release = threading.Event()
    hung = pool.submit(release.wait, 10)
    time.sleep(0.1)
    pool.abandon(hung)
    assert pool.threads == 0
    assert pool.submit(lambda: "next").result(timeout=5) == "next"  # a new thread: the pool kept its size
    assert pool.threads == 1
    release.set()
    hung.result(timeout=5)
    time.sleep(0.1)
    assert pool.threads == 1 and pool._started == 2                # the stuck one exited instead of staying


def test_abandoning_a_call_that_has_not_started_cancels_it():
    pool = Workers(1, name="t-cancel")
    gate = threading.Event()
    first = pool.submit(gate.wait, 5)
    queued = pool.submit(lambda: "never")
    pool.abandon(queued)
    gate.set()
    first.result(timeout=5)
    assert queued.cancelled() and pool.threads == 1


def _alive(prefix: str) -> int:
    return sum(t.name.startswith(prefix + "-") and t.is_alive() for t in threading.enumerate())


def test_stop_idle_ends_the_idle_threads_and_the_pool_starts_new_ones_on_demand():
    """The end of a run: idle workers exit (they used to stay as daemon threads for the process's life),
    a busy one finishes its call, and a later fit() can still submit."""
    pool = Workers(3, name="t-stop")
    gate, busy = threading.Event(), threading.Event()
    futures = [pool.submit(gate.wait, 5) for _ in range(3)]
    time.sleep(0.1)
    gate.set()
    assert all(f.result(timeout=5) for f in futures)
    time.sleep(0.1)  # each worker releases its idle permit after setting the result
    slow = pool.submit(busy.wait, 5)
    time.sleep(0.1)
    assert pool.stop_idle() == 2 and pool.threads == 1  # the busy worker is not stopped
    deadline = time.monotonic() + 5
    while _alive("t-stop") > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _alive("t-stop") == 1
    busy.set()
    assert slow.result(timeout=5)
    assert pool.submit(lambda: "again").result(timeout=5) == "again"
    assert pool.threads <= 3


def test_a_queued_call_gets_the_place_of_an_abandoned_one_at_once():
    """A call queued behind a hung one (pool at its size) used to wait until some call returned."""
    pool = Workers(1, name="t-backlog")
    release = threading.Event()
    hung = pool.submit(release.wait, 10)
    queued = pool.submit(lambda: "served")
    time.sleep(0.1)
    assert not queued.done()
    pool.abandon(hung)
    assert queued.result(timeout=2) == "served"
    release.set()
    hung.result(timeout=5)
