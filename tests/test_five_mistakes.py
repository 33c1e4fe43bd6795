"""The five classic mistakes, each committed the way the article describes it, and the runtime guards.

Every test asserts that the user gets phaserl's message (ConfigError / RewardError / PreflightError,
naming the cause and the fix), not a stack trace from deep inside torch. docs/five-mistakes.md
quotes these messages.
"""
import json
import logging
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _tiny_rm import make_reward_model_dir
from _tiny_run import make_run_dir
from phaserl import Critic, HybridActor, ReferencePolicy, RewardModelWrapper, RLTrainer, load_config
from phaserl.doctor import FAIL, load_doctor_config, run_doctor
from phaserl.doctor.checks import Context, check_shared_paths
from phaserl.doctor.probes import check_reference_frozen
from phaserl.errors import ConfigError, PreflightError, RewardError
from phaserl.models import ValueModel, load_pretrained
from phaserl.trainer.advantage_phase import nonfinite_advantage_cause
from phaserl.trainer.guard import RuntimeGuard

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("mistakes")
    return {"root": str(root), "overrides": make_run_dir(str(root))}


def trainer_for(tiny, *extra) -> RLTrainer:
    return RLTrainer.from_config(load_config(None, tiny["overrides"] + ["trainer.val_before_train=false",
                                                                        "trainer.loggers=[jsonl]", *extra]))


def doctor_result(tiny, name: str, *extra):
    results = run_doctor(load_doctor_config(None, tiny["overrides"] + list(extra)))
    return next(r for r in results if r.name == name)


# ---- 1. actor and critic wrapped with the same FSDP config ------------------------------------------------

def test_1_a_critic_given_the_actors_hybrid_engine_config_is_refused(tiny):
    value_model = ValueModel(load_pretrained(load_config(None, tiny["overrides"]).model.path))
    with pytest.raises(ConfigError, match="Critic: hybrid_engine_config=.* is not allowed. Only HybridActor "
                                          "switches between rollout and training mode"):
        Critic(model=value_model, hybrid_engine_config=dict(enable_rollout_optimization_switch=True))
    fsdp_config = dict(sharding_strategy="FULL_SHARD", enable_rollout_optimization_switch=True)  # "one config"
    with pytest.raises(ConfigError, match="Critic: fsdp_config has the actor's hybrid-engine key"):
        Critic(model=value_model, fsdp_config=fsdp_config)
    with pytest.raises(ConfigError, match="actor fsdp_config has hybrid-engine key"):
        HybridActor(model=load_pretrained(load_config(None, tiny["overrides"]).model.path), fsdp_config=fsdp_config)


