"""Qwen2.5-VL and Qwen3-VL on the native decoder against transformers' own classes, on tiny random configs: float32
logits equal with images of two sizes (Qwen2.5-VL: window and full attention in the tower, block M-RoPE; Qwen3-VL:
the learned position table resized per image, deepstack features, interleaved M-RoPE) and a text-only row, both ways
through Hugging Face directories; a placeholder count that does not match the images is an error; the tower is
frozen unless asked and LoRA adapts only the language model."""
import numpy as np
import pytest
import torch
import transformers

from _hf_pairs import randomize
from phaserl.data.images import image_processor, process_images
from phaserl.models import load_pretrained, save_pretrained
from phaserl.models.lora import LoRASettings, apply_lora
from phaserl.models.mrope import mrope_positions
from phaserl.models.qwen_vl import ImageTokenIds, VisionLM

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

torch.set_num_threads(1)
IMAGE, START, END = 290, 292, 293
PATCH, MERGE = 4, 2
TOKENS = ImageTokenIds(IMAGE, 291, START, END)


def qwen2_5_vl_config():
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
                         bos_token_id=1, eos_token_id=2),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH,
                           spatial_merge_size=MERGE, temporal_patch_size=2, window_size=16, out_hidden_size=64,
                           fullatt_block_indexes=[1]),
        image_token_id=IMAGE, video_token_id=291, vision_start_token_id=START, vision_end_token_id=END)


def qwen3_vl_config():
    return transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True,
                                          "rope_theta": 10000.0}, bos_token_id=1, eos_token_id=2),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH,
                           spatial_merge_size=MERGE, temporal_patch_size=2, out_hidden_size=64,
                           num_position_embeddings=16, deepstack_visual_indexes=[0, 1]),
        image_token_id=IMAGE, video_token_id=291, vision_start_token_id=START, vision_end_token_id=END)


FAMILIES = {"qwen2_5_vl": (qwen2_5_vl_config, transformers.Qwen2_5_VLForConditionalGeneration),
            "qwen3_vl": (qwen3_vl_config, transformers.Qwen3VLForConditionalGeneration)}


def picture(h: int, w: int, seed: int):
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    config, cls = FAMILIES[request.param]
    hf = randomize(cls(config()))
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory)
    return hf, load_pretrained(directory), directory


def batch():
    """Three left-padded rows: two images of different sizes (windows of 2x2 merged tokens cut the larger one), one
    image, and text only. Returns ids [3, S], mask [3, S], per-row ImageInputs (or None)."""
    processor = image_processor(patch_size=PATCH, merge_size=MERGE, min_pixels=8 * 8, max_pixels=64 * 64)
    two = process_images([picture(48, 40, 0), picture(16, 24, 1)], processor, merge_size=MERGE)
    one = process_images([picture(24, 32, 2)], processor, merge_size=MERGE)
    rows = [[5, 6, START, *[IMAGE] * two.tokens[0], END, 7, START, *[IMAGE] * two.tokens[1], END, 8, 9],
            [10, START, *[IMAGE] * one.tokens[0], END, 11, 12, 13],
            [14, 15, 16, 17]]
    S = max(map(len, rows))
    ids = torch.tensor([[0] * (S - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (S - len(r)) + [1] * len(r) for r in rows])
    return ids, mask, [two, one, None]


def hf_logits(hf, ids, mask, images):
    present = [im for im in images if im is not None]
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == IMAGE).int(),
                  pixel_values=torch.cat([im.pixel_values for im in present]),
                  image_grid_thw=torch.tensor([g for im in present for g in im.grids])).logits


def test_loads_natively_with_a_frozen_tower(pair):
    hf, ours, _ = pair
    assert isinstance(ours, VisionLM) and ours.config.mrope_section == (2, 3, 3)
    qwen3 = hf.config.model_type == "qwen3_vl"
    assert ours.config.mrope_interleaved == qwen3 and ours.config.qk_norm == qwen3
    assert ours.vision_config.deepstack_visual_indexes == ((0, 1) if qwen3 else ())
    assert not any(p.requires_grad for p in ours.visual.parameters())
    assert all(p.requires_grad for p in ours.model.parameters())


