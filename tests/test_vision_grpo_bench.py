"""benchmarks/vision_grpo.py on the CPU: the tiny run prints every side's lines, TRL's processor makes the prompt ids
ours trains on, and a TRL process that dies becomes an error line, not a crash."""
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
pytest.importorskip("PIL")


def lines(capsys) -> list:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_trls_processor_makes_ours_prompt_ids_from_a_conversational_prompt_and_its_image(tmp_path):
    import numpy as np
    from PIL import Image

    import vision_grpo
    from phaserl.data import load_prompt_rows, write_records
    from phaserl.data.images import build_vision_dataset, processor_for
    from phaserl.models.vision import VisionConfig
    from phaserl.world.vision_task import png_bytes

    a = vision_grpo.parse_args(["--tiny", "--image-side", "112"])  # 8 x 8 patches: 16 image tokens
    shape = vision_grpo.SHAPES[a.shape]
    tokenizer = vision_grpo.build_tokenizer(shape["text"]["vocab_size"])
    paths = vision_grpo.world_paths(str(tmp_path))
    tokenizer.save_pretrained(paths["tokenizer"])
    vision_grpo.write_processor(a, paths)  # as TRL's process makes it, over the saved tokenizer
    processor = vision_grpo.processor_class("qwen2_5_vl").from_pretrained(paths["processor"])
    picture = np.random.default_rng(0).integers(0, 256, (112, 112, 3), dtype=np.uint8)
    message = [{"role": "user", "content": [{"type": "image", "image": Image.fromarray(picture)},
                                            {"type": "text", "text": "t7 t8 t9"}]}]
    theirs = processor.apply_chat_template(conversation=[message], add_generation_prompt=True, tokenize=True,
                                           return_dict=True, return_tensors="pt")
    write_records(str(tmp_path / "rows.parquet"), [{"prompt": "<image> t7 t8 t9", "images": [{"bytes": png_bytes(
        picture)}], "data_source": "s", "reward_model": {"style": "rule", "ground_truth": ""}}])
    images = processor_for(VisionConfig(**shape["vision"]), min_pixels=112 * 112, max_pixels=112 * 112)
    ours = build_vision_dataset(load_prompt_rows([str(tmp_path / "rows.parquet")]), tokenizer, images, merge_size=2,
                                max_prompt_length=10**6, overlong="error", apply_chat_template=False).items
    assert theirs["input_ids"][0].tolist() == list(ours[0].prompt_ids) == [2] + [3] * 16 + [4, 7, 8, 9]
    assert vision_grpo.image_tokens(a) == 16 and theirs["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert theirs["pixel_values"].shape == ours[0].images.pixel_values.shape
    assert (theirs["pixel_values"] - ours[0].images.pixel_values).abs().max() < 1e-5  # the same pixels
    row = {"image": Image.fromarray(picture), "prompt": [{"role": "user", "content": "t7 t8 t9"}]}
    a.prompt_len = 3
    assert vision_grpo.check_trl_prompt(a, processor, row) == 16 + 2 + 3
    a.prompt_len = 4  # ours would train on one more word than TRL's prompt holds
    with pytest.raises(ValueError, match="made 21 prompt tokens .16 image tokens. of row 0; ours has 22"):
        vision_grpo.check_trl_prompt(a, processor, row)


def test_the_tiny_run_without_trl_prints_every_side_and_a_skipped_trl_line(monkeypatch, capsys):
    import vision_grpo

    monkeypatch.setitem(sys.modules, "trl", None)  # as on a machine without trl (find_spec answers None)
    vision_grpo.main(["--tiny", "--steps", "1", "--warmup", "0"])
    out = lines(capsys)
    sides = [(r["measure"], r.get("side")) for r in out]
    assert sides == [("setup", None), ("step", "trl"), ("rollout", "transformers"), ("rollout", "transformers"),
                     ("build", "ours"), ("rollout", "ours"), ("rollout", "ours"), ("step", "ours"), ("summary", None)]
    assert "trl is not installed" in out[1]["skipped"] and out[-1]["trl"] == {"skipped": "trl is not installed"}
    step = out[7]
    assert step["warmup"] is False and step["seconds"] > 0 and step["response_length_mean"] == 4.0
    assert out[-1]["ours"]["step_seconds_median"] == step["seconds"] and out[-1]["rollout_speedup"] > 0
    assert out[0]["sequence_len"] == 4 + 2 + 64 + 4 and out[0]["micro_batch"] == 2


def test_a_trl_process_that_dies_becomes_an_error_line(monkeypatch, capsys):
    import importlib.util

    import vision_grpo

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: object())  # as if trl were installed
    popen = subprocess.Popen
    started = []

    def dies(command, **kw):  # the TRL process prints a step, then dies as an out-of-memory kill would
        started.append(command)
        step = json.dumps({"bench": "vision_grpo", "measure": "step", "side": "trl", "step": 0, "warmup": False,
                           "seconds": 1.5, "peak_allocated_gib": 30.0})
        return popen([sys.executable, "-c", f"print({step!r}); print('not json'); raise SystemExit(3)"], **kw)

    monkeypatch.setattr(subprocess, "Popen", dies)
    a = vision_grpo.parse_args(["--tiny"])
    assert vision_grpo.trl_side(a, ["--tiny"], "/world") == {  # the step it finished still counts
        "step_seconds_median": 1.5, "steps_timed": 1, "peak_allocated_gib": 30.0,
        "error": "the TRL process exited with 3 (its stderr above)"}
    assert started[0][-3:] == ["--tiny", "--trl-world", "/world"]
    out = lines(capsys)
    assert [r.get("error") for r in out] == [None, "the TRL process exited with 3 (its stderr above)"]


@pytest.mark.slow
def test_the_tiny_run_with_trl_times_trls_grpo_trainer(capsys):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    import vision_grpo

    vision_grpo.main(["--tiny", "--steps", "1", "--warmup", "0", "--skip-transformers", "--skip-ours-step"])
    out = lines(capsys)
    trl = {r["measure"]: r for r in out if r.get("side") == "trl"}
    assert "error" not in trl["step"] and trl["step"]["seconds"] > 0 and trl["step"]["response_length_mean"] == 4.0
    assert trl["build"]["prompt_tokens"] == 4 + 2 + 64 and trl["build"]["image_tokens_per_prompt"] == 4
    assert trl["build"]["accumulation"] == 2  # 2 prompts x 2 samples in micro-batches of 2: one optimizer step
    ours = next(r for r in out if r["measure"] == "build" and r["side"] == "ours")
    assert trl["build"]["trainable_params"] == ours["trainable_params"]  # the tower and merger frozen on both
    assert out[-1]["trl"] == {"step_seconds_median": trl["step"]["seconds"], "steps_timed": 1,
                              "peak_allocated_gib": None}
