"""TextArena games as phaserl Environments: single-player games, and games against fixed opponents.

TextArena (`pip install "phaserl[textarena]"`) plays a game as

    game = ta.make("TicTacToe-v0"); game.reset(num_players, seed)
    loop: player_id, messages = game.get_observation(); done, info = game.step(move)
    rewards, game_info = game.close()

`TextArenaEnvironment` plays player `player_id` with the model being trained and every other player
with `opponent`, a fixed policy:

    agent:
      env: phaserl.agents.adapters.textarena:TextArenaEnvironment
      kwargs: {game: "TicTacToe-v0", opponent: "my_policies.py:first_free_square"}

- The model sees, each turn, the game's messages since its last move as one user message (`[GAME] ...`,
  `[Player 1] ...` lines, as TextArena's LLM wrapper writes them; `tags: false` for the text alone); its
  own move is not echoed back. The game's observation wrappers, which re-send the whole history every
  turn, are removed (the conversation already holds it); its action wrappers stay (TextArena's
  ActionFormattingWrapper puts a bare move in brackets).
- Reward: the model's player's reward from `game.close()` on the last step (0 on the others: TextArena
  scores at the end). `info["metrics"]`: `ta_invalid_move`, `ta_turns`, `ta_opponent_moves`.
- `opponent` is a function `(observation, player_id) -> move` or a class made with `opponent_kwargs`
  whose instances are called with the observation (TextArena's own agents), named as
  'path/to/file.py:name' or 'package.module:name'; or `{endpoint: base_url, model: name}`: another
  model behind an OpenAI-compatible endpoint; or `{model_path: dir}`: a frozen copy of a model (e.g.
  the policy's initial weights) loaded with transformers and played greedily, one per process. An
  opponent sees its whole history (what TextArena's agents expect), tags included.
- Seeds: the game is reset with the episode's seed, or with the row's `extra_info.seed` when
  `seed_from_row` (so a data file fixes the boards). TextArena seeds Python's global `random` in reset;
  resets run one at a time here, but a game or opponent that draws from it later is reproducible only
  with agent.workers = 1.

`records(game, size, seed)` writes the data rows (a short system prompt; the game's rules come as the
first observation): `python -m phaserl.agents.adapters.textarena TicTacToe-v0 --size 1000 --out train.jsonl`.
Not here: more than one trained player per game, games whose players move at once.
"""
from __future__ import annotations

import argparse
import inspect
import random
import threading
from typing import Optional, Union

from phaserl.agents.env import Environment, StepResult
from phaserl.agents.tools import load_object

SYSTEM_PROMPT = ("You are playing a text game. Read the rules and the game's messages, then answer with your move "
                 "in the format the game asks for (usually in square brackets, e.g. [4]).")
_RESET = threading.Lock()      # TextArena's reset seeds the process-wide `random` module


def _ta():
    try:
        import textarena
    except ImportError as exc:
        raise ImportError("the TextArena adapter needs the package: pip install textarena "
                          "(or pip install \"phaserl[textarena]\")") from exc
    return textarena


class TextArenaEnvironment(Environment):
    def __init__(self, game: str, opponent: Union[str, dict, None] = None, opponent_kwargs: Optional[dict] = None,
                 player_id: int = 0, num_players: Optional[int] = None, game_kwargs: Optional[dict] = None,
                 seed_from_row: bool = False, tags: bool = True):
        ta = _ta()
        self.name = game
        try:
            made = ta.make(game, **dict(game_kwargs or {}))
        except (ValueError, ImportError) as exc:
            raise ValueError(f"TextArenaEnvironment: game {game!r}: {exc}") from exc
        self.game = _without_observation_wrappers(made, ta)
        self.num_players = num_players if num_players is not None else (1 if opponent is None else 2)
        if not 0 <= player_id < self.num_players:
            raise ValueError(f"TextArenaEnvironment: player_id={player_id} is not a player of a "
                             f"{self.num_players}-player game of {game}")
        if self.num_players > 1 and opponent is None:
            raise ValueError(f"TextArenaEnvironment: {game} with num_players={self.num_players} needs an opponent: a "
                             "function 'file.py:name', {endpoint: ..., model: ...} or {model_path: ...}")
        self.opponent = make_opponent(opponent, dict(opponent_kwargs or {})) if opponent is not None else None
        self.player_id, self.seed_from_row, self.tags = player_id, seed_from_row, tags
        self._history: dict = {}        # player id -> the lines it has seen (opponents get the whole history)
        self._opponent_moves = 0

    def reset(self, row, *, seed: int):
        if self.seed_from_row:
            extra = (row.get("extra_info") if isinstance(row, dict) else getattr(row, "extra_info", None)) or {}
            if "seed" not in extra:
                raise ValueError(f"TextArenaEnvironment({self.name}): seed_from_row is set but the row has no "
                                 "extra_info.seed (records() writes it)")
            seed = int(extra["seed"])
        with _RESET:
            self.game.reset(num_players=self.num_players, seed=seed)
        self._history, self._opponent_moves = {}, 0
        text, done = self._advance()
        if done:
            raise ValueError(f"TextArenaEnvironment({self.name}): the game ended before player {self.player_id}'s "
                             "first move")
        return [{"role": "user", "content": text}]

    def step(self, action: str) -> StepResult:
        done, _ = self.game.step(action)
        text = None
        if not done:
            text, done = self._advance()
        if not done:
            return StepResult([{"role": "user", "content": text}], 0.0, False, {})
        rewards, game_info = self.game.close()
        mine = (game_info or {}).get(self.player_id, {})
        metrics = {"ta_invalid_move": float(bool(mine.get("invalid_move"))),
                   "ta_turns": float(mine.get("turn_count", 0)), "ta_opponent_moves": float(self._opponent_moves)}
        return StepResult(None, float((rewards or {}).get(self.player_id, 0.0)), True,
                          {"metrics": metrics, "textarena": {"reason": mine.get("reason"), "rewards": rewards}})

    def close(self) -> None:
        pass  # game.close() scores the game: it is called once, on the last step

    def _advance(self) -> tuple:
        """Let the other players move until it is the model's turn: (the model's new text, False), or (None, True)
        when the game ended first."""
        while True:
            pid, messages = self.game.get_observation()
            lines = self._lines(pid, messages)
            if pid == self.player_id:
                return "\n".join(lines), False
            self._opponent_moves += 1
            done, _ = self.game.step(self.opponent("\n".join(self._history[pid]), pid))
            if done:
                return None, True

    def _lines(self, pid: int, messages) -> list:
        ta = _ta()
        lines = []
        for sender, message, kind in messages or []:
            if kind == ta.ObservationType.PLAYER_ACTION and sender == pid:
                continue  # the player's own move: already in its conversation
            who = "GAME" if sender == ta.GAME_ID else self.game.state.role_mapping.get(sender, f"Player {sender}")
            lines.append(f"[{who}] {message}" if self.tags else str(message))
        self._history.setdefault(pid, []).extend(lines)
        return lines


