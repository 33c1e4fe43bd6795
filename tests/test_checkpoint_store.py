"""Checkpoint directories on disk: publish by rename, the `latest` pointer, skipping incomplete saves,
rotation from what is on disk, and cutting metrics.jsonl back to a resume point."""
import json
import logging
import os

import pytest

from phaserl.checkpoint import drop_metrics_after, store


def _fake_save(root, step: int, *, complete: bool = True) -> str:
    """A checkpoint written the way the Checkpointer writes one (tmp dir, metadata last, publish)."""
    tmp = store.new_tmp_dir(str(root), step)
    with open(os.path.join(tmp, "payload"), "w") as f:
        f.write(f"weights of step {step}")
    if complete:
        store.write_json(os.path.join(tmp, store.METADATA), {"step": step, "complete": True})
    return store.publish(tmp, str(root), step)


def test_publish_renames_the_temporary_directory_and_points_latest_at_it(tmp_path):
    path = _fake_save(tmp_path, 4)
    assert path == str(tmp_path / "step_4")
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_4"]      # no temporary left behind
    assert (tmp_path / "latest").read_text() == "step_4\n"
    assert (tmp_path / "step_4" / "payload").read_text() == "weights of step 4"


def test_publishing_a_step_again_replaces_the_old_directory_whole(tmp_path):
    _fake_save(tmp_path, 2)
    (tmp_path / "step_2" / "stale").write_text("from an earlier run")
    _fake_save(tmp_path, 2)
    assert sorted(os.listdir(tmp_path / "step_2")) == [store.METADATA, "payload"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_incomplete_and_temporary_directories_are_skipped_and_reported(tmp_path, caplog):
    _fake_save(tmp_path, 2)
    _fake_save(tmp_path, 4, complete=False)             # renamed but no metadata: never happens by itself
    interrupted = store.new_tmp_dir(str(tmp_path), 6)   # a save killed before its rename
    (tmp_path / "step_8").mkdir()
    (tmp_path / "step_8" / store.METADATA).write_text('{"step": 8, "complete": false}')
    with caplog.at_level(logging.WARNING, logger="phaserl"):
        newest = store.latest_complete(str(tmp_path))
    assert newest.step == 2 and newest.path == str(tmp_path / "step_2")
    text = caplog.text
    assert f"skipping incomplete {tmp_path / 'step_4'}: no metadata.json" in text
    assert f"skipping incomplete {interrupted}: temporary directory" in text
    assert f"skipping incomplete {tmp_path / 'step_8'}: metadata.json does not say complete=true" in text


def test_the_scan_wins_over_a_stale_pointer(tmp_path, caplog):
    _fake_save(tmp_path, 2)
    _fake_save(tmp_path, 4)
    (tmp_path / "latest").write_text("step_2\n")        # e.g. killed between the rename and the pointer update
    with caplog.at_level(logging.INFO, logger="phaserl"):
        assert store.latest_complete(str(tmp_path)).step == 4
    assert "names step_2" in caplog.text


def test_no_checkpoint_at_all(tmp_path):
    assert store.latest_complete(str(tmp_path / "missing")) is None
    assert store.latest_complete(str(tmp_path)) is None


def test_rotation_keeps_exactly_the_newest_n_complete_checkpoints(tmp_path):
    for step in (1, 2, 3, 10):        # 10 sorts before 2 as text: the order must be numeric
        _fake_save(tmp_path, step)
    removed = store.rotate(str(tmp_path), keep=2)
    assert removed == [str(tmp_path / "step_1"), str(tmp_path / "step_2")]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step_")) == ["step_10", "step_3"]


def test_rotation_decides_from_disk_and_ignores_incomplete_ones(tmp_path):
    # An earlier process left step_2 and step_4; this one saves step_6 and must count all of them.
    for step in (2, 4):
        _fake_save(tmp_path, step)
    _fake_save(tmp_path, 5, complete=False)
    _fake_save(tmp_path, 6)
    store.rotate(str(tmp_path), keep=2)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step_")) == ["step_4", "step_5", "step_6"]


def test_rotation_never_deletes_the_newest_complete_checkpoint(tmp_path):
    _fake_save(tmp_path, 1)
    _fake_save(tmp_path, 2)
    store.rotate(str(tmp_path), keep=0)   # the config forbids 0; the store still keeps one
    assert [n for n in os.listdir(tmp_path) if n.startswith("step_")] == ["step_2"]


def test_write_text_atomic_leaves_no_temporary_file(tmp_path):
    store.write_text_atomic(str(tmp_path / "latest"), "step_1\n")
    store.write_text_atomic(str(tmp_path / "latest"), "step_2\n")
    assert os.listdir(tmp_path) == ["latest"] and (tmp_path / "latest").read_text() == "step_2\n"


@pytest.mark.parametrize("resume_step, kept", [(2, [0, 1, 2]), (0, [0]), (-1, [])])
def test_metrics_after_the_resume_point_are_dropped_in_place(tmp_path, resume_step, kept):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "train/reward_mean": s / 10}) + "\n" for s in range(5)]
    path.write_text("".join(lines) + '{"step": 5, "train/rew')       # the last line cut by a kill
    appender = open(path, "a", encoding="utf-8")                      # the MetricsLogger's handle stays open
    dropped = drop_metrics_after(str(path), resume_step)
    appender.write(json.dumps({"step": resume_step + 1}) + "\n")
    appender.close()
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == kept + [resume_step + 1]
    assert dropped == 6 - len(kept)


def test_metrics_file_absent_or_already_clean(tmp_path):
    assert drop_metrics_after(str(tmp_path / "metrics.jsonl"), 3) == 0
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    assert drop_metrics_after(str(tmp_path / "metrics.jsonl"), 3) == 0
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n'
