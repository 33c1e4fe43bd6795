"""Multi-turn episodes of a vision-language policy whose environment answers with a picture (tiny random Qwen2.5-VL
and Qwen3-VL, deepstack included): the engine appends the observation's image tokens with their features and M-RoPE
positions, the episode's batch carries every image of the episode to the training forward, whose log-probs equal the
sampled ones and whose loss reaches the observation image's features; a count that does not match is an error."""
import io

import numpy as np
import pytest
import torch

from phaserl.agents import Environment, ImageObservation, StepResult
from phaserl.agents.episodes import AgentLimits, EpisodeRunner, EpisodeStart
from phaserl.agents.loader import EnvironmentFactory
from phaserl.agents.render import ObservationRenderer, ObservationVision
from phaserl.data.images import ImageInputs, image_processor, with_starts
from phaserl.data.prompts import PromptItem
from phaserl.data.rows import PromptRow
from phaserl.roles.forward import batch_logprobs
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams
from phaserl.trainer.episode_batch import episodes_batch
from test_rollout_vision import END, IMAGE, START, images, model, tower_output_grad  # noqa: F401  (fixtures)

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

torch.set_num_threads(1)
PARAMS = SamplingParams(max_new_tokens=3, temperature=0.9)
PROCESSOR = image_processor(patch_size=4, merge_size=2, min_pixels=8 * 8, max_pixels=64 * 64)
VISION = ObservationVision(PROCESSOR, 2, IMAGE)
MARKERS = {"<|vision_start|>": START, "<|image_pad|>": IMAGE, "<|vision_end|>": END}


