"""Two TextArena games for the tests, written with the package's own classes and registered with its
registry: short enough for the tiny model's 64-token context, in the tiny world's format.

    TinySum-v0    one player: answer `57+68=`; a wrong answer hears `no 57+68=` (two tries); reward 1 if right
    TinyDuel-v0   two players take turns answering sums, two each; more right answers wins (+1 / -1, 0 a draw)

`sometimes_right(observation, player_id)` is a rule opponent: right on sums that are even.
"""
import random
import re

import textarena as ta
from textarena.envs.registration import ENV_REGISTRY


class TinySum(ta.Env):
    def __init__(self, tries: int = 2):
        self.tries = tries

    def reset(self, num_players: int, seed=None):
        self.state = ta.SinglePlayerState(num_players=num_players, seed=seed)
        a, b = random.randint(10, 99), random.randint(10, 99)
        self.state.reset(game_state={"question": f"{a}+{b}=", "answer": str(a + b), "tries": 0},
                         player_prompt_function=lambda player_id, game_state: game_state["question"])

    def step(self, action: str):
        game = self.state.game_state
        self.state.add_observation(from_id=0, message=action, observation_type=ta.ObservationType.PLAYER_ACTION)
        game["tries"] += 1
        if action.strip() == game["answer"]:
            self.state.set_outcome(reward=1.0, reason="right")
        elif game["tries"] >= self.tries:
            self.state.set_outcome(reward=0.0, reason="out of tries")
        else:
            self.state.add_observation(message=f"no {game['question']}",
                                       observation_type=ta.ObservationType.GAME_MESSAGE)
        return self.state.step()


class TinyDuel(ta.Env):
    def reset(self, num_players: int, seed=None):
        self.state = ta.TwoPlayerState(num_players=num_players, seed=seed)
        pairs = [(random.randint(10, 99), random.randint(10, 99)) for _ in range(4)]
        self.state.reset(game_state={"questions": [f"{a}+{b}=" for a, b in pairs],
                                     "answers": [str(a + b) for a, b in pairs], "scores": [0, 0], "move": 0})
        self.state.add_observation(to_id=0, message=self.state.game_state["questions"][0],
                                   observation_type=ta.ObservationType.GAME_MESSAGE)

    def step(self, action: str):
        game, pid = self.state.game_state, self.state.current_player_id
        self.state.add_observation(from_id=pid, message=action, observation_type=ta.ObservationType.PLAYER_ACTION)
        game["scores"][pid] += action.strip() == game["answers"][game["move"]]
        game["move"] += 1
        if game["move"] == 4:
            a, b = game["scores"]
            if a == b:
                self.state.set_draw(reason="as many right answers")
            else:
                self.state.set_winner(player_id=0 if a > b else 1, reason="more right answers")
        else:
            self.state.add_observation(to_id=1 - pid, message=game["questions"][game["move"]],
                                       observation_type=ta.ObservationType.GAME_MESSAGE)
        return self.state.step()


def sometimes_right(observation: str, player_id: int) -> str:
    a, b = map(int, re.findall(r"(\d+)\+(\d+)=", observation)[-1])
    return str(a + b if (a + b) % 2 == 0 else a + b + 1)


for _id, _entry in (("TinySum-v0", TinySum), ("TinyDuel-v0", TinyDuel)):
    if _id not in ENV_REGISTRY:
        ta.register(id=_id, entry_point=_entry)
