"""StatefulLoader: seeded order, epoch rollover, exact resume, rank shares and resume on another world size."""
import pytest
import torch

from phaserl.data import StatefulLoader, epoch_permutation
from phaserl.errors import ConfigError, DataError


def take(loader, steps):
    return [loader.next_batch() for _ in range(steps)]


def test_unshuffled_order_and_epoch_rollover_drop_the_short_tail():
    loader = StatefulLoader(5, 2, seed=0, shuffle=False)
    assert loader.steps_per_epoch == 2
    assert take(loader, 2) == [[0, 1], [2, 3]]
    assert (loader.epoch, loader.position) == (0, 4)
    # Item 4 alone cannot fill a batch of 2: the loader moves on to epoch 1.
    assert take(loader, 3) == [[0, 1], [2, 3], [0, 1]]
    assert (loader.epoch, loader.position) == (2, 2)


def test_without_drop_last_the_short_tail_is_its_own_batch_split_over_ranks():
    rank0 = StatefulLoader(5, 2, seed=0, shuffle=False, world_size=2, rank=0, drop_last=False)
    rank1 = StatefulLoader(5, 2, seed=0, shuffle=False, world_size=2, rank=1, drop_last=False)
    assert rank0.steps_per_epoch == 3
    assert take(rank0, 4) == [[0], [2], [4], [0]]
    assert take(rank1, 4) == [[1], [3], [], [1]]


def test_shuffled_order_is_randperm_seeded_by_seed_and_epoch():
    loader = StatefulLoader(10, 5, seed=7)
    batches = take(loader, 4)
    epoch0, epoch1 = epoch_permutation(10, seed=7, epoch=0), epoch_permutation(10, seed=7, epoch=1)
    assert batches == [epoch0[:5], epoch0[5:], epoch1[:5], epoch1[5:]]
    assert sorted(epoch0) == list(range(10)) and epoch0 != epoch1
    assert epoch0 != list(range(10))
    # Determinism: the same seed gives the same batches, another seed others; torch's global RNG is not used.
    torch.manual_seed(123)
    assert take(StatefulLoader(10, 5, seed=7), 4) == batches
    assert take(StatefulLoader(10, 5, seed=8), 4) != batches
    # (seed, epoch) pairs are not summed: seed 1 epoch 0 differs from seed 0 epoch 1.
    assert epoch_permutation(10, seed=1, epoch=0) != epoch_permutation(10, seed=0, epoch=1)


def test_resume_mid_epoch_continues_identically():
    loader = StatefulLoader(11, 3, seed=3)
    take(loader, 2)
    state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (0, 6)
    expected = take(loader, 7)  # crosses two epoch boundaries (3 steps per epoch)
    resumed = StatefulLoader(11, 3, seed=3)
    resumed.load_state_dict(state)
    assert take(resumed, 7) == expected


def test_union_of_rank_shares_is_the_single_rank_batch():
    single = take(StatefulLoader(12, 4, seed=5), 6)
    shares = [take(StatefulLoader(12, 4, seed=5, rank=r, world_size=2), 6) for r in range(2)]
    for step in range(6):
        assert len(shares[0][step]) == len(shares[1][step]) == 2
        assert shares[0][step] + shares[1][step] == single[step]  # contiguous: rank 0 first


def test_resume_on_a_different_world_size():
    reference = StatefulLoader(12, 4, seed=9)
    take(reference, 2)
    state = reference.state_dict()
    expected = take(reference, 5)
    ranks = [StatefulLoader(12, 4, seed=9, rank=r, world_size=4) for r in range(4)]
    for loader in ranks:
        loader.load_state_dict(state)
    per_rank = [take(loader, 5) for loader in ranks]
    assert [sum((per_rank[r][step] for r in range(4)), []) for step in range(5)] == expected


def test_batch_larger_than_dataset_is_a_data_error():
    with pytest.raises(DataError, match="has 3 prompts but a step needs 4 .* at most 3"):
        StatefulLoader(3, 4, seed=0)


def test_batch_must_split_evenly_over_ranks():
    with pytest.raises(ConfigError, match="6 prompts per step do not split evenly over 4 ranks"):
        StatefulLoader(10, 6, seed=0, world_size=4)


def test_resume_with_other_data_or_seed_is_refused():
    state = StatefulLoader(10, 2, seed=0).state_dict()
    with pytest.raises(DataError, match="num_items=10, this run has num_items=9"):
        StatefulLoader(9, 2, seed=0).load_state_dict(state)
    with pytest.raises(DataError, match="seed=0, this run has seed=1"):
        StatefulLoader(10, 2, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="out of range"):
        StatefulLoader(10, 2, seed=0).load_state_dict({**state, "position": 11})
