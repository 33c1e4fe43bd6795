"""Adapters against the real packages (optional extras; each test skips when its package is missing)."""
import re

import pytest

from phaserl.agents.env import Environment, as_step_result


# ----- reasoning-gym -------------------------------------------------------------------------------
@pytest.mark.slow
def test_reasoning_gym_rows_score_with_the_datasets_own_score_answer(tmp_path):
    rg = pytest.importorskip("reasoning_gym")
    from phaserl.agents.adapters import reasoning_gym as adapter
    from phaserl.data.files import read_records
    from phaserl.rewards.registry import RuleRewards

    rows = adapter.records("basic_arithmetic", size=5, seed=3, config={"max_terms": 3})
    reference = rg.create_dataset("basic_arithmetic", size=5, seed=3, max_terms=3)
    assert [r["prompt"][0]["content"] for r in rows] == [e["question"] + adapter.INSTRUCTION for e in reference]
    assert [r["reward_model"]["ground_truth"] for r in rows] == [str(e["answer"]) for e in reference]
    # Through a file and the rule-reward machinery, as reward.functions would call it.
    path = tmp_path / "rg.parquet"
    adapter.main(["basic_arithmetic", "--size", "5", "--seed", "3", "--config", '{"max_terms": 3}', "--out", str(path)])
    records = read_records(str(path))
    assert [r["extra_info"] for r in records] == [r["extra_info"] for r in rows]
    rules = RuleRewards([("phaserl.agents.adapters.reasoning_gym:score", 1.0, {})])  # as reward.functions names it
    right = [f"so <answer>{e['answer']}</answer>" for e in reference]
    wrong = ["<answer>not a number</answer>", "no tag " + str(reference[1]["answer"]), "", "<answer></answer>", "x"]
    totals, _ = rules.score([r["prompt"] for r in records] * 2, right + wrong,
                            [r["reward_model"]["ground_truth"] for r in records] * 2, records * 2)
    assert totals[:5] == [1.0] * 5 and totals[5:] == [reference.score_answer(None, reference[0])] * 5 == [0.0] * 5
    assert adapter.score("", "\\boxed{%s}" % reference[0]["answer"], None, extra_info=rows[0]["extra_info"],
                         answer_format="boxed") == 1.0
    with pytest.raises(ValueError, match="extra_info.reasoning_gym"):
        adapter.score("", "<answer>1</answer>", None, extra_info={})


def test_reasoning_gym_environment_gives_retries_with_feedback():
    pytest.importorskip("reasoning_gym")
    from phaserl.agents.adapters.reasoning_gym import ReasoningGymEnvironment, records

    (row,) = records("basic_arithmetic", size=1, seed=0)
    answer = row["reward_model"]["ground_truth"]
    env = ReasoningGymEnvironment(attempts=3, decay=0.5)
    assert isinstance(env, Environment) and env.reset(row, seed=0) == ""
    first = env.step("<answer>999999</answer>")
    assert not first.done and "999999 is incorrect" in first.observation[0]["content"]
    assert "(none found)" in env.step("I do not know").observation[0]["content"]
    last = env.step(f"<answer>{answer}</answer>")
    assert last.done and last.reward == 0.25 and last.info["metrics"] == {"rg_attempts": 3.0, "rg_score": 1.0}
    env.reset(row, seed=0)
    assert env.step(f"<answer>{answer}</answer>").reward == 1.0
    with pytest.raises(ValueError, match="attempts=0"):
        ReasoningGymEnvironment(attempts=0)


# ----- Gym-style (GEM) ----------------------------------------------------------------------------
def test_gem_guess_the_number_through_the_gym_adapter():
    pytest.importorskip("gem")
    from phaserl.agents.adapters.gym import GymEnvironment

    env = GymEnvironment(make="gem:make", make_kwargs={"env_id": "game:GuessTheNumber-v0-easy"})
    first = env.reset({"prompt": ""}, seed=0)
    assert first[0]["role"] == "user" and "Guess The Number" in first[0]["content"]
    low, high = map(int, re.search(r"between (\d+) and (\d+)", first[0]["content"]).groups())
    rewards, done, turns = [], False, 0
    while not done and turns < 10:  # binary search on the env's own text feedback
        guess = (low + high) // 2
        result = as_step_result(env.step(f"my guess: \\boxed{{{guess}}}"), where="test")
        rewards.append(result.reward)
        done, turns = result.done, turns + 1
        text = result.observation[0]["content"] if result.observation else ""
        if "higher" in text:
            low = guess + 1
        elif "lower" in text:
            high = guess - 1
    env.close()
    assert done and rewards[-1] > 0  # found within the env's turn limit, rewarded by the env itself
    assert sum(rewards[:-1]) == 0


