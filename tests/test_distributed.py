"""Two ranks (gloo, CPU, FSDP2) against one process: the same RL step, reduced metrics, failures named by rank.

One spawn of two worker processes runs every 2-rank scenario in turn (process start-up and imports cost
more than the scenarios), while this process runs the 1-rank references on the same model and data.
Each scenario is one real `RLTrainer.train_step()` (rollout, score, forward passes, advantages, update
over 2 mini-batches) built from tests/_tiny_run.py.
"""
import os
import time
import traceback

import pytest
import torch

from _multiproc import free_port

pytestmark = pytest.mark.slow  # an end-to-end run (see README, "Tests")

GRPO = ["algorithm.adv_estimator=grpo", "algorithm.kl_placement=loss", "algorithm.kl_coef=0.1",
        "ref.fsdp.sharding_strategy=NO_SHARD", "actor.gradient_checkpointing=true"]
PPO = ["algorithm.adv_estimator=gae", "algorithm.kl_placement=reward", "actor.fsdp.sharding_strategy=SHARD_GRAD_OP",
       "critic.fsdp.sharding_strategy=NO_SHARD", "critic.optim.lr=1e-3"]
# The 2026 menu on the invariance bench: GPG's global alpha, CISPO, token-sum, TIS on the rollout/trainer ratio,
# the straight-through k3+ in the loss.
FAMILIES = ["algorithm.adv_estimator=gpg", "actor.policy_loss=cispo", "actor.clip_ratio_low=1.0",
            "actor.loss_agg_mode=token-sum", "algorithm.rollout_correction=tis", "algorithm.kl_placement=loss",
            "algorithm.kl_estimator=k3+", "algorithm.kl_coef=0.1", "ref.fsdp.sharding_strategy=NO_SHARD"]
DAPO = ["algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_max_rounds=2", "algorithm.overlong_buffer=2",
        "actor.clip_ratio_high=0.28"]
# LoRA: the base sharded with its layer, the adapters too (FULL_SHARD); the reference is the actor's model, adapters off
LORA = GRPO[:3] + ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.optim.lr=3e-2",
                   "actor.gradient_checkpointing=true"]
# Qwen3-MoE, its stacked experts sharded by FSDP2, the rollout's experts replayed in training ({root}: the fixture's)
MOE = GRPO[:3] + ["model.path={root}/moe", "actor.routing_replay=true"]
# a native non-Qwen family: Mistral, every layer a 4-key sliding window (shorter than the prompts), FSDP2-sharded
MISTRAL = GRPO[:3] + ["model.path={root}/mistral"]
# multi-turn episodes (agent.env) on FSDP2 ranks: each rank runs its prompts' episodes in its own decode session
AGENT = GRPO[:3] + [f"agent.env={os.path.join(os.path.dirname(os.path.abspath(__file__)), '_varied.py')}:Varied",
                    "agent.max_turns=2", "agent.max_episode_tokens=64"]
# Ulysses: the two ranks form one sequence-parallel group (each holds half of every micro-batch's tokens, its own
# rows run by both in turn), with every layer checkpointed (the recompute runs the all-to-alls again)
ULYSSES = GRPO + ["actor.sequence_parallel=2"]
# the bitwise numerics mode on FSDP2 ranks: the old log-prob pass (2 mini-batches) and the update's double forward
# (exact values, default graph) over gathered shards, with every layer checkpointed (recomputed in its forward's mode)
BITWISE = GRPO + ["rollout.bitwise=true"]
SCENARIOS = {"grpo": GRPO, "ppo": PPO, "families": FAMILIES, "dapo": DAPO, "grpo_lora": LORA, "moe_replay": MOE,
             "mistral": MISTRAL, "agent": AGENT, "ulysses": ULYSSES, "bitwise": BITWISE}
