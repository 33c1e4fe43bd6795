"""A vision-language batch through the trainer's passes: the batch carries each row's pixels from the rollout to
the old-policy/reference pass and the update (padded or packed rows), whose log-probs equal the sampled ones; the
update's loss has a gradient at the tower's output (the pixels reached it), and a batch that lost its pixels is an
error, never silent drift."""
import pytest
import torch

from phaserl.data.images import with_starts
from phaserl.data.prompts import PromptItem
from phaserl.data.rows import PromptRow
from phaserl.roles.forward import batch_logprobs
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams
from phaserl.trainer.rollout_phase import build_rollout_batch
from test_rollout_vision import END, IMAGE, START, images, model, tower_output_grad  # noqa: F401  (fixtures)

torch.set_num_threads(1)


class _Tokenizer:  # what build_rollout_batch needs of a tokenizer: decode
    def batch_decode(self, responses, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in responses]


@pytest.fixture(scope="module")
def batch(model):  # noqa: F811
    a, c = images((24, 32), (40, 16))
    row = PromptRow(prompt="p", data_source="", ground_truth=None, extra_info={}, source="t:row 0", index=0, raw={})
    a, c = with_starts(a, (2,)), with_starts(c, (2,))  # as the data path records them; the prompts are left-padded
    items = [PromptItem(row, (5, START, *[IMAGE] * a.num_tokens, END, 6), "", images=a),
             PromptItem(row, (8, START, *[IMAGE] * c.num_tokens, END), "", images=c),
             PromptItem(row, (10, 11, 12), "")]
    n = 2
    prompts = [list(item.prompt_ids) for item in items for _ in range(n)]
    result = RolloutEngine(model, EngineConfig()).generate(
        prompts, SamplingParams(max_new_tokens=4, temperature=1.0), eos_token_ids=[], pad_token_id=0,
        generator=torch.Generator().manual_seed(1), images=[item.images for item in items for _ in range(n)])
    return build_rollout_batch(items, n, result, tokenizer=_Tokenizer(), pad_token_id=0, group_offset=0,
                               device="cpu")


def test_the_batch_carries_each_rows_pixels(batch):
    assert len(batch.images) == 6 and batch.images[0] is batch.images[1] and batch.images[4] is None
    picked = batch.select(torch.tensor([3, 0]))
    assert picked.images == [batch.images[3], batch.images[0]]


@pytest.mark.parametrize("packing", [False, True])
def test_old_policy_and_reference_logprobs_equal_the_sampled_ones(model, batch, packing):  # noqa: F811
    # packed: the rows' real tokens in one sequence, each row's M-RoPE positions from 0 and its pixels in row order
    seen = []
    tower = model.image_features
    model.image_features = lambda images: (seen.append(len(images)), tower(images))[1]
    try:
        logp = batch_logprobs(model, batch, temperature=1.0, token_budget=64, packing=packing)
    finally:
        del model.image_features
    mask = batch.response_mask.bool()
    torch.testing.assert_close(logp[mask], batch.rollout_logprobs[mask], atol=1e-5, rtol=4e-6)
    assert seen and sum(seen) == 6  # every row went through a micro-batch with its images


def test_the_update_loss_reaches_the_vision_features(model, batch):  # noqa: F811
    features, grad = tower_output_grad(model, batch, 6, temperature=1.0)
    assert features.shape[0] == 12 + 10  # one pass over the batch's two distinct images (shared by their samples)
    assert grad is not None and grad.abs().sum() > 0


def test_a_batch_that_lost_its_pixels_is_an_error(model, batch):  # noqa: F811
    from dataclasses import replace

    with pytest.raises(ValueError, match="row 0: its prompt and observations hold 1 image segment"):
        batch_logprobs(model, replace(batch, images=[None] * 6), temperature=1.0, token_budget=64)


@pytest.mark.gpu
def test_gpu_packed_rows_with_images_equal_the_padded_ones_in_bf16(model, batch):  # noqa: F811
    # On CUDA in bf16 the packed micro-batch runs the varlen kernel (no mask): the rows' M-RoPE positions and pixels
    # must give what the padded rows give.
    import copy
    from dataclasses import replace

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gpu = copy.deepcopy(model).cuda().to(torch.bfloat16)
    on_gpu = replace(batch, **{k: getattr(batch, k).cuda() for k in ("input_ids", "attention_mask", "position_ids",
                                                                    "response_mask", "rollout_logprobs", "loss_mask")})
    padded = batch_logprobs(gpu, on_gpu, temperature=1.0, token_budget=64, packing=False)
    packed = batch_logprobs(gpu, on_gpu, temperature=1.0, token_budget=64, packing=True)
    mask = on_gpu.response_mask.bool()
    torch.testing.assert_close(packed[mask], padded[mask], atol=5e-2, rtol=5e-2)