def test_gym_adapter_passes_seed_and_row_options_and_rejects_non_text():
    from phaserl.agents.adapters.gym import GymEnvironment

    class Echo:
        def reset(self, seed=None, options=None):
            self.seed = seed
            return f"task {options['q']} seed {seed}", {}

        def step(self, action):
            return "", float(action == "42"), True, False, {"turns": 1}

    env = GymEnvironment(make=Echo, options_from_row=True, observation_as="text")
    assert env.reset({"q": "life"}, seed=7) == "task life seed 7"
    result = env.step("42")
    assert (result.observation, result.reward, result.done, result.info) == (None, 1.0, True, {"turns": 1})

    class Pixels(Echo):
        def reset(self, seed=None, options=None):
            return [[0, 1], [1, 0]], {}

    with pytest.raises(ValueError, match="returned a list observation"):
        GymEnvironment(make=Pixels).reset({}, seed=0)
    with pytest.raises(ValueError, match="'package.module:name'"):
        GymEnvironment(make="no_colon_here")


# ----- OpenEnv ------------------------------------------------------------------------------------
def _word_env():
    """A small OpenEnv environment built on the real base classes: guess a word, get letter feedback."""
    from openenv.core.env_server import Action, Observation, State
    from openenv.core.env_server import Environment as OEnv
    from pydantic import Field

    class GuessAction(Action):
        guess: str = Field(..., description="the guessed word")

    class GuessObservation(Observation):
        feedback: str = ""

    class WordEnv(OEnv[GuessAction, GuessObservation, State]):
        def __init__(self, secret: str = "cat"):
            super().__init__()
            self.secret, self._state = secret, State()

        def reset(self, seed=None, episode_id=None, **kwargs):
            self._state = State(episode_id=episode_id, step_count=0)
            return GuessObservation(feedback=f"guess a {len(self.secret)}-letter word", done=False, reward=None)

        def step(self, action, timeout_s=None, **kwargs):
            self._state.step_count += 1
            hits = sum(a == b for a, b in zip(action.guess.strip(), self.secret))
            solved = action.guess.strip() == self.secret
            return GuessObservation(feedback="" if solved else f"{hits} letters in place", done=solved,
                                    reward=1.0 if solved else 0.0, metadata={"step": self._state.step_count})

        @property
        def state(self):
            return self._state

    return WordEnv, GuessAction


@pytest.mark.slow
def test_openenv_environment_in_process():
    pytest.importorskip("openenv")
    from phaserl.agents.adapters.openenv import OpenEnvEnvironment

    WordEnv, GuessAction = _word_env()
    env = OpenEnvEnvironment(make=WordEnv, make_kwargs={"secret": "dog"})
    assert env.reset({}, seed=1) == [{"role": "user", "content": "guess a 3-letter word"}]
    miss = env.step("dig")
    assert (miss.observation, miss.reward, miss.done) == ([{"role": "user", "content": "2 letters in place"}], 0.0,
                                                          False)
    hit = env.step(" dog\n")
    assert hit.done and hit.reward == 1.0 and hit.observation is None
    assert hit.info["openenv_metadata"] == {"step": 2}
    # An explicit builder and field selection work too; an ambiguous Action class is a clear error.
    built = OpenEnvEnvironment(make=WordEnv, action=lambda text: GuessAction(guess=text.upper().lower()),
                               observation_field="feedback", observation_as="text")
    assert built.reset({}, seed=0) == "guess a 3-letter word"
    from openenv.core.env_server import Action

    class TwoStrings(Action):
        a: str
        b: str

    with pytest.raises(ValueError, match=r"string fields \['a', 'b'\]; name the one"):
        OpenEnvEnvironment(make=WordEnv, action=TwoStrings)


@pytest.mark.slow
def test_openenv_client_style_step_results_are_unwrapped():
    pytest.importorskip("openenv")
    from openenv.core.client_types import StepResult as ClientStepResult

    from phaserl.agents.adapters.openenv import OpenEnvEnvironment

    WordEnv, GuessAction = _word_env()

    class FakeClient:  # the shape of openenv's SyncEnvClient: StepResult(observation, reward, done)
        def __init__(self):
            self.inner = WordEnv("ox")

        def reset(self, **kwargs):
            return ClientStepResult(self.inner.reset(**kwargs), reward=None, done=False)

        def step(self, action, **kwargs):
            obs = self.inner.step(action)
            return ClientStepResult(obs, reward=obs.reward, done=obs.done)

    env = OpenEnvEnvironment(make=FakeClient, action=GuessAction)
    assert env.reset({}, seed=0)[0]["content"] == "guess a 2-letter word"
    assert env.step("ox").reward == 1.0
