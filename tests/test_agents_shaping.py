"""DAPO on multi-turn episodes: the overlong penalty judges the last model turn and lands on its final
token, the per-turn rewards stay where they were; dynamic sampling's select/join keep the placement.
Numbers worked out by hand in the comments."""
import torch

from phaserl.agents import Episode, Segment
from phaserl.batch import ScoredBatch
from phaserl.data.rows import PromptRow
from phaserl.trainer.dynamic_sampling import join
from phaserl.trainer.episode_batch import EpisodeScores, episodes_batch
from phaserl.trainer.score_shaping import OverlongShaping
from phaserl.world.tokenizer import build_tokenizer

TOK = build_tokenizer()
ROW = PromptRow(prompt="q", data_source="t", ground_truth="1", extra_info={}, source="t:row 0", index=0, raw={})


def episode(turns: list, observations: list, rewards: list) -> Episode:
    """turns: sampled lengths; observations: appended lengths between them; ids are arbitrary."""
    segments = [Segment("prompt", [5, 6])]
    for k, n in enumerate(turns):
        segments.append(Segment("model", [7] * n, [-0.1] * n))
        if k < len(observations):
            segments.append(Segment("observation", [8] * observations[k]))
    return Episode(row=ROW, segments=segments, turn_rewards=rewards, num_turns=len(turns))


def scored(episodes: list) -> ScoredBatch:
    batch = episodes_batch(episodes, 2, tokenizer=TOK, pad_token_id=0, group_offset=0, device="cpu")
    return ScoredBatch(batch, EpisodeScores().score(batch))


def test_the_overlong_penalty_lands_on_the_last_turns_final_token_and_keeps_the_turn_rewards():
    # A: turn 3 ids (reward 0.5), observation 2, turn 4 ids (reward 1.0): response columns 0-2 | 3-4 | 5-8
    # B: turn 2 ids (reward 0.2), observation 1, turn 3 ids (reward 0.0): columns 0-1 | 2 | 3-5
    a, b = episode([3, 4], [2], [0.5, 1.0]), episode([2, 3], [1], [0.2, 0.0])
    s = scored([a, b])
    shaped = OverlongShaping(max_len=4, buffer=2, factor=1.0)(s.scores, s.batch)
    # L_max = 4, buffer 2: the penalty starts after 2 tokens. The last turns: A 4 ids -> -(4 - 2) / 2 = -1.0;
    # B 3 ids -> -(3 - 2) / 2 = -0.5. (The whole responses, 9 and 6 tokens, would both be -1.)
    torch.testing.assert_close(shaped.by_source["overlong"], torch.tensor([-1.0, -0.5]))
    torch.testing.assert_close(shaped.total, torch.tensor([0.5 + 1.0 - 1.0, 0.2 + 0.0 - 0.5]))
    want = torch.zeros(2, 9)
    want[0, 2], want[0, 8] = 0.5, 1.0 - 1.0   # A: turn 1's reward kept; turn 2's final token gets the penalty
    want[1, 1], want[1, 5] = 0.2, 0.0 - 0.5   # B: likewise, on its last sampled token (column 5)
    torch.testing.assert_close(shaped.token_rewards, want)
    torch.testing.assert_close(shaped.token_rewards.sum(1), shaped.total)
    torch.testing.assert_close(s.scores.token_rewards[0, 8], torch.tensor(1.0))  # the input is not modified


def test_select_and_join_keep_the_per_turn_rewards():
    first, second = scored([episode([3, 4], [2], [0.5, 1.0]), episode([1], [], [0.3])]), \
        scored([episode([2], [], [0.7]), episode([1, 1], [1], [0.1, 0.2])])
    kept = first.select(torch.tensor([0, 1]))
    torch.testing.assert_close(kept.scores.token_rewards, first.scores.token_rewards)
    joined = join([second, first], pad_token_id=0)   # widths 3 and 9: the narrower rows padded with 0
    assert joined.scores.token_rewards.shape == (4, 9)
    torch.testing.assert_close(joined.scores.token_rewards[:2, :3], second.scores.token_rewards)
    assert joined.scores.token_rewards[:2, 3:].abs().sum() == 0
    torch.testing.assert_close(joined.scores.token_rewards[2:], first.scores.token_rewards)
    torch.testing.assert_close(joined.scores.token_rewards.sum(1), joined.scores.total)
