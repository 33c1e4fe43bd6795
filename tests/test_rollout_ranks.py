"""Rollout ranks on the CPU: the rank split, weights in buckets from FSDP2 trainer ranks to a rollout rank, the
sample channel back, and the one-line errors when a peer stalls or dies (gloo, 2-3 forked processes).

Every multi-process case forks its ranks once and runs its scenarios in turn (each with fresh process groups);
the test functions then check what each rank saved. The failure cases use a 1.5 s timeout.
"""
import os
import re
import time
import traceback
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from _multiproc import free_port, start_method
from phaserl.config import load_config
from phaserl.config.validate import derive
from phaserl.errors import ConfigError
from phaserl.models import CausalLM, DecoderConfig
from phaserl.models.lora import LoRASettings, apply_lora, is_adapter_parameter
from phaserl.parallel import RankFailure
from phaserl.parallel.launch import peer_failure
from phaserl.parallel.rank_split import RankSplit, build_groups, trainer_mesh
from phaserl.parallel.sample_channel import (
    SampleGroup,
    SampleReceiver,
    SampleSender,
    pack_groups,
    scatter_groups,
    unpack_groups,
)
from phaserl.parallel.weight_sync import WeightReceiver, WeightSender, plan_buckets

SHORT_S = 1.5          # the failure cases' collective timeout
BUCKET = 2048          # bytes: the tiny model's embedding (40 x 32 floats) is larger and travels alone
VERSIONS = (1, 2, 3)


def tiny(seed: int, dtype=torch.float32) -> CausalLM:
    torch.manual_seed(seed)
    cfg = DecoderConfig(model_type="qwen2", vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, attention_bias=True)
    return CausalLM(cfg).to(dtype)


def groups_a() -> list:
    """Sample groups with every awkward value: an empty response, NaN and -inf log-probs, large versions."""
    return [SampleGroup(5, [[3, 9, 1], [7], []], [[-0.25, float("nan"), -1e-30], [float("-inf")], []],
                        [[0, 0, 1], [2**40], []], ["stop", "length", "abort"]),
            SampleGroup(11, [list(range(2, 30))], [torch.linspace(-3, 0, 28).tolist()], [[4] * 28], ["length"])]


def groups_b() -> list:
    return [SampleGroup(0, [[39, 38]], [[-0.5, -0.125]], [[3, 3]], ["stop"])]


def same_groups(a: list, b: list) -> bool:
    """Bitwise equal (log-probs compared as their bits, so NaN equals NaN)."""
    def bits(t):
        return t.contiguous().view(torch.int32)
    return len(a) == len(b) and all(
        x.prompt_index == y.prompt_index and x.finish_reasons == y.finish_reasons
        and all(torch.equal(p, q) for p, q in zip(x.token_ids, y.token_ids))
        and all(torch.equal(p, q) for p, q in zip(x.versions, y.versions))
        and all(torch.equal(bits(p), bits(q)) for p, q in zip(x.logprobs, y.logprobs)) for x, y in zip(a, b))


# ----- one process ---------------------------------------------------------------------------------------------

def test_the_last_ranks_generate_and_rank_0_stays_a_trainer():
    split = RankSplit(world_size=4, rollout_ranks=1)
    assert (split.trainers, split.rollouts) == ([0, 1, 2], [3])
    assert [split.role(r) for r in range(4)] == ["trainer"] * 3 + ["rollout"]
    assert RankSplit(1, 0).role(0) == "both" and RankSplit(1, 0).rollouts == []
    with pytest.raises(ValueError, match="leaves no trainer rank"):
        RankSplit(2, 2)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        RankSplit(1, 1)


def test_a_split_without_torchrun_or_without_a_trainer_rank_is_a_config_error():
    with pytest.raises(ConfigError, match=r"rollout.ranks = 1 .* one process \(no torchrun\).*--nproc-per-node"):
        load_config(None, ["rollout.ranks=1"])
    with pytest.raises(ConfigError, match="rollout.ranks = 2 leaves no trainer rank.*at most 1"):
        load_config(None, ["rollout.ranks=2"], world_size=2)
    with pytest.raises(ConfigError, match="rollout.ranks"):
        load_config(None, ["rollout.ranks=-1"], world_size=2)


