"""`jaxlm judge`: judged rows equal `judge_pairs`, SCOPE's threshold from a calibration file
marks accepted rows, and bad files or flags fail with exit status 2 and the reason."""

import json

import numpy as np
import pytest

import jaxlm
from jaxlm.data.tokenizers import ByteTokenizer
from jaxlm.eval.conformal import scope_threshold
from jaxlm.eval.judge import judge_pairs
from trainers.cli import main

PAIRS = [{"question": "2+2?", "a": "4", "b": "5", "label": "A"},
         {"question": "largest planet?", "a": "Mars", "b": "Jupiter", "label": "B"},
         {"question": "3*3?", "a": "9", "b": "6", "label": "A"},
         {"question": "water formula?", "a": "H2O", "b": "CO2", "label": "A"}]


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("judge")
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(init_std=0.5, max_seq_len=128), seed=0, tokenizer=ByteTokenizer())
    jaxlm.save_checkpoint(model, d / "model")
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    return d


def test_judge_writes_the_judgments_and_the_scope_acceptance(judge_dir, capsys):
    out = judge_dir / "out" / "judged.jsonl"  # the parent is created
    main(["judge", str(judge_dir / "model"), "--pairs", str(judge_dir / "pairs.jsonl"), "--out", str(out),
          "--calibration", str(judge_dir / "pairs.jsonl"), "--alpha", "0.5", "--overwrite"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    model = jaxlm.load_checkpoint(judge_dir / "model")
    j = judge_pairs(model, [r["question"] for r in PAIRS], [r["a"] for r in PAIRS], [r["b"] for r in PAIRS])
    np.testing.assert_allclose([r["p_a"] for r in rows], j.p, atol=1e-6)
    assert [r["verdict"] for r in rows] == ["AB"[d] for d in j.decision]
    errors = (j.decision != np.array([0, 1, 0, 0])).astype(int)
    lam = scope_threshold(j.entropy, errors, 0.5)
    assert [r["accepted"] for r in rows] == [bool(e <= lam) for e in j.entropy]
    assert rows[0]["question"] == "2+2?" and "judged 4 pairs" in capsys.readouterr().out


@pytest.mark.parametrize("rows, argv, match", [
    ([{"question": "q", "a": "x"}], [], "['b'] must be strings"),
    (PAIRS, ["--alpha", "1.5"], "--alpha=1.5"),
    (PAIRS, ["--prompt-format", "{question} {first}"], "lacks the field"),
])
def test_bad_input_fails_with_the_reason(judge_dir, tmp_path, capsys, rows, argv, match):
    pairs = tmp_path / "p.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit) as e:
        main(["judge", str(judge_dir / "model"), "--pairs", str(pairs), "--out", str(tmp_path / "new" / "o.jsonl"), *argv])
    assert e.value.code == 2 and match in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # nothing is left behind by a refused run


def test_calibration_rows_need_labels(judge_dir, tmp_path, capsys):
    cal = tmp_path / "cal.jsonl"
    cal.write_text(json.dumps({"question": "q", "a": "x", "b": "y"}) + "\n")
    with pytest.raises(SystemExit) as e:
        main(["judge", str(judge_dir / "model"), "--pairs", str(judge_dir / "pairs.jsonl"), "--out",
              str(tmp_path / "new" / "o.jsonl"), "--calibration", str(cal)])
    assert e.value.code == 2 and "needs \"label\"" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_pairs_file_with_unicode_line_separators_inside_strings(tmp_path):
    """JSON Lines ends a row at \\n only: U+2028, U+2029 and U+0085 written raw inside a string
    (as `json.dumps(..., ensure_ascii=False)` does) stay in the row."""
    from trainers.judge_file import read_pairs

    rows = [{"question": "Which?", "a": "first\u2028second", "b": "p\u2029q"}, {"question": "q2", "a": "x\x85y", "b": "z"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n", encoding="utf-8")
    assert read_pairs(path) == rows
