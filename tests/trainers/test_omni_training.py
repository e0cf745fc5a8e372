"""Omni training through the run harness: the answer loss against a hand computation from the
model's logits, a run that checkpoints the encoders and resumes bit-identically, the omni
checkpoint it writes, and bad configs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlm
from jaxlm.checkpoint import load_model
from jaxlm.data.audiovisual import AVTaskConfig, av_example
from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tokenizers import ByteTokenizer
from jaxlm.models.config import ModelConfig
from jaxlm.models.omni import build_omni, load_omni
from trainers.config import ConfigError, ExperimentConfig, OmniTrainConfig, OptimizerConfig, TrainerConfig
from trainers.loop import train
from trainers.omni import HELD_OUT, clip_rows, make_omni_loss_fn, omni_config, row_length

TOK = ByteTokenizer()
TASK = AVTaskConfig(frames=2, grid=2, patch=2, audio_frames=4, window=8, tone_frames=1)


def _config(out_dir, *, steps=4, stop_after=None, **algo) -> ExperimentConfig:
    return ExperimentConfig(
        model=ModelConfig.tiny(vocab_size=261, rope="mrope", d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                               ffn_dim=64, max_seq_len=64),
        data=DataConfig(batch_size=4),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=1),
        trainer=TrainerConfig(steps=steps, out_dir=str(out_dir), log_every=1, eval_every=0, save_every=2,
                              eval_generate=2, stop_after=stop_after, progress=False),
        algorithm=OmniTrainConfig(task=TASK, encoder_hidden=16, eval_examples=4, **algo),
    )


def test_rows_train_exactly_the_answer_and_eos():
    cfg = _config("unused")
    config = omni_config(cfg, TOK)
    assert (config.video_token_id, config.audio_token_id) == (TOK.vocab_size, TOK.vocab_size + 1)
    rows = clip_rows(cfg.algorithm, config, TOK, [3, 7, HELD_OUT + 1], seed=5)
    for b, i in enumerate([3, 7, HELD_OUT + 1]):
        ex = av_example(TASK, i, 5)
        trained = rows["tokens"][b][rows["target"][b]]
        assert trained.tolist() == TOK.encode(ex["answer"]) + [TOK.eos_id]
        assert rows["tokens"][b][rows["mask"][b]][0] == TOK.bos_id
        assert TASK.questions[rows["question_type"][b]] == ex["question"]
        n_video, n_audio = (rows["tokens"][b] == config.video_token_id).sum(), (rows["tokens"][b] == 260).sum()
        assert (n_video, n_audio) == (TASK.frames * TASK.grid**2, TASK.audio_frames)


def test_loss_is_the_answer_cross_entropy_from_the_logits():
    cfg = _config("unused")
    config = omni_config(cfg, TOK)
    model = build_omni(config, seed=1, tokenizer=TOK)
    rows = clip_rows(cfg.algorithm, config, TOK, [0, 1, 2], seed=0)
    batch = {k: jnp.asarray(v) for k, v in rows.items() if k != "question_type"}
    graphdef, state = nnx.split(model)
    total, count = make_omni_loss_fn(graphdef)(nnx.to_pure_dict(state), batch, None)
    logits = np.asarray(model(batch["tokens"], batch["positions"], video=batch["video"], audio=batch["audio"],
                              mask=batch["mask"]).logits, np.float64)
    hand, n = 0.0, 0
    for b in range(3):
        for t in np.flatnonzero(rows["target"][b]):  # the token at t, predicted at t - 1
            z = logits[b, t - 1]
            hand += np.log(np.exp(z - z.max()).sum()) + z.max() - z[rows["tokens"][b, t]]
            n += 1
    assert float(count) == n == 3 * 2
    np.testing.assert_allclose(float(total), hand, rtol=1e-5)


def test_padding_to_the_task_width_changes_no_loss():
    """Batches are left-padded to the task's longest row (one shape for every batch): the loss
    sum and count are those of the unpadded rows."""
    cfg = _config("unused")
    a = dataclasses.replace(cfg.algorithm, task=dataclasses.replace(TASK, questions=("move:", "look:", "tone:")))
    config = omni_config(cfg, TOK)
    width = row_length(a, config, TOK)
    graphdef, state = nnx.split(build_omni(config, seed=2, tokenizer=TOK))
    loss = make_omni_loss_fn(graphdef)
    plain = clip_rows(a, config, TOK, [4, 5, 6], seed=1)
    assert plain["tokens"].shape[1] == width  # every question and answer here is one token
    padded = clip_rows(a, config, TOK, [4, 5, 6], seed=1, width=width + 5)
    assert padded["tokens"].shape[1] == width + 5 and not padded["mask"][:, :5].any()
    got = [loss(nnx.to_pure_dict(state), {k: jnp.asarray(v) for k, v in b.items() if k != "question_type"}, None)
           for b in (plain, padded)]
    np.testing.assert_allclose(float(got[0][0]), float(got[1][0]), rtol=1e-5)
    assert float(got[0][1]) == float(got[1][1]) == 6
    with pytest.raises(ValueError, match="longer than width"):
        clip_rows(a, config, TOK, [4], seed=1, width=width - 1)


def test_harness_trains_checkpoints_encoders_and_resumes_exactly(tmp_path):
    straight = train(_config(tmp_path / "a"))
    assert {"loss", "accuracy"} <= set(straight.final_eval)
    assert 0.0 <= straight.final_eval["accuracy"] <= 1.0 and len(straight.samples) == 2
    interrupted = train(_config(tmp_path / "b", stop_after=2))
    assert interrupted.stopped_early and interrupted.step == 2
    train(_config(tmp_path / "b"))
    a, b = load_omni(tmp_path / "a" / "model"), load_omni(tmp_path / "b" / "model")
    for x, y in zip(jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # the encoders trained (they are part of the state, not left at their initial values)
    fresh = build_omni(omni_config(_config("x"), TOK), seed=_config("x").trainer.seed)
    assert not np.array_equal(np.asarray(a.video_encoder.up.kernel[...]), np.asarray(fresh.video_encoder.up.kernel[...]))
    assert a.config.video_token_id == 259 and a.tokenizer is not None
    # the language model alone is a jaxlm checkpoint; load_model names the omni loader
    assert jaxlm.load_checkpoint(tmp_path / "a" / "model" / "lm").config.rope == "mrope"
    with pytest.raises(jaxlm.CheckpointError, match="omni checkpoint.*load_omni"):
        load_model(tmp_path / "a" / "model")
    # re-running a finished run changes nothing
    again = train(_config(tmp_path / "a"))
    assert again.step == 4 and again.final_eval["accuracy"] == straight.final_eval["accuracy"]


def test_encoders_alone_train_with_the_language_model_frozen(tmp_path):
    cfg = _config(tmp_path / "enc", steps=2)
    cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, trainable="encoder"))
    train(cfg)
    trained = load_omni(tmp_path / "enc" / "model")
    fresh = build_omni(omni_config(cfg, TOK), seed=cfg.trainer.seed)  # the encoders' initial values
    lm = jaxlm.build_model(cfg.model, seed=cfg.trainer.seed)  # the language model's (the harness's init)
    for x, y in zip(jax.tree.leaves(nnx.state(trained.lm, nnx.Param)), jax.tree.leaves(nnx.state(lm, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.array_equal(np.asarray(trained.audio_encoder.down.kernel[...]),
                              np.asarray(fresh.audio_encoder.down.kernel[...]))


def test_config_errors(tmp_path):
    cfg = _config(tmp_path)
    with pytest.raises(ValueError, match="needs model.rope='mrope'"):
        dataclasses.replace(cfg, model=ModelConfig.tiny(vocab_size=261))
    with pytest.raises(ValueError, match="algorithm.encoder_hidden"):
        OmniTrainConfig(encoder_hidden=0)
    for field, bad in (("frames", 0), ("frames", -2), ("patch", 3.5), ("grid", True)):  # crashed unnamed later
        with pytest.raises(ValueError, match=f"AVTaskConfig.{field}={bad!r} must be an int >= 1"):
            dataclasses.replace(TASK, **{field: bad})
    with pytest.raises(ValueError, match="AVTaskConfig.noise=nan"):  # every clip NaN, silently
        dataclasses.replace(TASK, noise=float("nan"))
    with pytest.raises(ValueError, match="must differ"):
        OmniTrainConfig(video_token_id=259, audio_token_id=259)
    with pytest.raises(ValueError, match=r"data.batch_size=4 is not divisible by trainer.grad_accum=3"):
        # accepted before; the first step failed with a bare reshape error
        dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=4),
                            trainer=dataclasses.replace(cfg.trainer, grad_accum=3))
    small = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=260))
    with pytest.raises(ConfigError, match="does not fit model.vocab_size=260"):
        train(small)
    short = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, max_seq_len=16),
                                data=dataclasses.replace(cfg.data, seq_len=16))
    with pytest.raises(ConfigError, match="model.max_seq_len=16 is shorter than the task's rows"):
        train(short)
    with pytest.raises(ConfigError, match="is a token of the tokenizer"):
        train(dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, video_token_id=65)))
