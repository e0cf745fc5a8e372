"""PrefixRL (method card B.1, `trainers.rl.prefix`).

- On real rollout rows the prefix is context: loss_mask 0, and neither the loss nor its
  gradient depends on ``old_logp`` or the advantage there (no loss, no importance ratio);
  the loss equals a numpy PPO-clip over the completion tokens only.
- Cut points and the band choice against hand-computed tables.
- The miniature (`configs/prefix_rl.py`): sorting 6 digits with a base SFT'd on 2-5 digits
  (`configs/prefix_rl_base.py`). The base never solves the problems (pass@16 = 0 on all 64),
  so the traces are the reference solutions (another source). Plain GRPO on the same
  problems gets reward 0 in every iteration and never moves; PrefixRL gets reward > 0, and
  its unprefixed held-out accuracy rises from 0 (back-generalisation). In this miniature the
  rise needs the card's optional recalibration (a curriculum toward shorter prefixes):
  with the cuts fixed at the base's choice it stays 0 (measured; see docs/rl.md).
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlm
from configs.prefix_rl_base import write_data
from jaxlm.data.pipeline import ExampleSource
from trainers.config import ConfigError, GRPOConfig, PrefixConfig
from trainers.recipes import load_config
from jaxlm.eval import task_accuracy
from trainers.loop import make_tokenizer, train
from trainers.rl import prefix as prefix_mod
from trainers.rl.collectors import COLLECTORS, SingleTurnCollector
from trainers.rl.loop import GRPOTrainer
from trainers.rl.prefix import (
    PrefixRLCollector,
    choose_cut,
    choose_prefixes,
    clean_cut,
    cut_points,
    pass_rates,
    sampling_of,
)
from trainers.rl.step import make_rl_loss

TOK = make_tokenizer("byte")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The recipe's base: 300 SFT steps on sorting 2-5 digits (~30 s on 2 CPU cores)."""
    out = tmp_path_factory.mktemp("prefix_base")
    data = write_data(str(out / "sorting_2to5.jsonl"))
    train(load_config("prefix_rl_base", [
        f"data.source.path={data}", f"trainer.out_dir={out}", "trainer.progress=false",
        "trainer.async_checkpoint=false",
    ]))
    return str(out / "model")


def _cfg(base, *overrides):
    return load_config("prefix_rl", [f"init_from={base}", "trainer.progress=false", *overrides])


def _fresh_state(trainer):
    """The trainer's initial state on copies of its parameters (the update donates the state),
    as committed arrays (else the step compiles twice)."""
    state = trainer.init_state()
    return jax.device_put(state.replace(params=jax.tree.map(jnp.copy, state.params)), jax.devices()[0])