ONE_RANK_ONLY = ("actor.sequence_parallel",)  # settings the 1-rank reference run leaves out
COMMON = ["trainer.loggers=[]", "data.val_files=[]", "trainer.total_steps=1", "ppo.num_mini_batches=2",
          "rollout.batch_size=1"]  # 1 prompt per generate call divides the prompts per rank on 1 and 2 ranks
# actor/grad_norm also proves gradients are summed over ranks: averaged, it would be halved (Adam would hide that
# in the weights).
EXACT_METRICS = {
    "grpo": ("train/reward_mean", "train/response_length_mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm",
             "actor/pg_clipfrac", "actor/kl_loss"),
    "ppo": ("train/reward_mean", "train/response_length_mean", "critic/vf_loss", "critic/grad_norm", "actor/pg_loss",
            "actor/grad_norm"),
    "families": ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy", "mismatch/k3",
                 "mismatch/correction_weight_mean", "train/zero_variance_group_frac"),
    "dapo": (),  # dynamic sampling fills each rank's share on its own: not the 1-rank step
    "grpo_lora": ("train/reward_mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss"),
    "moe_replay": ("train/reward_mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "mismatch/k3"),
    "mistral": ("train/reward_mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss"),
    "agent": ("train/reward_mean", "train/response_length_mean", "agent/turns_mean", "actor/pg_loss",
              "actor/grad_norm"),  # noise keyed by the global episode index: the 1-rank episodes
    "ulysses": ("train/reward_mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/kl_loss"),
    "bitwise": ("train/reward_mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "mismatch/abs_diff_max")}
TIMEOUT_S = 300


def _one_step(overrides: list) -> dict:
    """One RL step; returns the responses, the metrics, every role's full weights and its parameter placements."""
    from phaserl.config import load_config
    from phaserl.models import invariant
    from phaserl.parallel import rank_and_world
    from phaserl.parallel.fsdp import full_state_dict
    from phaserl.trainer import RLTrainer

    torch.manual_seed(0)
    cfg = load_config(None, overrides, world_size=rank_and_world()[1])
    try:
        trainer = RLTrainer.from_config(cfg)
        responses, generate = [], trainer._generate
        trainer._generate = lambda *args: _keep(responses, generate(*args))
        metrics = trainer.train_step()
    finally:
        invariant.enable(False)  # a bitwise run set the kernels of the process: the next ones take the default
    ref_root = trainer.ref_policy.model.model.embed_tokens.weight  # the root unit: FSDP2 keeps it after forward
    roles = {"actor": trainer.actor, "critic": trainer.critic, "ref": trainer.ref_policy}
    split = getattr(trainer.actor.model.model, "sequence_parallel", None)  # actor.sequence_parallel's group
    return {"responses": responses, "metrics": metrics, "sequence_parallel": split.k if split else 1,
            "weights": {name: full_state_dict(role.model) for name, role in roles.items() if role is not None},
            "ref_root_after_step": str(getattr(ref_root, "placements", "plain")),
            "placements": {name: str(getattr(role.model.model.norm.weight, "placements", "plain"))
                           for name, role in roles.items() if role is not None}}


def _keep(responses: list, batch):
    responses.extend(batch.response_texts)
    return batch


def _reduce_distinct_metrics(rank: int) -> dict:
    from phaserl.parallel import reduce_metrics

    mine = [{"a": 1.0, "len_max": 3.0, "adv_min": -1.0, "timing_s/step": 1.0, "only_rank0": 5.0},
            {"a": 3.0, "len_max": 7.0, "adv_min": -4.0, "timing_s/step": 2.0}][rank]
    return reduce_metrics(mine)


def _failure_on_rank_1(rank: int) -> str:
    """Rank 1 raises inside rank_errors(); rank 0 waits in a collective for it and must name it."""
    from phaserl.parallel import all_reduce_sum, rank_errors, set_phase

    set_phase("update", 7)
    try:
        with rank_errors():
            if rank == 1:
                raise ValueError("reward function crashed on row 3")
            all_reduce_sum(torch.ones(1))
    except Exception as exc:  # noqa: BLE001 - the message is the result under test
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _timeout_in_phase(rank: int) -> str:
    """Rank 0 enters a collective (1 s timeout) that rank 1 skips: the error must name rank 0's phase."""
    from datetime import timedelta

    import torch.distributed as dist

    from phaserl.parallel import launch, rank_errors, set_phase

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=1))
    store = dist.distributed_c10d._get_default_store()
    result = "rank 1 took no part"
    if rank == 0:
        set_phase("forward", 2)
        try:
            with rank_errors():
                dist.all_reduce(torch.ones(1), group=group)
            result = "no error"
        except Exception as exc:  # noqa: BLE001 - the message is the result under test
            result = f"{type(exc).__name__}: {exc}"
        store.delete_key(f"{launch._STORE_PREFIX}0")  # rank 0 lives on: its posted failure must not linger
        store.set("test/timeout_done", "1")
    else:
        store.wait(["test/timeout_done"])
    return result


