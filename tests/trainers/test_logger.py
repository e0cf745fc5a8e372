"""MetricsLogger: TensorBoard events survive a SIGKILL, a re-run adds no duplicate
points, a torn last line of metrics.jsonl is dropped, and JSON errors name the file."""

import json
import logging
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import jaxlm.fileio as jaxlm_fileio
from jaxlm.fileio import JSONFileError
from trainers.logger import MetricsLogger, plot_curves


def _events(tb_dir: Path) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in the event files (TFRecord framing)."""
    from tensorboardX.proto.event_pb2 import Event

    out = []
    for f in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = f.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            if pos + 12 + length + 4 > len(data):
                break
            event = Event.FromString(data[pos + 12:pos + 12 + length])
            out.extend((event.step, v.tag, v.simple_value) for v in event.summary.value)
            pos += 12 + length + 4
    return out


def _records(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_events_survive_sigkill(tmp_path):
    # to start fast, the child skips jaxlm/__init__ (jax; it needs jaxlm.fileio only) and
    # torch (tensorboardX imports it when present)
    child = textwrap.dedent(f"""
        import os, signal, sys, types
        sys.modules["torch"] = None
        pkg = types.ModuleType("jaxlm")
        pkg.__path__ = [{str(Path(jaxlm_fileio.__file__).parent)!r}]
        sys.modules["jaxlm"] = pkg
        from trainers.logger import MetricsLogger
        logger = MetricsLogger({str(tmp_path)!r}, total_steps=10, progress=False)
        for step in (1, 2, 3):
            logger.log(step, {{"loss": 1.0 / step}})
        logger.log(3, {{"loss": 0.5}}, kind="eval")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    scalars = {(s, tag) for s, tag, _ in _events(tmp_path / "tensorboard")}
    assert {(1, "train/loss"), (2, "train/loss"), (3, "train/loss"), (3, "eval/loss")} <= scalars
    assert [r["step"] for r in _records(tmp_path)] == [1, 2, 3, 3]


def test_rerun_of_a_finished_run_adds_no_duplicate_points(tmp_path):
    first = MetricsLogger(tmp_path, total_steps=3, progress=False)
    for step in (1, 2, 3):
        first.log(step, {"loss": 1.0 / step})
    first.log(3, {"loss": 0.4, "accuracy": 0.9}, kind="eval")
    first.close()
    # the same command again: nothing to train, the harness logs the final eval again
    again = MetricsLogger(tmp_path, total_steps=3, start_step=3, progress=False)
    assert again.logged(3, "eval") and again.logged(2) and not again.logged(4)
    again.log(3, {"loss": 0.4, "accuracy": 0.9}, kind="eval")
    again.close()
    assert [(r["step"], r["kind"]) for r in _records(tmp_path)] == [(1, "train"), (2, "train"), (3, "train"),
                                                                     (3, "eval")]
    points = [(s, tag) for s, tag, _ in _events(tmp_path / "tensorboard")]
    assert points.count((3, "eval/loss")) == 1 and points.count((3, "train/loss")) == 1


def test_resume_drops_later_records_and_a_torn_last_line(tmp_path, caplog):
    lines = [json.dumps({"step": s, "kind": "train", "loss": 1.0}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "kind": "tr')
    with caplog.at_level(logging.WARNING, logger="jaxlm.fileio"):
        logger = MetricsLogger(tmp_path, total_steps=5, start_step=2, progress=False)
    assert f"{tmp_path / 'metrics.jsonl'}: dropped a torn last line 4" in caplog.text
    logger.log(3, {"loss": 0.7})
    logger.close()
    assert [(r["step"], r["loss"]) for r in _records(tmp_path)] == [(1, 1.0), (2, 1.0), (3, 0.7)]


def test_bad_metrics_line_names_the_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "kind": "train"}\n{"step": 2,\n{"step": 3, "kind": "train"}\n')
    with pytest.raises(JSONFileError, match=rf"metrics file {tmp_path / 'metrics.jsonl'}: line 2 is not valid JSON"):
        MetricsLogger(tmp_path, total_steps=5, start_step=3, progress=False)
    (tmp_path / "metrics.jsonl").write_text('{"step": "one", "kind": "train"}\n')
    with pytest.raises(JSONFileError, match=r"metrics\.jsonl: record 1 is not an object with an integer 'step'"):
        MetricsLogger(tmp_path, total_steps=5, progress=False)


def test_plot_curves_reads_a_torn_file(tmp_path):
    lines = [json.dumps({"step": s, "kind": "train", "loss": 1.0 / s}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "ki')
    assert plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png") == tmp_path / "curves.png"


def test_tokens_per_s_counts_training_time_only(tmp_path, monkeypatch):
    """Setup before the first step and evaluations inside ``untimed`` are left out of the
    throughput window (the first record read 40 tok/s against ~1850 after it, the step-0
    evaluation counted as training)."""
    import trainers.logger as logger_module

    now = [100.0]
    monkeypatch.setattr(logger_module.time, "perf_counter", lambda: now[0])
    log = MetricsLogger(tmp_path, total_steps=4, progress=False)
    now[0] += 50.0  # setup (restoring a checkpoint, building the data)
    log.start_clock()
    with log.untimed():
        now[0] += 30.0  # the step-0 evaluation
        log.log(0, {"loss": 1.0}, kind="eval")
    now[0] += 2.0  # two steps of 100 tokens
    log.count_tokens(200)
    assert log.log(2, {"loss": 1.0})["tokens_per_s"] == pytest.approx(100.0)
    now[0] += 1.0
    log.count_tokens(100)
    with log.untimed():
        now[0] += 7.0  # a periodic evaluation between logs
    now[0] += 1.0
    log.count_tokens(100)
    assert log.log(4, {"loss": 1.0})["tokens_per_s"] == pytest.approx(100.0)
    log.close()
