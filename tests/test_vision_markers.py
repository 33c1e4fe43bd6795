"""A vision-language policy that samples the image marker ids itself (`<|image_pad|>`, `<|vision_start|>`,
`<|vision_end|>`): the markers are text on both sides. Tiny random Qwen2.5-VL and Qwen3-VL whose head favours the
marker ids sample them often; the rollout engine's log-probs of those tokens (decode, and the extend pass of a
multi-turn episode whose last sampled id is fed again before an image observation) equal the training forward's,
padded and packed, and nothing raises; so does a whole image-sized segment sampled in a turn before an image
observation (the images sit at the starts recorded with their ids). The real mistakes still do: fewer placeholders
than an image needs (a marker sampled later does not make up for it), a segment of the wrong size before an image, a
recorded start that is not its image's segment, a batch that lost pixels, and, for images that record no starts
(placed in order), a whole segment sampled before an image of the same episode."""
import copy

import pytest
import torch

from phaserl.agents import ImageObservation
from phaserl.agents.render import ObservationRenderer
from phaserl.data.images import join_images, with_starts
from phaserl.data.prompts import PromptItem
from phaserl.data.rows import PromptRow
from phaserl.models.mrope import mrope_positions
from phaserl.roles.forward import batch_logprobs
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams
from phaserl.trainer.episode_batch import episodes_batch
from phaserl.trainer.rollout_phase import build_rollout_batch
from test_agents_vision import PARAMS, TOK, VISION, picture, prompt_items, run_episodes
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


def forcing(first_turn: list, prompt_lengths: dict):
    """prepare(session) for run_episodes: each episode's first turn is `first_turn` (the draws after its prompt's last
    position on, by noise key), each forced token's log-prob the policy's own at the session's temperature; every
    other draw is the engine's."""
    def prepare(session):
        runner = session.runner
        drawn = runner._sample

        def sample(hidden, slots, at):  # hidden [b, H], at [b]
            tokens, logprobs = drawn(hidden, slots, at)
            keys = runner.state.key[:hidden.shape[0]] if slots is None else runner.state.key[slots]  # [b]
            logp = (torch.nn.functional.linear(hidden, runner.model.output_weight).float()
                    / PARAMS.temperature).log_softmax(-1)  # [b, V]
            for row, (key, position) in enumerate(zip(keys.tolist(), at.tolist())):
                j = position - (prompt_lengths.get(key, -10**9) - 1)
                if 0 <= j < len(first_turn):
                    tokens[row], logprobs[row] = first_turn[j], logp[row, first_turn[j]]
            return tokens, logprobs
        runner._sample = sample
    return prepare


def test_a_whole_segment_sampled_before_an_image_observation_is_text(model):  # noqa: F811
    # The first turn is a whole segment of exactly the size of the picture the second observation brings: placed in
    # order, the picture would land on it. At its recorded start, the sampled segment is text on both sides.
    _, shot = ObservationRenderer(TOK, VISION).render(ImageObservation("4 <image> 7", [picture(24, 16, 0)]))
    n = shot.num_tokens
    segment = [START, *[IMAGE] * n, END]
    lengths = {2 * i + k: len(item.prompt_ids) for i, item in enumerate(prompt_items()) for k in range(2)}
    episodes = run_episodes(model, turn_tokens=len(segment), prepare=forcing(segment, lengths))
    for ep in episodes:
        assert [s.kind for s in ep.segments] == ["prompt", "model", "observation", "model", "observation", "model"]
        assert ep.segments[1].token_ids == segment and ep.segments[4].images.num_tokens == n
    batch = episodes_batch(episodes, 2, tokenizer=TOK, pad_token_id=0, group_offset=0, device="cpu")
    mask = batch.loss_mask.bool()
    for packing in (False, True):
        logp = batch_logprobs(model, batch, temperature=PARAMS.temperature, token_budget=512, packing=packing)
        torch.testing.assert_close(logp[mask], batch.rollout_logprobs[mask], atol=1e-5, rtol=4e-6)
    for ep, image in zip(episodes, batch.images):  # the picture's recorded start: its own segment, not the sampled
        at = sum(len(s.token_ids) for s in ep.segments[:4])
        assert image.starts[-1] == at + ep.segments[4].token_ids.index(IMAGE)


def test_the_processor_calls_record_where_each_image_starts():
    from phaserl.data.images import image_processor, process_vision_row
    from phaserl.world.vision_task import build_vision_tokenizer, make_scene, png_bytes

    tokenizer = build_vision_tokenizer()
    processor = image_processor(patch_size=4, merge_size=2, min_pixels=8 * 8, max_pixels=32 * 32)
    scenes = [png_bytes(make_scene(i).pixels) for i in range(2)]
    row = PromptRow(prompt="<image> and <image>?", data_source="", ground_truth=None, extra_info={}, source="t:row 0",
                    index=0, raw={"images": scenes})
    ids, _, inputs = process_vision_row(row, tokenizer, processor, merge_size=2, apply_chat_template=True)
    pad, start = tokenizer.convert_tokens_to_ids("<|image_pad|>"), tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert len(inputs.starts) == 2 and inputs.starts[1] > inputs.starts[0] + inputs.tokens[0]
    for first, n in zip(inputs.starts, inputs.tokens):
        assert ids[first - 1] == start and ids[first:first + n] == [pad] * n
    ids, shots = ObservationRenderer(TOK, VISION).render(ImageObservation("1 <image> 2 <image>", [picture(8, 8, 0),
                                                                                                   picture(16, 8, 1)]))
    assert [ids[s - 1:s + n + 1] for s, n in zip(shots.starts, shots.tokens)] == [[START, *[IMAGE] * n, END]
                                                                                  for n in shots.tokens]