def test_batches_divide_over_the_trainer_ranks_only():
    cfg = load_config(None, ["rollout.ranks=1", "rollout.prompts_per_step=8"], world_size=3)
    d = derive(cfg, 3)
    assert (d.world_size, d.prompts_per_rank) == (2, 4)  # 8 prompts over 3 - 1 trainer ranks
    with pytest.raises(ConfigError, match=r"not divisible by the trainer ranks \(world_size - rollout.ranks = 4 - 1\)"):
        load_config(None, ["rollout.ranks=1", "rollout.prompts_per_step=8"], world_size=4)


def test_optimizer_offload_for_rollout_mode_is_reported_as_ignored_with_rollout_ranks():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(None, ["rollout.ranks=1", "actor.hybrid_engine.offload_optimizer=true"], world_size=3)
    assert any("offload_optimizer = true is ignored with rollout.ranks = 1" in str(w.message) for w in caught)


def test_buckets_hold_one_dtype_and_a_large_parameter_travels_alone():
    f32, bf16 = torch.float32, torch.bfloat16
    entries = [("a", (10,), f32), ("b", (100,), f32), ("c", (3, 2), f32), ("d", (4,), bf16), ("e", (2,), f32)]
    buckets = plan_buckets(entries, bucket_bytes=64)
    assert [[s.name for s in b.slots] for b in buckets] == [["a"], ["b"], ["c"], ["d"], ["e"]]
    buckets = plan_buckets(entries[2:], bucket_bytes=64)
    assert [(b.dtype, [s.name for s in b.slots], [s.offset for s in b.slots]) for b in buckets] == [
        (f32, ["c"], [0]), (bf16, ["d"], [0]), (f32, ["e"], [0])]
    together = plan_buckets([("x", (2, 3), f32), ("y", (5,), f32)], bucket_bytes=1 << 20)
    assert len(together) == 1 and together[0].numel == 11 and together[0].slots[1].offset == 6


def test_sample_groups_pack_and_unpack_exactly():
    groups = groups_a() + groups_b()
    ints, floats = pack_groups(groups)
    assert ints.dtype == torch.int64 and floats.dtype == torch.float32 and floats.numel() == 3 + 1 + 28 + 2
    assert same_groups(unpack_groups(ints, floats), groups)
    assert unpack_groups(*pack_groups([])) == []


def test_a_malformed_sample_group_names_the_prompt_and_response():
    with pytest.raises(ValueError, match="prompt 4, response 1: token ids \\[2\\], log-probs \\[1\\]"):
        SampleGroup(4, [[1], [1, 2]], [[0.0], [0.0]], [[0], [0, 0]], ["stop", "stop"])
    with pytest.raises(ValueError, match="finish reason 'eos'"):
        SampleGroup(4, [[1]], [[0.0]], [[0]], ["eos"])


def test_a_transfer_failure_is_one_line_with_the_cause():
    from phaserl.parallel.launch import set_phase

    set_phase("startup")  # the process-wide phase: an earlier test in this process may have left another
    closed = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:4242. This is "
                          "typically caused by a remote worker crashing.\nmore")
    message = str(peer_failure("receiving weights from trainer rank 0", closed, timeout_s=2.0, role="rollout"))
    assert "\n" not in message
    assert message == ("rank 0 of 1 (rollout) in phase 'startup': receiving weights from trainer rank 0: the "
                       "connection closed: the peer's process is gone (Connection closed by peer [10.0.0.2]:4242)")
    late = RuntimeError("[unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation to complete")
    assert str(peer_failure("x", late, timeout_s=2.0)).endswith("x: no answer within 2 s: the peer is stuck or gone")


# ----- several processes ---------------------------------------------------------------------------------------

def _worker(rank: int, world: int, port: int, root: str, job: str) -> None:
    from phaserl.parallel.launch import set_phase

    torch.set_num_threads(1)
    set_phase("startup")  # a forked worker inherits the parent's phase and step (earlier tests in the process set them)
    # Not launch.init_distributed: its watch would stop a rank the moment its peer on this host dies, and the dead
    # peer cases test what the transfers themselves report (what a rank on another host sees).
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    out = {}
    try:
        JOBS[job](rank, world, out)
    except Exception:  # noqa: BLE001 - reported by the test in the parent
        out["error"] = traceback.format_exc()
    torch.save(out, os.path.join(root, f"{job}-rank{rank}.pt"))
    if not job.endswith("dies"):  # a broken group's teardown may wait on the dead peer
        dist.destroy_process_group()
    os._exit(0)


