"""Bad input at the command line gets one or two lines naming the file, field or line and
what to do, and exit status 2; a directory in use by another process is refused."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import jaxlm
from jaxlm.data.files import DataError, read_rows
from trainers.cli import main

FILEIO = Path(jaxlm.__file__).parent / "fileio.py"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "m"
    jaxlm.save_checkpoint(jaxlm.build_model(jaxlm.ModelConfig.tiny(), tokenizer=jaxlm.ByteTokenizer()), path)
    return path


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _fails(argv, capsys, *needles, absent=("Traceback", "strict=False")) -> str:
    """``main(argv)`` exits with status 2 after at most two lines on stderr holding ``needles``."""
    with pytest.raises(SystemExit) as e:
        main(list(map(str, argv)))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert e.value.code == 2, err
    # the contract for usage errors: one or two lines, the first the CLI's own prefix (no traceback)
    assert 1 <= len(lines) <= 2 and lines[0].startswith("jaxlm: error:"), err
    for needle in needles:
        assert needle in err, (needle, err)
    for needle in absent:
        assert needle not in err, (needle, err)
    return err


def test_truncated_weights_file(checkpoint, tmp_path, capsys):
    bad = _copy(checkpoint, tmp_path / "m")
    data = max((f for f in (bad / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    _fails(["eval", "--model", bad, "--n", "1"], capsys, str(bad / "params"), "damaged")


def test_width_edited_config_names_the_parameters(checkpoint, tmp_path, capsys):
    bad = _copy(checkpoint, tmp_path / "m")
    meta = bad / "config" / "metadata"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "ffn_dim": 256}))
    _fails(["eval", "--model", bad, "--n", "1"], capsys, "mlp.up_proj.kernel is (64, 128) in params/ but (64, 256)",
           "config/ was edited")


def test_missing_model_directory(tmp_path, capsys):
    _fails(["eval", "--model", tmp_path / "nothing-here"], capsys, str(tmp_path / "nothing-here"), "does not exist")
    # the writing verbs name it before locking their output (the lock left empty parent directories)
    missing = tmp_path / "nothing-here"
    requests = tmp_path.parent / f"{tmp_path.name}-requests.jsonl"
    requests.write_text('{"prompt": "x", "target_new": " y"}\n')
    for argv in (["quantize", missing, "--out", tmp_path / "q" / "a" / "out"],
                 ["compress", missing, "--out", tmp_path / "k" / "a" / "out"],
                 ["convert", missing, tmp_path / "c" / "a" / "out"],
                 ["edit", missing, "--requests", requests, "--method", "finetune", "--out", tmp_path / "e" / "a" / "out"]):
        _fails(argv, capsys, str(missing), "does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_config_file_with_a_syntax_error(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("from trainers.config import ExperimentConfig\n\ndef get_config(:\n    return ExperimentConfig()\n")
    _fails(["train", bad], capsys, f"{bad}:3: syntax error")


def test_config_file_with_a_dict_section(tmp_path, capsys):
    bad = tmp_path / "dict_section.py"
    bad.write_text("from trainers.config import ExperimentConfig\n\n\ndef get_config():\n"
                   "    return ExperimentConfig(trainer=dict(steps=3))\n")
    _fails(["train", bad], capsys, f"{bad}:5", "ExperimentConfig.trainer must be a TrainerConfig, got dict")


@pytest.mark.parametrize("override, needle", [
    ("optimizer.lr=inf", "OptimizerConfig.lr=inf is invalid"),
    ("optimizer.lr=nan", "OptimizerConfig.lr=nan is invalid"),
    ("optimizer.b2=1.5", "OptimizerConfig.b1=0.9, b2=1.5"),
    ("trainer.stepz=3", "trainer.stepz"),
])
def test_bad_overrides(override, needle, tmp_path, capsys):
    _fails(["train", "quickstart", override, f"trainer.out_dir={tmp_path}"], capsys, needle)


def test_non_utf8_jsonl_names_the_file_line_and_file_offset(tmp_path):
    path = tmp_path / "rows.jsonl"
    first = b'{"prompt": "a", "completion": "b"}\n'
    second = b'{"prompt": "caf\xe9", "completion": "x"}\n'  # Latin-1, not UTF-8
    path.write_bytes(first + second)
    with pytest.raises(DataError) as e:
        read_rows(path)
    offset = len(first) + second.index(b"\xe9")
    assert str(e.value).startswith(f"{path}:2: not UTF-8 text (byte {offset} of the file")


@pytest.mark.parametrize("flag", ["--n", "--batch-size", "--max-new-tokens"])
def test_eval_counts_must_be_positive(flag, checkpoint, capsys):
    _fails(["eval", "--model", checkpoint, flag, "0"], capsys, f"{flag}=0 is invalid: must be >= 1")


@pytest.mark.parametrize("argv, needle", [
    (["--pass-at", "0", "4"], "--pass-at 0 4 is invalid: each k must be >= 1"),
    (["--pass-at", "4", "--temperature", "0"], "--temperature=0.0 is invalid: pass@k samples need a temperature > 0"),
])
def test_eval_pass_at_k_arguments(argv, needle, checkpoint, capsys):
    _fails(["eval", "--model", checkpoint, *argv], capsys, needle)


def test_convert_names_the_flag_to_overwrite(checkpoint, tmp_path, capsys):
    dst = _copy(checkpoint, tmp_path / "dst")
    _fails(["convert", checkpoint, dst], capsys, f"{dst} exists; pass --overwrite to replace it")


def _hold_lock(path: Path, beside: bool):
    """A second process holding the lock of ``path`` (fileio is standard-library only: load it
    on its own, without importing JAX)."""
    code = (
        "import importlib.util, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('fileio', {str(FILEIO)!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['fileio'] = m; spec.loader.exec_module(m)\n"
        f"m.DirectoryLock({str(path)!r}, what='test holder', beside={beside}).acquire()\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_training_run_on_one_out_dir_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    holder = _hold_lock(out, beside=False)
    try:
        err = _fails(["train", "quickstart", f"trainer.out_dir={out}", "trainer.steps=2"], capsys, str(out),
                     f"PID {holder.pid}")
    finally:
        holder.kill()
        holder.wait()
    assert not (out / "config.json").exists() and not (out / "checkpoints").exists(), err


@pytest.mark.parametrize("verb", ["convert", "quantize", "compress"])
def test_verbs_that_write_a_directory_refuse_one_in_use(verb, checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    holder = _hold_lock(out, beside=True)
    argv = {"convert": ["convert", checkpoint, out],
            "quantize": ["quantize", checkpoint, "--out", out, "--eval-n", "0", "--calibration-n", "4"],
            "compress": ["compress", checkpoint, "--out", out, "--eval-n", "0", "--calib", "4"]}[verb]
    try:
        _fails(argv, capsys, str(out), f"PID {holder.pid}")
    finally:
        holder.kill()
        holder.wait()
    assert not out.exists()


@pytest.mark.parametrize("verb", ["convert", "quantize"])
def test_overwrite_refuses_a_training_run_in_progress(verb, checkpoint, tmp_path, capsys):
    """--overwrite onto the directory a training run holds is refused: it is not swapped out
    from under the run."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    holder = _hold_lock(out, beside=False)
    argv = {"convert": ["convert", checkpoint, out, "--overwrite"],
            "quantize": ["quantize", checkpoint, "--out", out, "--overwrite", "--eval-n", "0",
                         "--calibration-n", "4"]}[verb]
    try:
        _fails(argv, capsys, str(out), f"PID {holder.pid}")
    finally:
        holder.kill()
        holder.wait()
    assert (out / "config.json").read_text() == "{}"


