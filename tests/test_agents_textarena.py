"""TextArena games through TextArenaEnvironment (skipped without the `textarena` extra): real games of the
package played by script (one player; two players against a rule opponent), the opponents (a rule, another
endpoint, a frozen copy of the model), the errors, and a few trainer steps on a one-player and a two-player
game with the trained ids checked against the sampler's."""
import dataclasses
import json
import os
import re

import pytest
import torch

pytest.importorskip("textarena")

from phaserl.agents.adapters.textarena import TextArenaEnvironment, make_opponent, records  # noqa: E402
from phaserl.config import load_config  # noqa: E402
from tests import _ta_games  # noqa: E402,F401  (registers TinySum-v0 and TinyDuel-v0)

ADAPTER = "phaserl.agents.adapters.textarena:TextArenaEnvironment"
GAMES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ta_games.py")


def test_a_one_player_game_of_the_package_step_by_step():
    env = TextArenaEnvironment("GuessTheNumber-v0")
    (first,) = env.reset({}, seed=3)
    assert first["role"] == "user" and first["content"].startswith("[GAME] You are Player 0. You are playing Guess")
    hints = [env.step(guess) for guess in ("10", "[5]")]  # a bare number gets its brackets (the action wrapper)
    assert [h.observation[0]["content"] for h in hints] == ["[GAME] The target number is lower.",
                                                            "[GAME] The target number is higher."]
    assert not any(h.done or h.reward for h in hints)  # only the new messages: the history is not re-sent
    for guess in range(6, 10):
        result = env.step(str(guess))
        if result.done:
            break
    assert result.done and result.reward == 1.0 and result.info["metrics"]["ta_invalid_move"] == 0.0
    assert result.info["textarena"]["reason"].startswith("Congratulations")
    env.reset({}, seed=3)  # the same seed, the same number
    assert [env.step(g).observation[0]["content"].split()[-1] for g in ("10", "5")] == ["lower.", "higher."]


def first_take(observation: str, player_id: int) -> str:
    """Nim: take one object from the first pile that has any (the piles as last shown)."""
    piles = dict(re.findall(r"pile (\d+): (\d+)", observation))
    return next(f"[{i} 1]" for i, n in piles.items() if int(n) > 0)


def test_a_two_player_game_of_the_package_against_a_rule_opponent():
    env = TextArenaEnvironment("Nim-v0", opponent=first_take, player_id=1)
    (first,) = env.reset({}, seed=0)
    text = first["content"]  # the opponent (player 0) moved first: the model sees its move and the board after
    assert "Welcome to Nim, Player 1!" in text and "[Player 0] [0 1]" in text and "pile 0: 2" in text
    result = env.step("[0 2]")  # empties pile 0; the opponent then takes from pile 1
    assert not result.done and "[Player 1]" not in result.observation[0]["content"]  # no echo of our own move
    assert "[Player 0] [1 1]" in result.observation[0]["content"]
    while not result.done:
        piles = dict(re.findall(r"pile (\d+): (\d+)", result.observation[0]["content"]))
        i, n = next((i, n) for i, n in piles.items() if int(n) > 0)
        result = env.step(f"[{i} {n}]")  # empty a whole pile each move
    assert result.reward in (1.0, -1.0) and result.info["metrics"]["ta_opponent_moves"] >= 2
    assert result.info["textarena"]["rewards"][1] == result.reward


