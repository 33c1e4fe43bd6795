"""Exceptions phaserl raises for problems in user input.

Every message names the file, row, key or value at fault and says how to fix it. `assert` is kept
for internal invariants; these classes are for people.
"""


class PhaserlError(Exception):
    """Base class of every user-facing phaserl error."""


class ConfigError(PhaserlError, ValueError):
    """A config key, value or combination of values is invalid."""


class DataError(PhaserlError, ValueError):
    """A dataset file or one of its rows is malformed."""


class RewardError(PhaserlError, RuntimeError):
    """A reward function or reward model failed or returned something unusable."""


class PreflightError(PhaserlError, RuntimeError):
    """A check run before (or during) training found a mistake that would waste the run."""


class CheckpointError(PhaserlError, RuntimeError):
    """A checkpoint is damaged, unsafe, locked by another run, or cannot be written."""


class AgentError(PhaserlError, RuntimeError):
    """An environment raised, hung or returned something unusable, and agent.on_env_error=stop."""