def _watchdog_line(rank: int) -> str:
    """The NCCL-path watchdog logs the phase once it outlives the collective timeout."""
    import logging

    from phaserl.parallel import launch

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("phaserl").addHandler(handler)
    launch.set_phase("score", 3)
    watchdog = launch._PhaseWatchdog(timeout_s=0.2)
    watchdog.start()
    time.sleep(0.5)
    watchdog.stop()
    logging.getLogger("phaserl").removeHandler(handler)
    return " | ".join(lines)


RM_TEXTS = ["2", "11", "7+7", "no idea"]


def _sharded_reward_model(rank: int, root: str, **engine) -> dict:
    """reward_model.fsdp FULL_SHARD: rank 0 scores 3 batches, rank 1 only 1 (uneven validation shares);
    `engine` makes every input its own batch (phaserl: a 1-token budget, packed; transformers: batch_size=1)."""
    from phaserl.parallel.fsdp import shard_roles
    from phaserl.roles import RewardModelWrapper
    from phaserl.roles.parallel_settings import FSDPSettings

    try:
        rm = RewardModelWrapper.from_pretrained(os.path.join(root, "rm"), **engine)
        rm.fsdp = FSDPSettings.from_any({"sharding_strategy": "FULL_SHARD"}, role="reward_model")
        shard_roles({"reward_model": rm}, torch.device("cpu"))
        texts = RM_TEXTS[:3] if rank == 0 else RM_TEXTS[3:]
        scores = rm.score(["1+1"] * len(texts), texts)  # rank 1 pads with 2 one-token batches, or both hang
        root_unit = rm.model.model.embed_tokens.weight
        return {"scores": scores, "sharded": rm.sharded, "root_after": str(getattr(root_unit, "placements", "plain")),
                "rm_dir": os.path.join(root, "rm"), "engine": rm.engine, "packed": rm._packs()}
    except Exception:  # noqa: BLE001 - reported by the test in the parent
        return {"error": traceback.format_exc()}


