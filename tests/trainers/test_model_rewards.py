"""Models as GRPO rewards: a saved reward model (``reward_model``) and a judge (``judge``) in
the REWARDS registry, checked against the models' own forward passes; the reward model's
directory round trip and its errors; a GRPO collector that scores its rollouts with them."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

import jaxlm
from jaxlm.checkpoint import CheckpointError
from jaxlm.data.tasks import Arithmetic
from jaxlm.data.tokenizers import ByteTokenizer
from trainers.config import DataConfig, ExperimentConfig, GRPOConfig, OptimizerConfig, TrainerConfig
from trainers.loop import initial_model, make_tokenizer
from trainers.reward_model import RewardModel, load_reward_model, save_reward_model, score_texts
from trainers.rl.loop import GRPOTrainer
from trainers.rl.registries import REWARDS

PROMPTS = ["3+4=", "9+1=", "2+2="]
COMPLETIONS = ["7", "10 maybe", ""]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    lm = jaxlm.build_model(jaxlm.ModelConfig.tiny(max_seq_len=96, init_std=0.3), seed=4, tokenizer=ByteTokenizer())
    rm = RewardModel(lm, rngs=nnx.Rngs(2))
    rm.offset[...] = 0.37  # a non-zero offset: sigmoid(s - b) must use it
    path = save_reward_model(rm, tmp_path_factory.mktemp("rm") / "rm")
    judge_path = jaxlm.save_checkpoint(lm, tmp_path_factory.mktemp("judge") / "judge")
    return dict(rm=rm, path=path, judge=lm, judge_path=judge_path)


def _head_score(rm, text):
    """The score from the backbone's last hidden state and the head weights, by hand."""
    ids = np.asarray([rm.tokenizer.encode(text, add_bos=True)], np.int32)
    h = np.asarray(rm.lm.backbone(ids).hidden[0, -1], np.float64)
    return float(h @ np.asarray(rm.head.kernel[...], np.float64)[:, 0] + float(rm.head.bias[...][0]))


def test_reward_model_directory_round_trip(saved, tmp_path):
    loaded = load_reward_model(saved["path"])
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    np.testing.assert_array_equal(score_texts(loaded, texts), score_texts(saved["rm"], texts))
    assert float(loaded.offset[...]) == pytest.approx(0.37)
    with pytest.raises(FileExistsError, match="exists"):
        save_reward_model(saved["rm"], saved["path"])
    save_reward_model(saved["rm"], saved["path"], overwrite=True)


def test_reward_model_directory_errors(saved, tmp_path):
    with pytest.raises(CheckpointError, match="not a reward model directory"):
        load_reward_model(tmp_path)
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(saved["path"], bad)
    (bad / "reward_model.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(CheckpointError, match="format='other'"):
        load_reward_model(bad)
    (bad / "reward_model.json").write_text(json.dumps({"format": "jaxlm.reward_model"}))
    from safetensors.numpy import load_file, save_file

    head = load_file(str(bad / "head.safetensors"))
    save_file({**head, "head.kernel": np.zeros((7, 1), np.float32)}, str(bad / "head.safetensors"))
    with pytest.raises(CheckpointError, match=r"head.kernel has shape \(7, 1\).*d_model=64"):
        load_reward_model(bad)
    (bad / "head.safetensors").unlink()
    with pytest.raises(CheckpointError, match="head.safetensors is missing"):
        load_reward_model(bad)


def test_reward_model_reward_is_the_calibrated_score(saved):
    rm = saved["rm"]
    cfg = GRPOConfig(rewards=("reward_model",), reward_model=str(saved["path"]))
    got = REWARDS["reward_model"](PROMPTS, COMPLETIONS, config=cfg)
    want = np.array([_head_score(rm, p + c) for p, c in zip(PROMPTS, COMPLETIONS)])
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-(want - 0.37))), atol=1e-5)
    raw = REWARDS["reward_model"](PROMPTS, COMPLETIONS, config=dataclasses.replace(cfg, reward_model_output="score"))
    np.testing.assert_allclose(raw, want, atol=1e-4)
    assert got.dtype == np.float32 and got.shape == (3,)
    # an example's prefix is read where the policy read it, before the completion, whether the
    # collector's prompt text holds it (PrefixRL) or not (CAMEL's forced verdict was dropped)
    cut = [dict(prefix=c[:2]) for c in COMPLETIONS]
    rest = [c[2:] for c in COMPLETIONS]
    for prompts in ([p + e["prefix"] for p, e in zip(PROMPTS, cut)], PROMPTS):
        np.testing.assert_allclose(REWARDS["reward_model"](prompts, rest, config=cfg, examples=cut), got, atol=1e-6)