def test_logits_equal_transformers_with_images_in_float32(pair):
    hf, ours, _ = pair
    ids, mask, images = batch()
    assert images[0].grids[0] != images[0].grids[1]  # two sizes in one row
    with torch.no_grad():
        got = ours.logits(ours(ids, attention_mask=mask, images=images))
    real = mask.bool()
    torch.testing.assert_close(got[real], hf_logits(hf, ids, mask, images)[real], atol=1e-5, rtol=1e-5)


def test_the_images_and_their_positions_change_the_logits(pair):
    # The parity above must be able to fail: other pixels, or plain positions, give other logits.
    hf, ours, _ = pair
    ids, mask, images = batch()
    with torch.no_grad():
        right = ours.logits(ours(ids, attention_mask=mask, images=images))
        other = [None if im is None else type(im)(im.pixel_values.flip(0), im.grids, im.tokens) for im in images]
        moved = ours.logits(ours(ids, attention_mask=mask, images=other))
        embeds, _ = ours.embed_with_images(ids, images)
        plain = ours.logits(ours.model(ids, (mask.cumsum(-1) - 1).clamp(min=0), mask, embeds=embeds))
    real = mask.bool()
    assert (right[real] - moved[real]).abs().max() > 1e-3
    assert (right[real] - plain[real]).abs().max() > 1e-3


def test_export_loads_in_transformers_with_the_same_logits(pair, tmp_path):
    _, ours, _ = pair
    save_pretrained(ours, tmp_path / "out")
    hf = type(pair[0]).from_pretrained(tmp_path / "out").eval()
    again = load_pretrained(tmp_path / "out")
    ids, mask, images = batch()
    with torch.no_grad():
        got = ours.logits(ours(ids, attention_mask=mask, images=images))
        back = again.logits(again(ids, attention_mask=mask, images=images))
    real = mask.bool()
    torch.testing.assert_close(hf_logits(hf, ids, mask, images)[real], got[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(back, got)


def test_a_placeholder_count_that_differs_from_the_processors_is_an_error(pair):
    _, ours, _ = pair
    ids, mask, images = batch()
    short = ids.clone()
    short[1, short[1].tolist().index(IMAGE)] = 7  # one placeholder fewer in row 1
    with pytest.raises(ValueError, match="row 1 holds 11 image placeholder tokens, its images give 12"):
        ours(short, attention_mask=mask, images=images)
    with pytest.raises(ValueError, match="needs 6 placeholder tokens, the ids hold a run of 2"):
        mrope_positions([START, IMAGE, IMAGE, END], [(1, 4, 6)], tokens=TOKENS, merge=MERGE)
    with pytest.raises(ValueError, match="hold 0 image segment"):  # placeholders without the vision markers
        mrope_positions([IMAGE, IMAGE, 5, IMAGE], [(1, 2, 4)], tokens=TOKENS, merge=MERGE)


def test_text_positions_after_an_image_continue_from_its_largest_position():
    # (t, h, w) = (1, 4, 6) patches -> 2 x 3 merged tokens at rows 0..1, columns 0..2 from the image's start (1)
    ids = [START] + [IMAGE] * 6 + [END, 9]
    positions, delta = mrope_positions(ids, [(1, 4, 6)], tokens=TOKENS, merge=MERGE)
    assert positions[:, 0].tolist() == [0, 0, 0]
    assert positions[:, 1:7].tolist() == [[1] * 6, [1, 1, 1, 2, 2, 2], [1, 2, 3, 1, 2, 3]]
    assert positions[:, 7].tolist() == [4, 4, 4] and positions[:, 8].tolist() == [5, 5, 5]
    assert delta == 6 - len(ids)


def test_lora_adapts_the_language_model_only(pair):
    import copy

    _, ours, _ = pair
    model = copy.deepcopy(ours)
    names = apply_lora(model, LoRASettings(rank=2, alpha=4))
    assert names and not any(n.startswith("visual") for n in names)
    assert not any(p.requires_grad for p in model.visual.parameters())
