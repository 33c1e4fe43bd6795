"""Tests never write outside temporary directories: phaserl's first-use caches follow
$PHASERL_CACHE_DIR, which tests/conftest.py points at a temp dir, instead of ~/.cache/phaserl."""
import os
import tempfile

from phaserl.world import prepare_tiny_world
from phaserl.world.build import cache_root


def _inside_tmp(path) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(tempfile.gettempdir()) + os.sep)


def test_the_cache_root_follows_the_environment_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("PHASERL_CACHE_DIR", str(tmp_path / "cache"))
    world = prepare_tiny_world()
    assert world.train_file.startswith(str(tmp_path / "cache" / "tiny-world"))
    monkeypatch.delenv("PHASERL_CACHE_DIR")
    assert cache_root() == type(cache_root())(os.path.expanduser("~/.cache/phaserl"))


def test_the_test_suite_keeps_the_tiny_world_and_tiny_rm_caches_in_a_temp_dir():
    # The tiny reward model is trained into cache_root()/tiny-rm by tests that use `reward_model.path: tiny`.
    assert _inside_tmp(cache_root()) and _inside_tmp(prepare_tiny_world().train_file)
    assert _inside_tmp(os.environ["MPLCONFIGDIR"])
