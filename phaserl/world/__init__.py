"""The tiny world: a built-in, offline task, tokenizer and warm-started model for `phaserl quickstart`.

    task.py       two-digit addition `a+b=`, hash-disjoint sft/train/val splits, the sloppy SFT teacher,
                  verl-schema records (data_source "tiny_arith", reward rule "tiny_exact")
    tokenizer.py  a character-level tokenizer with pad/EOS/role tokens and a chat template
    sft.py        supervised warm-start (loss on answer tokens only), greedy exact-match evaluation,
                  run_sft: the whole warm-start recipe from a random init
    build.py      prepare_tiny_world(): prompt files in a cache dir + the committed model's path
    vision_task.py, vision_build.py   the vision world (`tiny_vision`): counting red squares in small pictures,
                  a sloppy teacher, a warm-started tiny Qwen2.5-VL-shaped model (assets/vision-sft/; docs/vision.md)

The committed model (phaserl/world/assets/tiny-sft/: a 2-layer Qwen2, 0.13 M parameters, 0.5 MB)
imitates a teacher that forgets to carry, so its greedy held-out accuracy starts near 0.35, and a few
dozen GRPO steps on a 2-core CPU (a few seconds each) lift it above 0.8. Rebuild it from scratch
(3,000 SFT steps, about two minutes on a 2-core CPU) with

    python -m phaserl.world.build --regenerate
"""
from phaserl.world.task import Problem, make_problems, make_teacher_problems, to_record
from phaserl.world.tokenizer import build_tokenizer, save_tokenizer

__all__ = ["TinyWorld", "prepare_tiny_world", "regenerate_assets", "Problem", "make_problems",
           "make_teacher_problems", "to_record", "build_tokenizer", "save_tokenizer"]


def __getattr__(name: str):
    # build.py is imported on first use, so that `python -m phaserl.world.build` runs it exactly once.
    if name in ("TinyWorld", "prepare_tiny_world", "regenerate_assets"):
        from phaserl.world import build

        return getattr(build, name)
    raise AttributeError(f"module 'phaserl.world' has no attribute {name!r}")