def _store():
    return dist.distributed_c10d._get_default_store()


def _sync_scenario(rank: int, out: dict, name: str, trainer_model, rollout_model) -> None:
    """Versions 1-3 from 2 FSDP2 trainer ranks to rank 2; the trainer saves its full weights after each send."""
    from phaserl.parallel.fsdp import apply_fsdp, full_state_dict
    from phaserl.roles.parallel_settings import FSDPSettings

    groups = build_groups(RankSplit(3, 1), timeout_s=20.0)
    if groups.role == "trainer":
        model = trainer_model()
        apply_fsdp(model, trainer_mesh(groups, "cpu"), FSDPSettings.from_any(None, role="actor"), role="actor")
        sender = WeightSender(model, groups, bucket_bytes=BUCKET)
        _store().wait([f"{name}/polled"])
        expected = {}
        for version in VERSIONS:
            with torch.no_grad():  # an "optimizer step" on each rank's shards
                for p in model.parameters():
                    if p.requires_grad:
                        p.mul_(1.25).add_(0.01 * version)
            sender.send(version)
            expected[version] = full_state_dict(model)
        sender.close()
        out[name] = {"expected": expected, "names": [n for n, _ in sender.params], "nbytes": sender.nbytes,
                     "buckets": len(sender.buckets)}
    else:
        model = rollout_model()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        receiver = WeightReceiver(model, groups)
        polled_early = receiver.poll()
        _store().set(f"{name}/polled", "1")
        got, versions = {}, []
        while True:
            deadline = time.monotonic() + 15
            while not receiver.poll():  # the rollout loop's check between two decode steps
                assert time.monotonic() < deadline
                time.sleep(0.005)
            version = receiver.receive()
            if version is None:
                break
            versions.append(version)
            got[version] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[name] = {"got": got, "versions": versions, "polled_early": polled_early, "before": before,
                     "nbytes": receiver.nbytes}


