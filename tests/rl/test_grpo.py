"""The GRPO core end to end on a tiny model: rollout rows, exact accumulation, config
errors, bit-identical resume, and the divergence stop."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Arithmetic
from jaxlm.models.config import ModelConfig
from trainers.config import ConfigError, ExperimentConfig, GRPOConfig, OptimizerConfig, TrainerConfig
from trainers.recipes import load_config
from trainers.loop import initial_model, make_tokenizer, train
from trainers.rl.environments import RPSConfig
from trainers.rl.loop import GRPOTrainer


def _cfg(tmp_path=None, adam_eps=1e-8, lr=1e-3, **algo):
    return ExperimentConfig(
        model=ModelConfig.tiny(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=32),
        data=DataConfig(source=Arithmetic(digits=1), seq_len=16, batch_size=4),
        optimizer=OptimizerConfig(lr=lr, warmup_steps=0, schedule="constant", eps=adam_eps),
        trainer=TrainerConfig(steps=4, out_dir=str(tmp_path or "runs/unused"), progress=False, save_every=2,
                              log_every=1, eval_generate=8, async_checkpoint=False),
        algorithm=GRPOConfig(**{"num_generations": 4, "max_new_tokens": 5, "mu": 2, "minibatches": 2, **algo}),
    )


@pytest.fixture(scope="module")
def trainer():
    cfg = _cfg()
    tok = make_tokenizer("byte")
    return GRPOTrainer(cfg, initial_model(cfg), tok)


@pytest.fixture(scope="module")
def experience(trainer):
    state = trainer.init_state()
    rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), 0)
    return state, trainer.collector(state.params, 0, rng)


def test_rollout_rows_mark_policy_tokens_and_match_the_sampler(trainer, experience):
    state, exp = experience
    rows = exp.rows
    R, T = rows["tokens"].shape
    assert R == 4 * 4 and T == 16
    P = T - 5
    assert not rows["loss_mask"][:, :P].any()  # prompt tokens are never targets
    np.testing.assert_array_equal(rows["loss_mask"][:, P:].sum(1), rows["lengths"])
    # the same prompt repeated G times per group
    np.testing.assert_array_equal(rows["tokens"][0, :P], rows["tokens"][3, :P])
    logp, _ = trainer.logprob_fn(state.params, {k: jnp.asarray(rows[k]) for k in ("tokens", "attend", "positions")})
    m = rows["loss_mask"]
    np.testing.assert_allclose(np.asarray(logp)[m], rows["sampler_logp"][m], atol=1e-4)


def test_advantages_reach_every_token_of_their_rollout(trainer, experience):
    state, exp = experience
    exp = dataclasses.replace(exp, rewards=np.arange(16, dtype=np.float32).reshape(4, 4) % 3)
    rows, _ = trainer.prepare(state, exp)
    adv = rows["advantages"]
    r = exp.rewards
    want = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(adv[:, 0], want.reshape(-1), rtol=1e-5)
    assert np.all(adv == adv[:, :1])


def test_update_is_exact_under_gradient_accumulation(experience):
    """One minibatch split into 2 micro-batches of unequal token counts gives the same update
    as the whole minibatch at once (token_mean: sums and counts added, divided once).
    Adam eps = 1 (lr = 1) keeps the step proportional to the gradient (about 0.1 g): with
    eps = 1e-8 a gradient entry near 0 becomes a step of about +-lr whatever its size, so
    float32 summation order alone could decide it (measured: 8e-7 apart at lr 1e-3, either
    path); this compares the gradients, not that rounding."""
    state, exp = experience
    tok = make_tokenizer("byte")
    outs = []
    for accum in (1, 2):
        cfg = _cfg(adam_eps=1.0, lr=1.0, mu=1, minibatches=1)
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, grad_accum=accum))
        tr = GRPOTrainer(cfg, initial_model(cfg), tok)
        rows = dict(exp.rows)
        rows["loss_mask"] = rows["loss_mask"].copy()
        rows["loss_mask"][::2, -3:] = False  # unequal lengths across the two micro-batches
        e = dataclasses.replace(exp, rows=rows, rewards=np.arange(16, dtype=np.float32).reshape(4, 4) % 3)
        st = tr.init_state()
        prepared, _ = tr.prepare(st, e)
        prepared["old_logp"] = prepared["old_logp"] - 0.05 * (np.arange(16)[:, None] % 3)  # ratios != 1
        new, metrics = tr.update(st, prepared, 0)
        outs.append((jax.device_get(new.params), metrics))
    for a, b in zip(jax.tree.leaves(outs[0][0]), jax.tree.leaves(outs[1][0])):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert outs[0][1]["loss"] == pytest.approx(outs[1][1]["loss"], rel=1e-5)


def test_per_token_metrics_are_weighted_by_tokens_and_absent_without_tokens(experience):
    """clip_frac / ratio_mean / kl are means over the iteration's policy tokens (minibatches
    of unequal token counts weighted by their counts); when the zero-variance filter leaves
    no token, they and the entropy are not reported (not a misleading 0)."""
    state, exp = experience
    cfg = _cfg(lr=1e-30, mu=1, minibatches=2, filter_zero_variance=True)  # params stay put
    tr = GRPOTrainer(cfg, initial_model(cfg), make_tokenizer("byte"))
    st = tr.init_state()
    rewards = np.arange(16, dtype=np.float32).reshape(4, 4) % 3
    rewards[1] = 0.7  # one constant group: its rows lose their tokens
    rows, prep = tr.prepare(st, dataclasses.replace(exp, rewards=rewards))
    m = rows["loss_mask"]
    assert not m[4:8].any() and m.any() and "entropy" in prep
    delta = 0.05 * (np.arange(16)[:, None] % 3)
    rows["old_logp"] = rows["old_logp"] - delta
    _, metrics = tr.update(st, rows, 0)
    want = np.exp(np.broadcast_to(delta, m.shape)[m]).mean()
    assert metrics["ratio_mean"] == pytest.approx(want, rel=1e-5)
    assert metrics["clip_frac"] == pytest.approx(np.mean(np.broadcast_to(delta, m.shape)[m] > np.log1p(0.2)), abs=1e-6)

    st = tr.init_state()
    flat, prep = tr.prepare(st, dataclasses.replace(exp, rewards=np.full((4, 4), 0.7, np.float32)))
    assert not flat["loss_mask"].any() and "entropy" not in prep
    _, metrics = tr.update(st, flat, 0)
    assert metrics["finite"] and not {"clip_frac", "ratio_mean", "kl"} & set(metrics)


def test_shared_prompt_forward_equals_the_per_row_forward(trainer, experience):
    """Each distinct prompt run once, its keys/values gathered into the rows (a resampled,
    repeated, shuffled selection as Q-PAS draws it): log-probs and parameter gradients equal
    one forward per row (float32)."""
    from flax import nnx

    from trainers.rl.rollout import row_logprobs, shared_prompts

    state, exp = experience
    rows = exp.rows
    idx = np.random.default_rng(0).choice(len(rows["tokens"]), size=12, replace=True)
    plain = {k: jnp.asarray(rows[k][idx]) for k in ("tokens", "attend", "positions")}
    shared = {**plain, "prompts": jax.tree.map(jnp.asarray, shared_prompts(rows, exp.prompt_block)),
              "prompt_index": jnp.asarray(rows["prompt_index"][idx])}
    weight = jnp.asarray(np.random.default_rng(1).normal(size=plain["tokens"].shape) * rows["loss_mask"][idx])

    def objective(params, batch):
        return jnp.sum(row_logprobs(nnx.merge(trainer.graphdef, params), batch) * weight)

    (v0, g0), (v1, g1) = (jax.jit(jax.value_and_grad(objective))(state.params, b) for b in (plain, shared))
    lp0 = row_logprobs(nnx.merge(trainer.graphdef, state.params), plain)
    lp1 = row_logprobs(nnx.merge(trainer.graphdef, state.params), shared)
    m = rows["loss_mask"][idx]
    np.testing.assert_allclose(np.asarray(lp1)[m], np.asarray(lp0)[m], atol=2e-6)
    assert float(v1) == pytest.approx(float(v0), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_shared_prompt_update_equals_the_per_row_update(experience):
    """Two epochs of two shuffled minibatches: the same parameters with and without it
    (Adam eps = 1, lr = 1: see the accumulation test)."""
    state, exp = experience
    tok = make_tokenizer("byte")
    finals = []
    for shared in (False, True):
        cfg = _cfg(adam_eps=1.0, lr=1.0, shared_prompt_forward=shared)
        tr = GRPOTrainer(cfg, initial_model(cfg), tok)
        e = dataclasses.replace(exp, rewards=np.arange(16, dtype=np.float32).reshape(4, 4) % 3)
        st = tr.init_state()
        prepared, _ = tr.prepare(st, e)
        assert ("prompts" in prepared) == shared
        new, _ = tr.update(st, prepared, 0)
        finals.append(jax.device_get(new.params))
    for a, b in zip(jax.tree.leaves(finals[0]), jax.tree.leaves(finals[1])):
        np.testing.assert_allclose(b, a, atol=1e-6)


def test_shared_prompts_refuses_rows_that_do_not_share_their_prompt(experience):
    from trainers.rl.rollout import shared_prompts

    _, exp = experience
    rows = {k: v.copy() for k, v in exp.rows.items()}
    rows["tokens"][1, exp.prompt_block - 1] += 1  # row 1 no longer continues prompt 0
    with pytest.raises(ValueError, match="shared_prompt_forward.*differ"):
        shared_prompts(rows, exp.prompt_block)


@pytest.mark.parametrize(
    "override, match",
    [
        ({"advantage": "gae"}, "GRPOConfig.advantage='gae' is invalid"),
        ({"num_generations": 1}, "num_generations=1 must be >= 2"),
        ({"rewards": ("verifier", "nope"), "reward_weights": (1.0, 1.0)}, "'nope'"),
        ({"reward_weights": (1.0, 2.0)}, "equal length"),
        ({"dual_clip": 0.5}, "dual_clip"),
        ({"qpas_alpha": -1.0}, r"qpas_alpha=-1.0 must be a finite number >= 0"),
        ({"qpas_alpha": float("inf")}, r"qpas_alpha=inf must be a finite number >= 0"),
        ({"qpas_beta": 1.5}, r"qpas_beta=1.5 must be in \[0, 1\]"),
        # NaN passes "< 0"-style checks; a negative adv_eps flipped the advantages' sign
        ({"adv_eps": -1.0}, r"adv_eps=-1.0 must be >= 0"),
        ({"adv_eps": float("nan")}, r"adv_eps=nan is invalid: must be a finite number"),
        ({"beta": float("nan")}, r"beta=nan is invalid: must be a finite number"),
        ({"tis_cap": float("nan")}, r"tis_cap=nan is invalid"),
        ({"dual_clip": float("nan")}, r"dual_clip=nan is invalid"),
        ({"temperature": float("inf")}, r"temperature=inf is invalid"),
        # settings nothing would read, or that train on nothing
        ({"rewards": ("verifier", "length_penalty"), "reward_weights": (0.0, 0.0)}, "at least one weight"),
        ({"turn_gamma": 0.9}, r"turn_gamma=0.9 is read only by advantage='turn_level'"),
        ({"environment": RPSConfig()}, r"environment .* read only by collector='rps_memory'"),
    ],
)
def test_bad_grpo_config_names_the_field(override, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**override)


def test_rollouts_must_divide_into_minibatches():
    with pytest.raises(ValueError, match="not divisible"):
        _cfg(num_generations=3, minibatches=5)


def test_override_of_an_rl_field_is_type_checked():
    cfg = load_config("grpo_arithmetic", ["algorithm.beta=0.04", "algorithm.kl_estimator=k3+"])
    assert cfg.algorithm.beta == 0.04 and cfg.algorithm.kl_estimator == "k3+"
    with pytest.raises(ConfigError):
        load_config("grpo_arithmetic", ["algorithm.mu=two"])


def test_resume_is_bit_identical(tmp_path):
    train(_cfg(tmp_path / "full", beta=0.05))
    part = _cfg(tmp_path / "part", beta=0.05)
    stopped = train(dataclasses.replace(part, trainer=dataclasses.replace(part.trainer, stop_after=2)))
    assert stopped.stopped_early and stopped.step == 2
    resumed = train(part)
    assert resumed.step == 4
    import jaxlm

    a = jax.tree.leaves(jaxlm.load_checkpoint(tmp_path / "full" / "model"))
    b = jax.tree.leaves(jaxlm.load_checkpoint(tmp_path / "part" / "model"))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    recs = [json.loads(l) for l in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert {"reward", "kl", "clip_frac", "entropy", "loss"} <= set(recs[0])
    assert (tmp_path / "full" / "curves.png").exists()


def test_chat_prompts_are_rendered_with_the_generation_prompt(trainer):
    """A chat example's prompt is its messages before the final assistant turn, through the
    tokenizer's chat format with the assistant's generation prompt."""
    tok = trainer.tokenizer
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "2+3="},
                {"role": "assistant", "content": "5"}]
    example = {"messages": messages, "answer": "5"}
    col = trainer.collector
    want = tok.apply_chat_template(messages[:2], add_generation_prompt=True)
    assert col.prompt_ids(example) == want
    assert col.prompt_text(example) == tok.apply_chat_template(messages[:2], add_generation_prompt=True,
                                                               tokenize=False)
    assert col.prompt_ids({"messages": messages[:2]}) == want  # no assistant turn: all of them
    with pytest.raises(ValueError, match="no message before its assistant turn"):
        col.prompt_ids({"messages": messages[2:]})
