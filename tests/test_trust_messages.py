"""Messages of engineer trust: each used to be silence, a traceback, or a failure after training.

- a checkpoint_path or log_dir that is a file, or a disk too full for a checkpoint, passed the doctor and
  failed at the first save;
- critic.* with GRPO was ignored without a word;
- a truncated safetensors file gave a raw error that named no file;
- `phaserl train` on an empty file trained the built-in tiny task; Ctrl-C before training printed a
  traceback.
"""
import collections
import os
import signal
import warnings

import pytest

from _tiny_run import make_model_dir, make_run_dir
from phaserl.cli import main
from phaserl.config import load_config
from phaserl.doctor import FAIL, OK, load_doctor_config, run_doctor
from phaserl.doctor.storage import checkpoint_bytes
from phaserl.errors import ConfigError


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("messages"))
    return {"root": root, "overrides": make_run_dir(root)}


def _write_check(run, *extra):
    results = run_doctor(load_doctor_config(None, run["overrides"] + list(extra)))
    return next(r for r in results if r.name == "write paths")


def test_the_doctor_passes_writable_paths_and_states_the_checkpoint_size(run):
    result = _write_check(run)
    assert result.status == OK and "writable" in result.message and "one checkpoint is about" in result.message


def test_the_doctor_fails_a_checkpoint_path_that_is_a_file(run, tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("not a directory")
    result = _write_check(run, f"trainer.checkpoint_path={path}")
    assert result.status == FAIL and f"trainer.checkpoint_path = '{path}' is an existing file" in result.message


def test_the_doctor_fails_a_log_dir_under_a_file(run, tmp_path):
    (tmp_path / "f").write_text("")
    result = _write_check(run, f"trainer.log_dir={tmp_path / 'f' / 'logs'}")
    assert result.status == FAIL and "cannot be created" in result.message


def test_the_doctor_fails_a_disk_without_room_for_two_checkpoints(run, monkeypatch):
    from phaserl.doctor import storage

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    result = _write_check(run)
    assert result.status == FAIL
    assert "1000 B free under trainer.checkpoint_path, less than two checkpoints" in result.message


def test_checkpoint_size_counts_weights_and_both_adam_moments_per_role():
    assert checkpoint_bytes(1000, 2, roles=2, export_hf=True) == 1000 * 2 * (3 * 2 + 1)


def test_critic_keys_with_grpo_warn_naming_them():
    with pytest.warns(UserWarning, match=r"critic.path, critic.optim.lr are ignored: algorithm.adv_estimator = grpo "
                                         r"trains no critic"):
        load_config(None, ["algorithm.adv_estimator=grpo", "critic.path=/models/critic", "critic.optim.lr=1e-4"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the same keys with a critic-based estimator: used, no warning
        load_config(None, ["algorithm.adv_estimator=gae", "critic.path=/models/critic", "critic.optim.lr=1e-4"])


def test_a_truncated_safetensors_file_is_named_with_the_fix(tmp_path):
    from phaserl.models import load_pretrained

    model = make_model_dir(str(tmp_path))
    weights = os.path.join(model, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(ConfigError, match=rf"{weights}: not a complete safetensors file .*Re-download the model or "
                                          "re-export it"):
        load_pretrained(model)


def test_train_on_an_empty_config_file_stops_and_names_defaults(tmp_path, capsys):
    empty = tmp_path / "cfg.yaml"
    empty.write_text("# nothing yet\n")
    assert main(["train", str(empty), "--skip-doctor"]) == 1
    assert "is empty (or holds only comments)" in capsys.readouterr().err
    assert main(["train"]) == 2
    assert "give a CONFIG file (or --defaults" in capsys.readouterr().err


def test_ctrl_c_and_sigterm_outside_the_loop_exit_with_a_line(monkeypatch, capsys, tmp_path):
    import phaserl.config

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(phaserl.config, "load_config", interrupted)
    assert main(["config", str(tmp_path / "x.yaml")]) == 130
    assert "stopped by Ctrl-C outside the training loop" in capsys.readouterr().err

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(phaserl.config, "load_config", terminated)
    assert main(["config", str(tmp_path / "x.yaml")]) == 143
    assert "stopped by SIGTERM outside the training loop" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL   # restored afterwards


def test_train_with_a_log_dir_that_is_a_file_stops_with_the_key(run, tmp_path, capsys):
    (tmp_path / "logs").write_text("a file")
    code = main(["train", "--defaults", "--skip-doctor", *run["overrides"], f"trainer.log_dir={tmp_path / 'logs'}"])
    assert code == 1
    assert f"trainer.log_dir='{tmp_path / 'logs'}' cannot be used as a directory" in capsys.readouterr().err
