"""What a run leaves in log_dir: metrics.jsonl, TensorBoard event files (rank 0 only), and report.png, drawn at
the end of fit (named in the last console line) and on demand by `phaserl report RUN_DIR`."""
import json
import logging
import os

import pytest
import torch

from _tiny_run import make_run_dir
from phaserl.config import load_config
from phaserl.errors import DataError
from phaserl.metrics import MetricsLogger
from phaserl.report import cli_report, read_metrics, series, write_report
from phaserl.trainer import RLTrainer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_metrics(log_dir, records, tail: str = "") -> None:
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_series_reads_one_metric_over_steps_and_skips_a_line_cut_by_a_kill(tmp_path):
    _write_metrics(tmp_path, [{"step": 0, "val/score_mean": 0.25},
                              {"step": 1, "train/reward_mean": 0.5, "train/kl": "nan"},
                              {"step": 2, "train/reward_mean": 0.75, "val/score_mean": 0.5, "train/kl": 0.01}],
                   tail='{"step": 3, "train/rew')
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert series(records, "train/reward_mean") == ([1, 2], [0.5, 0.75])
    assert series(records, "val/score_mean") == ([0, 2], [0.25, 0.5])
    steps, kl = series(records, "train/kl")
    assert steps == [1, 2] and kl[0] != kl[0] and kl[1] == 0.01      # "nan" is read as NaN
    assert series(records, "actor/kl_loss") == ([], [])


def test_write_report_draws_a_png_even_with_panels_missing(tmp_path):
    _write_metrics(tmp_path, [{"step": s, "train/reward_mean": s / 4, "train/reward_std": 0.1,
                               "train/response_length_mean": 10 + s} for s in range(1, 5)])
    path = write_report(str(tmp_path))
    assert path == str(tmp_path / "report.png")
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    import matplotlib.image

    assert matplotlib.image.imread(path).shape[:2] == (700, 1100)     # 11 x 7 inches at 100 dpi
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "report.png"]  # no temporary file left


def test_report_errors_name_the_file_and_the_line(tmp_path):
    with pytest.raises(DataError, match=r"metrics.jsonl does not exist; RUN_DIR must be a run's trainer.log_dir"):
        write_report(str(tmp_path))
    _write_metrics(tmp_path, [{"step": 1}], tail='not json\n{"step": 2}\n')
    with pytest.raises(DataError, match=r"metrics.jsonl, line 2: not valid JSON"):
        write_report(str(tmp_path))


