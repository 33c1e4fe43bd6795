"""The console of a run: a start-of-run summary, and log lines (steps, [HybridEngine] switches)
printed through the progress bar (tqdm.write) instead of across it."""
import logging
import sys

import pytest
import tqdm

from _tiny_run import make_run_dir
from phaserl.config import load_config
from phaserl.trainer import RLTrainer


@pytest.fixture
def console_run(tmp_path, monkeypatch, caplog):
    written = []
    monkeypatch.setattr(tqdm.tqdm, "write", classmethod(lambda cls, s, file=None, end="\n", nolock=False:
                                                           written.append(s)))
    handler = logging.StreamHandler(sys.stdout)  # what `phaserl train` sets up (cli._setup_logging)
    logging.root.addHandler(handler)
    logger = logging.getLogger("phaserl")
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        cfg = load_config(None, make_run_dir(str(tmp_path)) + ["trainer.total_steps=1", "trainer.loggers=[console]"])
        RLTrainer.from_config(cfg).fit()
    finally:
        logging.root.removeHandler(handler)
        logger.setLevel(level)
    return {"through_bar": "\n".join(written), "log": caplog.text}


def test_switch_and_step_lines_go_through_the_progress_bar(console_run):
    lines = console_run["through_bar"]
    assert "[HybridEngine] Switching actor from training to rollout mode" in lines
    assert "[HybridEngine] Switching actor from rollout to training mode" in lines
    assert "step 1 | reward" in lines


def test_the_run_starts_with_a_summary_of_what_it_will_do(console_run):
    text = console_run["log"]
    summary = text[text.index("phaserl: run summary"):]
    for part in ["policy qwen2 (phaserl decoder)", "64 training prompts", "8 held-out prompts",
                 "grpo advantages", "4 prompts × 2 = 8 responses per step", "≤ 4 per generate call",
                 "≤ 64 tokens per micro-batch", "micro-batches: padded", "gradient checkpointing: off"]:
        assert part in summary, part
