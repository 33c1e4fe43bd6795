"""Record files and verl-schema rows: round trips, and malformed files whose errors name file, row and field."""
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from phaserl.data import (
    PromptRow,
    load_preference_rows,
    load_prompt_rows,
    parse_prompt_row,
    read_records,
    write_records,
)
from phaserl.errors import DataError

VERL_ROWS = [
    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "system", "content": "Think step by step."}, {"role": "user", "content": "1+1?"}],
     "ability": "math",
     "reward_model": {"ground_truth": "2", "style": "rule"},
     "extra_info": {"index": 0, "split": "train"}},
    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "2+3?"}],
     "ability": "math",
     "reward_model": {"ground_truth": "5", "style": "rule"},
     "extra_info": {"index": 1, "split": "train"}},
]


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


# ---- files.py ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.parquet"])
def test_write_then_read_returns_the_same_records(tmp_path, name):
    path = tmp_path / "sub" / name  # the parent directory is created
    write_records(path, VERL_ROWS)
    assert read_records(path) == VERL_ROWS
    assert os.listdir(tmp_path / "sub") == [name]  # no temp file left behind


def test_jsonl_skips_blank_lines_and_counts_rows_not_lines(tmp_path):
    path = write_lines(tmp_path / "a.jsonl", ['{"prompt": "x"}', "", "   ", '{"prompt": "y"}'])
    assert read_records(path) == [{"prompt": "x"}, {"prompt": "y"}]
    rows = load_prompt_rows([path])
    assert [r.index for r in rows] == [0, 1]
    assert rows[1].source == f"{path}:row 1 (line 4)"


def test_bad_json_line_names_file_line_and_json_error(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", ['{"prompt": "ok"}', "", '{"prompt": "unterminated}'])
    with pytest.raises(DataError) as e:
        read_records(path)
    msg = str(e.value)
    assert path in msg and "line 3" in msg and "invalid JSON" in msg and "Unterminated string" in msg


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = write_lines(tmp_path / "list.jsonl", ['{"prompt": "ok"}', '["prompt", "x"]'])
    with pytest.raises(DataError, match=r"list\.jsonl: line 2: expected a JSON object .* got list"):
        read_records(path)


def test_byte_order_mark_is_ignored_and_bad_utf8_names_its_line(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "x"}\n{"prompt": "\xc3\xa9"}\n')
    assert read_records(path) == [{"prompt": "x"}, {"prompt": "\u00e9"}]
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"prompt": "x"}\n{"prompt": "y"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1\.jsonl: line 3: not valid UTF-8"):
        read_records(bad)


def test_missing_file_and_wrong_extension(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: does not exist"):
        read_records(tmp_path / "nope.jsonl")
    csv = tmp_path / "rows.csv"
    csv.write_text("prompt\nhi\n")
    with pytest.raises(DataError) as e:
        read_records(csv)
    assert "rows.csv" in str(e.value) and "'.csv'" in str(e.value) and ".jsonl, .parquet" in str(e.value)
    with pytest.raises(DataError, match=r"\.txt"):
        write_records(tmp_path / "out.txt", [{"a": 1}])
    assert not (tmp_path / "out.txt").exists()


def test_unreadable_parquet_names_the_file(tmp_path):
    path = tmp_path / "cut.parquet"
    write_records(path, VERL_ROWS)
    path.write_bytes(path.read_bytes()[:40])  # a download cut short
    with pytest.raises(DataError) as e:
        read_records(path)
    assert str(path) in str(e.value) and "cannot be read as parquet" in str(e.value)


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_records(path, [{"prompt": "old"}])
    with pytest.raises(TypeError):
        write_records(path, [{"prompt": "new"}, {"prompt": object()}])  # not JSON-serializable
    assert read_records(path) == [{"prompt": "old"}]
    assert os.listdir(tmp_path) == ["rows.jsonl"]


# ---- rows.py ----------------------------------------------------------------------------------


def test_verl_parquet_round_trip_gives_typed_rows(tmp_path):
    # Written the way verl's preprocess scripts do: one pyarrow table, structs and lists of structs.
    path = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), path)
    rows = load_prompt_rows([path])
    assert rows[0] == PromptRow(
        prompt=VERL_ROWS[0]["prompt"], data_source="openai/gsm8k", ground_truth="2",
        extra_info={"index": 0, "split": "train"}, source=f"{path}:row 0", index=0, raw=VERL_ROWS[0])
    assert rows[1].prompt == [{"role": "user", "content": "2+3?"}] and rows[1].ground_truth == "5"
    assert rows[1].raw["ability"] == "math"


def test_parquet_null_message_fields_are_removed(tmp_path):
    # A "name" key on one message makes pyarrow give every message name=None.
    records = [{"prompt": [{"role": "user", "content": "a", "name": "bob"}]},
               {"prompt": [{"role": "user", "content": "b"}]}]
    path = str(tmp_path / "names.parquet")
    write_records(path, records)
    rows = load_prompt_rows([path])
    assert rows[0].prompt == [{"role": "user", "content": "a", "name": "bob"}]
    assert rows[1].prompt == [{"role": "user", "content": "b"}]


