"""A stage schedule runs each stage from the previous stage's model and reports every
domain's retention after each stage."""

import dataclasses
import json

import jax
import numpy as np
import pytest

import jaxlm
from jaxlm.data.mixture import mixture_of
from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Arithmetic, MarkovText
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig
from trainers.stages import Stage, retention, run_stages

MODEL = jaxlm.ModelConfig.tiny(d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64, n_layers=1, max_seq_len=64)
DOMAINS = {"math": Arithmetic(digits=1), "general": MarkovText()}


def _stage(name, source, lr):
    return Stage(name, ExperimentConfig(
        model=MODEL, data=DataConfig(source=source, seq_len=64, batch_size=8, pack=True, eval_examples=8),
        optimizer=OptimizerConfig(lr=lr, warmup_steps=1, schedule="constant", weight_decay=0.0),
        trainer=TrainerConfig(steps=3, progress=False, log_every=1, eval_every=0, save_every=100, eval_generate=0),
        algorithm=SFTConfig()))


def test_stages_chain_and_report_retention(tmp_path):
    stages = [_stage("pretrain", mixture_of(DOMAINS, {"general": 0.7, "math": 0.3}), 3e-3),
              _stage("frozen", DOMAINS["math"], 1e-12)]  # lr ~0: the second stage keeps the first's weights
    report = run_stages(stages, tmp_path, domains=DOMAINS, eval_n=16, max_new_tokens=3)
    assert [r["stage"] for r in report] == ["pretrain", "frozen"]
    assert json.loads((tmp_path / "retention.json").read_text()) == report
    a, b = (jaxlm.load_checkpoint(tmp_path / s / "model") for s in ("pretrain", "frozen"))
    for x, y in zip(jax.tree.leaves(jaxlm.models.params.flat_params(a)),
                    jax.tree.leaves(jaxlm.models.params.flat_params(b))):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=0, atol=1e-8)
    for d in DOMAINS:
        assert report[1]["domains"][d]["loss"] == pytest.approx(report[0]["domains"][d]["loss"], abs=1e-5)
    assert set(report[0]["domains"]["math"]) == {"loss", "accuracy"}
    assert set(report[0]["domains"]["general"]) == {"loss"}  # no generative verifier
    assert report[0]["domains"] == retention(a, DOMAINS, n=16, max_new_tokens=3)


def test_retention_rows_fit_the_model():
    """The default 64-token held-out rows on a shorter model are cut to its length; an explicit
    longer seq_len is refused (it scored positions past the model)."""
    short = jaxlm.build_model(dataclasses.replace(MODEL, max_seq_len=32), seed=0, tokenizer=jaxlm.data.ByteTokenizer())
    scores = retention(short, {"arith": Arithmetic(digits=1)}, n=8, max_new_tokens=2)
    assert np.isfinite(scores["arith"]["loss"])
    with pytest.raises(ValueError, match="seq_len=64 is more than the model's ModelConfig.max_seq_len=32"):
        retention(short, {"arith": Arithmetic(digits=1)}, n=8, seq_len=64)


def test_bad_stage_lists_are_refused(tmp_path):
    s = _stage("a", DOMAINS["math"], 1e-3)
    with pytest.raises(ValueError, match="repeat"):
        run_stages([s, dataclasses.replace(s)], tmp_path, domains=DOMAINS)
    # its directory took the report's path: the report failed after every stage had trained
    with pytest.raises(ValueError, match="a stage named 'retention.json'"):
        run_stages([dataclasses.replace(s, name="retention.json")], tmp_path / "r", domains=DOMAINS)
    assert not (tmp_path / "r").exists()
    with pytest.raises(ValueError, match="Stage.name='a/b'"):
        Stage("a/b", s.config)
    for bad in (".", ".."):  # ".." would write outside out_dir
        with pytest.raises(ValueError, match=f"Stage.name='{bad}' must be"):
            Stage(bad, s.config)
    # retention's arguments are checked before the first stage trains (they failed after it,
    # eval_n=0 naming DataConfig.batch_size)
    for kw, match in ((dict(eval_n=0), "eval_n=0 is invalid"), (dict(eval_seq_len=128), "eval_seq_len=128 is more "
                      "than stage 'a'"), (dict(max_new_tokens=0), "max_new_tokens=0"), (dict(eval_seq_len=0), "eval_seq_len=0")):
        with pytest.raises(ValueError, match=match):
            run_stages([s], tmp_path / "x", domains=DOMAINS, **kw)
        assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="n=0 is invalid"):
        retention(jaxlm.build_model(MODEL, seed=0, tokenizer=jaxlm.data.ByteTokenizer()), DOMAINS, n=0)


