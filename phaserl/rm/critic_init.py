"""Where the critic's weights start: the policy (fresh zero value head) or a trained reward model (its head).

A PPO critic reads the *policy's* token ids, so a critic started from a reward model only makes sense
when the RM shares the policy's tokenizer; `init_critic` checks the vocabulary before it returns and
says so when it does not. The RM directory is a `*ForSequenceClassification` with num_labels=1 (what
`phaserl train-rm` writes): our decoder for its families, transformers' own class for the others (HFValueModel).

Not here: choosing the path from the config (trainer/build.py), training (roles/critic.py).
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from phaserl.errors import ConfigError
from phaserl.models import ValueModel, load_pretrained, load_value_model, value_model_of

CRITIC_SOURCES = ("policy", "reward_model")


def init_critic(source: str, path: Optional[str], *, dtype: torch.dtype = torch.float32, device="cpu",
                trust_remote_code: bool = False, policy_tokenizer=None) -> ValueModel:
    """A ValueModel started from the policy directory `path` (source="policy": the head is zero, so every
    value starts at 0) or from the reward-model directory `path` (source="reward_model": its trained
    backbone and score head). `policy_tokenizer`, when given, must match the RM's vocabulary."""
    if source not in CRITIC_SOURCES:
        raise ConfigError(f"critic.init_from = {source!r}: expected one of {', '.join(CRITIC_SOURCES)}")
    if path is None:
        raise ConfigError(f"critic.init_from = {source} needs a directory to start from: set critic.path"
                          + (" or reward_model.path (the RM written by `phaserl train-rm`)" if source == "reward_model"
                             else ""))
    if source == "policy":
        return value_model_of(load_pretrained(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code))
    _check_is_reward_model(path)
    critic = load_value_model(path, dtype=dtype, device=device)
    if policy_tokenizer is not None:
        _check_same_vocabulary(path, critic, policy_tokenizer)
    return critic


def is_reward_model_dir(path: str) -> bool:
    """True when `path`/config.json names a `*ForSequenceClassification` architecture."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        return False
    with open(config_file) as f:
        architectures = json.load(f).get("architectures") or []
    return any(str(a).endswith("ForSequenceClassification") for a in architectures)


def _check_is_reward_model(path: str) -> None:
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(f"critic.init_from = reward_model but {config_file} does not exist; set critic.path (or "
                          f"reward_model.path) to a reward-model directory written by `phaserl train-rm`")
    if not is_reward_model_dir(path):
        raise ConfigError(f"critic.init_from = reward_model but {config_file} does not describe a "
                          f"*ForSequenceClassification reward model (see its 'architectures'); to start the critic "
                          f"from a policy checkpoint use critic.init_from = policy")


def _check_same_vocabulary(path: str, critic: ValueModel, policy_tokenizer) -> None:
    rm_vocab, policy_vocab = critic.config.vocab_size, len(policy_tokenizer)
    problem = None
    if policy_vocab > rm_vocab:
        problem = f"the policy tokenizer has {policy_vocab} tokens, the reward model's embedding only {rm_vocab}"
    else:
        from phaserl.models import load_tokenizer

        try:
            rm_tokenizer = load_tokenizer(path)
        except ConfigError:
            rm_tokenizer = None  # an RM saved without tokenizer files: the size check above is all we can do
        if rm_tokenizer is not None and rm_tokenizer.get_vocab() != policy_tokenizer.get_vocab():
            problem = "the reward model's tokenizer (saved in its directory) maps tokens to other ids than the policy's"
    if problem:
        raise ConfigError(f"critic.init_from = reward_model with {path}: {problem}. The critic reads the policy's "
                          f"token ids, so it can only start from a reward model trained with the policy's "
                          f"tokenizer; use critic.init_from = policy for this reward model")