def test_prefix_tokens_have_no_loss_and_no_ratio(base):
    cfg = _cfg(base, "data.batch_size=4", "algorithm.prefix.problems=8", "algorithm.prefix.trace_source=reference",
               "algorithm.prefix.band_lo=0.0", "algorithm.prefix.band_hi=1.0")
    trainer = GRPOTrainer(cfg, jaxlm.load_model(base), TOK)
    col = trainer.collector
    assert isinstance(col, PrefixRLCollector) and len(col.prefixed) == 8  # band [0, 1]: every problem
    state = _fresh_state(trainer)
    exp = col(state.params, 0, jax.random.key(0))
    rows, _ = trainer.prepare(state, exp)
    R, T = rows["tokens"].shape
    G, P = cfg.algorithm.num_generations, cfg.data.seq_len - cfg.algorithm.max_new_tokens
    in_prefix = np.zeros((R, T), bool)
    for r in range(R):
        ex = col._prefixed(r // G)
        n = len(ex["prefix_ids"])
        problem = TOK.encode(ex["problem_prompt"], add_bos=True)
        assert 0 < n and ex["prompt"] == ex["problem_prompt"] + ex["prefix"] == TOK.decode(problem + ex["prefix_ids"])
        # the open assistant turn: problem, then the prefix, then the completion (no EOS between)
        assert rows["tokens"][r, P - n - len(problem):P].tolist() == problem + ex["prefix_ids"]
        in_prefix[r, P - n:P] = True
        done = rows["lengths"][r]
        text = TOK.decode(rows["completion"][r, :done])
        assert exp.rewards.reshape(-1)[r] == col.task.verify(ex, ex["prefix"] + text)  # prefix + completion scored
    assert not rows["loss_mask"][in_prefix].any() and not rows["loss_mask"][:, :P].any()
    assert (rows["sampler_logp"][in_prefix] == 0).all() and (rows["old_logp"][in_prefix] == 0).all()

    rng = np.random.default_rng(0)
    m = rows["loss_mask"]
    old = rows["old_logp"] + np.where(m, rng.normal(0, 0.3, (R, T)), 0).astype(np.float32)  # ratios != 1, some clipped
    adv = rng.normal(size=(R, T)).astype(np.float32)  # non-zero everywhere, the prefix included
    batch = {k: jnp.asarray(rows[k]) for k in ("tokens", "attend", "positions", "loss_mask", "sampler_logp")}
    batch["weights"] = jnp.ones(R)
    loss_fn = make_rl_loss(trainer.graphdef, cfg.algorithm, completion_norm=float(cfg.algorithm.max_new_tokens))

    def loss(params, old_logp, advantages):
        total, (count, _) = loss_fn(params, {**batch, "old_logp": old_logp, "advantages": advantages})
        return total / count

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    value, (g_params, g_old, g_adv) = grad(state.params, jnp.asarray(old), jnp.asarray(adv))
    g_old, g_adv = np.asarray(g_old), np.asarray(g_adv)
    assert (g_old[in_prefix] == 0).all() and (g_adv[in_prefix] == 0).all()  # no ratio, no weight
    assert np.abs(g_old[m]).max() > 0 and np.abs(g_adv[m]).max() > 0

    old2 = np.where(in_prefix, rng.normal(0, 5, (R, T)), old).astype(np.float32)
    adv2 = np.where(in_prefix, rng.normal(0, 5, (R, T)), adv).astype(np.float32)
    value2, (g_params2, _, _) = grad(state.params, jnp.asarray(old2), jnp.asarray(adv2))
    assert float(value2) == float(value)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), g_params, g_params2)
    completion = np.argwhere(m)[0]
    old3 = old.copy()
    old3[tuple(completion)] -= 1.0
    assert float(grad(state.params, jnp.asarray(old3), jnp.asarray(adv))[0]) != float(value)

    # numpy PPO-clip (eps 0.2), token mean over the completion tokens only
    logp = np.asarray(trainer.logprob_fn(state.params, {k: batch[k] for k in ("tokens", "attend", "positions")})[0])
    ratio = np.exp(np.clip(logp - old, -20, 20))
    tok_loss = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.2))
    np.testing.assert_allclose(float(value), tok_loss[m].sum() / m.sum(), rtol=2e-5)