def test_a_preempted_stage_stops_the_schedule_and_a_rerun_resumes_it(tmp_path, monkeypatch):
    """A stage stopped by ``trainer.stop_after`` saved no model: the schedule stops saying so;
    the re-run (with ``out_dir`` spelled differently) resumes it and runs on."""
    first, second = _stage("a", DOMAINS["math"], 1e-3), _stage("b", DOMAINS["math"], 1e-3)
    cut = dataclasses.replace(second, config=dataclasses.replace(
        second.config, trainer=dataclasses.replace(second.config.trainer, stop_after=2)))
    with pytest.raises(RuntimeError, match="stage 'b' stopped at step 2 before its 3 steps"):
        run_stages([first, cut], tmp_path / "runs", domains={"math": DOMAINS["math"]}, eval_n=8, max_new_tokens=2)
    monkeypatch.chdir(tmp_path)
    report = run_stages([first, second], "./runs/", domains={"math": DOMAINS["math"]}, eval_n=8, max_new_tokens=2)
    assert [r["steps"] for r in report] == [3, 3]


@pytest.mark.slow  # four training stages and two GRPO runs (about 4 minutes on 2 cores); the checks above run by default
def test_mid_training_before_rl_gives_rl_a_larger_gain(tmp_path):
    """PRISM's claim in miniature, as `bench/prism_claim.py` measures it (its own process, XLA's
    default optimisation, so the documented numbers are reproduced): the same SFT and GRPO gain
    more accuracy after a mid-training stage than from the base, and the general domain's loss
    after RL is lower on the mid-trained arm."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "bench" / "prism_claim.py"
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", "").strip()
    proc = subprocess.run([sys.executable, str(bench), "--out", str(tmp_path / "runs"), "--json",
                           str(tmp_path / "result.json")], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["rl_gain with mid-training"] > result["rl_gain without"]
    after_rl = {arm: result[arm][-1]["domains"] for arm in ("with mid-training", "without")}
    assert after_rl["with mid-training"]["general"]["loss"] < after_rl["without"]["general"]["loss"]


def test_an_omni_stage_reports_retention_of_its_language_model(tmp_path):
    """[text -> omni alignment (encoders only)]: retention reads the omni checkpoint's language
    model, which the encoder-only stage leaves as the text stage wrote it."""
    from jaxlm.data.audiovisual import AVTaskConfig
    from trainers.config import OmniTrainConfig

    model = jaxlm.ModelConfig.tiny(vocab_size=261, rope="mrope", d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                   ffn_dim=64, max_seq_len=64)
    trainer = TrainerConfig(steps=2, progress=False, save_every=100, eval_generate=0)
    text = Stage("text", ExperimentConfig(
        model=model, data=DataConfig(source=DOMAINS["math"], seq_len=64, batch_size=4, eval_examples=4),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=1), trainer=trainer, algorithm=SFTConfig()))
    omni = Stage("omni", ExperimentConfig(
        model=model, data=DataConfig(batch_size=4), optimizer=OptimizerConfig(lr=3e-3, warmup_steps=1, trainable="encoder"),
        trainer=trainer, algorithm=OmniTrainConfig(
            task=AVTaskConfig(frames=2, grid=2, patch=2, audio_frames=4, window=8, tone_frames=1),
            encoder_hidden=16, eval_examples=4)))
    report = run_stages([text, omni], tmp_path, domains={"math": DOMAINS["math"]}, eval_n=4, max_new_tokens=2)
    assert [r["algorithm"] for r in report] == ["sft", "omni"]
    assert report[1]["domains"] == report[0]["domains"]  # the language model was frozen
    with pytest.raises(ValueError, match="an omni stage follows an omni stage"):
        run_stages([text, omni, dataclasses.replace(omni, name="again")], tmp_path / "x", domains=DOMAINS)
