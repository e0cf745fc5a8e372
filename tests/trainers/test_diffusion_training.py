"""Masked-diffusion training: LLaDA's forward process and losses against hand computations,
SPEED's KL term, and a run through the harness with resume."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Sorting
from jaxlm.models.config import ModelConfig
from trainers.config import DiffusionConfig, ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig
from trainers.loop import train
from jaxlm.checkpoint import load_model
from trainers.diffusion import diffusion_loss_sum, document_mask, noise_batch, pad_answers, sharpened_kl

MASK = 9


def _batch(tokens, loss_mask, seg):
    return {"tokens": jnp.asarray(tokens, jnp.int32), "loss_mask": jnp.asarray(loss_mask, bool),
            "segment_ids": jnp.asarray(seg, jnp.int32)}


def _ce(logits, target):
    z = np.asarray(logits, np.float64)
    return np.log(np.exp(z - z.max()).sum()) + z.max() - z[target]


def test_pretrain_loss_weights_by_one_over_p_mask():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(1, 4, 5)), jnp.float32)
    batch = _batch([[1, 2, 3, 4]], [[True] * 4], [[1, 1, 1, 1]])
    masked = jnp.asarray([[True, False, True, False]])
    p = jnp.full((1, 4), 0.3, jnp.float32)
    total, count = diffusion_loss_sum(logits, batch, masked, p, objective="pretrain")
    hand = (_ce(logits[0, 0], 1) + _ce(logits[0, 2], 3)) / 0.3
    np.testing.assert_allclose(total, hand, rtol=1e-5)
    assert count == 4  # 1/(B L) with B L = 4 real tokens


def test_sft_loss_divides_by_answer_length_per_document():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(1, 7, 6)), jnp.float32)
    # two packed documents: [prompt, a, a] and [prompt, prompt, a, a... ] answer lengths 2 and 2; padding last
    batch = _batch([[1, 2, 3, 1, 4, 5, 0]], [[False, True, True, False, False, True, False]], [[1, 1, 1, 2, 2, 2, 0]])
    masked = jnp.asarray([[False, True, False, False, False, True, False]])
    p = jnp.asarray([[0.5, 0.5, 0.5, 0.2, 0.2, 0.2, 0.2]])
    total, count = diffusion_loss_sum(logits, batch, masked, p, objective="sft")
    hand = _ce(logits[0, 1], 2) / (0.5 * 2) + _ce(logits[0, 5], 5) / (0.2 * 1)
    np.testing.assert_allclose(total, hand, rtol=1e-5)
    assert count == 2  # documents


def test_noise_batch_masks_per_document_and_never_the_prompt():
    T, B = 64, 256
    seg = np.zeros((B, T), np.int32)
    seg[:, :40], seg[:, 40:60] = 1, 2
    loss_mask = np.zeros((B, T), bool)
    loss_mask[:, 10:40], loss_mask[:, 50:60] = True, True
    batch = _batch(np.full((B, T), 5), loss_mask, seg)
    noisy, masked, p = noise_batch(jax.random.key(0), batch, mask_id=MASK, eps=1e-3, objective="sft")
    masked, p = np.asarray(masked), np.asarray(p)
    assert not masked[~loss_mask].any()
    assert (np.asarray(noisy)[masked] == MASK).all() and (np.asarray(noisy)[~masked] == 5).all()
    # one p_mask per document, in [eps, 1]
    assert (p[:, :40] == p[:, :1]).all() and (p[:, 40:60] == p[:, 40:41]).all()
    assert (p >= 1e-3).all() and (p <= 1).all()
    # masking rate follows p_mask: mean over rows of (masked fraction - p) ~ 0
    frac = masked[:, 10:40].mean(1)
    assert abs(float(np.mean(frac - p[:, 10]))) < 0.02
    _, masked_all, _ = noise_batch(jax.random.key(1), batch, mask_id=MASK, eps=1e-3, objective="pretrain")
    assert np.asarray(masked_all)[:, :10].any() and not np.asarray(masked_all)[:, 60:].any()  # padding never


def test_document_mask_is_bidirectional_within_documents():
    m = np.asarray(document_mask(jnp.asarray([[1, 1, 2, 0]])))[0, 0]
    expected = np.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]], bool)  # padding sees nothing
    np.testing.assert_array_equal(m, expected)


def test_pad_answers():
    batch = {"tokens": np.array([[1, 5, 6, 2, 0, 0, 0]]), "loss_mask": np.array([[0, 0, 1, 1, 0, 0, 0]], bool),
             "segment_ids": np.array([[1, 1, 1, 1, 0, 0, 0]]), "positions": np.array([[0, 1, 2, 3, 0, 0, 0]])}
    full = pad_answers(batch, eos_id=2)
    assert full["tokens"].tolist() == [[1, 5, 6, 2, 2, 2, 2]]
    assert full["loss_mask"].tolist() == [[False, False, True, True, True, True, True]]
    assert full["positions"].tolist() == [list(range(7))] and (full["segment_ids"] == 1).all()
    lengths = {int((pad_answers(batch, 2, np.random.default_rng(s))["segment_ids"] > 0).sum()) for s in range(40)}
    assert lengths == {4, 5, 6, 7}  # every length from the example's to the row's


def test_sharpened_kl_counts_teacher_correct_masked_positions_only():
    t = jnp.asarray([[[3.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 3.0]]])
    s = jnp.asarray([[[1.0, 0.5, 0.0], [0.2, 0.1, 0.0], [0.0, 0.0, 0.0]]])
    targets = jnp.asarray([[0, 0, 2]])  # the teacher is right at 0 and 2, wrong at 1
    masked = jnp.asarray([[True, True, False]])
    total, n = sharpened_kl(s, t, targets, masked, teacher_temperature=0.5, student_temperature=1.0)
    pt = np.exp(np.array([6.0, 0, 0]) - np.log(np.exp([6.0, 0, 0]).sum()))
    ps = np.exp(np.array([1.0, 0.5, 0]) - np.log(np.exp([1.0, 0.5, 0]).sum()))
    np.testing.assert_allclose(total, np.sum(pt * np.log(pt / ps)), rtol=1e-5)
    assert n == 1


def _config(tmp_path, **trainer):
    return ExperimentConfig(
        model=ModelConfig.tiny(vocab_size=260, mode="diffusion", mask_token_id=259, d_model=32, ffn_dim=64,
                               max_seq_len=64),
        data=DataConfig(source=Sorting(length=3, max_value=9), seq_len=24, batch_size=8, eval_examples=8),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=2),
        trainer=TrainerConfig(**{"steps": 4, "out_dir": str(tmp_path), "progress": False, "log_every": 1,
                                 "eval_every": 0, "save_every": 2, "eval_generate": 4, "eval_max_new_tokens": 8,
                                 "async_checkpoint": False, **trainer}),
        algorithm=DiffusionConfig(objective="sft", eval_steps=8),
    )


def test_harness_trains_and_resumes_exactly(tmp_path):
    straight = train(_config(tmp_path / "a"))
    assert 0.0 <= straight.final_eval["accuracy"] <= 1.0 and straight.samples  # decoded by diffusion_generate
    train(_config(tmp_path / "b", stop_after=2))
    train(_config(tmp_path / "b"))
    a, b = load_model(str(tmp_path / "a" / "model")), load_model(str(tmp_path / "b" / "model"))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert a.config.mode == "diffusion"


def test_config_errors(tmp_path):
    cfg = _config(tmp_path)
    with pytest.raises(ValueError, match="needs model.mode='diffusion'"):
        dataclasses.replace(cfg, model=ModelConfig.tiny(vocab_size=260, max_seq_len=64))
    with pytest.raises(ValueError, match="trained with algorithm=DiffusionConfig"):
        dataclasses.replace(cfg, algorithm=SFTConfig())
    with pytest.raises(ValueError, match="pad_answers=True needs data.pack=False"):
        dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pack=True))
    with pytest.raises(ValueError, match="algorithm.eps"):
        DiffusionConfig(eps=0.0)
    for field, value in (("distill_weight", float("inf")), ("teacher_temperature", float("inf")),
                         ("student_temperature", float("nan"))):
        with pytest.raises(ValueError, match=rf"algorithm.{field}={value!r} is invalid: must be a finite number"):
            DiffusionConfig(**{field: value})
    # a mask id that is the tokenizer's EOS: clean EOS answers would read as noise, and the sampler
    # (which never emits the mask id) could never stop
    from trainers.config import ConfigError

    eos = 2  # the byte tokenizer's
    clash = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mask_token_id=eos),
                                trainer=dataclasses.replace(cfg.trainer, out_dir=str(tmp_path / "clash")))
    with pytest.raises(ConfigError, match=f"model.mask_token_id={eos} is the tokenizer's eos id"):
        train(clash)
    # an ordinary token ('3' of the byte tokenizer): its clean occurrences would read as [MASK]
    three = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mask_token_id=54),
                                trainer=dataclasses.replace(cfg.trainer, out_dir=str(tmp_path / "three")))
    with pytest.raises(ConfigError, match="model.mask_token_id=54 is the tokenizer's ordinary token '3'"):
        train(three)
    import jaxlm

    with pytest.raises(ValueError, match=f"EOS id {eos} is the model's mask_token_id"):
        jaxlm.diffusion_generate(jaxlm.build_model(clash.model, seed=0), [[5, 6]], gen_length=4, steps=4,
                                 block_length=4, tokenizer=jaxlm.ByteTokenizer())
    # the held-out sampler's schedule is checked before training, not at the final evaluation
    for algo, match in ((DiffusionConfig(objective="sft", eval_block_length=3), "not divisible by block_length=3"),
                        (DiffusionConfig(objective="sft", eval_steps=32), "at most one step per token"),
                        (DiffusionConfig(objective="sft", eval_steps=3, eval_block_length=4),
                         "steps=3 is not divisible by the number of blocks")):
        with pytest.raises(ValueError, match=f"eval_max_new_tokens=8: .*{match}"):
            dataclasses.replace(cfg, algorithm=algo)
