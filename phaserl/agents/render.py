"""Observations to token ids, appended after what the model sampled (never re-tokenizing it).

Text is tokenized as it is (no special tokens added). Chat messages are rendered by the tokenizer's
chat template as the continuation of a conversation: the template's text for
`[user, assistant] + messages` (with the generation prompt) minus its text for `[user, assistant]`,
so a `tool` or `user` message comes out with the role markers and the next generation prompt the
template writes. What the template writes after an assistant turn's end-of-turn token (Qwen's
"\\n" after <|im_end|>) is put in front, since the model stopped at the token itself.
An environment with `tool_schemas` (ToolEnvironment) gets its prompt rendered with `tools=` them.
An ImageObservation (a vision-language policy: `ObservationVision`) goes the way of a data row's images
(data/images.py): each `<image>` becomes the family's vision markers before rendering, its images go through the
processor in one call, and each image's one placeholder id is expanded to the processor's token count (where each
image starts in the observation's ids is recorded with its pixels).
Not here: parsing tool calls (tool_parsers.py), deciding what the observation is (the environment).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from phaserl.data.images import (
    PLACEHOLDER,
    count_placeholders,
    expand_placeholders,
    image_starts,
    load_image,
    process_images,
    with_starts,
    with_vision_markers,
)
from phaserl.errors import ConfigError

_PROBE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


@dataclass(frozen=True)
class ObservationVision:
    """What turns an ImageObservation's images into model inputs: the policy's image processor (data.images.
    processor_for), its merge size and its image placeholder id."""

    processor: object
    merge_size: int
    image_token_id: int


def observation_vision(model, *, min_pixels: int, max_pixels: int) -> Optional[ObservationVision]:
    """The ObservationVision of a vision-language policy (data.min_pixels / max_pixels as for its rows); None for a
    text model."""
    if not getattr(model, "takes_images", False):
        return None
    from phaserl.data.images import processor_for

    processor = processor_for(model.vision_config, min_pixels=min_pixels, max_pixels=max_pixels)
    return ObservationVision(processor, model.vision_config.spatial_merge_size, model.image_token_id)


class ObservationRenderer:
    def __init__(self, tokenizer, vision: Optional[ObservationVision] = None):
        self.tokenizer, self.vision = tokenizer, vision
        self._after_eos = None  # the template's text after an assistant turn's EOS, found on first use
        self._base = None       # the template's text for _PROBE: the same for every observation, rendered once

    def ids(self, observation) -> list[int]:
        """Token ids to append for `observation` (text or chat messages); [] for None or ""."""
        if observation is None or observation == "" or observation == []:
            return []
        text = observation if isinstance(observation, str) else self.messages_text(observation)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render(self, observation) -> tuple[list[int], object]:
        """(ids to append, their data.images.ImageInputs or None) for any observation: text, chat messages, or an
        ImageObservation (one processor call for its images; placeholders expanded to their token counts)."""
        from phaserl.agents.env import ImageObservation

        if not isinstance(observation, ImageObservation):
            return self.ids(observation), None
        if self.vision is None:
            raise ValueError("an ImageObservation needs a vision-language policy (docs/vision.md); this policy is a "
                             "text model, which would read the images' placeholders as text")
        content, entries = observation.content, list(observation.images)
        if not isinstance(content, (str, list)):
            raise ValueError(f"ImageObservation.content is a {type(content).__name__}; give text or chat messages")
        placeholders = count_placeholders(content)
        if placeholders != len(entries) or not entries:
            raise ValueError(f"the ImageObservation holds {placeholders} '{PLACEHOLDER}' placeholder(s) for "
                             f"{len(entries)} image(s); put one '{PLACEHOLDER}' in its content per image, in order")
        ids = self.ids(with_vision_markers(content))
        # a DataError (a ValueError) names a bad image, or content that spells the image token itself
        pictures = [load_image(v, source="the observation", index=i, base_dir=None) for i, v in enumerate(entries)]
        v = self.vision
        inputs = process_images(pictures, v.processor, merge_size=v.merge_size)  # one call: grids, token counts
        ids = expand_placeholders(ids, v.image_token_id, inputs.tokens, source="the observation")
        return ids, with_starts(inputs, image_starts(ids, v.image_token_id, inputs.tokens))  # starts: in its ids

    def prompt_ids(self, prompt, tools: list) -> list[int]:
        """The prompt rendered again with `tools=` (the environment's tool schemas) in the chat template,
        generation prompt included: what the model sees when its environment offers tools."""
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def messages_text(self, messages: list) -> str:
        """The chat template's text for `messages` as the next part of a conversation, generation prompt included."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("an observation given as a list must be chat messages [{'role': ..., 'content': ...}]")
        tok = self.tokenizer
        if getattr(tok, "chat_template", None) is None:
            raise ConfigError("the environment returned chat messages, but the tokenizer has no chat template; "
                              "return text observations or set a tokenizer with a chat_template")
        if self._base is None:  # a chat template render is ~0.1-1 ms of Jinja: once, not per observation
            self._base = tok.apply_chat_template(_PROBE, tokenize=False)
        base = self._base
        full = tok.apply_chat_template(_PROBE + list(messages), tokenize=False, add_generation_prompt=True)
        if not full.startswith(base):
            raise ConfigError("the chat template renders a conversation differently once messages are added "
                              "(the prefix changes), so observations cannot be appended token-exactly; return text "
                              "observations instead")
        return self._tail(base) + full[len(base):]

    def _tail(self, base: str) -> str:
        if self._after_eos is None:
            eos = self.tokenizer.eos_token or ""
            cut = base.rfind(eos) if eos else -1
            self._after_eos = base[cut + len(eos):] if cut >= 0 else ""
        return self._after_eos
