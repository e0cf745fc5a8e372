"""Local jsonl / parquet data: rows validated with file and line in every error; dropped rows
are counted in the log; chat rows train on assistant turns only."""

import json
import logging

import numpy as np
import pytest

import jaxlm
from jaxlm.data.files import DataError, Files, read_rows
from jaxlm.data.encoding import encode
from jaxlm.data.pipeline import DataConfig, eval_batches, train_dataset

TOK = jaxlm.ByteTokenizer()


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "bad, match",
    [
        ("{not json", r"data.jsonl:2: invalid JSON"),
        ({"prompt": "x"}, r"data.jsonl:2: missing column\(s\) \['completion'\]"),
        ({"prompt": 1, "completion": "y"}, r"data.jsonl:2: column 'prompt' must be a string, got int"),
        ({"messages": [{"role": "bot", "content": "hi"}]}, r"data.jsonl:2: messages\[0\] must be"),
        ({"messages": [{"role": "user", "content": "hi"}]}, r"data.jsonl:2: 'messages' has no assistant turn"),
        ([1, 2], r"data.jsonl:2: expected an object, got list"),
        ('{"prompt": "x\\ud83d", "completion": "y"}', r"data.jsonl:2: column 'prompt' holds a lone surrogate"),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "\\udc00b"}]}',
         r"data.jsonl:2: messages\[1\].content holds a lone surrogate '\\udc00' at character 0"),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": '
         '[{"name": "f", "arguments": {"q": "\\ud83d"}}]}]}',
         r"data.jsonl:2: messages\[1\].tool_calls\[0\].function.arguments.q holds a lone surrogate"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b",
                                                          "reasoning_content": 3}]},
         r"data.jsonl:2: messages\[1\]: a assistant message's 'reasoning_content' must be a string"),
        # negative log-likelihoods stored with their sign are not log-probabilities
        ({"prompt": "a", "completion": "bc", "behavior_logprobs": [0.0, 2.3, 0.7]},
         r"data.jsonl:2: column 'behavior_logprobs' must hold log-probabilities \(<= 0\)"),
        ({"prompt": "a", "completion": "bc", "teacher_logprobs": [0.0, -2.3, 1e-3]},
         r"data.jsonl:2: column 'teacher_logprobs' must hold log-probabilities"),
    ],
)
def test_malformed_jsonl_rows_name_file_and_line(tmp_path, bad, match):
    path = _jsonl(tmp_path / "data.jsonl", [{"prompt": "a", "completion": "b"}, bad])
    with pytest.raises(DataError, match=match):
        read_rows(path)