def test_1_critic_hybrid_engine_in_yaml_stops_the_load_and_fails_the_doctor(tiny, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("critic:\n  hybrid_engine: {enable_rollout_optimization_switch: true}\n")
    with pytest.raises(ConfigError, match="critic.hybrid_engine must be null: only the actor generates"):
        load_config(str(path), tiny["overrides"])
    result = run_doctor(load_doctor_config(str(path), tiny["overrides"]))[1]
    assert (result.name, result.status) == ("parallel settings", FAIL)
    assert "(classic mistake 1). Delete critic.hybrid_engine" in result.message


@pytest.mark.slow
def test_1_only_the_actor_switches_modes_and_says_so(tiny, caplog):
    trainer = trainer_for(tiny, "algorithm.adv_estimator=gae")  # a critic is trained too
    with caplog.at_level(logging.INFO, logger="phaserl"):
        trainer.train_step()
    switches = [r.getMessage() for r in caplog.records if "[HybridEngine]" in r.getMessage()]
    assert [s.split(" (")[0] for s in switches] == ["[HybridEngine] Switching actor from training to rollout mode",
                                                   "[HybridEngine] Switching actor from rollout to training mode"]


# ---- 2. reward model fed the wrong input format --------------------------------------------------------

def test_2_a_response_field_the_rows_do_not_have_is_named(tiny):
    path = make_reward_model_dir(tiny["root"], name="rm_ok")
    rm = RewardModelWrapper.from_pretrained(path, apply_chat_template=False)
    rows = [{"prompt": "Change a tyre?", "chosen_response": "Loosen the nuts.", "rejected_response": "No."}]
    with pytest.raises(RewardError, match="row 0 has no 'response' field .* response_key='chosen_response'"):
        rm.score_rows(rows)


@pytest.mark.slow
def test_2_a_nan_reward_model_stops_at_the_score_phase_naming_the_format(tiny):
    path = make_reward_model_dir(tiny["root"], name="rm_nan", head="nan")
    trainer = trainer_for(tiny, "reward_model.enable=true", f"reward_model.path={path}", "reward.functions=[]",
                          "reward_model.max_length=128")
    with pytest.raises(RewardError, match="non-finite scores .* Likely cause: the input format probably does not "
                                          "match what the reward model was trained on"):
        trainer.train_step()


def test_2_a_constant_reward_model_fails_the_doctor_probe(tiny):
    path = make_reward_model_dir(tiny["root"], name="rm_zero", head="zero")
    result = doctor_result(tiny, "reward model", "reward_model.enable=true", f"reward_model.path={path}",
                           "reward_model.max_length=128")
    assert result.status == FAIL and "gave the same score 0 to all 4 responses" in result.message
    assert "check apply_chat_template / chat_template, response_key" in result.message


def test_2_non_finite_advantages_name_the_reward_models_input_format():
    scores = torch.tensor([1.0, float("nan"), 0.5, 0.0])  # [B]
    advantages = torch.tensor([[0.5, 0.5], [float("nan")] * 2, [0.0, 0.0], [-0.5, -0.5]])  # [B, R]
    with pytest.raises(PreflightError, match=r"non-finite advantages: 1 of 4 scores are non-finite: the reward "
                                             r"model probably received the wrong input format"):
        RuntimeGuard("stop").advantages_ok(nonfinite_advantage_cause(advantages, scores, None), step=0)
    assert RuntimeGuard("skip").advantages_ok(nonfinite_advantage_cause(advantages, scores, None), step=0) is False


# ---- 3. reference policy left trainable ------------------------------------------------------------------

@pytest.mark.slow
def test_3_a_reference_made_trainable_after_construction_stops_the_next_step(tiny):
    trainer = trainer_for(tiny)
    assert not any(p.requires_grad for p in trainer.ref_policy.model.parameters())  # frozen by construction
    trainer.ref_policy.model.requires_grad_(True)
    with pytest.raises(PreflightError, match=r"ReferencePolicy has \d+ trainable parameter\(s\) "
                                             r"\(model\.embed_tokens\.weight, .*Trying to backward through the graph"):
        trainer.train_step()


def test_3_a_reference_sharing_the_actors_weights_fails_the_check(tiny):
    policy = load_pretrained(load_config(None, tiny["overrides"]).model.path)
    result = check_reference_frozen(ReferencePolicy(model=policy), actor_model=policy)
    assert result.status == FAIL and "freezing the reference froze the actor" in result.message


def test_3_a_reference_sharing_the_actors_weights_is_refused_by_the_trainer(tiny):
    policy = load_pretrained(load_config(None, tiny["overrides"]).model.path)
    with pytest.raises(PreflightError, match="shares"):
        RLTrainer(actor=HybridActor(model=policy), ref_policy=ReferencePolicy(model=policy),
                  config=load_config(None, tiny["overrides"]))


# ---- 4. one global batch size for every phase ---------------------------------------------------------------

def test_4_one_size_everywhere_is_refused_with_the_arithmetic():
    # The article's user sets "batch_size 32" everywhere: 32 prompts × 4 samples = 128 responses, not 32 × 1.
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.batch_size=32", "reward_model.batch_size=32", "ppo.mini_batch_size=32"])
    assert ("ppo.mini_batch_size × ppo.num_mini_batches = 32 × 1 = 32 responses, but rollout.prompts_per_step × "
            "rollout.n = 32 × 4 = 128 responses per step") in str(e.value)
    with pytest.raises(ConfigError, match=r"rollout.prompts_per_step = 6 is not divisible by world_size = 4 "
                                          r"\(prompts per rank = 6 / 4 = 1.5\)"):
        load_config(None, ["rollout.prompts_per_step=6"], world_size=4)
    with pytest.raises(ConfigError, match=r"ppo.micro_batch_tokens = 128 cannot hold one full sequence: "
                                          r"data.max_prompt_length \+ rollout.max_new_tokens = 128 \+ 64 = 192"):
        load_config(None, ["ppo.micro_batch_tokens=128"])


def test_4_the_doctor_prints_the_arithmetic_and_sizes_for_this_machine(tiny):
    results = {r.name: r for r in run_doctor(load_doctor_config(None, tiny["overrides"] + [
        "rollout.prompts_per_step=5", "ppo.num_mini_batches=4"]))}
    assert results["batch sizes"].status == FAIL
    assert "5 × 2 = 10 responses per step do not split into ppo.num_mini_batches = 4" in results["batch sizes"].message
    assert results["memory"].details[-1].startswith("suggested for this machine: rollout.batch_size=5 "
                                                    "ppo.micro_batch_tokens=")


# ---- 5. checkpoints and logs on a node-local path -------------------------------------------------------------

def _rank_main(rank: int, world: int, port: int, root: str, overrides: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        node = os.path.join(root, f"node{rank}")  # each "node" has its own ./checkpoints, as in the article
        os.makedirs(node, exist_ok=True)
        os.chdir(node)
        local = overrides + ["trainer.checkpoint_path=checkpoints", "trainer.log_dir=logs"]
        result = check_shared_paths(Context(cfg=load_doctor_config(None, local), world_size=world))
        error = ""
        try:
            RLTrainer.from_config(load_config(None, local + ["trainer.loggers=[jsonl]"], world_size=world)).fit()
        except PreflightError as exc:
            error = str(exc)
        with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
            json.dump([result.status, result.message, error], f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_5_node_local_checkpoints_stop_every_rank_naming_ranks_and_hosts(tiny, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork: the ranks inherit the imported modules (spawn would import torch and transformers twice more)
    mp.start_processes(_rank_main, args=(2, port, str(tmp_path), tiny["overrides"]), nprocs=2, join=True,
                       start_method="fork")
    host = socket.gethostname()
    for rank in (0, 1):
        status, message, error = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert status == FAIL and error == message
        assert message.startswith("stopping before training: trainer.checkpoint_path='checkpoints' is not shared "
                                  f"between ranks: rank 0 on host {host}")
        assert f"cannot see the marker files of rank 1 on host {host}" in message
        assert "mount shared storage" in message
    assert not os.listdir(tmp_path / "node1" / "checkpoints")  # markers are cleaned up; nothing was trained


# ---- runtime guards ---------------------------------------------------------------------------------------------

def _nan_in_training(trainer):
    """Make the actor's training-mode forward produce NaN (rollout and old log-probs run in eval mode)."""
    def hook(module, inputs, output):
        return output * float("nan") if module.training else output
    return trainer.actor.model.register_forward_hook(hook)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()`")
def test_guard_a_non_finite_loss_stops_the_run(tiny):
    trainer = trainer_for(tiny)
    _nan_in_training(trainer)
    with pytest.raises(PreflightError, match=r"step 1: actor/pg_loss=nan.*actor/grad_norm=nan\. a non-finite loss "
                                             r"usually comes from non-finite advantages or rewards"):
        trainer.train_step()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()`")
def test_guard_on_nonfinite_skip_skips_the_optimizer_step(tiny, caplog):
    trainer = trainer_for(tiny, "trainer.on_nonfinite=skip")
    before = [p.detach().clone() for p in trainer.actor.model.parameters()]
    _nan_in_training(trainer)
    with caplog.at_level(logging.WARNING, logger="phaserl"):
        trainer.train_step()
    assert "the optimizer step was skipped (trainer.on_nonfinite=skip)" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.actor.model.parameters()))


def test_guard_rewards_constant_for_five_steps_warn_once(caplog):
    guard = RuntimeGuard(constant_reward_steps=5)
    with caplog.at_level(logging.WARNING, logger="phaserl"):
        for step in range(4):
            guard.check_rewards(torch.zeros(8), step)
        assert caplog.text == ""
        guard.check_rewards(torch.zeros(8), 4)
        guard.check_rewards(torch.zeros(8), 5)
    assert caplog.text.count("every response of the last 5 steps got the same reward (0)") == 1
    guard.check_rewards(torch.tensor([0.0, 1.0]), 6)  # a varied batch resets the count
    assert guard._constant_run == 0


@pytest.mark.slow
def test_guard_constant_rewards_warn_during_a_real_run(tiny, caplog):
    # The untrained tiny policy never answers a digit correctly: tiny_exact gives 0 to every response.
    trainer = trainer_for(tiny)
    with caplog.at_level(logging.WARNING, logger="phaserl"):
        for _ in range(4):
            trainer.train_step()
        assert "got the same reward" not in caplog.text
        trainer.train_step()
    assert "every response of the last 5 steps got the same reward (0)" in caplog.text
    assert "reward-model input format (`phaserl doctor CONFIG`)" in caplog.text