@pytest.mark.parametrize("argv, needle", [
    (["quantize", "--method", "twinquant", "--rank", "0"], "--rank 0.0 is invalid"),
    (["quantize", "--method", "twinquant", "--rank", "-2"], "--rank -2.0 is invalid"),
    (["quantize", "--calibration-n", "0"], "--calibration-n=0 is invalid: --method wush needs calibration"),
    (["quantize", "--method", "rtn", "--inner", "gptq", "--calibration-n", "0"], "--inner gptq needs calibration"),
    (["compress", "--calib", "0"], "--calib=0 is invalid: must be >= 1"),
])
def test_settings_the_method_cannot_use_are_refused_before_loading(checkpoint, tmp_path, capsys, argv, needle):
    """They were refused only once the model was loaded and the transform had begun (progress
    bars, then the error)."""
    verb, rest = argv[0], argv[1:]
    _fails([verb, checkpoint, "--out", tmp_path / "out", "--eval-n", "0", *rest], capsys, needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, needles", [
    # a nested section's own check: tyro's panel named it "__tyro-dummy-inner__.gradient"
    (["edit", "MODEL", "--requests", "r.jsonl", "--gradient.epochs", "0"],
     ("--gradient: epochs=0 is invalid", "see jaxlm edit --help")),
    (["eval", "--model", "m", "source:countdown", "--source.n-numbers", "0"], ("--source:", "n_numbers=0")),
    (["generate", "--model", "m", "--max-new-tokens", "abc"], ("--max-new-tokens: invalid literal", "Tokens to generate")),
    (["generate", "--model", "m", "--max-new-tokenz", "3"], ("unrecognized option(s): --max-new-tokenz", "closest: --max-new-tokens")),
    (["judge"], ("missing MODEL, --pairs, --out (required by jaxlm judge)",)),
])
def test_parse_errors_are_one_or_two_lines(capsys, argv, needles):
    """tyro's boxed panels (5-10 lines, its internal names) in the CLI's one- or two-line form."""
    _fails(argv, capsys, *needles, absent=("Traceback", "__tyro", "╭", "│"))


