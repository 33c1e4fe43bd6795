"""Multi-turn masks: observation tokens are holes in the loss mask, bridged by GAE and ignored by the
update; GRPO compares whole trajectories. Numbers worked out by hand in the comments."""
import copy
import math

import torch

from phaserl.agents import Episode, Segment
from phaserl.algo import ADVANTAGE_ESTIMATORS, AdvantageInputs, bind_policy_loss
from phaserl.batch import TrainBatch
from phaserl.data.rows import PromptRow
from phaserl.roles import HybridActor
from phaserl.roles.actor import PolicyLossSettings
from phaserl.roles.optim import OptimSettings
from phaserl.trainer.advantage_phase import AdvantageSettings, compute_advantages
from phaserl.trainer.episode_batch import EpisodeScores, episodes_batch
from phaserl.world.tokenizer import build_tokenizer
from tests.test_rollout_engine import tiny_model

TOK = build_tokenizer()


def test_gae_bridges_an_observation_hole():
    # One episode, response = turn 1 (2 tokens), observation (2 tokens), turn 2 (1 token).
    # gamma = 0.9, lam = 0.8; turn rewards 0.3 (end of turn 1, t=1) and 1.0 (end of turn 2, t=4).
    # The hole's values (9) and rewards must not matter: the recursion carries across t = 2, 3.
    rewards = torch.tensor([[0.0, 0.3, 7.0, 7.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 9.0, 9.0, 0.4]])
    mask = torch.tensor([[1, 1, 0, 0, 1]])
    adv, ret = ADVANTAGE_ESTIMATORS["gae"](AdvantageInputs(
        token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([0]), values=values, gamma=0.9, lam=0.8))
    # t=4: A = 1.0 + 0.9 * 0 - 0.4 = 0.6
    # t=1: delta = 0.3 + 0.9 * V_4 - V_1 = 0.3 + 0.36 - 0.2 = 0.46; A = 0.46 + 0.72 * 0.6 = 0.892
    # t=0: delta = 0 + 0.9 * 0.2 - 0.5 = -0.32; A = -0.32 + 0.72 * 0.892 = 0.32224
    # returns = A + V on the sampled tokens, 0 in the hole
    torch.testing.assert_close(ret, torch.tensor([[0.82224, 1.092, 0.0, 0.0, 1.0]]), atol=1e-5, rtol=0)
    # whitened over the 3 sampled tokens: mean 1.81424 / 3, unbiased std
    raw = torch.tensor([0.32224, 0.892, 0.6])
    white = (raw - raw.mean()) / raw.std()
    torch.testing.assert_close(adv, torch.tensor([[white[0], white[1], 0.0, 0.0, white[2]]]), atol=1e-5, rtol=0)


def _episode(turns: list, observation=(30, 31), rewards=None) -> Episode:
    segments = [Segment("prompt", [9, 10])]
    for k, turn in enumerate(turns):
        if k:
            segments.append(Segment("observation", list(observation)))
        segments.append(Segment("model", list(turn), [-0.1] * len(turn)))
    row = PromptRow("q", "t", None, {}, "t.jsonl:row 0", 0, {})
    return Episode(row, segments, turn_rewards=list(rewards or []), num_turns=len(turns))


def test_grpo_compares_whole_trajectories_and_leaves_observations_at_zero():
    # A group of two episodes of one prompt: returns 0.5 + 1.0 = 1.5 and 0.0 + 0.0 = 0.
    # mean 0.75, unbiased std sqrt(2 * 0.75^2) = 1.06066 -> A = +-0.75 / 1.06066 = +-0.70711 (eps 1e-6)
    eps = [_episode([[11, 12], [13]], rewards=[0.5, 1.0]), _episode([[14], [15, 16, 17]], rewards=[0.0, 0.0])]
    batch = episodes_batch(eps, 2, tokenizer=TOK, pad_token_id=0, group_offset=0, device="cpu")
    scores = EpisodeScores().score(batch)
    settings = AdvantageSettings(ADVANTAGE_ESTIMATORS["grpo"], 1.0, 1.0, True, False, "k3")
    adv, _, placed, _ = compute_advantages(batch, scores.total, settings, old_logprobs=None, ref_logprobs=None,
                                           values=None, kl_coef=0.0, token_rewards=scores.token_rewards)
    a = 0.75 / math.sqrt(2 * 0.75 ** 2)
    # row 0 response: [11, 12 | 30, 31 | 13]; row 1: [14 | 30, 31 | 15, 16, 17]
    torch.testing.assert_close(adv, torch.tensor([[a, a, 0, 0, a, 0], [-a, 0, 0, -a, -a, -a]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(placed[0], torch.tensor([0.0, 0.5, 0, 0, 1.0, 0]))  # each turn's reward at its end


def test_the_update_ignores_observation_tokens():
    """Advantages and old log-probs in the holes may hold anything: the step is the same."""
    eps = [_episode([[11, 12], [13]], rewards=[0.5, 1.0]), _episode([[14], [15, 16, 17]], rewards=[0.0, 0.0])]
    batch = episodes_batch(eps, 2, tokenizer=TOK, pad_token_id=0, group_offset=0, device="cpu")
    hole = (batch.response_mask.bool() & ~batch.loss_mask.bool()).float()  # [B, R]
    adv = torch.tensor([[1.0, 1.0, 0, 0, 1.0, 0], [-1.0, 0, 0, -1.0, -1.0, -1.0]])
    old = torch.full(adv.shape, -3.0)
    results = []
    for junk in (0.0, 50.0):
        actor = HybridActor(copy.deepcopy(model_for_update()), TOK)
        actor.setup_training(OptimSettings(lr=0.1, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=0.0,
                                           warmup_steps=0, lr_schedule="constant", total_steps=1),
                             PolicyLossSettings(bind_policy_loss("ppo", clip_low=0.2, clip_high=0.2, dual_clip_c=3.0),
                                                "token-mean", 0.01, 0.0, "k3", 1.0, 8))
        train = TrainBatch(batch, old + junk * hole, None, adv + junk * hole, adv, None)
        stats = actor.update_mini_batch(train, token_budget=4096, global_tokens=float(batch.loss_mask.sum()),
                                        global_seqs=2.0)
        results.append((stats, [p.detach().clone() for p in actor.model.parameters()]))
    (s0, p0), (s1, p1) = results
    assert s0["actor/pg_loss"] == s1["actor/pg_loss"] and s0["actor/entropy"] == s1["actor/entropy"]
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))


_MODEL = []


def model_for_update():
    if not _MODEL:
        _MODEL.append(tiny_model(vocab_size=len(TOK)))
    return _MODEL[0]