def _lora(seed: int):
    model = tiny(seed)
    apply_lora(model, LoRASettings(rank=4, alpha=8.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_()  # B starts at zero; give it values, as training would
    return model


def _samples_scenario(rank: int, out: dict) -> None:
    groups = build_groups(RankSplit(3, 1), timeout_s=20.0)
    if rank == 2:
        sender = SampleSender(groups)
        sender.send(groups_a())
        sender.send(groups_b())
        out["samples"] = {"pending_after_send": sender.pending}
        sender.close()
    elif rank == 0:
        receiver = SampleReceiver(groups)
        first, second = receiver.receive(), receiver.receive()
        share = scatter_groups(groups, [first[1][:1], first[1][1:] + second[1]])
        out["samples"] = {"sources": [first[0], second[0]], "share": pack_groups(share), "dropped": receiver.drain(),
                          "closed": receiver.closed}
    else:
        out["samples"] = {"share": pack_groups(scatter_groups(groups, None))}  # saved as tensors: weights_only loads


def _main_job(rank: int, world: int, out: dict) -> None:
    _sync_scenario(rank, out, "float32", lambda: tiny(0), lambda: tiny(1))
    _sync_scenario(rank, out, "bfloat16", lambda: tiny(0), lambda: tiny(1, torch.bfloat16))  # fp32 master weights
    _sync_scenario(rank, out, "lora", lambda: _lora(0), lambda: _lora(1))   # another base: it must stay as it is
    _samples_scenario(rank, out)


def _timed(out: dict, key: str, fn) -> None:
    start = time.monotonic()
    try:
        fn()
        out[key] = ("no error", time.monotonic() - start)
    except RankFailure as exc:
        out[key] = (str(exc), time.monotonic() - start)


def _stall_job(rank: int, world: int, out: dict) -> None:
    """Rank 0 trains, rank 1 generates; in each case one side stops answering and the other must raise."""
    store = _store()

    def case(name, failing_rank, act, stall):
        groups = build_groups(RankSplit(2, 1), timeout_s=SHORT_S)
        if rank == failing_rank:
            _timed(out, name, lambda: act(groups))
            store.set(f"{name}/done", "1")
        else:
            stall(groups)
            store.wait([f"{name}/done"])

    model = tiny(0)
    case("rollout_takes_no_bucket", 0, lambda g: WeightSender(model, g).send(1),
         lambda g: WeightReceiver(tiny(1), g))
    case("trainer_sends_no_version", 1, lambda g: WeightReceiver(tiny(1), g).receive(),
         lambda g: WeightSender(model, g))
    case("trainer_takes_no_samples", 1, lambda g: (s := SampleSender(g), s.send(groups_b()), s.flush()),
         lambda g: None)
    case("no_samples_arrive", 0, lambda g: SampleReceiver(g).receive(), lambda g: None)


def _rollout_dies_job(rank: int, world: int, out: dict) -> None:
    """Rank 1 (rollout) is killed after the handshake: rank 0's waits for samples and its next send must raise."""
    groups = build_groups(RankSplit(2, 1), timeout_s=20.0)
    store = _store()
    if rank == 1:
        WeightReceiver(tiny(1), groups)
        store.set("ready", "1")
        time.sleep(0.2)
        os._exit(9)
    sender, receiver = WeightSender(tiny(0), groups), SampleReceiver(groups)
    store.wait(["ready"])
    _timed(out, "samples_from_a_dead_rank", receiver.receive)
    _timed(out, "weights_to_a_dead_rank", lambda: sender.send(1))


def _trainer_dies_job(rank: int, world: int, out: dict) -> None:
    """Rank 0 (the trainer, and the store's host) is killed: rank 1's poll for weights and its samples must raise."""
    groups = build_groups(RankSplit(2, 1), timeout_s=20.0)
    if rank == 0:
        WeightSender(tiny(0), groups)
        time.sleep(0.5)
        os._exit(9)
    receiver, sender = WeightReceiver(tiny(1), groups), SampleSender(groups)

    def poll_until_it_fails():
        while not receiver.poll():
            time.sleep(0.005)
    _timed(out, "poll_after_the_trainer_died", poll_until_it_fails)
    _timed(out, "samples_to_a_dead_trainer", lambda: (sender.send(groups_b()), sender.flush()))


JOBS = {"main": _main_job, "stall": _stall_job, "rollout_dies": _rollout_dies_job, "trainer_dies": _trainer_dies_job}


def _spawn(tmp_path, job: str, world: int, limit_s: float = 60.0) -> list:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_worker, args=(world, free_port(), str(tmp_path), job), nprocs=world, join=False,
                             start_method=start_method())
    deadline = time.monotonic() + limit_s
    for process in ctx.processes:
        process.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in ctx.processes if p.is_alive()]
    for process in alive:
        process.kill()
    assert not alive, f"{job}: {len(alive)} rank(s) still running after {limit_s} s (a hang)"
    results = []
    for rank in range(world):
        path = tmp_path / f"{job}-rank{rank}.pt"
        results.append(torch.load(path, weights_only=True) if path.exists() else None)
        if results[-1] is not None:
            assert "error" not in results[-1], f"{job}, rank {rank}:\n{results[-1]['error']}"
    return results


@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("rollout_ranks"), "main", world=3)


@pytest.mark.slow
@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_every_version_arrives_in_order_and_bitwise(main_run, name, dtype):
    trainer, rollout = main_run[0][name], main_run[2][name]
    assert rollout["versions"] == list(VERSIONS) and rollout["polled_early"] is False
    assert trainer["buckets"] > 2 and trainer["nbytes"] == rollout["nbytes"]
    assert trainer["nbytes"] == sum(p.numel() for p in rollout["before"].values()) * dtype.itemsize
    for version in VERSIONS:
        got, expected = rollout["got"][version], trainer["expected"][version]
        assert got.keys() <= expected.keys()
        for key, value in got.items():
            assert value.dtype == dtype
            # bf16: the trainer's float32 weights cast once, exactly as the rollout would cast them itself
            assert torch.equal(value, expected[key].to(dtype)), (version, key)
    assert main_run[1][name]["expected"][3].keys() == trainer["expected"][3].keys()  # both trainer ranks sent


