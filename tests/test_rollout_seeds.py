"""The rollout phases' named seed streams draw the values the phases drew before they had names.

Every seeded run's samples hang on these numbers (the kill-and-resume and world-size invariance tests pin
the samples; these pin the seeds themselves): a stream's key tuple must never change.
"""
from phaserl.trainer.rollout_context import SeedStreams


def test_each_named_stream_is_its_key_tuple_hashed():
    for seed, step in [(0, 0), (7, 3), (1234, 99)]:
        s = SeedStreams(seed, step)
        for index, n in [(0, 1), (5, 4), (64, 8)]:
            assert s.generate_call(index, n) == hash((seed, step, index, n)) & (2**63 - 1)
            assert s.episode(index) == hash((seed, step, index)) & (2**31 - 1)
            assert s.agent_session(n) == hash((seed, step, n, 1)) & (2**63 - 1)
            assert s.harness_endpoint(index, n) == hash((seed, step, index, n, 2)) & (2**63 - 1)


def test_the_streams_do_not_coincide():
    """One step's streams are distinct seeds (an episode's reset seed is not a generate call's)."""
    s = SeedStreams(3, 2)
    values = {s.generate_call(0, 4), s.agent_session(4), s.harness_endpoint(0, 4), s.episode(0)}
    assert len(values) == 4


def test_the_values_are_the_same_in_every_process():
    """Ints only: the values do not depend on PYTHONHASHSEED (a resumed run is a new process)."""
    import os
    import subprocess
    import sys

    code = "from phaserl.trainer.rollout_context import SeedStreams as S; s = S(5, 6); " \
           "print(s.generate_call(8, 2), s.episode(9), s.agent_session(2), s.harness_endpoint(8, 2))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": h}).stdout for h in ("1", "2")}
    assert len(outs) == 1
