"""A vision-language policy that samples the image marker ids itself (`<|image_pad|>`, `<|vision_start|>`,
`<|vision_end|>`): the markers are text on both sides. Tiny random Qwen2.5-VL and Qwen3-VL whose head favours the
marker ids sample them often; the rollout engine's log-probs of those tokens (decode, and the extend pass of a
multi-turn episode whose last sampled id is fed again before an image observation) equal the training forward's,
padded and packed, and nothing raises. The real mistakes still do: fewer placeholders than an image needs (a marker
sampled later does not make up for it), a segment of the wrong size before an image, a batch that lost pixels, and a
whole segment sampled before an image of the same episode."""
import copy

import pytest
import torch

from phaserl.data.images import join_images
from phaserl.data.prompts import PromptItem
from phaserl.data.rows import PromptRow
from phaserl.models.mrope import mrope_positions
from phaserl.roles.forward import batch_logprobs
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams
from phaserl.trainer.episode_batch import episodes_batch
from phaserl.trainer.rollout_phase import build_rollout_batch
from test_agents_vision import TOK, run_episodes
from test_rollout_vision import END, IMAGE, START, forward_logprobs, images, model  # noqa: F401  (fixtures)

pytest.importorskip("PIL")
torch.set_num_threads(1)
SEED = {"qwen2_5_vl": 0, "qwen3_vl": 5}  # seeds whose responses hold <|vision_start|> then <|image_pad|> (a whole
# segment too, in the text row, for Qwen2.5-VL)
ROW = PromptRow(prompt="p", data_source="", ground_truth=None, extra_info={}, source="t:row 0", index=0, raw={})


class _Tokenizer:  # what build_rollout_batch needs of a tokenizer: decode
    def batch_decode(self, responses, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in responses]


def marker_loving(model, boost=((IMAGE, 12.0), (START, 8.0), (END, 8.0))):  # noqa: F811
    """The policy with its head's rows of the marker ids scaled up: where a row's logit is positive it dominates, so
    the policy samples markers often (lone, in runs, and whole segments)."""
    policy = copy.deepcopy(model)
    with torch.no_grad():
        for token, factor in boost:
            policy.output_weight[token] *= factor
    return policy


def in_segment(tokens: list) -> bool:
    """A placeholder right after a sampled <|vision_start|>: what a plain id count would take for an image's."""
    return any(a == START and b == IMAGE for a, b in zip(tokens, tokens[1:]))


def test_sampled_markers_are_text_in_the_engine_and_every_training_pass(model):  # noqa: F811
    policy = marker_loving(model)
    a, c = images((24, 32), (40, 16))
    items = [PromptItem(ROW, (5, START, *[IMAGE] * a.num_tokens, END, 6, 7), "", images=a),
             PromptItem(ROW, (8, START, *[IMAGE] * c.num_tokens, END, 9), "", images=c),
             PromptItem(ROW, (10, 11, 12), "")]  # a text row: its sampled markers are text too
    n = 2
    prompts = [list(item.prompt_ids) for item in items for _ in range(n)]
    pictures = [item.images for item in items for _ in range(n)]
    result = RolloutEngine(policy, EngineConfig(max_slots=4)).generate(
        prompts, SamplingParams(max_new_tokens=10, temperature=1.0), eos_token_ids=[3], pad_token_id=0,
        generator=torch.Generator().manual_seed(SEED[model.vision_config.family]), images=pictures)
    responses = result.response_ids
    assert sum(r.count(IMAGE) for r in responses) >= 3 and any(in_segment(r) for r in responses), \
        "the policy sampled too few markers for the test to mean anything: pick another seed"
    # the model's own forward over prompt + response (what the GPU decode test checks)
    for prompt, tokens, logprobs, image in zip(prompts, responses, result.logprobs, pictures):
        torch.testing.assert_close(torch.tensor(logprobs), forward_logprobs(policy, prompt, tokens, image, 1.0),
                                   atol=1e-5, rtol=4e-6)
    # the trainer's passes (old policy, reference and update read the same rows_logprobs), padded and packed
    batch = build_rollout_batch(items, n, result, tokenizer=_Tokenizer(), pad_token_id=0, group_offset=0,
                                device="cpu")
    mask = batch.response_mask.bool()
    for packing in (False, True):
        logp = batch_logprobs(policy, batch, temperature=1.0, token_budget=64, packing=packing)
        torch.testing.assert_close(logp[mask], batch.rollout_logprobs[mask], atol=1e-5, rtol=4e-6)


