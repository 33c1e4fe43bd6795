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