def test_cut_points_and_band_choice_by_hand(monkeypatch):
    assert cut_points(11, (0.2, 0.4, 0.6, 0.8)) == [2, 4, 7, 9]  # round(2.2, 4.4, 6.6, 8.8)
    assert cut_points(3, (0.1, 0.5, 0.9)) == [2]  # 0 and the whole trace are no prefix
    assert choose_cut([2, 4, 7, 9], [0.0, 0.1, 0.45, 0.9], 0.2, 0.8) == 7  # the one in [0.2, 0.8]
    assert choose_cut([2, 4, 7, 9], [0.3, 0.35, 0.6, 0.9], 0.2, 0.8) == 7  # |0.6-0.5| < |0.35-0.5|
    assert choose_cut([2, 4], [0.6, 0.4], 0.2, 0.8) == 2  # tie: the shorter prefix
    assert choose_cut([3, 7], [3 / 10, 7 / 10], 0.2, 0.8) == 3  # a tie up to float error too
    assert choose_cut([3, 7], [0.55, 0.45], 0.2, 0.8) == 3
    assert choose_cut([3], [0.2], 0.2, 0.8) == 3  # edges are in the band
    assert choose_cut([2, 4], [0.1, 0.95], 0.2, 0.8) is None
    assert choose_cut([2, 4, 7], [0.1, 0.3, 0.5], 0.05, 0.5) == 4  # centre 0.275

    problems = [{"prompt": "sort 3 1 2:", "completion": "1 2 3", "values": [3, 1, 2]},
                {"prompt": "sort 5 4:", "completion": "4 5", "values": [5, 4]}]
    pool = {0: [TOK.encode("1 2 3")], 1: [TOK.encode("4 5")]}
    table = {("sort 3 1 2:", "1 "): 0.1, ("sort 3 1 2:", "1 2"): 0.45, ("sort 3 1 2:", "1 2 "): 0.7,
             ("sort 5 4:", "4"): 0.9, ("sort 5 4:", "4 "): 1.0}

    def fake_pass_rates(policy, task, probs, prefixes, n, spec, rng):
        return np.asarray([table[(e["prompt"], TOK.decode(p))] for e, p in zip(probs, prefixes)])

    monkeypatch.setattr(prefix_mod, "pass_rates", fake_pass_rates)
    spec = prefix_mod.Sampling(TOK, 32, 8)
    chosen, stats = choose_prefixes(None, None, problems, pool, fractions=(0.4, 0.6, 0.8), band_lo=0.2, band_hi=0.8,
                                    n=8, spec=spec, rng=None)
    assert len(chosen) == 1 and stats["prefixed"] == 1 and stats["with_trace"] == 2  # problem 1: none in band
    c = chosen[0]
    assert c["prompt"] == "sort 3 1 2:1 2" and c["prefix"] == "1 2" and c["prefix_ids"] == TOK.encode("1 2")
    assert c["problem_prompt"] == "sort 3 1 2:" and c["pass_rate"] == 0.45 and c["prefix_fraction"] == 3 / 5
    # a cut inside a multi-byte character is no candidate: "café" is 5 bytes, the cut at 4 splits "é"
    trace = TOK.encode("café")
    assert [h for h in range(1, 5) if clean_cut(TOK, trace, h)] == [1, 2, 3]
    seen = []
    monkeypatch.setattr(prefix_mod, "pass_rates",
                        lambda policy, task, probs, prefixes, *a: seen.extend(prefixes) or np.full(len(prefixes), 0.5))
    chosen, _ = choose_prefixes(None, None, [{"prompt": "q:", "completion": "café"}], {0: [trace]},
                                fractions=(0.6, 0.8), band_lo=0.2, band_hi=0.8, n=8, spec=spec, rng=None)
    assert seen == [trace[:3]] and chosen[0]["prefix"] == "caf"  # round(0.8 * 5) = 4 splits "é": dropped
    # a cut whose prefixed prompt overflows the prompt block is no candidate (it crashed the
    # whole calibration): BOS + "q:" is 3 tokens, block 5 takes prefixes of at most 2
    seen.clear()
    chosen, stats = choose_prefixes(None, None, [{"prompt": "q:", "completion": "abcd"}], {0: [TOK.encode("abcd")]},
                                    fractions=(0.25, 0.5, 0.75), band_lo=0.2, band_hi=0.8, n=8,
                                    spec=prefix_mod.Sampling(TOK, 5, 8), rng=None)
    assert seen == [TOK.encode("a"), TOK.encode("ab")] and stats["cuts_over_prompt_block"] == 1


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="band_lo"):
        PrefixConfig(band_lo=0.9, band_hi=0.5)
    with pytest.raises(ValueError, match="fractions"):
        PrefixConfig(fractions=(0.5, 1.0))
    with pytest.raises(ValueError, match="trace_source"):
        PrefixConfig(trace_source="oracle")
    with pytest.raises(ValueError, match="pass_rate_samples"):
        PrefixConfig(pass_rate_samples=0)
    with pytest.raises(ValueError, match="recalibrate_every"):
        PrefixConfig(recalibrate_every=-1)
    PrefixConfig(trace_source="reference", pool_samples=0)  # no rejection sampling: no budget needed
    other = sorted(k for k in COLLECTORS if k != "single_turn")
    if other:  # prefixed problems are single-turn prompts
        with pytest.raises(ValueError, match="collector='single_turn'"):
            GRPOConfig(collector=other[0], prefix=PrefixConfig())
    with pytest.raises(ConfigError, match="band_lo"):
        load_config("prefix_rl", ["algorithm.prefix.band_lo=0.9"])
    assert load_config("prefix_rl", ["algorithm.prefix.band_lo=0.1"]).algorithm.prefix.band_lo == 0.1


