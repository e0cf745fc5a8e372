"""``jaxlm serve-stream``: OnlineSPEC from the command line on tiny checkpoints."""

import json

import numpy as np
import pytest

import jaxlm
from jaxlm.checkpoint import load_checkpoint
from jaxlm.models.params import flat_params
from trainers.cli import main

SERVE = ["spec.chunk-size", "3", "spec.batch-size", "3", "spec.max-new-tokens", "6"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A target and a smaller draft sharing the byte tokenizer, and a file of five prompts
    (two chunks of three: the second one short)."""
    root = tmp_path_factory.mktemp("serve_stream")
    tok = jaxlm.ByteTokenizer()
    target = jaxlm.build_model(jaxlm.ModelConfig.tiny(init_std=0.5, max_seq_len=64), tokenizer=tok, seed=0)
    draft = jaxlm.build_model(jaxlm.ModelConfig.tiny(d_model=32, n_layers=1, ffn_dim=64, max_seq_len=64),
                              tokenizer=tok, seed=1)
    jaxlm.save_checkpoint(target, root / "target")
    jaxlm.save_checkpoint(draft, root / "draft")
    rows = [{"id": f"q{i}", "prompt": p} for i, p in enumerate(["1+2=", "30+4=", "hello", "7+7=", "x"])]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, target, draft, rows


def _serve(root, preset, *extra):
    flags = [f"--{a}" if i % 2 == 0 else a for i, a in enumerate(SERVE)]
    main(["serve-stream", str(root / "target"), "--draft", str(root / "draft"), "--prompts",
          str(root / "prompts.jsonl"), *extra, f"spec:{preset}", *flags])


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_opt_hydra_serves_the_targets_greedy_output_and_adapts_the_draft(pair, tmp_path, capsys):
    root, target, draft, rows = pair
    _serve(root, "opt-hydra", "--completions", str(tmp_path / "out.jsonl"), "--report", str(tmp_path / "r.json"),
           "--save-draft", str(tmp_path / "adapted"))
    out = _read_jsonl(tmp_path / "out.jsonl")
    plain = jaxlm.generate(target, [r["prompt"] for r in rows], max_new_tokens=6, temperature=0)
    assert [{k: o[k] for k in ("id", "prompt")} for o in out] == rows  # every row, in file order
    assert [o["tokens"] for o in out] == plain.completions()
    assert [o["completion"] for o in out] == plain.texts
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["config"]["method"] == "opt_hydra" and report["config"]["chunk_size"] == 3
    assert [c["prompts"] for c in report["chunks"]] == [3, 2]
    assert sum(c["generated_tokens"] for c in report["chunks"]) == int(np.sum(plain.lengths))
    assert all(np.isfinite(c["train_loss"]) and c["tokens_per_round"] >= 1 for c in report["chunks"])
    adapted = load_checkpoint(tmp_path / "adapted")
    before, after = flat_params(draft), flat_params(adapted)
    assert before.keys() == after.keys()
    assert any(not np.array_equal(np.asarray(before[k]), np.asarray(after[k])) for k in before)
    text = capsys.readouterr()
    assert "chunk 0: 3 prompts" in text.err and "chunk 1: 2 prompts" in text.err
    assert "tokens per verify round" in text.out


def test_static_keeps_the_draft_and_reports_no_loss(pair, tmp_path):
    root, _, draft, _ = pair
    _serve(root, "static", "--report", str(tmp_path / "r.json"), "--save-draft", str(tmp_path / "same"))
    report = json.loads((tmp_path / "r.json").read_text())
    assert [c["train_loss"] for c in report["chunks"]] == [None, None]
    same = flat_params(load_checkpoint(tmp_path / "same"))
    for k, v in flat_params(draft).items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(same[k]), err_msg=k)


def _fails(argv, capsys, *needles) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    assert "Traceback" not in err
    return err


def test_bad_input_names_the_file_line_argument_or_field(pair, tmp_path, capsys):
    root, _, _, _ = pair
    base = ["serve-stream", str(root / "target"), "--draft", str(root / "draft")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1="}\n{"question": "2+2="}\n')
    _fails(base + ["--prompts", str(bad)], capsys, f"{bad}:2", "'prompt'")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"prompt": ""}\n')
    _fails(base + ["--prompts", str(empty)], capsys, f"{empty}:1", "non-empty 'prompt'")
    _fails(base + ["--prompts", str(tmp_path / "none.jsonl")], capsys, "does not exist")
    prompts = ["--prompts", str(root / "prompts.jsonl")]
    (tmp_path / "taken").mkdir()
    _fails(base + prompts + ["--save-draft", str(tmp_path / "taken")], capsys, "exists; pass --overwrite")
    _fails(base + prompts + ["spec:osd", "--spec.chunk-size", "0"], capsys, "OnlineSpecConfig.chunk_size=0")
    # two outputs on one path: the report overwrote the completions, exit 0
    same = str(tmp_path / "same.json")
    _fails(base + prompts + ["--completions", same, "--report", same], capsys,
           "--completions and --report name the same path")
    _fails(base + prompts + ["--report", str(root / "prompts.jsonl")], capsys, "--report and --prompts name the same")
    _fails(base + prompts + ["--report", str(tmp_path / "taken")], capsys, "is a directory")
    (tmp_path / "plain").write_text("x")  # an existing file cannot become the draft directory (found at the end)
    _fails(base + prompts + ["--save-draft", str(tmp_path / "plain"), "--overwrite"], capsys, "is a file")
    # outputs inside the draft's directory: its save replaced the directory and deleted them (exit 0)
    draft_dir = tmp_path / "out" / "d"
    _fails(base + prompts + ["--save-draft", str(draft_dir), "--completions", str(draft_dir / "c.jsonl"),
                             "--overwrite"], capsys, "--completions", "lies inside --save-draft")
    # a file where a parent directory must be: found after serving, the completions written
    _fails(base + prompts + ["--completions", str(tmp_path / "c.jsonl"), "--report", str(tmp_path / "plain" / "r.json")],
           capsys, "--report", "is not a directory")
    assert not (tmp_path / "out").exists() and not (tmp_path / "c.jsonl").exists()
    assert not (tmp_path / "same.json").exists()
    # a prompt too long for the models is found before any chunk is served (it failed after
    # serving and training on the chunks before it, writing nothing)
    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt": "1+1="}\n' + json.dumps({"prompt": "x" * 60}) + "\n")
    _fails(base + ["--prompts", str(long), "--completions", str(tmp_path / "out.jsonl"), "spec:static",
                   "--spec.max-new-tokens", "6"], capsys, "prompt 2 has 61 tokens", "max_seq_len=64")
    assert not (tmp_path / "out.jsonl").exists()
    other = jaxlm.build_model(jaxlm.ModelConfig.tiny(vocab_size=300, n_layers=1, max_seq_len=64), seed=0)
    jaxlm.save_checkpoint(other, tmp_path / "other_vocab")
    _fails(["serve-stream", str(root / "target"), "--draft", str(tmp_path / "other_vocab")] + prompts
           + ["spec:static", "--spec.max-new-tokens", "4"], capsys, "vocab")