def test_a_rewritten_reward_model_is_read_again(saved, tmp_path):
    """The reward reads a directory once, but a directory saved over is read again."""
    path = tmp_path / "rm"
    rm = load_reward_model(saved["path"])
    save_reward_model(rm, path)
    cfg = GRPOConfig(rewards=("reward_model",), reward_model=str(path), reward_model_output="score")
    before = REWARDS["reward_model"](PROMPTS, COMPLETIONS, config=cfg)
    rm.head.bias[...] = rm.head.bias[...] + 1.5
    save_reward_model(rm, path, overwrite=True)
    after = REWARDS["reward_model"](PROMPTS, COMPLETIONS, config=cfg)
    np.testing.assert_allclose(after, before + 1.5, atol=1e-5)
    with pytest.raises(ValueError, match="is not a directory"):
        REWARDS["reward_model"](PROMPTS, COMPLETIONS, config=dataclasses.replace(cfg, reward_model=str(tmp_path / "x")))


def test_judge_reward_is_p_yes_from_the_verdict_logits(saved):
    judge = saved["judge"]
    cfg = GRPOConfig(rewards=("judge",), judge_model=str(saved["judge_path"]))
    got = REWARDS["judge"](PROMPTS, COMPLETIONS, config=cfg)
    tok = judge.tokenizer
    yes, no = tok.encode("Y")[0], tok.encode("N")[0]
    for p, c, g in zip(PROMPTS, COMPLETIONS, got):
        ids = np.asarray([tok.encode(f"Question: {p}\nAnswer: {c}\nCorrect: ", add_bos=True)], np.int32)
        logits = np.asarray(judge(ids).logits[0, -1], np.float64)
        assert g == pytest.approx(1 / (1 + np.exp(logits[no] - logits[yes])), abs=1e-5)
    # a PrefixRL example's prefix (in the prompt) is read as the start of the answer
    cut = [dict(prefix=c[:2]) for c in COMPLETIONS]
    prefixed = REWARDS["judge"]([p + e["prefix"] for p, e in zip(PROMPTS, cut)], [c[2:] for c in COMPLETIONS],
                                config=cfg, examples=cut)
    np.testing.assert_allclose(prefixed, got, atol=1e-6)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(rewards=("reward_model",)), "GRPOConfig.reward_model is None"),
        (dict(rewards=("judge",)), "GRPOConfig.judge_model is None"),
        (dict(reward_model_output="logit"), "reward_model_output='logit' is invalid"),
    ],
)
def test_grpo_config_names_the_model_reward_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**{"reward_weights": (1.0,), **fields})


def test_grpo_collector_scores_rollouts_with_the_reward_model(saved, tmp_path):
    """In a GRPO run the rollouts' rewards are the reward model's P(compliant) of exactly
    the prompt and completion the policy produced (weighted 2x, plus the verifier's 0/1)."""
    cfg = ExperimentConfig(
        model=jaxlm.ModelConfig.tiny(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=32),
        data=DataConfig(source=Arithmetic(digits=1), seq_len=16, batch_size=2),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0, schedule="constant"),
        trainer=TrainerConfig(steps=1, out_dir=str(tmp_path), progress=False, async_checkpoint=False),
        algorithm=GRPOConfig(num_generations=3, max_new_tokens=4, rewards=("reward_model", "verifier"),
                             reward_weights=(2.0, 1.0), reward_model=str(saved["path"])),
    )
    trainer = GRPOTrainer(cfg, initial_model(cfg), make_tokenizer("byte"))
    state = trainer.init_state()
    exp = trainer.collector(state.params, 0, jax.random.key(0))
    tok = make_tokenizer("byte")
    texts = [tok.decode(c[:n]) for c, n in zip(exp.rows["completion"], exp.rows["lengths"])]
    examples = [trainer.collector.examples(i) for i in range(2)]
    prompts = [e["prompt"] for e in examples for _ in range(3)]
    loaded = load_reward_model(saved["path"])
    p = 1 / (1 + np.exp(-(score_texts(loaded, [a + b for a, b in zip(prompts, texts)]) - 0.37)))
    verified = np.array([Arithmetic(digits=1).verify(e, t) for e, t in zip([e for e in examples for _ in range(3)], texts)])
    np.testing.assert_allclose(exp.rewards.ravel(), 2 * p + verified, atol=1e-5)
    assert exp.metrics["reward/reward_model"] == pytest.approx(p.mean(), abs=1e-5)