@pytest.fixture(scope="module")
def miniature(base):
    """PrefixRL and plain GRPO, same trainer (update, seed, iterations) and the same 64 hard
    problems; only the collector differs. Unprefixed held-out accuracy before and after."""
    t0 = time.time()
    cfg = _cfg(base)
    task, a = cfg.data.source, cfg.algorithm
    trainer = GRPOTrainer(cfg, jaxlm.load_model(base), TOK)  # builds the pool and the prefixes
    prefix_rl = trainer.collector
    problems = prefix_rl.problems
    plain_cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(a, prefix=None))
    plain = SingleTurnCollector(plain_cfg, trainer.graphdef, TOK, examples=lambda i: problems[i % len(problems)])
    held_out = [ExampleSource(task, "eval")[i] for i in range(64)]
    spec = sampling_of(cfg, TOK)

    def unprefixed(params):
        greedy = task_accuracy(nnx.merge(trainer.graphdef, params), held_out, task.verify, tokenizer=TOK,
                               max_new_tokens=a.max_new_tokens, batch_size=64).accuracy
        sampled = pass_rates((trainer.graphdef, params), task, held_out, [[]] * len(held_out), 16, spec,
                             jax.random.key(1)).mean()
        return {"greedy": greedy, "sampled": float(sampled)}

    def run(collector):
        trainer.collector = collector
        state = _fresh_state(trainer)
        rewards, fractions = [], []
        for k in range(cfg.trainer.steps):
            state, m, _ = trainer.iteration(state, k)
            rewards.append(m["reward"])
            fractions.append(m.get("prefix/fraction"))
        return state.params, rewards, fractions

    out = {"base": unprefixed(trainer.params), "pool": prefix_rl.pool, "problems": problems,
           "first_calibration": dict(prefix_rl.calibration)}
    params, out["prefix_rewards"], out["prefix_fractions"] = run(prefix_rl)
    out["prefix"] = unprefixed(params)
    params, out["plain_rewards"], _ = run(plain)
    out["plain_moved"] = any(jax.tree.leaves(jax.tree.map(lambda x, y: bool((np.asarray(x) != np.asarray(y)).any()),
                                                          params, trainer.params)))
    out["seconds"] = time.time() - t0
    print({k: v for k, v in out.items() if k not in ("pool", "problems")})
    return out


@pytest.mark.slow
def test_miniature_base_cannot_solve_the_hard_problems(miniature):
    # pass@16 = 0 on every problem: the pool holds only the reference traces (another source)
    assert all(miniature["pool"][i] == [TOK.encode(e["completion"])] for i, e in enumerate(miniature["problems"]))
    assert miniature["base"]["greedy"] == 0 and miniature["base"]["sampled"] == 0


@pytest.mark.slow
def test_miniature_plain_grpo_gets_no_reward_prefix_rl_does(miniature):
    assert miniature["plain_rewards"] == [0.0] * len(miniature["plain_rewards"])
    assert not miniature["plain_moved"]  # every group ties at 0: no advantage, no update
    assert min(miniature["prefix_rewards"]) > 0 and np.mean(miniature["prefix_rewards"]) > 0.2
    # the curriculum: recalibration moves the cuts toward shorter prefixes as the policy improves
    f = miniature["prefix_fractions"]
    assert np.mean(f[-8:]) < np.mean(f[:8])


@pytest.mark.slow
def test_miniature_back_generalisation_to_unprefixed_problems(miniature):
    """Trained only on prefixed problems, the policy now solves some unprefixed held-out ones."""
    assert miniature["prefix"]["greedy"] >= 3 / 64  # base: 0 of 64 (seeds 0-4: 5-16 of 64)
    assert miniature["prefix"]["sampled"] >= 0.02  # base: 0 of 1024 samples (seeds 0-4: 0.04-0.14)


@pytest.mark.slow  # the harness resume is checked by tests/trainers/test_loop.py and tests/rl/test_grpo.py
def test_resume_between_recalibrations_is_bit_identical(base, tmp_path):
    """The chosen cuts travel in the checkpoint: a run stopped at iteration 3 (cuts chosen at
    iteration 2, recalibrate_every=2) and resumed ends with the same parameters as an
    uninterrupted run, and both recalibrated at 2 and 4."""
    common = ["trainer.steps=5", "trainer.save_every=1", "trainer.eval_every=0", "trainer.log_every=1",
              "trainer.async_checkpoint=false", "data.batch_size=4", "algorithm.num_generations=4",
              "algorithm.prefix.problems=16", "algorithm.prefix.trace_source=reference",
              "algorithm.prefix.pass_rate_samples=4", "algorithm.prefix.recalibrate_every=2",
              "algorithm.prefix.band_lo=0", "algorithm.prefix.band_hi=1"]  # any cut: this tests resume
    train(_cfg(base, f"trainer.out_dir={tmp_path / 'full'}", *common))
    part = [f"trainer.out_dir={tmp_path / 'part'}", *common]
    assert train(_cfg(base, *part, "trainer.stop_after=3")).stopped_early
    assert train(_cfg(base, *part)).step == 5
    a = jax.tree.leaves(jaxlm.load_checkpoint(tmp_path / "full" / "model"))
    b = jax.tree.leaves(jaxlm.load_checkpoint(tmp_path / "part" / "model"))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
