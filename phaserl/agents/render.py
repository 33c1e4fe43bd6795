"""Observations to token ids, appended after what the model sampled (never re-tokenizing it).

Text is tokenized as it is (no special tokens added). Chat messages are rendered by the tokenizer's
chat template as the continuation of a conversation: the template's text for
`[user, assistant] + messages` (with the generation prompt) minus its text for `[user, assistant]`,
so a `tool` or `user` message comes out with the role markers and the next generation prompt the
template writes. What the template writes after an assistant turn's end-of-turn token (Qwen's
"\\n" after <|im_end|>) is put in front, since the model stopped at the token itself.
An environment with `tool_schemas` (ToolEnvironment) gets its prompt rendered with `tools=` them.
Not here: parsing tool calls (tool_parsers.py), deciding what the observation is (the environment).
"""
from __future__ import annotations

from phaserl.errors import ConfigError

_PROBE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class ObservationRenderer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._after_eos = None  # the template's text after an assistant turn's EOS, found on first use
        self._base = None       # the template's text for _PROBE: the same for every observation, rendered once

    def ids(self, observation) -> list[int]:
        """Token ids to append for `observation` (text or chat messages); [] for None or ""."""
        if observation is None or observation == "" or observation == []:
            return []
        text = observation if isinstance(observation, str) else self.messages_text(observation)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

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