class _Tokenizer:
    """Ids written as numbers, the vision markers as their ids (what the runner and the renderer need)."""

    eos_token, chat_template = None, None

    def encode(self, text, add_special_tokens=False):
        for name, i in MARKERS.items():
            text = text.replace(name, f" {i} ")
        return [int(t) for t in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


TOK = _Tokenizer()


def picture(h: int, w: int, seed: int) -> bytes:
    """A random RGB picture as PNG bytes (as an environment that takes screenshots would hand them over)."""
    pixels = (np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


class Screenshot(Environment):
    """Text feedback after the first turn, a picture after the second (the episode's second observation), then
    done after the third. at_reset: a picture as the first observation too (prefilled with the prompt)."""

    def __init__(self, at_reset: bool = False, content: str = "4 <image> 7"):
        self.at_reset, self.content = at_reset, content

    def reset(self, row, *, seed):
        self.turn, self.seed = 0, seed
        return ImageObservation("<image> 2", [picture(16, 16, seed + 100)]) if self.at_reset else ""

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return StepResult("8 9", 0.0)
        if self.turn == 2:
            return StepResult(ImageObservation(self.content, [picture(24, 16, self.seed)]), 0.5)
        return StepResult(None, 1.0, done=True)


def prompt_items() -> list:
    (a,) = images((24, 32))
    row = PromptRow(prompt="p", data_source="", ground_truth=None, extra_info={}, source="t:row 0", index=0, raw={})
    a = with_starts(a, (2,))  # its placeholders begin at index 2 of the prompt's ids, as the data path records
    return [PromptItem(row, (5, START, *[IMAGE] * a.num_tokens, END, 6), "", images=a),  # a prompt with its image
            PromptItem(row, (10, 11, 12), "")]                                            # a text prompt


def run_episodes(model, device="cpu", seed=2, on_env_error="stop", turn_tokens=3, prepare=None, **env):  # noqa: F811
    """Two episodes of each prompt_items() row (noise keys 0, 1 and 2, 3); prepare(session) before they start."""
    limits = AgentLimits(max_turns=4, max_turn_tokens=turn_tokens, max_episode_tokens=192, context_limited=False,
                         step_timeout_s=10.0, on_env_error=on_env_error, workers=2, overlap=False)
    runner = EpisodeRunner(EnvironmentFactory(Screenshot, env), TOK, limits, vision=VISION)
    starts = [EpisodeStart(item, seed=10 * i + k, label=f"t:row {i}, sample {k}", noise_key=2 * i + k)
              for i, item in enumerate(prompt_items()) for k in range(2)]
    engine = RolloutEngine(model, EngineConfig(max_slots=4))
    generator = torch.Generator(device).manual_seed(seed)
    params = SamplingParams(max_new_tokens=turn_tokens, temperature=PARAMS.temperature)
    with engine.session(params, slot_len=192, eos_token_ids=[3], generator=generator) as s:
        if prepare is not None:
            prepare(s)
        episodes = runner.run_session(s, starts)
    return episodes


@pytest.fixture(scope="module")
def batch(model):  # noqa: F811
    episodes = run_episodes(model)
    for ep in episodes:
        assert [s.kind for s in ep.segments] == ["prompt", "model", "observation", "model", "observation", "model"]
        observation = ep.segments[4]
        assert observation.images is not None and observation.token_ids.count(IMAGE) == observation.images.num_tokens
    return episodes_batch(episodes, 2, tokenizer=TOK, pad_token_id=0, group_offset=0, device="cpu")


@pytest.mark.parametrize("packing", [False, True])
def test_sampled_logprobs_after_an_image_observation_equal_the_training_forward(model, batch, packing):  # noqa: F811
    assert batch.images is not None and len(batch.images) == 4
    assert batch.images[0].grids[0] == batch.episodes[0].segments[0].images.grids[0]  # the prompt's image first
    logp = batch_logprobs(model, batch, temperature=0.9, token_budget=512, packing=packing)
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(logp[mask], batch.rollout_logprobs[mask], atol=1e-5, rtol=4e-6)
    # the check can fail: other pixels at the observation's image change the log-probs of the turn after it
    changed = []
    for im in batch.images:
        pixels = im.pixel_values.clone()
        pixels[-4:] += 1.0  # the last patches: the observation's picture
        changed.append(ImageInputs(pixels, im.grids, im.tokens, im.starts))
    other = batch_logprobs(model, _with_images(batch, changed), temperature=0.9, token_budget=512, packing=packing)
    assert (other[mask] - logp[mask]).abs().max() > 1e-3


def test_the_update_loss_reaches_the_observation_images_features(model, batch):  # noqa: F811
    features, grad = tower_output_grad(model, batch, 4, temperature=0.9)
    at = 0
    assert grad is not None
    for ep, im in zip(batch.episodes, batch.images):  # each episode's images are its own object: one part each
        at += im.num_tokens
        observed = ep.segments[4].images.num_tokens  # the observation's image: the last tokens of the episode's
        assert grad[at - observed:at].abs().sum() > 0
    assert at == features.shape[0]


def test_a_picture_in_the_first_observation_is_prefilled_with_the_prompt(model):  # noqa: F811
    episodes = run_episodes(model, at_reset=True)
    for ep in episodes:
        assert [s.kind for s in ep.segments][:3] == ["prompt", "observation", "model"]
        assert len(ep.images().grids) == len(ep.segments[0].images.grids if ep.segments[0].images else ()) + 2
    batch = episodes_batch(episodes, 2, tokenizer=TOK, pad_token_id=0, group_offset=0, device="cpu")
    logp = batch_logprobs(model, batch, temperature=0.9, token_budget=512)
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(logp[mask], batch.rollout_logprobs[mask], atol=1e-5, rtol=4e-6)


def test_an_observation_whose_placeholders_and_pictures_disagree_ends_or_stops_the_episode(model):  # noqa: F811
    from phaserl.errors import AgentError

    episodes = run_episodes(model, on_env_error="end", content="<image> <image>")
    assert all(ep.finish_reason == "env_error" and ep.num_turns == 2 for ep in episodes)
    with pytest.raises(AgentError, match="2 '<image>' placeholder"):
        run_episodes(model, content="<image> <image>")


def test_a_batch_without_the_observations_pixels_is_an_error(model, batch):  # noqa: F811
    prompts_only = [ep.segments[0].images for ep in batch.episodes]  # the observations' images lost
    with pytest.raises(ValueError, match="row 0: its prompt and observations hold 2 image segment"):
        batch_logprobs(model, _with_images(batch, prompts_only), temperature=0.9, token_budget=512)


def parked(model):  # noqa: F811
    """A session with one text sequence whose first turn has ended (parked, ready to be extended)."""
    engine = RolloutEngine(model, EngineConfig(max_slots=2))
    context = engine.session(PARAMS, slot_len=128, eos_token_ids=[], generator=torch.Generator().manual_seed(0))
    session = context.__enter__()
    session.start(0, [5, 6, 7], 3)
    while not session.step():
        pass
    return context, session


@pytest.mark.parametrize("case", ["one token short", "no images"])
def test_appended_image_tokens_that_do_not_match_the_images_are_an_error(model, case):  # noqa: F811
    (c,) = images((24, 16))
    n = c.num_tokens - 1 if case == "one token short" else c.num_tokens
    context, session = parked(model)
    try:
        session.extend(0, [4, START, *[IMAGE] * n, END, 7], 3, **({"images": c} if case != "no images" else {}))
        with pytest.raises(ValueError, match="placeholder"):
            session.step()
    finally:
        context.__exit__(None, None, None)


def test_an_image_observation_is_one_processor_call_and_its_placeholders_are_checked():
    renderer = ObservationRenderer(TOK, VISION)
    ids, inputs = renderer.render(ImageObservation("1 <image> 2 <image>", [picture(24, 16, 0), picture(8, 40, 1)]))
    assert len(inputs.grids) == 2 and ids.count(IMAGE) == inputs.num_tokens
    assert ids[:2] == [1, START] and ids[-1] == END
    with pytest.raises(ValueError, match="1 '<image>' placeholder"):
        renderer.render(ImageObservation("<image>", [picture(8, 8, 0), picture(8, 8, 1)]))
    with pytest.raises(ValueError, match="text model"):
        ObservationRenderer(TOK).render(ImageObservation("<image>", [picture(8, 8, 0)]))


def _with_images(batch, images):
    import dataclasses

    return dataclasses.replace(batch, images=list(images))


@pytest.mark.gpu
def test_gpu_cuda_graph_decode_after_an_image_observation(model):  # noqa: F811
    # On CUDA the decode steps replay CUDA graphs that read each slot's M-RoPE shift, which the image observation's
    # extend pass changes in place. float32: the sampled log-probs equal the training forward's.
    import copy

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gpu = copy.deepcopy(model).cuda()
    episodes = run_episodes(gpu, "cuda")  # a sampled marker id is text on both sides (tests/test_vision_markers.py)
    batch = episodes_batch(episodes, 2, tokenizer=TOK, pad_token_id=0, group_offset=0, device="cuda")
    assert batch.images is not None and all(ep.segments[4].images is not None for ep in episodes)
    logp = batch_logprobs(gpu, batch, temperature=0.9, token_budget=512, packing=True)
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(logp[mask], batch.rollout_logprobs[mask], atol=2e-4, rtol=1e-4)
