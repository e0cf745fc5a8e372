"""Reward models: the Bradley-Terry and calibration losses against their formulas, the score
against the head applied to an unpadded forward's last hidden state, one training step
lowering the joint loss, and the configurable-safety augmentation's labels and pairs."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlm
from jaxlm.data import safety
from jaxlm.data.tokenizers import ByteTokenizer
from trainers.reward_model import (RewardModel, RewardModelConfig, bradley_terry_loss, calibration_loss,
                                   score_texts, train_reward_model)


def test_losses_match_their_formulas():
    s_pos, s_neg = np.array([2.0, -1.0, 0.3]), np.array([1.0, 0.5, 0.3])
    want = np.mean(-np.log(1 / (1 + np.exp(-(s_pos - s_neg)))))
    assert float(bradley_terry_loss(jnp.asarray(s_pos), jnp.asarray(s_neg))) == pytest.approx(want, rel=1e-6)
    s, b, y = np.array([3.0, -2.0, 0.0, 1.5]), 0.5, np.array([1.0, 0.0, 1.0, 0.0])
    p = 1 / (1 + np.exp(-(s - b)))
    want = np.mean(-(y * np.log(p) + (1 - y) * np.log1p(-p)))
    assert float(calibration_loss(jnp.asarray(s), jnp.asarray(b), jnp.asarray(y))) == pytest.approx(want, rel=1e-6)
    # a confident wrong score costs about its margin and stays finite (no log(0))
    big = float(calibration_loss(jnp.asarray([40.0]), jnp.asarray(0.5), jnp.asarray([0.0])))
    assert big == pytest.approx(39.5, rel=1e-6)


@pytest.fixture(scope="module")
def rm():
    lm = jaxlm.build_model(jaxlm.ModelConfig.tiny(max_seq_len=96), seed=0, tokenizer=ByteTokenizer())
    return RewardModel(lm, rngs=nnx.Rngs(1))


def test_texts_past_the_backbone_length_are_refused(rm):
    assert score_texts(rm, ["x" * 95]).shape == (1,)  # 96 tokens with BOS: the whole model, width 96
    with pytest.raises(ValueError, match=r"text 1 has 101 tokens, more than the reward model's .*max_seq_len=96"):
        score_texts(rm, ["ok", "x" * 100])


def test_score_is_the_head_on_the_last_hidden_state(rm):
    texts = ["allow: drugs\nQ: x?\nA: background (drugs)", "short"]
    got = score_texts(rm, texts)
    for text, s in zip(texts, got):
        ids = np.asarray([rm.tokenizer.encode(text, add_bos=True)], np.int32)
        h = rm.lm.backbone(ids).hidden[0, -1]
        want = float(h @ rm.head.kernel[...][:, 0] + rm.head.bias[...][0])
        assert s == pytest.approx(want, abs=1e-4)


def test_right_padded_rows_are_scored_at_their_last_real_token(rm):
    """The score reads the last real position whatever the padding side (a right-padded batch
    was scored at its last pad column, and csrm_loss trained there)."""
    texts = ["hello world", "a much longer second text"]
    want = score_texts(rm, texts)
    ids = [rm.tokenizer.encode(t, add_bos=True) for t in texts]
    T = 32
    tokens, mask = np.zeros((2, T), np.int32), np.zeros((2, T), bool)
    for r, row in enumerate(ids):
        tokens[r, :len(row)], mask[r, :len(row)] = row, True
    np.testing.assert_allclose(np.asarray(rm(jnp.asarray(tokens), jnp.asarray(mask))), want, atol=1e-5)


def test_training_inputs_are_checked(rm):
    points, pairs = [("safe text", True), ("bad text", 0)], [("good", "bad")]
    with pytest.raises(ValueError, match=r"width=200 is invalid: must be an int in \[1, ModelConfig.max_seq_len=96\]"):
        train_reward_model(rm, points, pairs, RewardModelConfig(steps=1), width=200)
    with pytest.raises(ValueError, match="text 0 has 101 tokens"):  # an explicit width no longer skips the check
        train_reward_model(rm, [("x" * 100, True)], pairs, RewardModelConfig(steps=1), width=64)
    with pytest.raises(ValueError, match="point 1 has label 2"):  # an unbounded BCE target
        train_reward_model(rm, [("a", 1), ("b", 2)], pairs, RewardModelConfig(steps=1))
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match=f"batch_size={bad!r} is invalid"):
            score_texts(rm, ["a"], batch_size=bad)


def test_training_lowers_the_joint_loss(rm):
    base = safety.items(n=12)
    points, pairs = safety.augment(base, safety.all_configs(), per_item=2)
    _, log = train_reward_model(rm, points, pairs, RewardModelConfig(steps=60, learning_rate=3e-3))
    assert log[-1]["loss"] < log[0]["loss"], log
    with pytest.raises(ValueError, match="calibration_weight"):
        RewardModelConfig(calibration_weight=-1.0)
    for field in ("calibration_weight", "learning_rate"):  # NaN trained a model of NaN scores
        with pytest.raises(ValueError, match=f"RewardModelConfig.{field}=nan must be a finite number"):
            RewardModelConfig(**{field: float("nan")})
    with pytest.raises(ValueError, match="at least one point"):
        train_reward_model(rm, [], pairs)
    for field, bad in (("steps", 2.5), ("batch_pairs", True), ("warmup_steps", 1.5)):  # failed in the loop
        with pytest.raises(ValueError, match=f"RewardModelConfig.{field}={bad!r} must be an int"):
            RewardModelConfig(**{field: bad})


def test_learning_rate_schedule_warms_up_then_decays_by_cosine():
    # constant by default
    constant = RewardModelConfig(steps=100, learning_rate=1e-3).learning_rate_schedule()
    assert [float(constant(i)) for i in (0, 50, 99)] == pytest.approx([1e-3] * 3, rel=1e-6)
    # linear warmup over 10 steps, then lr_min + (lr - lr_min) (1 + cos(pi t)) / 2 over the other 90
    cfg = RewardModelConfig(steps=100, learning_rate=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    sched = cfg.learning_rate_schedule()
    for step in (0, 5, 10, 40, 77, 100):
        if step < 10:
            want = 1e-3 * step / 10
        else:
            t = (step - 10) / 90
            want = 1e-4 + (1e-3 - 1e-4) * (1 + np.cos(np.pi * t)) / 2
        assert float(sched(step)) == pytest.approx(want, rel=1e-5, abs=1e-9), step
    with pytest.raises(ValueError, match="warmup_steps"):
        RewardModelConfig(steps=10, warmup_steps=10)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        RewardModelConfig(min_lr_ratio=1.5)


def test_augmentation_relabels_by_configuration_and_keeps_the_severity_order():
    base = safety.items()
    points, pairs = safety.augment(base, safety.all_configs(), per_item=4, seed=0)
    item_of = {safety.rm_input(c, it): (c, it) for c in safety.all_configs() for it in base}
    assert len(points) == 4 * len(base)
    for text, label in points:
        c, it = item_of[text]
        assert label == (it.severity == 0 or it.category in c)
    labels = np.array([l for _, l in points])
    assert 0.3 < labels.mean() < 0.8  # both labels occur
    for chosen, rejected in pairs:
        (c1, a), (c2, b) = item_of[chosen], item_of[rejected]
        assert c1 == c2 and a.request == b.request and a.severity < b.severity and b.category not in c1
    # one response, two configurations, opposite labels
    it = next(i for i in base if i.severity == 3)
    assert safety.compliant(it, frozenset({it.category})) and not safety.compliant(it, frozenset())