def test_logprobs_writes_only_jsonl(checkpoint, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    _fails(["logprobs", checkpoint, "--data", data, "--out", tmp_path / "scored.parquet"], capsys,
           "writes a .jsonl file")
    assert not (tmp_path / "scored.parquet").exists()


def test_judge_and_logprobs_outputs_are_checked_before_the_work(checkpoint, tmp_path, capsys):
    """``judge --out`` naming the calibration file replaced the labelled rows with judged ones
    (exit 0); a directory or a file standing where a parent must be failed after the scoring;
    ``judge`` wrote JSON lines into any suffix."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"question": "1+1?", "a": "2", "b": "3"}\n')
    cal = tmp_path / "cal.jsonl"
    cal.write_text('{"question": "1+1?", "a": "2", "b": "3", "label": 0}\n')
    base = ["judge", checkpoint, "--pairs", pairs, "--calibration", cal]
    _fails(base + ["--out", cal, "--overwrite"], capsys, "--out and --calibration name the same path")
    _fails(base + ["--out", tmp_path / "judged.parquet"], capsys, "`jaxlm judge` writes a .jsonl file")
    (tmp_path / "file").write_text("x")
    _fails(base + ["--out", tmp_path / "file" / "j.jsonl"], capsys, "is not a directory")
    (tmp_path / "dir.jsonl").mkdir()
    _fails(["logprobs", checkpoint, "--data", pairs, "--out", tmp_path / "dir.jsonl", "--overwrite"], capsys,
           "is a directory")
    assert '"label": 0' in cal.read_text() and not (tmp_path / "judged.parquet").exists()


def test_generate_without_prompts_fails_before_building_a_model(capsys):
    """The embedded default's "model: ..." line came first, before the usage error."""
    _fails(["generate", "--prompt"], capsys, "--prompt is empty")


def test_dtype_for_a_jaxlm_checkpoint_is_a_usage_error(checkpoint, capsys):
    _fails(["generate", "--model", checkpoint, "--prompt", "1+1=", "--dtype", "bfloat16"], capsys,
           "--dtype applies to HF directories", "jaxlm checkpoint")


def test_quickstart_checks_the_grpo_stage_before_training(tmp_path, capsys):
    """A bad --rl-overrides key is refused before the SFT stage runs (nothing is written),
    --rl-overrides with --rl-steps 0 is refused, and the GRPO stage takes the SFT model's
    shape (--overrides model.d_model=32 trains and fine-tunes one model)."""
    from trainers.quickstart import _grpo_config
    from trainers.recipes import load_config

    out = tmp_path / "qs"
    _fails(["quickstart", "--out", out, "--rl-overrides", "algorithm.bogus=1"], capsys, "algorithm.bogus")
    assert not out.exists()
    _fails(["quickstart", "--out", out, "--rl-steps", "0", "--rl-overrides", "trainer.seed=1"], capsys, "rl_steps=0")
    sft = load_config("quickstart", [f"trainer.out_dir={out}", "model.d_model=32", "model.n_heads=2"])
    rl = _grpo_config(sft, 3, ["trainer.seed=1"], progress=False)
    assert rl.model == sft.model and rl.init_from == str(out / "model") and rl.trainer.steps == 3


def test_a_training_run_directory_names_its_model(checkpoint, tmp_path, capsys):
    """`--model RUN` (the run's own config.json is not a HF config) points at RUN/model."""
    run = tmp_path / "run"
    _copy(checkpoint, run / "model")
    (run / "config.json").write_text(json.dumps({"model": {}, "trainer": {}, "algorithm": {}}))
    _fails(["eval", "--model", run, "--n", "1"], capsys, "is a training run's directory", str(run / "model"))
    with pytest.raises(jaxlm.models.hf.io.CheckpointError, match="training run's directory"):
        jaxlm.load_checkpoint(run)


def test_edit_refuses_to_replace_a_report_and_writes_strict_json(checkpoint, tmp_path, capsys):
    from jaxlm.fileio import atomic_write_json

    report = tmp_path / "report.json"
    report.write_text('{"precious": true}')
    _fails(["edit", checkpoint, "--requests", tmp_path / "requests.jsonl", "--report", report], capsys,
           "--report", "exists", "--overwrite")
    assert json.loads(report.read_text()) == {"precious": True}
    # a report path that is a directory, or the requests file, is refused before the edit runs
    # (a directory failed after the edit, the edited model already saved)
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"prompt": "x", "target_new": " y"}\n')
    (tmp_path / "dir").mkdir()
    _fails(["edit", checkpoint, "--requests", requests, "--method", "finetune", "--out", tmp_path / "edited",
            "--report", tmp_path / "dir", "--overwrite"], capsys, "is a directory")
    _fails(["edit", checkpoint, "--requests", requests, "--report", requests, "--overwrite"], capsys,
           "--report and --requests name the same path")
    assert not (tmp_path / "edited").exists()
    # an unmeasured metric (NaN) is written as null, which strict JSON parsers accept
    atomic_write_json(tmp_path / "sub" / "r.json", {"retention": float("nan"), "rows": [1.0, float("inf")]})
    strict = json.loads((tmp_path / "sub" / "r.json").read_text(),
                        parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert strict == {"retention": None, "rows": [1.0, None]}