def _worker(rank: int, world: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from phaserl.parallel import init_distributed

    init_distributed(timeout_s=60, backend="gloo")
    out = {}
    for name, extra in SCENARIOS.items():
        try:
            out[name] = _one_step(_overrides(root, name, f"ranks{world}") + [e.format(root=root) for e in extra])
        except Exception:  # noqa: BLE001 - reported by the test in the parent
            out[name] = {"error": traceback.format_exc()}
    out["reduced"] = _reduce_distinct_metrics(rank)
    out["watchdog"] = _watchdog_line(rank)
    out["timeout"] = _timeout_in_phase(rank)
    out["rm"] = _sharded_reward_model(rank, root, micro_batch_tokens=1, packing=True)
    out["rm_hf"] = _sharded_reward_model(rank, root, engine="transformers", batch_size=1)
    out["failure"] = _failure_on_rank_1(rank)  # breaks the process group: last
    torch.save(out, os.path.join(root, f"rank{rank}.pt"))


def _overrides(root: str, name: str, tag: str) -> list:
    with open(os.path.join(root, "overrides.txt")) as f:
        files = [line for line in f.read().splitlines() if line]
    run = os.path.join(root, f"{name}-{tag}")
    return files + COMMON + [f"trainer.log_dir={run}/logs", f"trainer.checkpoint_path={run}/ckpt"]



@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch.multiprocessing as mp

    from _tiny_rm import make_reward_model_dir
    from _tiny_run import make_model_dir, make_run_dir

    root = str(tmp_path_factory.mktemp("distributed"))
    make_model_dir(root, model_type="qwen3_moe", name="moe", head_dim=8, qk_norm=True, num_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=16)  # root/moe
    make_model_dir(root, model_type="mistral", name="mistral", sliding_window=4,
                   layer_types=("sliding_attention",) * 2)  # root/mistral
    make_reward_model_dir(root)  # root/rm
    reward = os.path.join(root, "spread.py")  # varied rewards, so the advantages (and gradients) are not 0
    with open(reward, "w") as f:
        f.write("def spread(prompt, response, ground_truth, **row):\n"
                "    return sum(ord(c) for c in response) % 7 / 7\n")
    overrides = [o for o in make_run_dir(root) if not o.startswith("trainer.")]
    with open(os.path.join(root, "overrides.txt"), "w") as f:
        f.write("\n".join(overrides + [f"reward.functions=[{{name: '{reward}:spread'}}]"]) + "\n")
    t0 = time.monotonic()
    ctx = mp.start_processes(_worker, args=(2, free_port(), root), nprocs=2, join=False, start_method="spawn")
    try:
        single = {name: _one_step(_overrides(root, name, "ranks1") + [e.format(root=root) for e in extra
                                                                      if not e.startswith(ONE_RANK_ONLY)])
                  for name, extra in SCENARIOS.items()}
        while not ctx.join(timeout=5):
            if time.monotonic() - t0 > TIMEOUT_S:
                pytest.fail(f"the 2-rank workers did not finish within {TIMEOUT_S} s")
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
    ranks = [torch.load(os.path.join(root, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    return single, ranks


def _two(ranks: list, name: str) -> list:
    for r, out in enumerate(ranks):
        assert "error" not in out[name], f"rank {r}, {name}:\n{out[name]['error']}"
    return [out[name] for out in ranks]


def _max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_grpo_step_on_two_ranks_equals_one_rank(runs):
    single, ranks = runs
    two = _two(ranks, "grpo")
    # the same global rollout: each prompt's samples depend on (seed, step, global prompt index), not the rank
    assert two[0]["responses"] + two[1]["responses"] == single["grpo"]["responses"]
    assert _max_weight_diff(two[0]["weights"]["actor"], two[1]["weights"]["actor"]) == 0.0
    assert _max_weight_diff(two[0]["weights"]["actor"], single["grpo"]["weights"]["actor"]) < 1e-5
    # the reference holds the initial weights: the step really moved the actor (both optimizer steps)
    assert _max_weight_diff(two[0]["weights"]["actor"], two[0]["weights"]["ref"]) > 1e-4


def test_sequence_parallel_ranks_train_as_one_rank(runs):
    """actor.sequence_parallel=2: the reference's and the update's forwards spread every micro-batch over both
    ranks (all-to-alls around attention, recomputed in backward); the step is the 1-rank step."""
    single, ranks = runs
    two = _two(ranks, "ulysses")
    assert two[0]["sequence_parallel"] == two[1]["sequence_parallel"] == 2
    assert two[0]["responses"] + two[1]["responses"] == single["ulysses"]["responses"]
    assert _max_weight_diff(two[0]["weights"]["actor"], two[1]["weights"]["actor"]) == 0.0
    assert _max_weight_diff(two[0]["weights"]["actor"], single["ulysses"]["weights"]["actor"]) < 1e-5
    assert _max_weight_diff(two[0]["weights"]["actor"], two[0]["weights"]["ref"]) > 1e-4
    assert two[0]["metrics"]["actor/kl_loss"] > 0  # the reference's log-probs (sequence-parallel too) differ


def test_the_bitwise_mode_on_two_ranks_logs_zero_mismatch_and_trains_as_one_rank(runs):
    single, ranks = runs
    two = _two(ranks, "bitwise")
    assert two[0]["metrics"]["mismatch/abs_diff_max"] == single["bitwise"]["metrics"]["mismatch/abs_diff_max"] == 0.0
    assert two[0]["responses"] + two[1]["responses"] == single["bitwise"]["responses"]
    assert _max_weight_diff(two[0]["weights"]["actor"], two[1]["weights"]["actor"]) == 0.0
    assert _max_weight_diff(two[0]["weights"]["actor"], single["bitwise"]["weights"]["actor"]) < 1e-5
    assert _max_weight_diff(two[0]["weights"]["actor"], two[0]["weights"]["ref"]) > 1e-4


def test_moe_with_routing_replay_on_two_ranks_equals_one_rank(runs):
    single, ranks = runs
    two = _two(ranks, "moe_replay")
    assert two[0]["responses"] + two[1]["responses"] == single["moe_replay"]["responses"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in two[0]["weights"]["actor"]
    assert _max_weight_diff(two[0]["weights"]["actor"], two[1]["weights"]["actor"]) == 0.0
    assert _max_weight_diff(two[0]["weights"]["actor"], single["moe_replay"]["weights"]["actor"]) < 1e-5
    assert _max_weight_diff(two[0]["weights"]["actor"], two[0]["weights"]["ref"]) > 1e-4


def test_a_native_mistral_with_sliding_windows_on_two_ranks_equals_one_rank(runs):
    single, ranks = runs
    two = _two(ranks, "mistral")
    assert two[0]["responses"] + two[1]["responses"] == single["mistral"]["responses"]
    assert _max_weight_diff(two[0]["weights"]["actor"], two[1]["weights"]["actor"]) == 0.0
    assert _max_weight_diff(two[0]["weights"]["actor"], single["mistral"]["weights"]["actor"]) < 1e-5
    assert _max_weight_diff(two[0]["weights"]["actor"], two[0]["weights"]["ref"]) > 1e-4


def test_lora_adapters_on_two_ranks_equal_one_rank_and_the_reference_is_the_sharded_base(runs):
    single, ranks = runs
    two = _two(ranks, "grpo_lora")
    assert two[0]["responses"] + two[1]["responses"] == single["grpo_lora"]["responses"]
    actor = two[0]["weights"]["actor"]
    assert _max_weight_diff(actor, single["grpo_lora"]["weights"]["actor"]) < 1e-5
    assert max(actor[k].abs().max().item() for k in actor if k.endswith(".lora_B")) > 1e-4  # the adapters trained
    assert two[0]["placements"] == {"actor": "(Shard(dim=0),)", "ref": "(Shard(dim=0),)"}  # one model, sharded once
    assert two[0]["weights"]["ref"].keys() == actor.keys()


def test_multi_turn_episodes_on_two_ranks_equal_one_rank(runs):
    """Each rank runs its own prompts' episodes in its own decode session (environments seeded and sampling noise
    keyed by the global episode index, the session's noise seed the step's on every rank), so every episode samples
    the 1-rank run's tokens although it decodes beside other episodes in other slots; the update is one FSDP2
    step: both ranks end with the 1-rank weights, moved from the reference."""
    single, ranks = runs
    two = _two(ranks, "agent")
    assert two[0]["responses"] + two[1]["responses"] == single["agent"]["responses"]
    assert two[0]["metrics"]["agent/turns_mean"] > 1
    assert _max_weight_diff(two[0]["weights"]["actor"], two[1]["weights"]["actor"]) == 0.0
    assert _max_weight_diff(two[0]["weights"]["actor"], single["agent"]["weights"]["actor"]) < 1e-5
    assert _max_weight_diff(two[0]["weights"]["actor"], two[0]["weights"]["ref"]) > 1e-4


def test_ppo_critic_update_on_two_ranks_equals_one_rank(runs):
    single, ranks = runs
    two = _two(ranks, "ppo")
    assert two[0]["responses"] + two[1]["responses"] == single["ppo"]["responses"]
    assert _max_weight_diff(two[0]["weights"]["critic"], single["ppo"]["weights"]["critic"]) < 1e-5


def test_ppo_actor_update_on_two_ranks_equals_one_rank(runs):
    single, ranks = runs
    two = _two(ranks, "ppo")
    assert _max_weight_diff(two[0]["weights"]["actor"], single["ppo"]["weights"]["actor"]) < 1e-5


def test_new_losses_token_sum_and_rollout_correction_on_two_ranks_equal_one_rank(runs):
    single, ranks = runs
    two = _two(ranks, "families")
    assert two[0]["responses"] + two[1]["responses"] == single["families"]["responses"]
    assert _max_weight_diff(two[0]["weights"]["actor"], single["families"]["weights"]["actor"]) < 1e-5
    assert _max_weight_diff(two[0]["weights"]["actor"], two[0]["weights"]["ref"]) > 1e-4
    # the metrics (actor/pg_loss, grad_norm: a token-sum gradient summed over ranks) are in EXACT_METRICS


def test_dynamic_sampling_agrees_on_its_rounds_across_ranks(runs):
    _, ranks = runs
    two = _two(ranks, "dapo")  # no rank left waiting in a collective: both ran the same number of rounds
    assert two[0]["metrics"]["sampling/rounds"] == two[1]["metrics"]["sampling/rounds"] >= 1
    assert two[0]["metrics"]["train/zero_variance_group_frac"] == 0.0 or two[0]["metrics"]["sampling/filled_groups"] > 0


def test_each_role_is_sharded_by_its_own_settings(runs):
    single, ranks = runs
    grpo, ppo = _two(ranks, "grpo")[0], _two(ranks, "ppo")[0]
    assert grpo["placements"] == {"actor": "(Shard(dim=0),)", "ref": "plain"}  # a frozen NO_SHARD role: a replica
    assert ppo["placements"] == {"actor": "(Shard(dim=0),)", "critic": "(Replicate(), Shard(dim=0))",  # NO_SHARD
                                 "ref": "(Shard(dim=0),)"}  # FULL_SHARD, run under torch.inference_mode()
    assert single["grpo"]["placements"] == {"actor": "plain", "ref": "plain"}  # one process: no FSDP at all
    # a frozen FULL_SHARD role never runs backward, where FSDP2 frees a root kept gathered: the reference
    # reshards itself after its forward, so its embeddings/head do not stay gathered for the rest of the run
    assert ppo["ref_root_after_step"] == "(Shard(dim=0),)"


@pytest.mark.parametrize("name, engine, packed", [("rm", "phaserl", True), ("rm_hf", "transformers", False)])
def test_a_sharded_reward_model_scores_uneven_shares_like_one_process(runs, name, engine, packed):
    from phaserl.roles import RewardModelWrapper

    _, ranks = runs
    two = _two(ranks, name)
    assert two[0]["sharded"] and two[1]["sharded"]
    assert (two[0]["engine"], two[0]["packed"]) == (engine, packed)
    assert two[0]["root_after"] == two[1]["root_after"] == "(Shard(dim=0),)"  # freed after scoring
    # one process, unsharded, transformers' own classifier, all four inputs in one batch
    single = RewardModelWrapper.from_pretrained(two[0]["rm_dir"], engine="transformers", batch_size=4)
    expected = single.score(["1+1"] * len(RM_TEXTS), RM_TEXTS)
    assert expected.std() > 0.05  # distinct scores, so a mix-up of rows would show
    torch.testing.assert_close(torch.cat([two[0]["scores"], two[1]["scores"]]), expected, atol=1e-5, rtol=1e-5)


def test_metrics_are_reduced_across_ranks(runs):
    single, ranks = runs
    for name in SCENARIOS:
        two = _two(ranks, name)
        per_rank = ("timing_s/", "perf/")  # each rank's own clock, added after the reduction
        same = [{k: v for k, v in out["metrics"].items() if not k.startswith(per_rank)} for out in two]
        assert same[0] == same[1]
        for key in EXACT_METRICS[name]:
            assert two[0]["metrics"][key] == pytest.approx(single[name]["metrics"][key], rel=1e-4, abs=1e-6), key
    expected = {"a": 2.0, "len_max": 7.0, "adv_min": -4.0, "timing_s/step": 2.0, "only_rank0": 5.0}
    assert ranks[0]["reduced"] == ranks[1]["reduced"] == expected


def test_an_error_on_rank_1_is_named_on_rank_0(runs):
    _, ranks = runs
    rank1, rank0 = ranks[1]["failure"], ranks[0]["failure"]
    assert rank1.startswith("RankFailure: rank 1 of 2") and "phase 'update' (step 7)" in rank1
    assert "ValueError: reward function crashed on row 3" in rank1
    # rank 0 was waiting in a collective: its error leads with rank 1's failure, not with "connection closed"
    assert rank0.startswith("RankFailure: rank 1 of 2"), rank0
    assert "reward function crashed on row 3" in rank0 and "then rank 0 stopped in phase 'update'" in rank0


def test_a_collective_timeout_names_the_phase(runs):
    _, ranks = runs
    message = ranks[0]["timeout"]
    assert message.startswith("RankFailure: rank 0 of 2: a collective timed out"), message
    assert "in phase 'forward' (step 2)" in message
    assert ranks[1]["timeout"] == "rank 1 took no part"
    for rank, out in enumerate(ranks):  # NCCL aborts instead of raising: the watchdog thread logs the phase
        assert f"rank {rank} of 2: phase 'score' (step 3) has run" in out["watchdog"]
        assert "longer than the collective timeout" in out["watchdog"]
        assert out["watchdog"].count("has run") == 1  # once per phase, not at every check


# ----- one process: the same calls are harmless no-ops, and bad settings fail before any GPU is used --------
def test_one_process_needs_no_launcher(monkeypatch):
    from phaserl.parallel import gather_full_params, init_distributed, rank_errors, reduce_metrics, reshard_params

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed() == (0, 1)
    model = torch.nn.Linear(2, 2)
    assert gather_full_params(model) is False and reshard_params(model) is False
    assert reduce_metrics({"train/reward_mean": 0.5}) == {"train/reward_mean": 0.5}
    with pytest.raises(ValueError, match="plain"):  # no rank prefix, no wrapping in one process
        with rank_errors():
            raise ValueError("plain")


def test_a_partial_torchrun_environment_is_named(monkeypatch):
    from phaserl.errors import ConfigError
    from phaserl.parallel import init_distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ConfigError, match="MASTER_ADDR.*torchrun"):
        init_distributed()


@pytest.mark.parametrize("role, settings, message", [
    ("critic", dict(cpu_offload=True), "forward-only roles"),
    ("actor", dict(cpu_offload=True), "offload_optimizer"),
    ("ref", dict(cpu_offload=True, sharding_strategy="NO_SHARD"), "FULL_SHARD with cpu_offload"),
    ("ref", dict(param_dtype="int8"), "bfloat16"),
])
def test_settings_that_cannot_work_are_rejected_with_the_reason(role, settings, message):
    from phaserl.errors import ConfigError
    from phaserl.parallel.fsdp import _check
    from phaserl.roles.parallel_settings import FSDPSettings

    with pytest.raises(ConfigError, match=message):
        _check(FSDPSettings(**settings), role, "cuda")
    _check(FSDPSettings(cpu_offload=True), "ref", "cuda")  # offloading the frozen reference is fine
