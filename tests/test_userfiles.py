"""phaserl/userfiles.py: the one loader of user code that configs name (reward functions, environments,
harnesses, tools): a file runs once whoever asks for it, and every failure names the setting, the file and the fix."""
import pytest

from phaserl.agents.loader import load_environment_class
from phaserl.errors import ConfigError
from phaserl.rewards.registry import resolve_reward_fn
from phaserl.userfiles import load_file, load_module, split_spec


def test_a_file_named_by_a_reward_and_an_environment_runs_once(tmp_path):
    path = tmp_path / "both.py"
    path.write_text("import builtins\nbuiltins.phaserl_runs = getattr(builtins, 'phaserl_runs', 0) + 1\n"
                    "def score(prompt, response, ground_truth, **row):\n    return 1.0\n"
                    "class Env:\n    def reset(self, row, *, seed):\n        pass\n"
                    "    def step(self, action):\n        pass\n")
    import builtins

    fn = resolve_reward_fn(f"{path}:score")
    cls = load_environment_class(f"{path}:Env")
    assert builtins.phaserl_runs == 1 and fn.__module__ == cls.__module__
    del builtins.phaserl_runs


def test_a_missing_file_names_the_setting_the_path_and_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"agent.env='nope.py:Env': file nope.py not found \(looked at .*nope.py; "
                                          r"relative paths are relative to the working directory"):
        load_environment_class("nope.py:Env")


def test_a_file_that_raises_is_named_with_its_error_and_can_be_loaded_after_the_fix(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('half-written')\n")
    with pytest.raises(ConfigError, match=r"reward function 'x': importing .*broken.py failed with RuntimeError: "
                                          "half-written"):
        load_file(str(path), "reward function 'x'")
    path.write_text("VALUE = 3\n")
    assert load_file(str(path), "reward function 'x'").VALUE == 3  # nothing of the failed run was kept


def test_a_module_that_cannot_be_imported_says_how_to_give_a_file_instead():
    with pytest.raises(ConfigError, match=r"agent.harness='phaserl_no_such_module:h': cannot import "
                                          r"phaserl_no_such_module .*'path/to/file.py:function'"):
        load_module("phaserl_no_such_module", "agent.harness='phaserl_no_such_module:h'", name_hint="function")


def test_split_spec_takes_both_forms_and_names_the_key_when_malformed():
    assert split_spec("envs/maze.py:Maze", "agent.env") == ("envs/maze.py", "Maze")
    assert split_spec("pkg.mod.Maze", "agent.env") == ("pkg.mod", "Maze")
    with pytest.raises(ConfigError, match="agent.env is empty; set it to 'path/to/file.py:ClassName'"):
        split_spec("  ", "agent.env", name_hint="ClassName")
    with pytest.raises(ConfigError, match=r"agent.env='Maze': write 'path/to/file.py:name'"):
        split_spec("Maze", "agent.env")
