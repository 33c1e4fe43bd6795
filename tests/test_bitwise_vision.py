"""The bitwise numerics mode (rollout.bitwise) with vision-language policies (tiny random Qwen2.5-VL and Qwen3-VL,
deepstack included): the vision tower gives an image's features the same bits whatever else its call holds, and the
trainer's log-prob of every sampled token of image prompts (one or two images of different sizes a row, beside text
rows) equals the rollout engine's exactly (0.0), for padded and packed micro-batches of every size, with and without
autograd; without the mode the same comparison is only close.
"""
import copy

import numpy as np
import pytest
import torch

from phaserl.data.images import image_processor, process_images, with_starts
from phaserl.data.prompts import PromptItem
from phaserl.data.rows import PromptRow
from phaserl.models import invariant
from phaserl.roles.forward import rows_logprobs
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams
from phaserl.trainer.rollout_phase import build_rollout_batch
from test_rollout_vision import END, IMAGE, START, model  # noqa: F401  (the tiny VLM fixture of each family)
from test_trainer_vision import _Tokenizer

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def default_numerics_after():
    yield
    invariant.enable(False)


def pictures(*sizes, seed=0):
    """One row's images, (height, width) each, through one processor call."""
    processor = image_processor(patch_size=4, merge_size=2, min_pixels=8 * 8, max_pixels=64 * 64)
    rng = np.random.default_rng(seed)
    made = [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for h, w in sizes]
    return process_images(made, processor, merge_size=2)


def segment(n: int) -> list[int]:
    return [START, *[IMAGE] * n, END]


def items():
    """Four prompts: one image; two images of different sizes; text; one image of a third size."""
    row = PromptRow(prompt="p", data_source="", ground_truth=None, extra_info={}, source="t:row 0", index=0, raw={})
    one, two, three = pictures((24, 32)), pictures((16, 24), (40, 16), seed=1), pictures((32, 32), seed=2)
    a, (b, c) = one.tokens[0], two.tokens
    return [PromptItem(row, (5, *segment(a), 6), "", images=with_starts(one, (2,))),
            PromptItem(row, (7, *segment(b), 8, *segment(c), 9), "", images=with_starts(two, (2, b + 5))),
            PromptItem(row, (10, 11, 12), ""),
            PromptItem(row, (13, 14, *segment(three.tokens[0])), "", images=with_starts(three, (3,)))]


def sampled_batch(vlm, n=2, max_slots=3):
    """n samples of each prompt through the engine (8 sequences in 3 slots: refill and compaction; each prefill
    pass holds several image prompts), laid out as the trainer's batch."""
    prompts = items()
    rows = [item for item in prompts for _ in range(n)]
    device = vlm.output_weight.device
    engine = RolloutEngine(vlm, EngineConfig(max_slots=max_slots))
    result = engine.generate([list(item.prompt_ids) for item in rows], SamplingParams(max_new_tokens=6,
                             temperature=0.9, top_k=50), eos_token_ids=[], pad_token_id=0,
                             max_new_tokens=[6 - i % 3 for i in range(len(rows))],
                             generator=torch.Generator(device=device).manual_seed(3),
                             images=[item.images for item in rows])
    return build_rollout_batch(prompts, n, result, tokenizer=_Tokenizer(), pad_token_id=0, group_offset=0,
                               device=device)


def trainer_vs_engine(vlm, batch, sizes=(1, 3, 8)) -> list[float]:
    """max |trainer - engine| over the sampled tokens of each micro-batch: padded and packed, of `sizes` rows,
    without and with autograd."""
    B = batch.input_ids.shape[0]
    diffs = []
    for packing in (False, True):
        for size in sizes:
            for grad in (False, True):
                with torch.set_grad_enabled(grad):
                    for start in range(0, B, size):
                        idx = torch.arange(start, min(start + size, B), device=batch.input_ids.device)
                        logp, _, mask = rows_logprobs(vlm, batch, idx, packing=packing, temperature=0.9,
                                                      with_entropy=grad)
                        diff = (logp - batch.rollout_logprobs[idx, :mask.shape[1]]).abs() * mask
                        diffs.append(float(diff.detach().max()))
    return diffs