def _without_observation_wrappers(game, ta):
    """`game` with its ObservationWrappers taken out of the wrapper chain (the others kept, in order)."""
    chain = []
    while isinstance(game, ta.Wrapper):
        chain.append(type(game))
        game = game.env
    for wrapper in reversed(chain):
        if not issubclass(wrapper, ta.ObservationWrapper):
            game = wrapper(game)
    return game


# ----- opponents ----------------------------------------------------------------------------------
def make_opponent(spec, kwargs: dict):
    """`(observation, player_id) -> move` for an opponent spec (module docstring)."""
    if isinstance(spec, dict) and "endpoint" in spec:
        return EndpointOpponent(**spec)
    if isinstance(spec, dict) and "model_path" in spec:
        return FrozenModelOpponent(**spec)
    if isinstance(spec, dict):
        raise ValueError(f"TextArenaEnvironment: opponent {spec!r}: give {{endpoint: base_url, model: name}}, "
                         "{model_path: dir} or a function 'path/to/file.py:name'")
    policy = load_object(spec, what="TextArenaEnvironment opponent") if isinstance(spec, str) else spec
    if inspect.isclass(policy):
        policy = policy(**kwargs)
    if not callable(policy):
        raise ValueError(f"TextArenaEnvironment: opponent {spec!r} is not callable")
    try:
        takes_player = len(inspect.signature(policy).parameters) >= 2
    except (TypeError, ValueError):
        takes_player = False
    return (lambda obs, pid: str(policy(obs, pid))) if takes_player else (lambda obs, pid: str(policy(obs)))


class EndpointOpponent:
    """Another model behind an OpenAI-compatible chat endpoint; each move is one request on its history."""

    def __init__(self, endpoint: str, model: str, api_key: str = "unused", temperature: float = 0.0,
                 max_tokens: int = 256, system_prompt: Optional[str] = SYSTEM_PROMPT):
        import openai

        self.client = openai.OpenAI(base_url=endpoint, api_key=api_key, max_retries=1)
        self.model, self.temperature, self.max_tokens, self.system = model, temperature, max_tokens, system_prompt

    def __call__(self, observation: str, player_id: int) -> str:
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + \
            [{"role": "user", "content": observation}]
        reply = self.client.chat.completions.create(model=self.model, messages=messages, temperature=self.temperature,
                                                    max_tokens=self.max_tokens)
        return reply.choices[0].message.content or ""


class FrozenModelOpponent:
    """A frozen copy of a model (a Hugging Face directory), greedy; loaded once per process and shared."""

    _loaded: dict = {}
    _lock = threading.Lock()

    def __init__(self, model_path: str, max_new_tokens: int = 32, system_prompt: Optional[str] = None):
        self.path, self.max_new_tokens, self.system = model_path, max_new_tokens, system_prompt
        with self._lock:
            if model_path not in self._loaded:
                from transformers import AutoModelForCausalLM, AutoTokenizer

                model = AutoModelForCausalLM.from_pretrained(model_path).eval().requires_grad_(False)
                self._loaded[model_path] = (model, AutoTokenizer.from_pretrained(model_path))

    def __call__(self, observation: str, player_id: int) -> str:
        import torch

        model, tokenizer = self._loaded[self.path]
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + \
            [{"role": "user", "content": observation}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        room = getattr(model.config, "max_position_embeddings", 1 << 30) - self.max_new_tokens
        ids = torch.tensor([list(ids)[-room:]])  # [1, T]: the history's end when it outgrows the context
        with self._lock, torch.inference_mode():  # one generate at a time: episodes run on several threads
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


# ----- data rows ----------------------------------------------------------------------------------
def records(game: str, *, size: int, seed: int = 0, system_prompt: str = SYSTEM_PROMPT) -> list:
    """`size` verl-schema rows for `game`, each with its own board seed (`extra_info.seed`, for seed_from_row)."""
    rng = random.Random(seed)
    return [{"prompt": [{"role": "system", "content": system_prompt}], "data_source": f"textarena/{game}",
             "extra_info": {"seed": rng.randrange(2**31), "index": i}} for i in range(size)]


def main(argv=None) -> int:
    from phaserl.data import write_records

    parser = argparse.ArgumentParser(description="Write TextArena training rows (verl schema) for a game.")
    parser.add_argument("game")
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help=".jsonl or .parquet")
    args = parser.parse_args(argv)
    write_records(args.out, records(args.game, size=args.size, seed=args.seed))
    print(f"wrote {args.size} rows of {args.game} to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
