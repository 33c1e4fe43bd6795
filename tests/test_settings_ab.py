"""benchmarks/step_probes.settings_ab: on/off settings alternated in one process, each side's medians and their
difference, the setting restored; and grpo_step.py's --ab on the CPU's tiny run."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


class _Actor:
    keep_head_logits = False


class _Trainer:
    """Records which side each step ran on; the test's timed_step says 2.0 s with the logits kept, 2.1 s without."""

    def __init__(self):
        self.actor, self.step_num, self.sides = _Actor(), 0, []

    def train_step(self) -> dict:
        self.sides.append(self.actor.keep_head_logits)
        return {"timing_s/step": 0.0}


def test_each_setting_alternates_on_and_off_and_is_restored(monkeypatch):
    import step_probes

    trainer, lines = _Trainer(), []
    walls = {True: 2.0, False: 2.1}
    monkeypatch.setattr(step_probes, "timed_step", lambda t: (t.train_step(), walls[t.actor.keep_head_logits]))
    step_probes.settings_ab(trainer, ["keep_head_logits"], 2, 3, lambda **r: lines.append(r))
    # per round: on (1 untimed + 3), off (1 + 3)
    assert trainer.sides == ([True] * 4 + [False] * 4) * 2 and trainer.actor.keep_head_logits is False
    sides = [r for r in lines if r["measure"] == "ab_side"]
    assert [(r["on"], r["round"], r["s_all"]) for r in sides] == [(True, 0, [2.0] * 3), (False, 0, [2.1] * 3),
                                                                  (True, 1, [2.0] * 3), (False, 1, [2.1] * 3)]
    summary = lines[-1]
    assert (summary["measure"], summary["on_s"], summary["off_s"], summary["steps_per_side"]) == ("ab", 2.0, 2.1, 6)
    assert summary["on_minus_off_s"] == pytest.approx(-0.1)


def test_an_unknown_setting_is_named_with_the_choices():
    import step_probes

    with pytest.raises(SystemExit, match=r"\['fast_mode'\] are not settings; choose from keep_head_logits, pinned"):
        step_probes.settings_ab(_Trainer(), ["fast_mode"], 1, 1, print)


def test_ab_without_timed_steps_is_refused_before_anything_is_built():
    # a first GPU run (2026-12-04): `--steps 0 --ab ...` built the trainer, ran four untimed steps and
    # then failed on an empty median
    import grpo_step
    import step_probes

    with pytest.raises(SystemExit):
        grpo_step.parse_args(["--only", "ours", "--steps", "0", "--ab", "keep_head_logits"])
    with pytest.raises(SystemExit, match="--steps 0, --ab-rounds 2; give both at least 1"):
        step_probes.settings_ab(_Trainer(), ["keep_head_logits"], 2, 0, print)


@pytest.mark.slow  # builds and runs the tiny GRPO world: ~20 s on a 2-core CPU
def test_grpo_step_ab_on_the_tiny_run_prints_both_settings(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "grpo_step.py"), "--tiny", "--only", "ours",
                          "--warmup", "1", "--steps", "1", "--ab", "keep_head_logits,pinned_copies", "--ab-rounds", "1",
                          "--world", str(tmp_path / "w")], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["setting"] for r in lines if r.get("measure") == "ab"] == ["keep_head_logits", "pinned_copies"]
    assert sum(r.get("measure") == "ab_side" for r in lines) == 4