def test_cli_report(tmp_path, capsys):
    _write_metrics(tmp_path, [{"step": 1, "train/reward_mean": 0.5}])
    assert cli_report([str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"report: {tmp_path / 'report.png'}\n"


def test_only_rank_0_writes_logs(tmp_path):
    logger = MetricsLogger(str(tmp_path / "rank1"), ["console", "jsonl", "tensorboard"], rank=1)
    logger.log(1, {"train/reward_mean": 0.5})
    logger.close()
    assert not (tmp_path / "rank1").exists()


@pytest.mark.slow
def test_a_run_writes_jsonl_tensorboard_and_the_report_named_last(tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.set_num_threads(1)
    overrides = make_run_dir(str(tmp_path)) + ["trainer.loggers=[console,jsonl,tensorboard]"]
    trainer = RLTrainer.from_config(load_config(None, overrides))
    with caplog.at_level(logging.INFO, logger="phaserl"):
        trainer.fit()
    logs = tmp_path / "logs"
    assert [json.loads(line)["step"] for line in (logs / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(logs))
    events = EventAccumulator(str(logs))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/reward_mean", "val/score_mean", "timing_s/step", "perf/tokens_per_s"} <= tags
    assert [e.step for e in events.Scalars("train/reward_mean")] == [1, 2]
    assert (logs / "report.png").read_bytes()[:8] == PNG_MAGIC
    last = caplog.records[-1].getMessage()
    assert last.startswith("phaserl: done at step 2") and f"report {logs / 'report.png'}" in last
    assert f"checkpoint {tmp_path / 'ckpt' / 'step_2'}" in last


def test_tensorboard_curves_after_a_resume_hold_only_the_resumed_runs_values(tmp_path):
    """A killed run's events from the resume step on are purged, like its metrics.jsonl lines."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from phaserl.metrics import MetricsLogger

    first = MetricsLogger(str(tmp_path), ["tensorboard"])
    for step in range(4):
        first.log(step, {"train/reward_mean": float(step)})
    first.close()
    resumed = MetricsLogger(str(tmp_path), ["tensorboard"])  # resumed from a checkpoint at step 1
    for step in (2, 3):
        resumed.log(step, {"train/reward_mean": 10.0 + step})
    resumed.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    curve = [(e.step, e.value) for e in acc.Scalars("train/reward_mean")]
    assert curve == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]


def test_the_report_labels_its_axes_clips_the_band_and_draws_one_kl_curve_per_quantity():
    # Regression: unlabelled y-axes, a ±std band past the rewards' range, two identical KL curves.
    import matplotlib

    matplotlib.use("Agg")
    from phaserl.report import caption, draw_report

    records = [{"step": s, "train/reward_mean": 0.9, "train/reward_std": 0.3, "train/reward_min": 0.0,
                "train/reward_max": 1.0, "train/kl": 0.01 * s, "actor/kl_loss": 0.01 * s,
                "train/response_length_mean": 3.0, "val/response_length_mean": 3.5} for s in range(1, 4)]
    fig = draw_report(records, "t")
    reward, _, kl, length = fig.axes
    assert all(ax.get_ylabel() for ax in fig.axes)
    (band,) = reward.collections
    ys = band.get_paths()[0].vertices[:, 1]
    assert ys.max() == pytest.approx(1.0) and ys.min() == pytest.approx(0.6)   # 0.9 + 0.3 clipped at max 1.0
    assert [line.get_label() for line in kl.get_lines()] == ["train/kl (k3) = actor/kl_loss"]
    assert len(length.get_lines()) == 2                                        # different numbers: two curves
    records[1]["actor/kl_loss"] = 0.5
    assert len(draw_report(records, "t").axes[2].get_lines()) == 2
    assert caption(records) in [t.get_text() for t in fig.texts]


def _curves(kl, val, reward=None):
    reward = reward or [0.5 + 0.05 * s for s in range(len(kl))]
    records = [{"step": s, "train/reward_mean": r, "train/kl": k} for s, (k, r) in enumerate(zip(kl, reward))]
    for s, v in val:
        records[s]["val/score_mean"] = v
    return records


def test_the_caption_says_what_this_runs_curves_show():
    """'KL should grow slowly (a jump means the policy runs away)' sat under the quickstart,
    whose KL jumps to 0.40 in 7 steps while its held-out score goes 0.36 -> 0.965."""
    from phaserl.report import caption

    quickstart = caption(_curves([0.0, 0.02, 0.1, 0.17, 0.34, 0.22, 0.4, 0.25, 0.3, 0.28], [(0, 0.36), (9, 0.965)]))
    assert "should grow slowly" not in quickstart and "runs away" not in quickstart
    assert "validation score 0.36 -> 0.965: they agree" in quickstart
    assert "KL to the reference up to 0.4 (step 6)" in quickstart and "paid" in quickstart
    drifting = caption(_curves([0.0, 0.1, 0.2, 0.3], [(0, 0.5), (3, 0.5)]))
    assert "lower the learning rate or raise algorithm.kl_coef" in drifting
    hacking = caption(_curves([0.0] * 4, [(0, 0.6), (3, 0.3)]))
    assert "does not follow the reward (reward hacking or overfitting" in hacking


def test_the_band_says_what_it_is():
    import matplotlib

    matplotlib.use("Agg")
    from phaserl.report import draw_report

    records = [{"step": s, "train/reward_mean": 0.5, "train/reward_std": 0.1} for s in range(3)]
    (band,) = draw_report(records, "t").axes[0].collections
    assert band.get_label() == "spread of the step's responses: mean ± 1 std, clipped to their lowest and highest"
