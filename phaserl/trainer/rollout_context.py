"""What a rollout phase reads (phase 2: rollout_phase.py, agent_phase.py, harness_phase.py): the run's
settings, the actor, this rank and step, and the step's named seed streams; and `RolloutChoice`, the phase
the builder picks once.

A phase takes a `RolloutContext`, never the trainer: it samples with the actor and reads the run's
settings, and nothing else of the loop. Every random draw a phase seeds comes from one named stream of
`SeedStreams`. Each stream's value is `hash()` of a tuple of ints (stable across processes; a str would
hash differently in every process under PYTHONHASHSEED), and the values are part of the product: a fixed
`trainer.seed` samples the same responses after a resume and on any number of ranks (tests/test_resume_kill.py,
tests/test_world_size_*.py), so a stream's tuple never changes.
Not here: the asynchronous stream's seeds (stream.py, agent_stream.py), which key each group by itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from ..roles import HybridActor
    from .prompt_stream import PromptStream

_BITS_63 = 2**63 - 1  # a torch.Generator seed
_BITS_31 = 2**31 - 1  # an environment's reset seed (numpy and Gym take 32-bit seeds)


@dataclass(frozen=True)
class SeedStreams:
    """The seeds of one RL step's rollout, by what they seed. Indices are global (over all ranks), so a sample
    does not depend on the rank that draws it."""

    seed: int   # trainer.seed
    step: int   # the RL step

    def generate_call(self, first_prompt: int, n: int) -> int:
        """A single-turn generate call, by the global index of its first prompt."""
        return hash((self.seed, self.step, first_prompt, n)) & _BITS_63

    def episode(self, index: int) -> int:
        """An environment episode's reset seed, by the episode's global index."""
        return hash((self.seed, self.step, index)) & _BITS_31

    def agent_session(self, n: int) -> int:
        """The decode session of an agent.env rollout: the same on every rank (each episode's own noise is keyed
        by its global index)."""
        return hash((self.seed, self.step, n, 1)) & _BITS_63

    def harness_endpoint(self, first_sample: int, n: int) -> int:
        """The endpoint's generator of an agent.harness rollout, by the global index of the rank's first sample."""
        return hash((self.seed, self.step, first_sample, n, 2)) & _BITS_63


@dataclass(frozen=True)
class RolloutContext:
    run: Any           # the RunSettings (settings.py; not imported: the phases below it would import back up)
    actor: "HybridActor"
    rank: int          # among the trainer ranks
    step_num: int      # the RL step the rollout is for

    @property
    def seeds(self) -> SeedStreams:
        return SeedStreams(self.run.seed, self.step_num)


@dataclass(frozen=True)
class RolloutChoice:
    """Phases 1-3 as the builder chose them (agent_phase.rollout_choice): the rollout phase, what scores its
    batches, the settings of a multi-turn phase, and the prompts (a verifiers environment brings its own)."""

    phase: Callable                    # (RolloutContext, items, params, n) -> RolloutBatch
    reward: object                     # RewardSources, or EpisodeScores for episodes
    train_prompts: "PromptStream"
    val_prompts: Optional[list]        # this rank's share of the held-out PromptItems, or None
    agent: Any = None      # agent.env: agent_phase.AgentSettings, read by agent_rollout
    harness: Any = None    # agent.harness: harness_phase.HarnessSettings or VerifiersSettings, read by its phase
