"""No command writes a run's files before its inputs validate: a quickstart or train that fails
while loading (no CUDA device, a missing data file) leaves the run directory as it was."""
import os

import pytest
import torch

from phaserl.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_quickstart_on_cuda_without_a_gpu_leaves_an_earlier_run_untouched(tmp_path, capsys):
    out = tmp_path / "qs"
    out.mkdir()
    (out / "config.yaml").write_text("the earlier run's config\n")
    assert main(["quickstart", "--out", str(out), "--device", "cuda"]) == 1
    assert "no CUDA device" in capsys.readouterr().err
    assert (out / "config.yaml").read_text() == "the earlier run's config\n"
    assert sorted(os.listdir(out)) == ["config.yaml"]


def test_train_with_a_missing_data_file_writes_no_run_directory(tmp_path, capsys):
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from _tiny_run import make_run_dir

    overrides = make_run_dir(str(tmp_path)) + [f"data.train_files=[{tmp_path / 'missing.jsonl'}]"]
    config = tmp_path / "run.yaml"
    config.write_text("trainer: {seed: 0}\n")
    assert main(["train", "--skip-doctor", str(config), *overrides]) == 1
    assert "missing.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists() and not (tmp_path / "ckpt").exists()