def alone_and_together(vlm) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each row's tower output computed alone and in one call with the other rows' images (and a text row)."""
    rows = [pictures((24, 32)), pictures((16, 24), (40, 16), seed=1), pictures((32, 32), seed=2)]
    with torch.no_grad():
        together = vlm.image_features([rows[1], None, rows[0], rows[2]])
        return [(vlm.image_features([row])[0], joint) for row, joint in zip(rows, [together[2], together[0],
                                                                                     together[3]])]


def test_an_images_tower_features_do_not_depend_on_the_other_images_of_the_call(model):  # noqa: F811
    with invariant.bitwise():
        exact = alone_and_together(model)
    assert all(torch.equal(alone, joint) for alone, joint in exact)
    default = alone_and_together(model)
    assert not all(torch.equal(alone, joint) for alone, joint in default)  # the test can fail
    for (alone, _), (theirs, _) in zip(exact, default):  # the mode's kernels: the default tower's numbers, to rounding
        torch.testing.assert_close(alone, theirs, atol=1e-5, rtol=1e-4)


def test_mrope_positions_lay_the_attention_out_by_place_in_the_sequence():
    """In the bitwise mode the decoder lays keys out by each token's place in its sequence (where the engine writes
    it), whatever rotary positions the tokens carry: M-RoPE's [3, B, T] ones count places from the mask/seq ids."""
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    rotary = torch.randint(0, 9, (3, 2, 5))
    padded = invariant.Aligned.of(mask, rotary, None)
    assert padded.pos.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]] and padded.length == 5
    seq_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    packed = invariant.Aligned.of(torch.ones(1, 8), torch.randint(0, 9, (3, 1, 8)), seq_ids)
    assert packed.pos.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]] and packed.seq.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trainer_logprobs_of_image_prompts_equal_the_engines_bit_for_bit(model, dtype):  # noqa: F811
    vlm = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    with invariant.bitwise():
        batch = sampled_batch(vlm)
        assert sum(im is not None for im in batch.images) == 6
        diffs = trainer_vs_engine(vlm, batch)
    assert max(diffs) == 0.0, diffs


def test_lora_on_the_language_model_keeps_the_equality(model):  # noqa: F811
    """Adapters on the decoder's projections (the tower has none): the engine multiplies the merged weights, the
    trainer's forward computes them again, and image prompts still agree exactly."""
    from phaserl.models.lora import LoRASettings, apply_lora

    vlm = copy.deepcopy(model)
    apply_lora(vlm, LoRASettings(rank=4, alpha=8.0))
    with torch.no_grad():
        for name, p in vlm.named_parameters():
            if name.endswith("lora_B"):  # a zero B would merge to W exactly
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(7))
    with invariant.bitwise():
        batch = sampled_batch(vlm)
        diffs = trainer_vs_engine(vlm, batch, sizes=(3, 8))
    assert max(diffs) == 0.0, diffs


def test_episodes_with_image_observations_extend_with_the_trainers_numbers(model):  # noqa: F811
    """Multi-turn episodes whose environment answers with a picture (the engine's extend pass places the
    observation's features and M-RoPE positions): every turn's log-probs equal the trainer's, bit for bit."""
    from phaserl.trainer.episode_batch import episodes_batch
    from test_agents_vision import TOK, run_episodes

    with invariant.bitwise():
        episodes = run_episodes(model)
        assert all(ep.segments[4].images is not None for ep in episodes)
        batch = episodes_batch(episodes, 2, tokenizer=TOK, pad_token_id=0, group_offset=0, device="cpu")
        diffs = []
        for packing in (False, True):
            for idx in ([0], [1, 2], [0, 1, 2, 3]):
                with torch.no_grad():
                    logp, _, mask = rows_logprobs(model, batch, torch.tensor(idx), packing=packing, temperature=0.9,
                                                  with_entropy=False)
                loss_mask = batch.loss_mask[idx, :mask.shape[1]].bool() & mask
                diffs.append(float(((logp - batch.rollout_logprobs[idx, :mask.shape[1]]).abs() * loss_mask).max()))
    assert max(diffs) == 0.0, diffs