def test_a_utf8_byte_order_mark_is_not_part_of_the_first_row(tmp_path):
    """Windows editors start UTF-8 files with a byte-order mark: every jsonl reader skips it
    (it was refused as invalid JSON on line 1)."""
    from jaxlm.data.files import read_prompts
    from jaxlm.fileio import jsonl_lines

    rows = [{"prompt": "é", "completion": "b"}, {"prompt": "c", "completion": "d"}]
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows).encode())
    assert read_rows(path) == read_rows(_jsonl(tmp_path / "plain.jsonl", rows))
    assert [r["prompt"] for r in read_prompts(path)] == ["é", "c"]
    assert [json.loads(line) for _, line in jsonl_lines(path)] == rows
    bad = tmp_path / "bad.jsonl"  # byte offsets in errors still count from the file's start
    bad.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "a", "completion": "b"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not UTF-8 text \(byte 50 of the file"):
        read_rows(bad)


def test_reasoning_and_tool_call_ids_are_kept(tmp_path):
    """Fields the chat layer renders (an assistant turn's reasoning, a tool result's call id)
    survive reading a file, as they do when the messages are passed directly."""
    row = {"messages": [{"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "", "tool_calls": [{"name": "add", "arguments": {"a": 2}}],
                         "reasoning_content": "use the tool"},
                        {"role": "tool", "content": "4", "name": "add", "tool_call_id": "call_0"},
                        {"role": "assistant", "content": "4", "thinking": "two plus two"}]}
    (got,) = read_rows(_jsonl(tmp_path / "data.jsonl", [row]))
    assert got["messages"][1]["reasoning_content"] == "use the tool"
    assert got["messages"][2]["tool_call_id"] == "call_0" and got["messages"][3]["thinking"] == "two plus two"


def test_a_row_the_template_refuses_names_its_file_line(tmp_path):
    """An error found only while encoding a row (a log-prob column of the wrong length, a
    chat template that refuses the conversation) names the file and line, not the row's
    index in the split."""
    good = {"prompt": "a", "completion": "b", "behavior_logprobs": [0.0] * 4}  # BOS a b EOS
    path = _jsonl(tmp_path / "data.jsonl", [good] * 3 + [{"prompt": "p", "completion": "c", "behavior_logprobs": [0.0]}])
    with pytest.raises(DataError, match=r"data.jsonl:4 \(train split\): a row's 'behavior_logprobs' has 1 entries"):
        next(iter(train_dataset(DataConfig(source=Files(path=str(path), eval_fraction=0.0), seq_len=16,
                                           batch_size=1), TOK)))


def test_parquet_rows_and_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["1+1=", "2+2="], "completion": ["2", "4"]}), tmp_path / "ok.parquet")
    assert read_rows(tmp_path / "ok.parquet")[1] == {"prompt": "2+2=", "completion": "4"}
    pq.write_table(pa.table({"prompt": ["1+1="], "answer": ["2"]}), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad.parquet row 0: missing column\(s\) \['completion'\]"):
        read_rows(tmp_path / "bad.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="junk.parquet: not a readable parquet file"):
        read_rows(tmp_path / "junk.parquet")
    (tmp_path / "x.csv").write_text("prompt,completion\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        read_rows(tmp_path / "x.csv")


def test_parquet_chat_rows_with_tool_calls_read_as_jsonl(tmp_path):
    """pyarrow gives every message of a column the keys of all of them: the messages without
    tool calls read back with ``tool_calls: None`` (the file was refused)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"messages": [{"role": "user", "content": "weather in Oslo?"},
                      {"role": "assistant", "content": "", "tool_calls": [
                          {"name": "get_weather", "arguments": {"city": "Oslo"}}]},
                      {"role": "tool", "content": "sunny", "name": "get_weather"},
                      {"role": "assistant", "content": "Sunny."}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    assert pq.read_table(tmp_path / "chat.parquet").to_pylist()[1]["messages"][0]["tool_calls"] is None
    assert read_rows(tmp_path / "chat.parquet") == read_rows(tmp_path / "chat.jsonl")


def test_chat_rows_train_on_assistant_turns_only():
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                        {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"}]}
    enc = encode(row, TOK)
    trained = TOK.decode(enc["tokens"][enc["loss_mask"]])
    assert trained == "yo\nok\n"  # the EOS is trained too but decodes to nothing
    assert enc["loss_mask"][-1] and enc["tokens"][-1] == TOK.eos_id


def test_long_rows_are_dropped_with_a_count(tmp_path, caplog):
    rows = [{"prompt": f"q{i}", "completion": "a" * (5 if i % 4 else 80)} for i in range(40)]
    path = _jsonl(tmp_path / "data.jsonl", rows)
    cfg = DataConfig(source=Files(path=str(path), eval_fraction=0.2), seq_len=32, batch_size=4)
    with caplog.at_level(logging.WARNING):
        batch = next(iter(train_dataset(cfg, TOK)))
    assert "dropped" in caplog.text and "longer than seq_len=32" in caplog.text
    assert batch["tokens"].shape == (4, 32)
    assert len(eval_batches(cfg, TOK)) >= 1
    cfg_none = DataConfig(source=Files(path=str(_jsonl(tmp_path / "long.jsonl", rows[::4]))), seq_len=32)
    with pytest.raises(DataError, match="no train row fits seq_len=32"):
        next(iter(train_dataset(cfg_none, TOK)))


def test_train_iterator_state_resumes_exactly():
    for pack in (False, True):
        cfg = DataConfig(seq_len=32, batch_size=4, pack=pack)
        it = iter(train_dataset(cfg, TOK))
        for _ in range(3):
            next(it)
        state = it.get_state()
        expected = [next(it) for _ in range(2)]
        fresh = iter(train_dataset(cfg, TOK))
        fresh.set_state(json.loads(json.dumps(state)))  # the state survives JSON (orbax JsonSave)
        for e in expected:
            got = next(fresh)
            for k in e:
                np.testing.assert_array_equal(got[k], e[k])


def test_packed_rows_have_resets():
    cfg = DataConfig(seq_len=40, batch_size=2, pack=True)
    batch = next(iter(train_dataset(cfg, TOK)))
    for seg, pos, tok in zip(batch["segment_ids"], batch["positions"], batch["tokens"]):
        assert seg.max() >= 2  # several documents per row
        for s in range(1, seg.max() + 1):
            idx = np.flatnonzero(seg == s)
            np.testing.assert_array_equal(pos[idx], np.arange(len(idx)))  # positions restart
            assert tok[idx[0]] == TOK.bos_id