def test_markers_sampled_before_an_image_observation_are_text(model):  # noqa: F811
    # The turns before the episode's picture sample placeholders and <|vision_start|>, and some end on a marker (fed
    # again at the head of the observation's extend pass); the picture still takes the observation's own segment.
    # No <|vision_end|> favoured: a whole sampled segment before an image is refused (the last test).
    policy = marker_loving(model, ((IMAGE, 12.0), (START, 8.0)))
    episodes = run_episodes(policy, seed=3)
    before = [s.token_ids for ep in episodes for s in ep.segments[:4] if s.kind == "model"]
    assert sum(t.count(IMAGE) for t in before) >= 3 and any(t[-1] in (IMAGE, START) for t in before), \
        "the turns before the picture sampled too few markers for the test to mean anything: pick another seed"
    assert all(ep.segments[4].images is not None for ep in episodes)
    batch = episodes_batch(episodes, 2, tokenizer=TOK, pad_token_id=0, group_offset=0, device="cpu")
    mask = batch.loss_mask.bool()
    for packing in (False, True):
        logp = batch_logprobs(policy, batch, temperature=0.9, token_budget=512, packing=packing)
        torch.testing.assert_close(logp[mask], batch.rollout_logprobs[mask], atol=1e-5, rtol=4e-6)


def test_a_sampled_marker_is_positioned_as_text():
    from phaserl.models.qwen_vl import ImageTokenIds

    tokens = ImageTokenIds(IMAGE, 291, START, END)
    prompt = [5, START, *[IMAGE] * 6, END, 6]
    sampled = [IMAGE, 7, START, IMAGE, IMAGE, END, IMAGE]
    got, delta = mrope_positions(prompt + sampled, [(1, 4, 6)], tokens=tokens, merge=2)
    text, text_delta = mrope_positions(prompt + [9] * len(sampled), [(1, 4, 6)], tokens=tokens, merge=2)
    assert torch.equal(got, text) and delta == text_delta
    assert got[:, len(prompt):].tolist() == [list(range(7, 14))] * 3  # one position each, all axes equal


def test_fewer_placeholders_than_an_image_needs_is_still_an_error(model):  # noqa: F811
    (a,) = images((24, 32))
    n = a.num_tokens
    short = [5, START, *[IMAGE] * (n - 1), END, 6]
    # a sampled placeholder after it brings the row's count to the image's: the short segment is still the error
    with pytest.raises(ValueError, match=f"row 0 holds {n} image placeholder tokens, its images give {n} "
                                         rf"\(image_grid_thw\): image 0 .* needs {n} placeholder tokens, the ids hold "
                                         f"a run of {n - 1}"):
        model(torch.tensor([short + [IMAGE]]), images=[a])
    with pytest.raises(ValueError, match=f"a prompt holds {n - 1} image placeholder tokens, its images give {n}"):
        RolloutEngine(model).generate([short], SamplingParams(max_new_tokens=2), eos_token_ids=[], pad_token_id=0,
                                      images=[a])
    with pytest.raises(ValueError, match="the ids hold 0 image segment"):  # placeholders without their markers
        model(torch.tensor([[5, *[IMAGE] * n, 6]]), images=[a])
    with pytest.raises(ValueError, match=f"needs {n} placeholder tokens, the ids hold a run of 1"):  # extra, before
        model(torch.tensor([[5, START, IMAGE, END, START, *[IMAGE] * n, END]]), images=[a])


def test_lost_pixels_and_a_sampled_segment_before_an_image_are_refused_in_training(model):  # noqa: F811
    a, c = images((24, 32), (24, 16))
    prompt = [5, START, *[IMAGE] * a.num_tokens, END, 6]
    observation = [4, START, *[IMAGE] * c.num_tokens, END, 7]

    def check(turn: list, loss: list, pictures):
        ids = torch.tensor([prompt + turn])
        model.check_pixels(ids, torch.ones_like(ids), torch.tensor([loss]), pictures)

    sampled = [START, IMAGE, END]  # a whole segment the policy wrote
    check(sampled, [1, 1, 1], [a])  # after the row's last image: text
    check([9] + observation + sampled, [1] + [0] * len(observation) + [1, 1, 1], [join_images([a, c])])
    with pytest.raises(ValueError, match="row 0: its prompt and observations hold 2 image segment.*its images give 1"):
        check([9] + observation, [1] + [0] * len(observation), [a])  # the observation's pixels lost
    with pytest.raises(ValueError, match="row 0: its prompt and observations hold 1 image segment.*give 0"):
        check([9], [1], None)  # the prompt's pixels lost
    with pytest.raises(ValueError, match="row 0: the policy sampled a whole image segment"):
        check(sampled + observation, [1, 1, 1] + [0] * len(observation), [join_images([a, c])])
