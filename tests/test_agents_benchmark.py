"""benchmarks/agent_rollout.py runs on the CPU (--smoke) and prints one JSON line per case."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


def test_the_agent_rollout_benchmark_smoke_runs(capsys):
    import agent_rollout

    agent_rollout.main(["--smoke", "--engine-compile", "off", "auto", "--profile-extend"])
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    profiles = [r for r in out if r["case"] == "extend_profile"]
    out = [r for r in out if r["case"] != "extend_profile"]
    lines, variants = out[:-1], out[-1]
    # per variant: the prompt prefill (8 prompts x 16 ids) and one lock-step extend (8 x (4 ids + the last sampled))
    assert [(r["part"], r["tokens"]) for r in profiles] == [("prefill", 8 * 16), ("extend", 8 * 5)] * 2
    assert all(r["wall_ms"] > 0 and r["us_per_token"] > 0 and "top" in r for r in profiles)  # kernels: CUDA only
    cases = [("single_turn", None), ("multi_turn", 0.0), ("multi_turn", 20.0), ("multi_turn_jitter", 20.0)]
    assert [(r["case"], r.get("latency_ms")) for r in lines] == cases * 2
    assert [r["engine_compile"] for r in lines] == ["off"] * 4 + ["auto"] * 4  # one engine per variant
    assert all(r["extend_passes"] >= 1 and r["extend_pass_ms"] > 0 for r in lines if r["case"] != "single_turn")
    assert variants["case"] == "variants" and len(variants["table"]) == 3  # per multi-turn case
    assert all(r["sampled_tokens"] == 8 * 2 * 8 for r in lines)  # 8 episodes x 2 turns x 8 tokens
    assert lines[1]["extend_tokens"] == 8 * 4                    # one 4-token observation per episode
    # the breakdown counts what ran: one decode call per step, extends only in the multi-turn cases
    assert all(r["calls"]["decode"] == r["decode_steps"] for r in lines)
    assert "extend" not in lines[0]["calls"] and lines[1]["calls"]["extend"] >= 1
    assert all(0 < r["device_busy"] <= 1.0 + 1e-6 for r in lines)


def test_the_agent_rollout_benchmark_measures_the_asynchronous_stream_twice_per_latency(capsys):
    import agent_rollout

    agent_rollout.main(["--smoke", "--async-phases", "2", "--jitter-ms"])
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    runs = [r for r in out if r["case"] == "async"]
    assert [(r["latency_ms"], r["measured"]) for r in runs] == [(0.0, "first"), (0.0, "second"), (20.0, "first"),
                                                                  (20.0, "second")]
    for r in runs:  # 2 timed phases of 8 completed 2-turn episodes of 8 tokens a turn each
        assert r["phases"] == 2 and r["trained_tokens"] == 2 * 8 * 2 * 8 and r["tokens_per_s"] > 0
        assert r["sampled_tokens_per_s"] >= r["tokens_per_s"] * 0.5 and r["vs_single_turn"] > 0


def test_the_agent_host_benchmark_runs_the_real_runner_over_a_sleeping_session(capsys):
    import agent_host

    agent_host.main(["--episodes", "8", "--turns", "3", "--turn-tokens", "4", "--prompt", "4", "--latency-ms", "2",
                     "--jitter-ms", "2", "--step-ms", "0.2", "--pass-ms", "0.5"])
    lock, jitter = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert (lock["case"], jitter["case"]) == ("lock-step", "jitter")
    for r in (lock, jitter):  # the sleeps alone are the ideal: the runner's own work only adds to it
        assert r["wall_s"] >= r["ideal_s"] > 0 and r["decode_steps"] >= 3 * 4
    assert len(lock["boundary_ms"]) == 2 and all(ms >= 2.0 for ms in lock["boundary_ms"])  # each holds the latency
    assert lock["turns_ms"][0] == 0.0 and lock["applies_ms"][1] >= lock["answers_ms"][1] >= lock["answers_ms"][0]


def test_the_turn_boundary_benchmark_splits_the_wall_of_the_real_session(capsys):
    import turn_boundary

    turn_boundary.main(["--episodes", "8", "--turns", "2", "--prompt", "8", "--turn-tokens", "4", "--obs-tokens", "2",
                        "--latency-ms", "0", "--jitter-ms", "2", "--repeats", "1"])
    lock, jitter = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert (lock["jitter"], jitter["jitter"]) == (False, True)
    for r in (lock, jitter):  # the parts add up to the wall; the host's share is what is left of it
        parts = r["compute_s"] + r["kv_move_s"] + r["tool_wait_s"] + r["host_s"]
        assert abs(parts - r["wall_s"]) < 1e-3 and r["compute_s"] > 0 and r["host_s"] > 0
        host = r["step_host_s"] + r["ended_s"] + r["answers_s"] + r["apply_s"] + r["loop_s"]
        assert abs(host - r["host_s"]) < 1e-3 and abs(r["boundary_host_ms"] - 1000 * r["host_s"] / 2) < 0.1
        assert r["decode_steps"] >= 2 * 4 and r["extend_passes"] >= 1