@pytest.mark.slow
def test_a_lora_sync_sends_the_adapters_only(main_run):
    trainer, rollout = main_run[0]["lora"], main_run[2]["lora"]
    assert trainer["names"] and all(is_adapter_parameter(n) for n in trainer["names"])
    adapters = [n for n in rollout["before"] if is_adapter_parameter(n)]
    assert sorted(trainer["names"]) == sorted(adapters)
    assert trainer["nbytes"] == sum(rollout["before"][n].numel() * 4 for n in adapters)
    final, expected = rollout["got"][3], trainer["expected"][3]
    for name, value in final.items():
        if is_adapter_parameter(name):
            assert torch.equal(value, expected[name]), name
        else:  # the rollout rank's own base (deliberately another seed here): never written
            assert torch.equal(value, rollout["before"][name]), name


@pytest.mark.slow
def test_sample_groups_reach_the_trainer_ranks_exactly(main_run):
    rank0, rank1 = main_run[0]["samples"], main_run[1]["samples"]
    assert rank0["sources"] == [2, 2] and rank0["dropped"] == 0 and rank0["closed"] is True
    assert same_groups(unpack_groups(*rank0["share"]), groups_a()[:1])
    assert same_groups(unpack_groups(*rank1["share"]), groups_a()[1:] + groups_b())


@pytest.mark.slow
def test_a_stalled_peer_gives_a_one_line_error_within_the_timeout(tmp_path):
    trainer, rollout = _spawn(tmp_path, "stall", world=2)
    trainer_line, rollout_line = "rank 0 of 2 (trainer) in phase", "rank 1 of 2 (rollout) in phase 'startup'"
    cases = {"rollout_takes_no_bucket": (trainer, f"{trainer_line} 'weight sync': sending bucket 1 of "),
             "trainer_sends_no_version": (rollout, f"{rollout_line}: waiting for weights after the first version from "
                                                   "trainer rank 0"),
             "trainer_takes_no_samples": (rollout, f"{rollout_line}: sending sample batch 1 (1 group) to trainer "
                                                   "rank 0"),
             "no_samples_arrive": (trainer, f"{trainer_line} 'startup': waiting for samples from rollout rank 1")}
    for case, (out, start) in cases.items():
        message, seconds = out[case]
        assert message.startswith(start), (case, message)
        assert message.endswith(f"no answer within {SHORT_S:g} s: the peer is stuck or gone"), (case, message)
        assert "\n" not in message
        assert seconds < SHORT_S + 3, (case, seconds)


@pytest.mark.slow
def test_a_dead_rollout_rank_gives_a_one_line_error_at_once(tmp_path):
    trainer, rollout = _spawn(tmp_path, "rollout_dies", world=2)
    assert rollout is None  # killed before saving anything
    # A send to a dead peer can succeed into the socket's buffer before the peer's reset arrives: the weights' failure
    # is named at the header or at a later bucket of the same version, whichever send first sees the closed socket.
    weights = r"sending (weight version 1's header|bucket \d+ of \d+ of weight version 1) to rollout rank 1"
    for case, action in (("samples_from_a_dead_rank", "waiting for samples from rollout rank 1"),
                         ("weights_to_a_dead_rank", weights)):
        message, seconds = trainer[case]
        assert message.startswith("rank 0 of 2 (trainer) in phase "), message
        assert re.search(action, message) and "the connection closed: the peer's process is gone" in message, message
        assert "\n" not in message and seconds < 5, (case, seconds)


@pytest.mark.slow
def test_a_dead_trainer_gives_a_one_line_error_at_once(tmp_path):
    trainer, rollout = _spawn(tmp_path, "trainer_dies", world=2)
    assert trainer is None
    for case, action in (("poll_after_the_trainer_died", "waiting for weights after the first version from trainer "
                                                         "rank 0"),
                         ("samples_to_a_dead_trainer", "sending sample batch 1 (1 group) to trainer rank 0")):
        message, seconds = rollout[case]
        assert message.startswith("rank 1 of 2 (rollout) in phase 'startup': " + action), message
        assert "the connection closed: the peer's process is gone" in message, message
        assert "\n" not in message and seconds < 5, (case, seconds)