def test_opponents_a_rule_a_class_another_endpoint_and_a_frozen_copy():
    pytest.importorskip("openai")
    from transformers import AutoTokenizer

    from phaserl.agents.completion import FakeBackend
    from phaserl.agents.server import ChatServer
    from phaserl.world import prepare_tiny_world

    rule = make_opponent(f"{GAMES}:sometimes_right", {})
    assert rule("12+34=\n7\n10+11=", 1) == "22"  # the last question; 21 is odd: answered wrong on purpose

    class Echo:
        def __init__(self, word):
            self.word = word

        def __call__(self, observation):  # TextArena's agents take the observation alone
            return self.word
    assert make_opponent(Echo, {"word": "[3]"})("anything", 1) == "[3]"

    world = prepare_tiny_world()
    tok = AutoTokenizer.from_pretrained(world.tokenizer_dir)
    backend = FakeBackend(lambda ids: tok("42", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                          eos_token_ids=(tok.eos_token_id,))
    with ChatServer(backend, tok) as server:
        endpoint = make_opponent({"endpoint": server.base_url, "model": "other", "system_prompt": None}, {})
        assert endpoint("12+34=", 1) == "42"
    assert tok.decode(list(backend.requests[0].prompt_ids)) == "<|user|>12+34=<|assistant|>"

    frozen = make_opponent({"model_path": world.model_dir, "max_new_tokens": 4}, {})
    env = TextArenaEnvironment("TinyDuel-v0", opponent={"model_path": world.model_dir, "max_new_tokens": 4},
                               tags=False)
    env.reset({}, seed=1)
    result = env.step("0")
    answer = frozen("\n".join(env._history[1]), 1)  # what it saw: our move "0" and its question
    assert re.fullmatch(r"\d+", answer) and result.observation[0]["content"].startswith(answer + "\n")


def test_errors_name_the_game_and_the_fix():
    with pytest.raises(ValueError, match="game 'NoSuchGame-v0'"):
        TextArenaEnvironment("NoSuchGame-v0")
    with pytest.raises(ValueError, match="needs an opponent"):
        TextArenaEnvironment("TinyDuel-v0", num_players=2)
    with pytest.raises(ValueError, match="player_id=2 is not a player of a 2-player game"):
        TextArenaEnvironment("TinyDuel-v0", opponent=first_take, player_id=2)
    with pytest.raises(ValueError, match=r"model_path: dir"):
        TextArenaEnvironment("TinyDuel-v0", opponent={"model": "x"})
    env = TextArenaEnvironment("TinySum-v0", seed_from_row=True)
    with pytest.raises(ValueError, match="no extra_info.seed"):
        env.reset({"extra_info": {}}, seed=0)


def test_records_fix_the_boards_through_seed_from_row(tmp_path):
    from phaserl.agents.adapters.textarena import main
    from phaserl.data.files import read_records

    path = tmp_path / "rows.jsonl"
    assert main(["TinySum-v0", "--size", "3", "--seed", "5", "--out", str(path)]) == 0
    rows = read_records(str(path))
    assert rows == records("TinySum-v0", size=3, seed=5) and rows[0]["prompt"][0]["role"] == "system"
    env = TextArenaEnvironment("TinySum-v0", seed_from_row=True, tags=False)
    boards = [env.reset(row, seed=i)[0]["content"] for i, row in enumerate(rows * 2)]
    assert boards[:3] == boards[3:] and len(set(boards)) == 3  # the row's seed, not the episode's


# ----- trainer steps on the tiny model ---------------------------------------------------------------
def _config(tmp_path, kwargs: dict, *extra):
    from phaserl.data import write_records

    write_records(str(tmp_path / "train.jsonl"), records("TinySum-v0", size=16, seed=0, system_prompt="play"))
    write_records(str(tmp_path / "val.jsonl"), records("TinySum-v0", size=4, seed=1, system_prompt="play"))
    return load_config(None, [
        "model.path=tiny", f"data.train_files=[{tmp_path / 'train.jsonl'}]",
        f"data.val_files=[{tmp_path / 'val.jsonl'}]",
        "data.max_prompt_length=16", "rollout.prompts_per_step=4", "rollout.batch_size=4", "rollout.n=2",
        "rollout.max_new_tokens=4", "rollout.val_temperature=0.0", f"agent.env={ADAPTER}",
        f"agent.kwargs={json.dumps(kwargs)}", "agent.max_turns=4", "agent.max_episode_tokens=64",
        "agent.workers=4", "agent.overlap=false", "algorithm.adv_estimator=grpo", "algorithm.kl_placement=none",
        "ppo.micro_batch_tokens=8192", "ppo.forward_micro_batch_tokens=8192", "trainer.total_steps=2",
        "trainer.device=cpu", "trainer.loggers=[jsonl]", f"trainer.log_dir={tmp_path / 'logs'}",
        f"trainer.checkpoint_path={tmp_path / 'ckpt'}", *extra])


def train_and_check(cfg) -> list:
    """Fit, keeping every training batch; each one's trained ids are its episodes' sampled and appended ids, the
    loss mask is 1 exactly on the sampled ones, and the model that sampled them gives back their log-probs."""
    from phaserl.roles.forward import batch_logprobs
    from phaserl.trainer import RLTrainer

    torch.manual_seed(0)
    trainer = RLTrainer.from_config(cfg)
    batches, phase = [], trainer.run.rollout_phase

    def keeping(tr, items, params, n):
        batch = phase(tr, items, params, n)
        if params is tr.run.sampling:
            with torch.no_grad():
                recomputed = batch_logprobs(tr.actor.model, batch, temperature=1.0, token_budget=8192)  # [B, R]
            batches.append((batch, recomputed))
        return batch
    trainer.run = dataclasses.replace(trainer.run, rollout_phase=keeping)
    trainer.fit()
    assert len(batches) == cfg.trainer.total_steps
    for batch, recomputed in batches:
        for i, episode in enumerate(batch.episodes):
            response = episode.response_ids()
            assert batch.response_ids[i, :len(response)].tolist() == response
            assert batch.loss_mask[i, :len(response)].tolist() == episode.loss_mask()
        mask = batch.loss_mask.bool()
        torch.testing.assert_close(recomputed[mask], batch.rollout_logprobs[mask], atol=1e-4, rtol=0)
    return [episode for batch, _ in batches for episode in batch.episodes]


@pytest.mark.slow  # two trainer steps, twice (about 20 s on 2 cores)
def test_a_one_player_and_a_two_player_game_train_on_the_sampled_ids(tmp_path):
    from transformers import AutoTokenizer

    from phaserl.world import prepare_tiny_world

    tok = AutoTokenizer.from_pretrained(prepare_tiny_world().tokenizer_dir)
    episodes = train_and_check(_config(tmp_path / "sum", {"game": "TinySum-v0", "tags": False}))
    retried = [ep for ep in episodes if ep.num_turns == 2]
    assert retried, "no episode had a second try: the observation mask went untested"
    for ep in retried:  # the game's question (at reset) and its "no <question>", each a user turn, masked out
        question, no = [tok.decode(s.token_ids) for s in ep.segments if s.kind == "observation"]
        assert question.startswith("<|user|>") and no == "<|user|>no " + question[len("<|user|>"):]
    assert {ep.reward for ep in episodes} <= {0.0, 1.0}

    lines = [json.loads(line) for line in open(tmp_path / "sum" / "logs" / "metrics.jsonl")]
    assert "val/score_mean" in lines[0] and "agent/ta_turns_mean" in lines[-1]

    episodes = train_and_check(_config(tmp_path / "duel", {"game": "TinyDuel-v0", "tags": False,
                                                           "opponent": f"{GAMES}:sometimes_right"}))
    assert all(ep.num_turns == 2 and ep.reward in (-1.0, 0.0, 1.0) for ep in episodes)
    assert all(ep.metrics["ta_opponent_moves"] == 2 for ep in episodes)
