"""phaserl's CUDA allocator setting: expandable segments by default on a GPU run, the user's variable always wins
(phaserl/cuda_allocator.py). The switch itself is torch's; these tests check who decides and what is said."""
import os

import pytest
import torch

from _tiny_run import make_run_dir
from phaserl import cuda_allocator
from phaserl.cuda_allocator import DEFAULT, ENVS, configure_cuda_allocator


@pytest.fixture
def no_alloc_env(monkeypatch):
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", lambda s: calls.append(("old name", s)),
                        raising=False)
    monkeypatch.setattr(cuda_allocator, "ACTIVE", None)
    return calls


def test_without_a_user_setting_phaserl_turns_on_expandable_segments(no_alloc_env):
    line = configure_cuda_allocator()
    assert no_alloc_env == [DEFAULT] == ["expandable_segments:True"]
    assert line.startswith("expandable_segments:True (phaserl's default") and cuda_allocator.ACTIVE == line


@pytest.mark.parametrize("name", ENVS)
def test_the_users_allocator_variable_wins_whatever_it_says(no_alloc_env, monkeypatch, name):
    monkeypatch.setenv(name, "expandable_segments:False,max_split_size_mb:512")
    line = configure_cuda_allocator()
    assert no_alloc_env == []  # torch's allocator is not touched
    assert line == (f"{name}=expandable_segments:False,max_split_size_mb:512 (set in the environment: phaserl leaves "
                    "it as it is); without expandable segments the allocator can hold far more than the peak (0.5B, "
                    "32,640-token micro-batches: 62.8 GiB reserved for 35.8 allocated)")


def test_planned_says_what_the_builder_will_do_and_changes_nothing(no_alloc_env, monkeypatch):
    assert configure_cuda_allocator() == cuda_allocator.planned() and no_alloc_env == [DEFAULT]  # one call: configure's
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments: True")  # the user's, with expandable segments
    assert cuda_allocator.planned() == ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments: True (set in the environment: "
                                        "phaserl leaves it as it is)")
    assert no_alloc_env == [DEFAULT]


def test_a_torch_with_only_the_older_name_of_the_switch_gets_it_through_that(no_alloc_env, monkeypatch):
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings")
    configure_cuda_allocator()
    assert no_alloc_env == [("old name", DEFAULT)]


def test_a_torch_without_the_runtime_switch_gets_the_variable_before_cuda_starts(no_alloc_env, monkeypatch):
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings")
    monkeypatch.delattr(torch.cuda.memory, "_set_allocator_settings")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    configure_cuda_allocator()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == DEFAULT
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # too late to set the variable: say so
    assert configure_cuda_allocator().startswith("torch's defaults (CUDA was initialized")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_a_cpu_run_leaves_the_allocator_alone_and_its_summary_says_nothing_of_it(tmp_path, no_alloc_env):
    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer
    from phaserl.trainer.summary import run_summary

    trainer = RLTrainer.from_config(load_config(None, make_run_dir(str(tmp_path)) + ["trainer.loggers=[]"]))
    assert no_alloc_env == [] and cuda_allocator.ACTIVE is None
    assert "CUDA allocator" not in run_summary(trainer)


@pytest.mark.gpu
def test_on_a_gpu_the_run_summary_names_the_allocator_setting_and_a_step_runs_with_it(tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer
    from phaserl.trainer.summary import run_summary

    for name in ENVS:
        monkeypatch.delenv(name, raising=False)
    trainer = RLTrainer.from_config(load_config(None, make_run_dir(str(tmp_path)) + [
        "trainer.loggers=[]", "trainer.device=cuda"]))
    assert "CUDA allocator: expandable_segments:True (phaserl's default" in run_summary(trainer)
    trainer.train_step()  # the engine's graphs captured and replayed beside expandable segments


@pytest.mark.gpu
def test_on_a_gpu_the_doctors_memory_details_say_what_the_run_will_set(tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from phaserl.doctor import load_doctor_config, run_doctor

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    results = {r.name: r for r in run_doctor(load_doctor_config(None, make_run_dir(str(tmp_path)) + [
        "trainer.device=cuda"]), world_size=1)}
    assert ("CUDA allocator: PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512 (set in the environment: phaserl leaves it "
            "as it is); without expandable segments") in "\n".join(results["memory"].details)
