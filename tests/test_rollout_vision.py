"""The rollout engine with image prompts (tiny random Qwen2.5-VL and Qwen3-VL, deepstack included): every sampled
token's log-prob equals the training forward's log-softmax with the same pixels, prompts whose ids are equal but
whose images differ are kept apart, and text prompts in the same call are plain decoding."""
import numpy as np
import pytest
import torch

from _hf_pairs import randomize
from phaserl.data.images import image_processor, process_images
from phaserl.models.config import DecoderConfig
from phaserl.models.qwen_vl import ImageTokenIds, VisionLM
from phaserl.models.vision import VisionConfig
from phaserl.roles.forward import head_logprobs
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

torch.set_num_threads(1)
IMAGE, START, END = 290, 292, 293


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def model(request):
    """A tiny random VLM of each family (Qwen3-VL: interleaved M-RoPE, qk-norm, deepstack after layers 0 and 1)."""
    torch.manual_seed(0)
    qwen3 = request.param == "qwen3_vl"
    cfg = DecoderConfig(model_type="qwen3" if qwen3 else "qwen2", vocab_size=300, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, attention_bias=not qwen3,
                        qk_norm=qwen3, rope_theta=10000.0, mrope_section=(2, 3, 3), mrope_interleaved=qwen3)
    shape = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4)
    vision = VisionConfig(**shape, family="qwen3_vl", hidden_act="gelu_pytorch_tanh", num_position_embeddings=16,
                          deepstack_visual_indexes=(0, 1)) if qwen3 else \
        VisionConfig(**shape, window_size=16, fullatt_block_indexes=(1,))
    return randomize(VisionLM(cfg, vision, ImageTokenIds(IMAGE, 291, START, END)))


def images(*sizes):
    processor = image_processor(patch_size=4, merge_size=2, min_pixels=8 * 8, max_pixels=64 * 64)
    rng = np.random.default_rng(0)
    return [process_images([Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))], processor, merge_size=2)
            for h, w in sizes]


def tower_output_grad(model, batch, rows: int, temperature: float):
    """The gradient of an update-like loss (-sum of the rows' log-probs, packed) at the frozen tower's output, held
    as a leaf by a forward hook; asserts the training forward ran the tower exactly once."""
    from phaserl.roles.forward import rows_logprobs

    seen = []

    def leaf(module, args, out):
        seen.append(out.detach().requires_grad_())
        return seen[-1]

    hook = model.visual.register_forward_hook(leaf)
    try:
        with torch.enable_grad():
            logp, _, mask = rows_logprobs(model, batch, torch.arange(rows), packing=True, temperature=temperature,
                                          with_entropy=False)
            (-logp[mask].sum()).backward()
    finally:
        hook.remove()
        model.zero_grad(set_to_none=True)
    assert len(seen) == 1, "the training forward never ran the vision tower"
    return seen[0], seen[0].grad


def forward_logprobs(model, prompt, tokens, image, temperature):
    with torch.no_grad():
        hidden = model(torch.tensor([prompt + tokens]), images=None if image is None else [image])
        expected, _ = head_logprobs(model, hidden[0, len(prompt) - 1:-1], torch.tensor(tokens),
                                    temperature=temperature, chunk_size=4, with_entropy=False)
    return expected


def test_sampled_logprobs_equal_the_training_forward_with_the_same_pixels(model):
    a, b, c = images((24, 32), (24, 32), (40, 16))  # a and b: same grid, so the same prompt ids
    prompt_ab = [5, START, *[IMAGE] * a.num_tokens, END, 6, 7]
    prompt_c = [8, START, *[IMAGE] * c.num_tokens, END, 9]
    prompts = [prompt_ab, prompt_ab, prompt_ab, prompt_ab, prompt_c, [10, 11, 12], prompt_c]
    pictures = [a, a, b, b, c, None, c]
    engine = RolloutEngine(model, EngineConfig(max_slots=3))  # 7 sequences in 3 slots: refill and compaction
    result = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.9), eos_token_ids=[3],
                             pad_token_id=0, generator=torch.Generator().manual_seed(0), images=pictures)
    for prompt, tokens, logprobs, image in zip(prompts, result.response_ids, result.logprobs, pictures):
        torch.testing.assert_close(torch.tensor(logprobs), forward_logprobs(model, prompt, tokens, image, 0.9),
                                   atol=1e-5, rtol=4e-6)
    # the check can fail: with the other image of the same ids, the forward gives other log-probs
    other = forward_logprobs(model, prompt_ab, result.response_ids[2], a, 0.9)
    assert (other - torch.tensor(result.logprobs[2])).abs().max() > 1e-3


def test_images_for_a_text_model_are_an_error(model):
    from phaserl.errors import ConfigError
    from phaserl.models import CausalLM

    text = CausalLM(model.config.replace(mrope_section=None))
    (a,) = images((24, 32))
    with pytest.raises(ConfigError, match="not a vision-language model"):
        RolloutEngine(text).generate([[1, 2]], SamplingParams(max_new_tokens=2), eos_token_ids=[], pad_token_id=0,
                                     images=[a])


def test_placeholders_without_pixels_are_an_error(model):
    (a,) = images((24, 32))
    prompt = [5, START, *[IMAGE] * a.num_tokens, END]
    with pytest.raises(ValueError, match="no images were given"):
        RolloutEngine(model).generate([prompt], SamplingParams(max_new_tokens=2), eos_token_ids=[], pad_token_id=0)


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_gpu_cuda_graph_decode_keeps_the_image_shift(model, compile):
    # On CUDA the decode steps replay CUDA graphs (per bucket) that read each slot's M-RoPE shift; refill and
    # compaction move it with the slot. float32: the sampled log-probs equal the training forward's.
    import copy

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gpu = copy.deepcopy(model).cuda()
    a, c = images((24, 32), (40, 16))
    prompt_a = [5, START, *[IMAGE] * a.num_tokens, END, 6, 7]
    prompt_c = [8, START, *[IMAGE] * c.num_tokens, END, 9]
    prompts = [prompt_a, prompt_c, [10, 11, 12]] * 3
    pictures = [a, c, None] * 3
    engine = RolloutEngine(gpu, EngineConfig(max_slots=4, token_budget=4096, compile=compile))
    result = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0), eos_token_ids=[3],
                             pad_token_id=0, generator=torch.Generator("cuda").manual_seed(0), images=pictures)
    assert engine.last_stats["graphs"] >= 1
    for prompt, tokens, logprobs, image in zip(prompts, result.response_ids, result.logprobs, pictures):
        with torch.no_grad():
            hidden = gpu(torch.tensor([prompt + tokens], device="cuda"), images=None if image is None else [image])
            expected, _ = head_logprobs(gpu, hidden[0, len(prompt) - 1:-1], torch.tensor(tokens, device="cuda"),
                                        temperature=1.0, chunk_size=4, with_entropy=False)
        torch.testing.assert_close(torch.tensor(logprobs), expected.cpu(), atol=2e-4, rtol=1e-4)
