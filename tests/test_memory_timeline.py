"""The memory timeline (phaserl.parallel.memory): a no-op off CUDA; on a GPU, one sample per phase and switch."""
import pytest
import torch

from _tiny_run import make_run_dir
from phaserl.parallel import mark_memory, record_memory, stop_recording


def test_off_cuda_nothing_is_recorded():
    assert record_memory("cpu") is None
    mark_memory("rollout", 0)
    assert stop_recording() == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_step_on_the_gpu_samples_every_phase_and_both_ends_of_each_switch(tmp_path):
    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer

    overrides = make_run_dir(str(tmp_path)) + ["trainer.device=cuda", "rollout.engine_compile=false",
                                               "rollout.engine_keep_awake=false"]  # the switch frees the KV cache
    trainer = RLTrainer.from_config(load_config(None, overrides))
    record_memory(trainer.actor.device)
    trainer.train_step()
    samples = stop_recording()
    labels = [s.label for s in samples]
    assert labels == ["step", "prompts", "rollout", "switch to rollout starts", "switch to rollout done",
                      "switch to training starts", "switch to training done", "score", "forward", "advantage",
                      "update"]
    by = {s.label: s for s in samples}
    kv = trainer.actor.last_switch["kv_cache_gb"]  # negative: freed by the switch back
    assert kv < 0
    assert by["switch to rollout done"].allocated_gb - by["switch to rollout starts"].allocated_gb >= -kv * 0.99
    assert by["switch to training done"].allocated_gb < by["switch to training starts"].allocated_gb
