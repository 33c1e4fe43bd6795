"""Vision rows in verl's multimodal schema: an `images` column of PNG bytes (parquet) or file paths (JSONL), one
`<image>` placeholder per image; one processor call per row gives the ids (each placeholder expanded to the image's
token count) and the pixels; bad rows are named by file and row."""
import json

import numpy as np
import pytest

from phaserl.data import load_prompt_rows
from phaserl.data.files import write_records
from phaserl.data.images import build_vision_dataset, image_processor
from phaserl.errors import ConfigError, DataError
from phaserl.world.vision_task import build_vision_tokenizer, make_scene, png_bytes

pytest.importorskip("PIL")

@pytest.fixture(scope="module")
def tools():
    tokenizer = build_vision_tokenizer()
    processor = image_processor(patch_size=4, merge_size=2, min_pixels=8 * 8, max_pixels=32 * 32)
    return tokenizer, processor


def build(rows, tools, **kw):
    tokenizer, processor = tools
    args = dict(merge_size=2, max_prompt_length=200, overlong="error", apply_chat_template=True)
    return build_vision_dataset(rows, tokenizer, processor, **{**args, **kw})


def pictures(n):
    return [make_scene(i).pixels for i in range(n)]


def test_parquet_bytes_and_jsonl_paths_give_the_same_ids_and_pixels(tmp_path, tools):
    a, b = pictures(2)
    (tmp_path / "img").mkdir()
    for name, pixels in (("a.png", a), ("b.png", b)):
        (tmp_path / "img" / name).write_bytes(png_bytes(pixels))
    def user(text):
        return [{"role": "user", "content": text}]

    write_records(tmp_path / "train.parquet", [
        {"prompt": user("<image>and<image>how many red squares?"),
         "images": [{"bytes": png_bytes(a), "path": None}, {"bytes": png_bytes(b), "path": None}]},
        {"prompt": user("<image>count"), "images": [{"bytes": png_bytes(b), "path": None}]},
        {"prompt": user("no picture here"), "images": []}])
    with open(tmp_path / "train.jsonl", "w") as f:  # the same rows with paths relative to the file
        f.write(json.dumps({"prompt": user("<image>and<image>how many red squares?"),
                            "images": ["img/a.png", "img/b.png"]}) + "\n")
        f.write(json.dumps({"prompt": "<image>count", "images": ["img/b.png"]}) + "\n")
        f.write(json.dumps({"prompt": "no picture here"}) + "\n")
    parquet = build(load_prompt_rows([str(tmp_path / "train.parquet")]), tools).items
    jsonl = build(load_prompt_rows([str(tmp_path / "train.jsonl")]), tools).items
    tokenizer, _ = tools
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for p, j in zip(parquet, jsonl):
        assert p.prompt_ids == j.prompt_ids
    two, one, text = parquet
    assert two.images.grids == ((1, 6, 6), (1, 6, 6)) and two.images.tokens == (9, 9)
    assert two.prompt_ids.count(pad) == 18 and one.prompt_ids.count(pad) == 9
    assert two.images.pixel_values.shape == (72, 3 * 2 * 4 * 4)
    assert np.allclose(two.images.pixel_values.numpy(), jsonl[0].images.pixel_values.numpy())
    assert text.images is None and pad not in text.prompt_ids
    # the placeholders of one image are contiguous, between the vision start and end tokens
    start = tokenizer.convert_tokens_to_ids("<|vision_start|>")
    at = one.prompt_ids.index(start)
    assert one.prompt_ids[at + 1:at + 10] == (pad,) * 9


def test_bad_rows_are_named_by_file_and_row(tmp_path, tools):
    good = png_bytes(pictures(1)[0])
    cases = {
        "missing.jsonl": ([{"prompt": "<image>count", "images": ["nowhere.png"]}], "does not exist"),
        "garbage.parquet": ([{"prompt": "<image>count", "images": [{"bytes": good}]},
                             {"prompt": "<image>count", "images": [{"bytes": b"not a png at all"}]}],
                            "not a readable image"),
        "extra.jsonl": ([{"prompt": "<image><image>count", "images": [], "x": 1}], "more placeholders than images"),
    }
    for name, (records, message) in cases.items():
        if name.endswith(".jsonl"):
            (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
        else:
            write_records(tmp_path / name, records)
        row = len(records) - 1
        with pytest.raises(DataError, match=f"{name}:row {row}.*{message}"):
            build(load_prompt_rows([str(tmp_path / name)]), tools)


def test_prompts_with_images_are_never_cut(tmp_path, tools):
    write_records(tmp_path / "t.parquet", [{"prompt": "<image>count", "images": [{"bytes": png_bytes(
        pictures(1)[0])}]}])
    rows = load_prompt_rows([str(tmp_path / "t.parquet")])
    with pytest.raises(ConfigError, match="never cut"):
        build(rows, tools, overlong="truncate_left")
    with pytest.raises(DataError, match="with its image tokens, over data.max_prompt_length=8"):
        build(rows, tools, max_prompt_length=8)
