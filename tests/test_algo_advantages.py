"""Every advantage estimator against numbers worked out by hand in the comments."""
import math

import pytest
import torch

from phaserl.algo import ADVANTAGE_ESTIMATORS, AdvantageInputs
from phaserl.errors import ConfigError


def run(name, **kwargs):
    return ADVANTAGE_ESTIMATORS[name](AdvantageInputs(**kwargs))


def close(actual, expected, atol=1e-5):
    expected = torch.tensor(expected, dtype=torch.float32)
    assert torch.allclose(actual, expected, atol=atol), f"\n{actual}\n!=\n{expected}"


def test_registry_names_match_the_config_choices():
    from phaserl.config.schema import AlgorithmConfig

    choices = AlgorithmConfig.__dataclass_fields__["adv_estimator"].metadata["choices"]
    assert set(ADVANTAGE_ESTIMATORS) == set(choices) == {
        "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "grpo_passk", "opo",
        "gpg"}


def test_gae_returns_and_whitened_advantages():
    # gamma = 1, lam = 0.5. Row 0 has 2 real tokens; its padding holds garbage value 9 and reward 5.
    rewards = torch.tensor([[0.0, 1.0, 5.0], [0.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 0.25, 9.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv, ret = run("gae", token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([0, 1]),
                   values=values, gamma=1.0, lam=0.5)
    # Row 0: t=1 delta = 1 + 0 - 0.25 = 0.75 -> A = 0.75
    #        t=0 delta = 0 + 0.25 - 0.5 = -0.25 -> A = -0.25 + 0.5 * 0.75 = 0.125
    # Row 1: t=2 delta = 2 + 0 - 1 = 1 -> A = 1;  t=1 delta = 0 -> A = 0.5;  t=0 delta = 0 -> A = 0.25
    # returns = A + V
    close(ret, [[0.625, 1.0, 0.0], [1.25, 1.5, 2.0]])
    # whiten the 5 real A's {0.125, 0.75, 0.25, 0.5, 1}: mean 2.625/5 = 0.525
    # deviations -0.4, 0.225, -0.275, -0.025, 0.475; squares sum 0.5125; unbiased var 0.5125/4 = 0.128125
    std = math.sqrt(0.128125)
    close(adv, [[-0.4 / std, 0.225 / std, 0.0], [-0.275 / std, -0.025 / std, 0.475 / std]])


def test_gae_with_discount_and_lambda_one_is_discounted_return_minus_value():
    # gamma = 0.5, lam = 1: A_t = G_t - V_t with G = discounted return; rewards [1, 0, 4] -> G = [2, 2, 4]
    rewards = torch.tensor([[1.0, 0.0, 4.0]])
    values = torch.tensor([[1.0, 3.0, 0.0]])
    adv, ret = run("gae", token_rewards=rewards, response_mask=torch.ones(1, 3), group_ids=torch.tensor([0]),
                   values=values, gamma=0.5, lam=1.0)
    close(ret, [[2.0, 2.0, 4.0]])  # G_2 = 4, G_1 = 0 + 0.5 * 4, G_0 = 1 + 0.5 * 2
    # raw A = G - V = [1, -1, 4]: mean 4/3, deviations -1/3, -7/3, 8/3, squares 114/9, unbiased var 57/9
    std = math.sqrt(57 / 9)
    close(adv, [[(-1 / 3) / std, (-7 / 3) / std, (8 / 3) / std]])


def test_gae_without_values_is_a_config_error():
    with pytest.raises(ConfigError, match="critic"):
        run("gae", token_rewards=torch.zeros(1, 2), response_mask=torch.ones(1, 2), group_ids=torch.tensor([0]))


# Five responses of two prompts, interleaved (ids 7 and 3). Scores are the sum of the real token
# rewards: the first response spreads its score of 1 over two tokens (0.5 + 0.5), padding holds 8.
GROUP_REWARDS = torch.tensor([
    [0.5, 0.5, 8.0],  # id 7, score 1
    [0.0, 3.0, 8.0],  # id 3, score 3
    [0.0, 0.0, 0.0],  # id 7, score 0
    [1.0, 8.0, 8.0],  # id 3, score 1
    [0.0, 0.0, 0.0],  # id 7, score 0
])
GROUP_MASK = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
GROUP_IDS = torch.tensor([7, 3, 7, 3, 7])


def broadcast(per_response):
    return (torch.tensor(per_response).unsqueeze(-1) * GROUP_MASK).tolist()


def test_grpo_divides_by_the_unbiased_group_std():
    adv, ret = run("grpo", token_rewards=GROUP_REWARDS, response_mask=GROUP_MASK, group_ids=GROUP_IDS)
    # id 7 scores {1, 0, 0}: mean 1/3, unbiased var ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3, std 0.57735
    # id 3 scores {3, 1}: mean 2, unbiased var (1 + 1) / 1 = 2, std sqrt(2)
    s7, s3 = math.sqrt(1 / 3), math.sqrt(2)
    close(adv, broadcast([(2 / 3) / s7, 1 / s3, (-1 / 3) / s7, -1 / s3, (-1 / 3) / s7]))
    assert torch.equal(adv, ret)


def test_dr_grpo_only_subtracts_the_group_mean():
    adv, _ = run("grpo", token_rewards=GROUP_REWARDS, response_mask=GROUP_MASK, group_ids=GROUP_IDS,
                 norm_by_std=False)
    close(adv, broadcast([2 / 3, 1.0, -1 / 3, -1.0, -1 / 3]))


def test_grpo_equal_scores_and_single_response_groups_get_zero():
    rewards = torch.tensor([[1.0], [1.0], [5.0]])
    adv, _ = run("grpo", token_rewards=rewards, response_mask=torch.ones(3, 1), group_ids=torch.tensor([0, 0, 1]))
    close(adv, [[0.0], [0.0], [0.0]])  # std 0 -> 0 / eps = 0; a group of one is its own mean


def test_rloo_subtracts_the_mean_of_the_others():
    adv, _ = run("rloo", token_rewards=GROUP_REWARDS, response_mask=GROUP_MASK, group_ids=GROUP_IDS)
    # id 7 {1, 0, 0}: 1 - (0 + 0)/2 = 1; 0 - (1 + 0)/2 = -0.5 (twice).  id 3 {3, 1}: 3 - 1 = 2; 1 - 3 = -2
    close(adv, broadcast([1.0, 2.0, -0.5, -2.0, -0.5]))


def test_rloo_rejects_a_group_of_one():
    with pytest.raises(ConfigError, match="rollout.n"):
        run("rloo", token_rewards=torch.ones(3, 1), response_mask=torch.ones(3, 1), group_ids=torch.tensor([0, 0, 1]))


def test_reinforce_plus_plus_discounted_return_whitened():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [1.0, 2.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = run("reinforce_plus_plus", token_rewards=rewards, response_mask=mask,
                   group_ids=torch.tensor([0, 1]), gamma=0.5)
    # row 0: G = [0.25, 0.5, 1]; row 1 (padding reward 5 ignored): G_1 = 2, G_0 = 1 + 0.5 * 2 = 2
    close(ret, [[0.25, 0.5, 1.0], [2.0, 2.0, 0.0]])
    # real G's {0.25, 0.5, 1, 2, 2}: mean 1.15; deviations -0.9, -0.65, -0.15, 0.85, 0.85
    # squares 0.81 + 0.4225 + 0.0225 + 0.7225 + 0.7225 = 2.7; unbiased var 0.675
    std = math.sqrt(0.675)
    close(adv, [[-0.9 / std, -0.65 / std, -0.15 / std], [0.85 / std, 0.85 / std, 0.0]])


def test_reinforce_plus_plus_baseline_group_mean_then_batch_whiten():
    rewards = torch.tensor([[0.0, 3.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.5], [0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    adv, ret = run("reinforce_plus_plus_baseline", token_rewards=rewards, response_mask=mask,
                   group_ids=torch.tensor([0, 0, 1, 1]))
    # scores 3, 1 (mean 2) -> +1, -1; scores 0.5, 0.5 -> 0, 0; broadcast over the real tokens
    close(ret, [[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # 7 real entries {1, 1, -1, 0, 0, 0, 0}: mean 1/7; deviations 6/7, 6/7, -8/7, -1/7 (x4)
    # squares (36 + 36 + 64 + 4) / 49 = 20/7; unbiased var (20/7) / 6 = 10/21
    std = math.sqrt(10 / 21)
    a, b, c = (6 / 7) / std, (-8 / 7) / std, (-1 / 7) / std
    close(adv, [[a, a, 0.0], [b, 0.0, 0.0], [c, c, c], [c, 0.0, 0.0]])


def test_remax_subtracts_the_greedy_score():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv, _ = run("remax", token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([0, 1]),
                 baseline_scores=torch.tensor([0.25, 0.5]))
    close(adv, [[0.75, 0.75], [-0.5, 0.0]])  # 1 - 0.25; 0 - 0.5 on the one real token
    with pytest.raises(ConfigError, match="greedy"):
        run("remax", token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([0, 1]))


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_every_estimator_is_zero_beyond_the_mask_and_finite(name):
    torch.manual_seed(0)
    rewards = torch.randn(4, 5)
    rewards[0, 4] = float("nan")  # garbage in the padding must not leak
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    adv, ret = run(name, token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([0, 0, 1, 1]),
                   values=torch.randn(4, 5), baseline_scores=torch.randn(4), gamma=0.9, lam=0.95)
    assert adv.shape == ret.shape == (4, 5)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_remax_with_kl_in_the_reward_uses_the_reward_to_go_as_verl():
    # KL shaped in: token rewards [-0.1, 0.9] (score 1 on the last token minus KL 0.1 on each)
    rewards = torch.tensor([[-0.1, 0.9]])
    adv, ret = run("remax", token_rewards=rewards, response_mask=torch.ones(1, 2), group_ids=torch.tensor([0]),
                   baseline_scores=torch.tensor([0.25]))
    close(ret, [[0.8, 0.9]])  # reward-to-go: -0.1 + 0.9; 0.9
    close(adv, [[0.55, 0.65]])  # minus the greedy score


def test_passk_credits_only_the_best_response_of_each_group():
    # group 0 scores [0.2, 1.0, 0.5, 0.0]: best 1.0, second 0.5 -> 0.5 / unbiased std
    # mean 0.425, squared deviations sum 0.5675, var 0.5675 / 3; group 1 [1, 1]: a tie -> 0
    scores = torch.tensor([0.2, 1.0, 0.5, 0.0, 1.0, 1.0])
    rewards = torch.stack([torch.zeros(6), scores], dim=1)  # score on the last of 2 tokens
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv, _ = run("grpo_passk", token_rewards=rewards, response_mask=torch.ones(6, 2), group_ids=groups)
    best = 0.5 / (math.sqrt(0.5675 / 3) + 1e-6)
    close(adv[:, 0], [0.0, best, 0.0, 0.0, 0.0, 0.0])
    adv, _ = run("grpo_passk", token_rewards=rewards, response_mask=torch.ones(6, 2), group_ids=groups,
                 norm_by_std=False)
    close(adv[:, 1], [0.0, 0.5, 0.0, 0.0, 0.0, 0.0])
    with pytest.raises(ConfigError, match="at least 2"):
        run("grpo_passk", token_rewards=rewards[:1], response_mask=torch.ones(1, 2), group_ids=groups[:1])


def test_opo_baseline_is_the_length_weighted_group_mean():
    # scores [1, 0] with lengths [1, 3]: b = (1 * 1 + 3 * 0) / 4 = 0.25
    rewards = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    adv, _ = run("opo", token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([7, 7]))
    close(adv, [[0.75, 0.0, 0.0], [-0.25, -0.25, -0.25]])


def test_gpg_rescales_by_the_share_of_informative_responses():
    # group 0 [1, 0] informative, group 1 [1, 1] not: B = 4, M = 2 -> alpha = 4 / 2
    rewards = torch.tensor([[1.0], [0.0], [1.0], [1.0]])
    adv, _ = run("gpg", token_rewards=rewards, response_mask=torch.ones(4, 1), group_ids=torch.tensor([0, 0, 1, 1]))
    close(adv[:, 0], [1.0, -1.0, 0.0, 0.0])  # 2 * (1 - 0.5), 2 * (0 - 0.5)
    # over two ranks the counts are summed, so alpha is the global B / (B - M) = 8 / 2
    adv, _ = run("gpg", token_rewards=rewards, response_mask=torch.ones(4, 1), group_ids=torch.tensor([0, 0, 1, 1]),
                 total=lambda t: t + t.new_tensor([4.0, 0.0]))  # the other rank: 4 responses, none informative
    close(adv[:, 0], [2.0, -2.0, 0.0, 0.0])


def test_group_has_variance_is_exact_and_per_group():
    from phaserl.algo import group_has_variance

    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 3.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert group_has_variance(scores, groups).tolist() == [False, False, True, True, False, False, False]
