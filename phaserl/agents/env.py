"""The environment contract, and the token-exact record of one episode.

An episode starts from a data row and alternates model turns and environment turns:

    obs = env.reset(row, seed=...)            # first observation: appended to the prompt
    loop: model samples a turn (token ids)    # the action is the turn's decoded text
          result = env.step(action_text)      # observation, reward, done, info
          append the observation's tokens     # masked out of the loss
    until result.done, a turn limit or a token budget.

An `Observation` is text (tokenized and appended as it is) or chat messages (rendered by the chat
template as the continuation of the conversation, e.g. a `tool` or `user` message and the next
generation prompt), or, for a vision-language policy, an `ImageObservation`: such text or messages with one
`<image>` placeholder per image plus the images (PIL images, encoded bytes or file paths), e.g. a screenshot.
Its images go through the image processor in one call that decides their token counts; the placeholders are
expanded to that many image tokens and the pixels travel with the episode to every training pass, with where each
image starts in the episode's ids (so a marker the model samples is never taken for an image's).
The `Episode` keeps the ids the model sampled and the ids appended for
observations, in order: training uses exactly these ids, never a re-tokenization of decoded text.

Not here: running episodes (the runner), tools and tool-call parsing, adapters for other packages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Literal, Optional, Union

from phaserl.data.images import join_images


@dataclass
class ImageObservation:
    """An observation with pictures (a vision-language policy only): `content` is text or chat messages holding one
    `<image>` placeholder per entry of `images`, in order; an image is a PIL image, its encoded bytes (PNG, JPEG)
    or a file path."""

    content: Union[str, list]
    images: list


Observation = Union[str, list, ImageObservation]  # text, chat messages [{"role": ..., "content": ...}, ...], or those
                                                  # with images


@dataclass
class StepResult:
    """What `Environment.step` returns (a 4-tuple `(observation, reward, done, info)` is accepted too)."""

    observation: Optional[Observation] = None  # None or "" = nothing to append (usual when done)
    reward: float = 0.0                         # this turn's reward; an episode's return is their sum
    done: bool = False
    info: dict = field(default_factory=dict)    # free-form; numbers under info["metrics"] are logged


class Environment:
    """Base class of user environments. Subclass it (or provide the same two methods).

    One instance serves one episode at a time; phaserl makes a fresh instance per episode, so the
    n samples of a prompt never share state. The constructor receives the config's `kwargs`.
    `reset` and `step` may block (they run in worker threads, beside decoding); they may raise, and
    phaserl turns the exception into an ended episode with a message naming the environment and row.
    """

    def reset(self, row: dict, *, seed: int) -> Observation:
        """Start an episode for a data row (its `prompt`, `ground_truth`, `extra_info`, ... as a dict);
        return the first observation, appended after the prompt ("" for none)."""
        return ""

    def step(self, action: str) -> Union[StepResult, tuple]:
        """React to the model's turn (its decoded text, special tokens stripped)."""
        raise NotImplementedError(f"{type(self).__name__}.step(action) is not written")

    def close(self) -> None:
        """Release what the episode held (processes, sandboxes); called once per episode."""


def as_step_result(value, *, where: str) -> StepResult:
    """Normalize what `step` returned; a bad value is a ValueError naming `where`."""
    if isinstance(value, StepResult):
        result = value
    elif isinstance(value, tuple) and len(value) in (4, 5):  # Gym's 5-tuple: terminated or truncated
        obs, reward, *flags, info = value
        result = StepResult(obs, reward, any(bool(f) for f in flags), dict(info or {}))
    else:
        raise ValueError(f"{where}: step() returned {type(value).__name__}; return a StepResult or a tuple "
                         "(observation, reward, done, info)")
    try:
        reward = float(result.reward)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: step() returned reward {result.reward!r}, not a number") from None
    if not math.isfinite(reward):
        raise ValueError(f"{where}: step() returned a non-finite reward ({reward})")
    if result.observation is not None and not isinstance(result.observation, (str, list, ImageObservation)):
        raise ValueError(f"{where}: step() returned an observation of type {type(result.observation).__name__}; "
                         "return text, a list of chat messages or an ImageObservation")
    return StepResult(result.observation, reward, bool(result.done), dict(result.info or {}))


@dataclass
class Segment:
    """A run of consecutive tokens of one episode with one origin."""

    kind: Literal["prompt", "model", "observation"]
    token_ids: list                      # the exact ids: sampled (model) or appended (prompt, observation)
    logprobs: Optional[list] = None      # model segments: the sampler's log-prob of each id
    versions: Optional[list] = None      # model segments of an asynchronous rollout: the policy version that sampled
                                         # each id (None: the weights being trained)
    images: object = None                # prompt and observation segments of a vision policy: the
                                         # data.images.ImageInputs of their image tokens, else None


@dataclass
class Episode:
    """One finished episode: its segments in order, rewards, and why it ended.

    The first segment is the prompt. Training sees prompt = segments[0], response = the rest
    concatenated, loss mask = 1 on model tokens and 0 on observation tokens.
    """

    row: object                          # the PromptRow it started from
    segments: list                       # [Segment], segments[0].kind == "prompt"
    turn_rewards: list = field(default_factory=list)  # one per environment step
    finish_reason: str = "done"          # done | max_turns | max_tokens | context | env_error | length
    num_turns: int = 0                   # model turns
    metrics: dict = field(default_factory=dict)  # tool_calls, tool_errors, tool_seconds, env info metrics
    routes: object = None                # routing replay: [positions its slot held, L, k] int16 (DecodeSession.routes)

    @property
    def reward(self) -> float:
        return float(sum(self.turn_rewards))

    @property
    def prompt_ids(self) -> list:
        return list(self.segments[0].token_ids)

    def response_ids(self) -> list:
        return [t for s in self.segments[1:] for t in s.token_ids]

    def loss_mask(self) -> list:
        """1 per sampled token, 0 per observation token, aligned with response_ids()."""
        return [int(s.kind == "model") for s in self.segments[1:] for _ in s.token_ids]

    def images(self):
        """The ImageInputs of every image in the episode's ids, in order (prompt, then observations: one object, as
        the training forward takes a row's images), or None when it has none."""
        return segment_images(self.segments)

    def response_versions(self) -> Optional[list]:
        """The policy version per response token (-1 on observation tokens), or None when no model segment records
        versions (a synchronous rollout)."""
        if not any(s.versions is not None for s in self.segments[1:] if s.kind == "model"):
            return None
        out = []
        for s in self.segments[1:]:
            out += list(s.versions) if s.kind == "model" else [-1] * len(s.token_ids)
        return out

    def response_logprobs(self) -> list:
        """The sampler's log-prob per response token (0.0 on observation tokens)."""
        out = []
        for s in self.segments[1:]:
            out += list(s.logprobs) if s.kind == "model" else [0.0] * len(s.token_ids)
        return out


def segment_images(segments: list):
    """The ImageInputs of the images in segments' ids, in order, each image's recorded start moved to where its
    segment begins in the concatenated ids (data.images.join_images); None when no segment has any."""
    offsets = list(accumulate((len(s.token_ids) for s in segments[:-1]), initial=0))
    return join_images([s.images for s in segments], offsets)
