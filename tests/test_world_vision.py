"""The vision world: its prompt files are verl-schema rows with images, its committed tiny VLM loads natively with a
frozen tower and imitates the sloppy teacher, and examples/vision_grpo.yaml raises the held-out score by >= 0.20."""
import json
import os

import pytest

from phaserl.data import load_prompt_rows
from phaserl.models import load_pretrained
from phaserl.models.qwen_vl import VisionLM
from phaserl.world import prepare_tiny_world
from phaserl.world.vision_build import NUM_VAL, greedy_counts, prepare_vision_world, prompt_ids, scenes, world_processor
from phaserl.world.vision_task import build_vision_tokenizer, make_scene

pytest.importorskip("PIL")
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "vision_grpo.yaml")


def test_the_world_files_hold_images_and_the_model_imitates_the_teacher():
    world = prepare_vision_world()
    rows = load_prompt_rows([world.val_file])
    assert len(rows) == NUM_VAL and len(rows[0].raw["images"]) == 1 and "<image>" in rows[0].prompt[0]["content"]
    model = load_pretrained(world.model_dir)
    assert isinstance(model, VisionLM) and not any(p.requires_grad for p in model.visual.parameters())
    tokenizer = build_vision_tokenizer()
    inputs, made = scenes(2_000_000, 100, world_processor())
    digits = [tokenizer.convert_ids_to_tokens(t) for t in greedy_counts(model, prompt_ids(tokenizer, 9), inputs)]
    accuracy = sum(d == str(s.count) for d, s in zip(digits, made)) / len(made)
    # greedy: the teacher's usual answer, the count of the left two columns (right when the right column is empty)
    left = sum(d == str(sum(1 for _, col in s.red_cells if col < 2)) for d, s in zip(digits, made)) / len(made)
    assert left >= 0.9 and accuracy < 0.6, (left, accuracy)
    assert make_scene(5).pixels.tobytes() == make_scene(5).pixels.tobytes()  # scenes are made from their seed


@pytest.mark.slow
def test_the_vision_example_raises_the_held_out_score_by_20_points(tmp_path):
    from phaserl.cli import main

    assert main(["train", EXAMPLE, "trainer.device=cpu", "trainer.loggers=[jsonl]", f"trainer.log_dir={tmp_path}",
                 f"trainer.checkpoint_path={tmp_path / 'ckpt'}"]) == 0
    vals = [(r["step"], r["val/score_mean"]) for r in map(json.loads, open(tmp_path / "metrics.jsonl"))
            if "val/score_mean" in r]
    assert vals[0][0] == 0 and vals[-1][1] - vals[0][1] >= 0.20, vals


def test_the_doctor_probes_a_vision_row_end_to_end():
    import torch

    from phaserl.config.load import load_config
    from phaserl.doctor.checks import Context
    from phaserl.doctor.vision import check_vision_rows

    world = prepare_vision_world()
    cfg = load_config(EXAMPLE)
    ctx = Context(cfg=cfg, world_size=1)
    ctx.device, ctx.tokenizer = torch.device("cpu"), build_vision_tokenizer()
    ctx.policy, ctx.train_rows = load_pretrained(world.model_dir), load_prompt_rows([world.train_file])[:4]
    result = check_vision_rows(ctx)
    assert result.status == "OK", result.message
    assert "image tokens per row 9-9" in result.message and "log-prob of the first sampled token" in result.message


def test_a_critic_for_a_vision_policy_is_refused_at_build():
    from phaserl.config.load import load_config
    from phaserl.errors import ConfigError
    from phaserl.trainer.build import build_roles

    cfg = load_config(EXAMPLE, ["algorithm.adv_estimator=gae", "trainer.device=cpu"])
    with pytest.raises(ConfigError, match="critic .* does not take images"):
        build_roles(cfg)


def test_the_doctor_mismatch_probe_samples_with_the_pixels(monkeypatch):
    import re

    import torch

    from phaserl.config.load import load_config
    from phaserl.doctor.checks import Context
    from phaserl.doctor.mismatch import check_mismatch

    world = prepare_vision_world()
    ctx = Context(cfg=load_config(EXAMPLE), world_size=1)
    ctx.device, ctx.tokenizer = torch.device("cpu"), build_vision_tokenizer()
    ctx.policy, ctx.train_rows = load_pretrained(world.model_dir), load_prompt_rows([world.train_file])[:4]
    seen = []  # the images of every tower pass: the engine's and the trainer's side
    tower = ctx.policy.image_features
    monkeypatch.setattr(ctx.policy, "image_features", lambda images: (seen.append(images), tower(images))[1])
    result = check_mismatch(ctx)
    assert result.status == "OK", result.message
    assert len(seen) >= 2 and all(im is not None for im in seen[0])
    mean = float(re.search(r"\|Δ log p\| mean (\S+)", result.message).group(1))
    assert mean < 1e-5, result.message


@pytest.mark.parametrize("lora", [0, 4])
def test_model_vision_trainable_trains_the_tower_beside_lora(lora):
    from phaserl.config.load import load_config
    from phaserl.trainer.build import build_roles

    def tower_trainable(overrides):
        cfg = load_config(EXAMPLE, ["trainer.device=cpu", f"actor.lora.rank={lora}", *overrides])
        model = build_roles(cfg).actor.model
        adapted = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" in n]
        assert all(n.startswith("model.") for n in adapted) and bool(adapted) == bool(lora)
        return {p.requires_grad for p in model.visual.parameters()}

    assert tower_trainable([]) == {False}
    assert tower_trainable(["model.vision_trainable=true"]) == {True}


def test_image_rows_in_settings_that_cannot_carry_them_are_refused():
    from phaserl.config.load import load_config
    from phaserl.errors import ConfigError
    from phaserl.trainer.build import _prompt_dataset

    world = prepare_vision_world()
    model, tokenizer = load_pretrained(world.model_dir), build_vision_tokenizer()
    for settings, message in (([("rollout", "max_staleness", 1)], "asynchronous stream"),
                              ([("agent", "harness", "h.py:run")], "agent.harness episodes"),
                              ([("agent", "env", "env.py:Env"), ("rollout", "engine", "hf")], "built-in engine only")):
        cfg = load_config(EXAMPLE)
        for key, name, value in settings:
            setattr(getattr(cfg, key), name, value)
        with pytest.raises(ConfigError, match=message):
            _prompt_dataset(cfg, [world.val_file], "val", tokenizer, model)
    cfg = load_config(EXAMPLE)
    cfg.agent.env = "env.py:Env"  # agent.env episodes on the built-in engine take the rows with their images
    assert _prompt_dataset(cfg, [world.val_file], "val", tokenizer, model).items[0].images is not None
    text_model = load_pretrained(prepare_tiny_world().model_dir)  # a text policy given image rows
    with pytest.raises(Exception, match="the policy is a text model"):
        _prompt_dataset(load_config(EXAMPLE), [world.val_file], "val", tokenizer, text_model)