def test_plain_jsonl_defaults_and_top_level_ground_truth(tmp_path):
    path = tmp_path / "p.jsonl"
    write_records(path, [{"question": "3*3?", "ground_truth": 9}])
    (row,) = load_prompt_rows([str(path)], prompt_key="question")
    assert (row.prompt, row.data_source, row.ground_truth, row.extra_info) == ("3*3?", "", 9, {})


def test_numpy_and_tuple_message_lists_are_accepted():
    np = pytest.importorskip("numpy")
    messages = np.array([{"role": "user", "content": "hi"}], dtype=object)
    row = parse_prompt_row({"prompt": messages}, prompt_key="prompt", source="x:row 0", index=0)
    assert row.prompt == [{"role": "user", "content": "hi"}]
    row = parse_prompt_row({"prompt": ({"role": "user", "content": "hi"},)}, prompt_key="prompt",
                           source="x:row 0", index=0)
    assert row.prompt == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("bad_row, expected", [
    ({"question": "hi", "data_source": "d"}, ["no 'prompt' field", "'data_source', 'question'", "data.prompt_key"]),
    ({"prompt": 7}, ["field 'prompt' is a int", "list of chat"]),
    ({"prompt": "   "}, ["field 'prompt' is an empty string"]),
    ({"prompt": []}, ["field 'prompt' is an empty message list"]),
    ({"prompt": [{"role": "human", "content": "hi"}]}, ["message 0 has role 'human'", "system, user, assistant, tool"]),
    ({"prompt": [{"role": "user", "content": "a"}, {"role": "user"}]}, ["message 1 has no 'content'", "keys present"]),
    ({"prompt": [{"role": "user", "content": 3}]}, ["message 0 has content of type int"]),
    ({"prompt": "hi", "reward_model": "42"}, ["field 'reward_model' is a str", "ground_truth"]),
    ({"prompt": "hi", "extra_info": [1]}, ["field 'extra_info' is a list"]),
    ({"prompt": "hi", "data_source": 3}, ["field 'data_source' is a int"]),
    ({"prompt": "hi", "ground_truth": "1", "reward_model": {"ground_truth": "2"}}, ["disagree"]),
])
def test_malformed_prompt_rows_name_file_row_and_field(tmp_path, bad_row, expected):
    path = tmp_path / "train.jsonl"
    write_records(path, [{"prompt": "fine"}, bad_row])
    with pytest.raises(DataError) as e:
        load_prompt_rows([str(path)])
    msg = str(e.value)
    assert f"{path}:row 1 (line 2)" in msg
    for part in expected:
        assert part in msg


def test_empty_file_and_empty_file_list_are_errors(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: the file has no rows"):
        load_prompt_rows([str(path)])
    with pytest.raises(DataError, match="no prompt files"):
        load_prompt_rows([])


def test_rows_from_several_files_keep_their_own_index(tmp_path):
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")
    write_records(a, [{"prompt": "a0"}, {"prompt": "a1"}])
    write_records(b, [{"prompt": "b0"}])
    rows = load_prompt_rows([a, b])
    assert [(r.prompt, r.index) for r in rows] == [("a0", 0), ("a1", 1), ("b0", 0)]
    assert rows[2].source == f"{b}:row 0"


# ---- preference rows ----------------------------------------------------------------------------


def test_preference_rows_load(tmp_path):
    path = str(tmp_path / "pref.parquet")
    write_records(path, [{"prompt": "Say hi", "chosen_response": "hi", "rejected_response": "no"}])
    (row,) = load_preference_rows([path])
    assert (row.prompt, row.chosen_response, row.rejected_response, row.source) == ("Say hi", "hi", "no",
                                                                                    f"{path}:row 0")


def test_preference_row_missing_rejected_response(tmp_path):
    path = tmp_path / "pref.jsonl"
    path.write_text(json.dumps({"prompt": "p", "chosen_response": "a", "rejected_response": "b"}) + "\n"
                    + json.dumps({"prompt": "p", "chosen_response": "a"}) + "\n")
    with pytest.raises(DataError) as e:
        load_preference_rows([str(path)])
    msg = str(e.value)
    assert f"{path}:row 1 (line 2)" in msg and "'rejected_response'" in msg and "keys present" in msg


def test_preference_row_with_non_string_response(tmp_path):
    path = tmp_path / "pref.jsonl"
    write_records(path, [{"prompt": "p", "chosen_response": ["a"], "rejected_response": "b"}])
    with pytest.raises(DataError, match=r"row 0 \(line 1\): field 'chosen_response' is a list"):
        load_preference_rows([str(path)])