def test_positions_follow_the_recorded_starts():
    from phaserl.models.qwen_vl import ImageTokenIds

    tokens = ImageTokenIds(IMAGE, 291, START, END)
    segment = [START, *[IMAGE] * 6, END]
    got, delta = mrope_positions([5] + segment + [6] + segment, [(1, 4, 6)], tokens=tokens, merge=2, starts=(11,))
    text, text_delta = mrope_positions([5] + [9] * 8 + [6] + segment, [(1, 4, 6)], tokens=tokens, merge=2)
    assert torch.equal(got, text) and delta == text_delta  # the first segment is text: the image is the second's
    ordered, _ = mrope_positions([5] + segment + [6] + segment, [(1, 4, 6)], tokens=tokens, merge=2)
    assert not torch.equal(got, ordered)  # placed in order, the image would take the first


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


def test_lost_pixels_are_refused_in_training_and_a_sampled_segment_only_without_recorded_starts(model):  # noqa: F811
    a, c = images((24, 32), (24, 16))
    prompt = [5, START, *[IMAGE] * a.num_tokens, END, 6]
    observation = [4, START, *[IMAGE] * c.num_tokens, END, 7]
    a_at, c_at = with_starts(a, (2,)), with_starts(c, (2,))  # recorded in their own ids, as the processor calls do

    def check(turn: list, loss: list, pictures):
        ids = torch.tensor([prompt + turn])
        model.check_pixels(ids, torch.ones_like(ids), torch.tensor([loss]), pictures)

    sampled = [START, *[IMAGE] * c.num_tokens, END]  # a whole segment the policy wrote, of the observation's size
    check(sampled, [1] * len(sampled), [a])  # after the row's last image: text
    check([9] + observation + sampled, [1] + [0] * len(observation) + [1] * len(sampled), [join_images([a, c])])
    with pytest.raises(ValueError, match="row 0: its prompt and observations hold 2 image segment.*its images give 1"):
        check([9] + observation, [1] + [0] * len(observation), [a])  # the observation's pixels lost
    with pytest.raises(ValueError, match="row 0: its prompt and observations hold 1 image segment.*give 0"):
        check([9], [1], None)  # the prompt's pixels lost
    # before the observation's image: text where the images record their starts, refused where they are placed in order
    turn, loss = sampled + observation, [1] * len(sampled) + [0] * len(observation)
    check(turn, loss, [join_images([a_at, c_at], [0, len(prompt) + len(sampled)])])
    with pytest.raises(ValueError, match="row 0: the policy sampled a whole image segment"):
        check(turn, loss, [join_images([a, c])])
    at, wrong = len(prompt) + len(sampled) + 2, len(prompt) + 2
    with pytest.raises(ValueError, match=rf"row 0: its prompt and observations hold image segments at tokens "
                                         rf"\[2, {at}\], its images are recorded at \[2, {wrong}\]"):
        check(turn, loss, [join_images([a_at, c_at], [0, len(prompt)])])  # the observation's start not moved


def test_a_recorded_start_off_its_images_segment_is_an_error(model):  # noqa: F811
    a, c = images((24, 32), (24, 16))
    n, m = a.num_tokens, c.num_tokens
    ids = [5, START, *[IMAGE] * n, END, 6, START, *[IMAGE] * m, END]
    both = join_images([with_starts(a, (2,)), with_starts(c, (2,))], [0, n + 3])  # c's ids from the 6 on
    model(torch.tensor([ids]), images=[both])  # the right starts
    with pytest.raises(ValueError, match=f"row 0 holds {n + m} image placeholder tokens, its images give {n + m} "
                                         rf"\(image_grid_thw\): image 1 \(grid 1x6x4\) is recorded at token {n + 6}, "
                                         f"where the ids hold no segment of {m} placeholders"):
        model(torch.tensor([ids]), images=[with_starts(both, (2, n + 6))])  # one token late
    with pytest.raises(ValueError, match="row 0 .* the images record 1 start.* for 2 image"):
        model(torch.tensor([ids]), images=[with_starts(both, (2,))])
    with pytest.raises(ValueError, match="a prompt holds .* image 0 .* is recorded at token 1"):
        RolloutEngine(model).generate([ids], SamplingParams(max_new_tokens=2), eos_token_ids=[], pad_token_id=0,
                                      images=[with_starts(both, (1, n + 5))])
