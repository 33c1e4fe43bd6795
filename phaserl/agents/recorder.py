"""The token-exact record of conversations served by the OpenAI-compatible endpoint.

Every completion of a conversation is kept as (prompt ids, sampled ids, log-probs, finish reason)
exactly as the backend produced them. `Conversation.episodes()` turns the record into `Episode`s:

    request 1:  prompt P1                -> sampled C1
    request 2:  prompt P2 = P1 + C1 + O1 -> sampled C2      (O1: tool results, next user turn, ...)
    episode:    [prompt P1] [model C1] [observation O1] [model C2]

Training then sees exactly the sampled ids C1, C2 with their log-probs, and O1 as appended. When a
request's prompt does not start with the previous prompt + completion token for token (the harness
edited the history, or a chat template renders past turns differently), the ids cannot be joined
honestly: the record starts a new piece whose prompt is that request's whole prompt, and counts a
`prefix_mismatches` metric; the server logs a warning. Each piece becomes its own Episode, all
with the conversation's reward. A conversation whose request an episode limit refused (server.py)
ends with that limit as its last piece's finish reason. Nothing is ever re-tokenized here.
Not here: HTTP and chat templates (server.py), which tries to splice the sampled ids in first.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

from phaserl.agents.env import Episode, Segment


@dataclass
class Turn:
    prompt_ids: list
    token_ids: list
    logprobs: list
    finish_reason: str
    spliced: bool = False            # the server put the sampled ids back in place of a re-rendered reply


@dataclass
class Conversation:
    id: str
    turns: list = field(default_factory=list)   # [Turn], in request order
    messages: list = field(default_factory=list)  # the last request's normalized messages
    reply: Optional[dict] = None     # the normalized assistant message last returned
    ended: Optional[str] = None      # the episode limit that refused a request ("max_turns", "max_tokens", "context")
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def full_ids(self) -> list:
        """The last prompt + its completion: what a continuing request's prompt should start with."""
        if not self.turns:
            return []
        last = self.turns[-1]
        return list(last.prompt_ids) + list(last.token_ids)

    def extends(self, prompt_ids: list) -> bool:
        full = self.full_ids()
        return bool(full) and len(prompt_ids) >= len(full) and list(prompt_ids[:len(full)]) == full

    def add(self, turn: Turn) -> bool:
        """Record a completion; False when its prompt does not extend the previous one (a new piece)."""
        continues = not self.turns or self.extends(turn.prompt_ids)
        self.turns.append(turn)
        return continues

    def episodes(self, row, reward: float) -> list:
        """One Episode per piece (see the module docstring), each with `reward` as its one turn reward."""
        pieces: list = []
        for turn in self.turns:
            if not pieces or not _extends(pieces[-1], turn.prompt_ids):
                pieces.append([Segment("prompt", list(turn.prompt_ids))])
            else:
                seen = sum(len(s.token_ids) for s in pieces[-1])
                if len(turn.prompt_ids) > seen:
                    pieces[-1].append(Segment("observation", list(turn.prompt_ids[seen:])))
            pieces[-1].append(Segment("model", list(turn.token_ids), list(turn.logprobs)))
        mismatches = len(pieces) - 1 if pieces else 0
        spliced = sum(t.spliced for t in self.turns)
        out = []
        for segments in pieces:
            last = self.turns[-1] if segments is pieces[-1] else None
            finish = "length" if last is not None and last.finish_reason == "length" else "done"
            if last is not None and self.ended:
                finish = self.ended
            out.append(Episode(row=row, segments=segments, turn_rewards=[float(reward)], finish_reason=finish,
                               num_turns=sum(s.kind == "model" for s in segments),
                               metrics={"requests": float(len(self.turns)), "prefix_mismatches": float(mismatches),
                                        "spliced_turns": float(spliced)}))
        return out


def _extends(segments: list, prompt_ids: list) -> bool:
    ids = [t for s in segments for t in s.token_ids]
    return len(prompt_ids) >= len(ids) and list(prompt_ids[:len(ids)]) == ids


class ConversationStore:
    """Conversations by id, safe to use from the server's request threads."""

    def __init__(self):
        self._by_id: dict = {}
        self._closed: set = set()     # ids handed back by pop(): later requests for them are refused
        self._lock = threading.Lock()

    def get(self, conversation_id: str) -> Conversation:
        """The conversation of that id (created on first use); KeyError once it was popped."""
        with self._lock:
            if conversation_id in self._closed:
                raise KeyError(conversation_id)
            if conversation_id not in self._by_id:
                self._by_id[conversation_id] = Conversation(conversation_id)
            return self._by_id[conversation_id]

    def find(self, messages: list) -> Optional[Conversation]:
        """The conversation whose last request + reply the given messages continue (no id in the URL)."""
        with self._lock:
            candidates = list(self._by_id.values())
        for conv in candidates:
            head = conv.messages + ([conv.reply] if conv.reply is not None else [])
            if head and len(messages) > len(head) and messages[:len(head)] == head:
                return conv
        return None

    def pop(self, conversation_id: str) -> Optional[Conversation]:
        """Take a finished conversation out; its id is closed for good."""
        with self._lock:
            self._closed.add(conversation_id)
            return self._by_id.pop(conversation_id, None)

    def ids(self) -> list:
        with self._lock:
            return list(self._by_id)