def test_without_the_mode_the_same_comparison_is_only_close(model):  # noqa: F811
    """The test above can fail: with the default kernels the trainer's packed rows differ from the engine's bits."""
    batch = sampled_batch(model)
    with torch.no_grad():
        logp, _, mask = rows_logprobs(model, batch, torch.arange(8), packing=True, temperature=0.9,
                                      with_entropy=False)
    diff = ((logp - batch.rollout_logprobs[:, :mask.shape[1]]).abs() * mask).max()
    assert 0.0 < diff < 1e-4


def test_a_trainable_tower_gets_the_default_kernels_gradients(model):  # noqa: F811
    """model.vision_trainable in the mode: the tower's kernels (attention per group, LayerNorm, GELU, linears) have
    the default kernels' backward, so its parameters' gradients are the default mode's, to rounding."""
    from phaserl.models.vision import set_trainable

    vlm = copy.deepcopy(model)
    set_trainable(vlm.visual, True)
    with invariant.bitwise():
        batch = sampled_batch(vlm)
    grads = []
    for on in (True, False):
        with invariant.bitwise(on):
            logp, _, mask = rows_logprobs(vlm, batch, torch.arange(8), packing=True, temperature=0.9,
                                          with_entropy=False)
            (-logp[mask].sum()).backward()
        grads.append({name: p.grad for name, p in vlm.visual.named_parameters()})
        vlm.zero_grad(set_to_none=True)
    assert all(g is not None and g.abs().sum() > 0 for g in grads[0].values())
    for name, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][name], atol=1e-5, rtol=1e-3, msg=name)


def test_the_builder_takes_the_mode_for_a_vision_language_actor(model):  # noqa: F811
    from phaserl.trainer.build import set_numerics

    set_numerics(True, model)
    assert invariant.enabled()


@pytest.mark.slow
def test_a_vision_grpo_run_in_bitwise_mode_logs_zero_mismatch_every_step(tmp_path):
    """examples/vision_grpo.yaml (the built-in vision world's tiny Qwen2.5-VL) in the mode: 16 responses a step
    through 5 engine slots, packed micro-batches of 120 tokens, two mini-batches (the old log-prob pass measures)."""
    import json
    import os

    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer

    example = os.path.join(os.path.dirname(__file__), "..", "examples", "vision_grpo.yaml")
    cfg = load_config(example, [
        "trainer.device=cpu", "trainer.loggers=[jsonl]", f"trainer.log_dir={tmp_path}",
        f"trainer.checkpoint_path={tmp_path / 'ckpt'}", "trainer.total_steps=2", "data.val_files=[]",
        "rollout.bitwise=true", "rollout.prompts_per_step=4", "rollout.n=4", "rollout.batch_size=4",
        "rollout.engine_max_slots=5", "ppo.packing=true", "ppo.micro_batch_tokens=120",
        "ppo.forward_micro_batch_tokens=150", "algorithm.rollout_correction=tis"])
    RLTrainer.from_config(cfg).fit()
    lines = [json.loads(raw) for raw in open(tmp_path / "metrics.jsonl")]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert line["mismatch/abs_diff_max"] == 0.0 and line["mismatch/k3"] == 0.0, line
        assert line["mismatch/correction_weight_mean"] == 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_trainer_logprobs_of_image_prompts_equal_the_engines_bit_for_bit(model, dtype):  # noqa: F811
    """On a GPU (the Triton matmul and attention where they run; the tower's LayerNorm and GELU from elementwise
    ops): the same equality, and the tower's invariance."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gpu = copy.deepcopy(model).cuda().to(dtype)
    one, two = pictures((24, 32)), pictures((16, 24), (40, 16), seed=1)
    with invariant.bitwise():
        with torch.no_grad():
            assert torch.equal(gpu.image_features([one])[0], gpu.image_features([two, one])[1])
        batch = sampled_batch(gpu)
        diffs = trainer_vs_engine(gpu, batch)
    assert max(diffs) == 0.0, diffs
