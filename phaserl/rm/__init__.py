"""Reward models end to end: Bradley–Terry training, the tiny world's preference pairs, critic init.

    config.py       RMTrainConfig + load_rm_config (the YAML of `phaserl train-rm`)
    train.py        train_reward_model, evaluate_pairs, SequenceScorer (our decoder as an RM), export
    run.py          run_train_rm(cfg): read pairs, train, export, write the stats (cfg already resolved)
    tiny_prefs.py   preference pairs from the tiny arithmetic world (correct vs near-miss answers)
    tiny_model.py   the built-in tiny RM ('tiny' as a reward-model path): trained on first use, then reused
    critic_init.py  init_critic("policy" | "reward_model", path): where the PPO critic starts

Scoring with a trained RM during RL is `phaserl.roles.RewardModelWrapper` (reward_model.* in the RL config);
`phaserl train-rm`'s arguments are parsed in `phaserl.cli`, its 'tiny' names resolved in `phaserl.resolve`.
"""
from phaserl.rm.config import RMTrainConfig, load_rm_config
from phaserl.rm.critic_init import CRITIC_SOURCES, init_critic, is_reward_model_dir
from phaserl.rm.run import run_train_rm
from phaserl.rm.tiny_model import prepare_tiny_reward_model
from phaserl.rm.tiny_prefs import make_tiny_preference_records, write_tiny_preference_files
from phaserl.rm.train import (
                              PairAccuracy,
                              RMTrainStats,
                              SequenceScorer,
                              evaluate_pairs,
                              export_reward_model,
                              train_reward_model,
)

__all__ = ["RMTrainConfig", "load_rm_config", "CRITIC_SOURCES", "init_critic", "is_reward_model_dir",
           "make_tiny_preference_records", "write_tiny_preference_files", "PairAccuracy", "RMTrainStats",
           "SequenceScorer", "evaluate_pairs", "export_reward_model", "train_reward_model", "run_train_rm",
           "prepare_tiny_reward_model"]
