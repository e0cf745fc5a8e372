"""CCC-GRPO (method card B.2): the swap-in CCC reward against a brute-force numpy reference,
the registered rewards, the long-tailed regression task, and the miniature comparison with
the point-wise reward -|error| on tiny models."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from jaxlm.data.regression import LongTailedRegression, parse_number
from trainers.rl.ccc import ccc, evaluate_regression, swap_in_ccc_rewards
from trainers.rl.registries import REWARDS


def lin_ccc(p, y):
    """Lin (1989), eq. for the sample CCC with population (1/n) moments, written out."""
    p, y = np.asarray(p, np.float64), np.asarray(y, np.float64)
    n = len(p)
    mp, my = p.sum() / n, y.sum() / n
    sp2 = ((p - mp) ** 2).sum() / n
    sy2 = ((y - my) ** 2).sum() / n
    spy = ((p - mp) * (y - my)).sum() / n
    return 2 * spy / (sp2 + sy2 + (mp - my) ** 2)


def brute_force_swap_in(pred, valid, target, r_min):
    """Build p^(i,k) explicitly for every rollout and score it (card B.2)."""
    B, G = pred.shape
    has_anchor = valid.any(1)
    anchor = np.array([pred[i][valid[i]].mean() if has_anchor[i] else np.nan for i in range(B)])
    out = np.full((B, G), r_min, np.float64)
    for i in range(B):
        for k in range(G):
            if not valid[i, k]:
                continue
            p = anchor.copy()
            p[i] = pred[i, k]
            out[i, k] = lin_ccc(p[has_anchor], target[has_anchor])
    return out


def test_ccc_matches_lin_formula_and_its_properties():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(2, 40))
        y = rng.gamma(1.5, 20.0, n)
        p = y * rng.uniform(0.3, 1.5) + rng.normal(0, rng.uniform(0.1, 30), n) + rng.normal(0, 10)
        assert ccc(p, y) == pytest.approx(lin_ccc(p, y), abs=1e-12)
    y = rng.normal(size=10)
    assert ccc(y, y) == pytest.approx(1.0)
    assert ccc(-y + 2 * y.mean(), y) == pytest.approx(-1.0)  # reflected about the mean
    assert ccc(y + 1.0, y) < np.corrcoef(y + 1.0, y)[0, 1]  # a shift costs CCC, not Pearson
    assert ccc(np.full(4, 3.0), np.full(4, 3.0)) == 1.0  # undefined 0/0: perfect agreement
    with pytest.raises(ValueError, match="one length"):
        ccc([1.0, 2.0], [1.0])


@pytest.mark.parametrize("seed", range(6))
def test_swap_in_rewards_equal_brute_force(seed):
    rng = np.random.default_rng(seed)
    B, G = int(rng.integers(2, 9)), int(rng.integers(2, 6))
    target = rng.gamma(1.0, 25.0, B) + rng.choice([0.0, 500.0])  # offsets test the centring
    pred = target[:, None] + rng.normal(0, 15, (B, G))
    valid = rng.random((B, G)) > 0.3
    valid[0] = False  # a group without an anchor leaves the batch
    valid[1, 0] = True
    pred[~valid] = rng.choice([np.nan, 1e9, -3.0])  # what invalid entries hold must not matter
    r_min = float(rng.choice([-1.0, -2.5]))
    got = swap_in_ccc_rewards(pred, valid, target, invalid_reward=r_min)
    want = brute_force_swap_in(pred, valid, target, r_min)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("wild", [1e9, 1e12, 1e15])
def test_one_huge_answer_leaves_its_groups_other_rewards_exact(wild):
    """A wild anchor (one rollout of a group answers 1e12) must not disturb the CCCs of the
    group's other rollouts: raw batch sums (S2 - a_i^2) cancelled to CCCs above 1."""
    for seed in range(5):
        rng = np.random.default_rng(seed)
        B, G = 5, 4
        target = rng.normal(50, 10, B)
        pred = target[:, None] + rng.normal(0, 3, (B, G))
        pred[0, 0] = wild
        valid = np.ones((B, G), bool)
        got = swap_in_ccc_rewards(pred, valid, target)
        want = brute_force_swap_in(pred, valid, target, -1.0)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)
        assert (np.abs(got) <= 1.0).all()


def test_swap_in_rewards_edge_cases():
    # every rollout valid, one group: the batch's targets are constant -> CCC 0 unless exact
    got = swap_in_ccc_rewards(np.array([[3.0, 5.0]]), np.ones((1, 2), bool), np.array([3.0]))
    np.testing.assert_array_equal(got, [[1.0, 0.0]])
    none = swap_in_ccc_rewards(np.zeros((3, 2)), np.zeros((3, 2), bool), np.arange(3.0), invalid_reward=-1.0)
    np.testing.assert_array_equal(none, -np.ones((3, 2)))
    # the group's rollouts share the rest of the batch: the anchors' own CCC is a group mean
    rng = np.random.default_rng(1)
    pred, y = rng.normal(50, 20, (8, 4)), rng.normal(50, 20, 8)
    r = swap_in_ccc_rewards(pred, np.ones_like(pred, bool), y)
    assert r.shape == (8, 4) and np.all(np.abs(r) <= 1)
    with pytest.raises(ValueError, match=r"pred \[B, G\]"):
        swap_in_ccc_rewards(pred, np.ones_like(pred, bool), y[:3])
    # a non-finite value is no perfect agreement: NaN from ccc, an error naming it from the rewards
    assert np.isnan(ccc([np.nan, 2.0, 3.0], [1.0, 2.0, 3.0])) and np.isnan(ccc([1.0, 2.0, 3.0], [1.0, 2.0, np.inf]))
    assert ccc([2.0, 2.0], [2.0, 2.0]) == 1.0
    bad_y = y.copy()
    bad_y[2] = np.nan
    with pytest.raises(ValueError, match=r"target of group 2 is nan; targets must be finite"):
        swap_in_ccc_rewards(pred, np.ones_like(pred, bool), bad_y)
    bad_pred = pred.copy()
    bad_pred[1, 3] = np.inf
    with pytest.raises(ValueError, match=r"valid prediction \(1, 3\) is inf"):
        swap_in_ccc_rewards(bad_pred, np.ones_like(pred, bool), y)
    valid = np.ones_like(pred, bool)
    valid[1, 3] = False  # marked invalid: anything may stand there
    assert swap_in_ccc_rewards(bad_pred, valid, y)[1, 3] == -1.0


def _columns(task, examples_per_group, G, order=None):
    examples = [e for e in examples_per_group for _ in range(G)]
    group = np.repeat(np.arange(len(examples_per_group)), G)
    if order is not None:
        examples, group = [examples[i] for i in order], group[order]
    return dict(examples=examples, group=group, num_generations=G, task=task)


def test_registered_rewards_reshape_flat_rollouts_to_groups():
    task = LongTailedRegression()
    exs = [task.example(i, "train") for i in range(5)]
    G = 3
    rng = np.random.default_rng(0)
    flat = [str(int(e["target"]) + int(d)) for e in exs for d in rng.integers(-20, 20, G)]
    flat[4] = "12a"  # invalid
    flat[6:9] = ["x", "", "?"]  # a group with no valid rollout
    cols = _columns(task, exs, G)
    pred = np.array([np.nan if parse_number(c) is None else parse_number(c) for c in flat]).reshape(5, G)
    target = np.array([e["target"] for e in exs])
    want = brute_force_swap_in(np.nan_to_num(pred), ~np.isnan(pred), target, -1.0).reshape(-1)
    np.testing.assert_allclose(REWARDS["ccc"](None, flat, **cols), want, atol=1e-6)
    # rollouts in any order (grouped by `group`): the same reward per rollout
    perm = rng.permutation(len(flat))
    shuffled = REWARDS["ccc"](None, [flat[i] for i in perm], **_columns(task, exs, G, perm))
    np.testing.assert_allclose(shuffled, want[perm], atol=1e-6)
    huge = REWARDS["ccc"](None, ["1" + "0" * 200] + flat[1:], **cols)  # absurd but finite
    assert np.isfinite(huge).all() and huge[0] < want[0]
    # the r_min of the config
    cfg = type("C", (), {"ccc_invalid_reward": -3.0})()
    assert REWARDS["ccc"](None, flat, **cols, config=cfg)[4] == -3.0
    np.testing.assert_array_equal(REWARDS["format"](None, flat, **cols), ~np.isnan(pred.reshape(-1)))
    err = np.abs(pred.reshape(-1) - np.repeat(target, G)) / task.error_scale
    np.testing.assert_allclose(REWARDS["neg_abs_error"](None, flat, **cols),
                               np.where(np.isnan(err), -1.0, -np.minimum(err, 1.0)), atol=1e-6)


def test_numeric_rewards_read_a_prefixrl_prefix_as_the_start_of_the_answer():
    """PrefixRL moves the answer's first tokens into the prompt: the numeric rewards parse
    prefix + completion, as the verifier does (they parsed the completion alone, so with
    prefix "4" and target 42 the exact completion "2" scored below "5")."""
    task = LongTailedRegression()
    exs = [dict(task.example(i, "train"), target=t) for i, t in enumerate((42.0, 17.0))]
    G = 2
    prefixed = [dict(e, prefix=str(int(e["target"]))[0]) for e in exs]
    completions = ["2", "5", "7", "x"]  # after the prefix: 42, 45 | 17, "1x"
    full = ["42", "45", "17", "1x"]
    for name in ("ccc", "neg_abs_error", "format", "crps_loo"):
        got = REWARDS[name](None, completions, **_columns(task, prefixed, G))
        want = REWARDS[name](None, full, **_columns(task, exs, G))
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert REWARDS["neg_abs_error"](None, completions, **_columns(task, prefixed, G))[0] == 0.0


def _crps_brute(samples, y):
    """CRPS as the integral of (F(x) - 1[x >= y])^2 over x (F the ensemble's step CDF), on a
    fine grid: the definition, independent of the pairwise formula."""
    s = np.sort(np.asarray(samples, np.float64))
    lo, hi = min(s[0], y) - 1.0, max(s[-1], y) + 1.0
    x = np.linspace(lo, hi, 400_001)
    F = np.searchsorted(s, x, side="right") / len(s)
    return float(np.sum((F - (x >= y)) ** 2) * (x[1] - x[0]))


def test_loo_crps_reward_matches_brute_force():
    """The card's related reward (B.2, arXiv 2605.20740): every rollout's leave-one-out CRPS
    credit against explicit sets scored by the CRPS integral; invalid answers get -1 and leave
    the set; a lone valid answer gets 0; the registered reward regroups flat rollouts."""
    from trainers.rl.ccc import crps, loo_crps_rewards

    rng = np.random.default_rng(3)
    for _ in range(20):
        s, y = rng.normal(size=rng.integers(1, 6)) * 5, float(rng.normal() * 5)
        assert crps(s, y) == pytest.approx(_crps_brute(s, y), abs=1e-3)
    pred = np.round(rng.normal(size=(5, 4)) * 10, 1)
    valid = np.ones_like(pred, bool)
    valid[1, 2] = False
    valid[3, 1:] = False  # one valid answer left
    valid[4] = False
    target = rng.normal(size=5) * 10
    got = loo_crps_rewards(pred, valid, target, scale=2.0)
    for i in range(5):
        S = [k for k in range(4) if valid[i, k]]
        for k in range(4):
            if not valid[i, k]:
                want = -1.0
            elif len(S) < 2:
                want = 0.0
            else:
                rest = [pred[i, j] for j in S if j != k]
                want = (crps(rest, target[i]) - crps(pred[i, S], target[i])) / 2.0
            assert got[i, k] == pytest.approx(want, abs=1e-9), (i, k)
    # an answer at the target earns credit; a far outlier in a good ensemble loses it
    r = loo_crps_rewards(np.array([[10.0, 11.0, 9.0, 40.0]]), np.ones((1, 4), bool), np.array([10.0]))
    assert r[0, 0] > 0 > r[0, 3]
    task = LongTailedRegression()
    exs = [task.example(i, "train") for i in range(3)]
    flat = [str(int(e["target"]) + d) for e in exs for d in (0, 3, -7)]
    flat[1] = "x"
    pred_g = np.array([np.nan if parse_number(c) is None else parse_number(c) for c in flat]).reshape(3, 3)
    want = loo_crps_rewards(np.nan_to_num(pred_g), ~np.isnan(pred_g), np.array([e["target"] for e in exs]),
                            scale=task.error_scale).reshape(-1)
    np.testing.assert_allclose(REWARDS["crps_loo"](None, flat, **_columns(task, exs, 3)), want, atol=1e-6)


def test_grpo_config_names_the_ccc_fields():
    from trainers.config import GRPOConfig

    c = GRPOConfig(rewards=("ccc", "format"), reward_weights=(1.0, 0.5), ccc_invalid_reward=-2.0)
    assert c.ccc_invalid_reward == -2.0
    with pytest.raises(ValueError, match="GRPOConfig.rewards"):
        GRPOConfig(rewards=("cc",), reward_weights=(1.0,))
    for field in ("ccc_invalid_reward", "cf_quality"):
        with pytest.raises(ValueError, match=f"GRPOConfig.{field}=nan is invalid: must be a finite number"):
            GRPOConfig(**{field: float("nan")})
    with pytest.raises(ValueError, match=r"GRPOConfig.reward_weights=\(nan,\) must be finite numbers"):
        GRPOConfig(reward_weights=(float("nan"),))


# -- the task --------------------------------------------------------------------------
def test_huge_answers_keep_rewards_and_advantages_finite():
    """A parsed 60-digit answer is clipped (`PRED_LIMIT`) before the float32 rewards: the
    group's rewards and GRPO advantages stay finite and the outlier still ranks last."""
    from trainers.rl.advantages import ADVANTAGES

    task = LongTailedRegression()
    exs = [dict(task.example(0, "train"), target=4.0)]
    flat = ["3", "4", "5", "1" + "0" * 60]
    for name in ("ccc", "crps_loo"):
        r = REWARDS[name](None, flat, **_columns(task, exs, 4))
        adv = np.asarray(ADVANTAGES["grpo"](r.reshape(1, 4)))
        assert np.isfinite(r).all() and np.isfinite(adv).all(), name
    assert r[3] < 0 < r[:3].min() and adv[0, 3] < 0  # crps_loo: the outlier loses its group's credit


def test_evaluate_regression_with_no_parsed_answer(monkeypatch):
    """An untrained model may parse nothing: every answer is invalid, CCC is nan, no error."""
    import types

    import jaxlm

    task = LongTailedRegression()
    exs = [task.example(i, "eval") for i in range(6)]
    monkeypatch.setattr(jaxlm, "generate", lambda *a, **k: types.SimpleNamespace(texts=["x?"] * len(exs)))
    out = evaluate_regression(None, task, exs)
    assert out["invalid"] == 1.0 and out["accuracy"] == 0.0 and np.isnan(out["ccc"])
    assert all(out[f"mae_{task.bucket(e)}"] == task.error_scale for e in exs)


def test_long_tailed_regression_task():
    task = LongTailedRegression()
    p = task.bin_frequencies()
    assert p.sum() == pytest.approx(1.0) and p[0] / p[-1] == pytest.approx(task.imbalance)
    train = [task.example(i, "train") for i in range(3000)]
    counts = np.bincount([e["bin"] for e in train], minlength=task.n_bins) / len(train)
    np.testing.assert_allclose(counts, p, atol=0.02)
    buckets = {task.bucket(e) for e in train}
    assert buckets == {"many", "medium", "few"}
    evals = [task.example(i, "eval") for i in range(1000)]
    assert {e["prompt"] for e in evals}.isdisjoint({e["prompt"] for e in train})
    eval_counts = np.bincount([e["bin"] for e in evals], minlength=task.n_bins) / len(evals)
    assert eval_counts.min() > 0.03  # balanced held-out bins (the train tail is 0.4%)
    for e in train[:50]:  # the target is a function of the text
        assert float(e["completion"]) == e["target"]
        assert task.verify(e, e["completion"]) == 1.0 and task.verify(e, " " + e["completion"] + "\n") == 1.0
        assert task.verify(e, str(int(e["target"]) + 1)) == 0.0
    same = [e for e in train if e["prompt"][:2] == train[0]["prompt"][:2]]
    assert len({e["target"] for e in same}) == 1
    assert task.parse("12") == 12.0 and task.parse("-2.5") == -2.5 and task.parse("12a") is None
    assert task.abs_error(train[0], "x") != task.abs_error(train[0], "x")  # nan
    assert task.chance_accuracy() == pytest.approx(0.01)
    assert task.example(7, "train") == task.example(7, "train")
    with pytest.raises(ValueError, match="imbalance"):
        LongTailedRegression(imbalance=0.5)
    with pytest.raises(ValueError, match="few_below"):
        LongTailedRegression(few_below=0.5, many_above=0.2)


def test_held_out_bins_follow_their_distribution_exactly():
    """Uniform held-out bins (DIR's balanced test set), or the training frequencies with
    ``balanced_eval=False``: chi-square against the stated distribution. Redrawing the bin
    with each draw weighted bins by their share of eval-hashed prompts (0.65x-1.35x)."""
    from scipy import stats

    for task in (LongTailedRegression(), LongTailedRegression(balanced_eval=False, seed=3)):
        n = 6000
        counts = np.bincount([task.example(i, "eval")["bin"] for i in range(n)], minlength=task.n_bins)
        want = np.full(task.n_bins, 1 / task.n_bins) if task.balanced_eval else task.bin_frequencies()
        assert stats.chisquare(counts, want * n).pvalue > 1e-3, counts
    tiny = LongTailedRegression(bin_width=2, noise_letters=0)  # 20 prompts: most bins have no held-out one
    held_out = [tiny.example(i, "eval") for i in range(20)]
    assert {e["prompt"] for e in held_out}.isdisjoint({tiny.example(i, "train")["prompt"] for i in range(200)})


def test_task_is_a_config_source():
    from trainers.recipes import load_config

    cfg = load_config("ccc_grpo", ["data.source.imbalance=50"])
    assert isinstance(cfg.data.source, LongTailedRegression) and cfg.data.source.imbalance == 50
    assert cfg.algorithm.rewards == ("ccc", "format")
    base = load_config("ccc_grpo_mae")
    assert base.algorithm.rewards == ("neg_abs_error", "format")
    assert dataclasses.replace(base.algorithm, rewards=cfg.algorithm.rewards) == cfg.algorithm


# -- the miniature: CCC-GRPO vs the point-wise reward ----------------------------------
RL_SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def miniature(tmp_path_factory):
    """SFT (`configs/ccc_sft.py`) once, then GRPO from it with rewards (ccc, format) and
    (neg_abs_error, format) (`configs/ccc_grpo.py`, `configs/ccc_grpo_mae.py`: 30
    iterations of 256 prompts x 8 samples) for each of `RL_SEEDS`, and the exact-match
    verifier for the first; the arms share seed and prompts. Greedy evaluation on 400
    balanced held-out examples. ``results[arm][seed]``."""
    import time

    import jax

    from trainers.recipes import load_config
    from trainers.loop import initial_model, make_tokenizer, train
    from trainers.rl.loop import GRPOTrainer

    t0 = time.time()
    sft_dir = tmp_path_factory.mktemp("ccc_sft")
    train(load_config("ccc_sft", [
        f"trainer.out_dir={sft_dir}", "trainer.progress=false", "trainer.eval_generate=0",
        "trainer.async_checkpoint=false",
    ]))
    tokenizer = make_tokenizer("byte")
    results, compiled = {"ccc": {}, "neg_abs_error": {}, "verifier": {}}, None
    runs = [(arm, seed) for seed in RL_SEEDS for arm in ("ccc", "neg_abs_error")] + [("verifier", RL_SEEDS[0])]
    for arm, seed in runs:
        cfg = load_config("ccc_grpo", [f"init_from={sft_dir / 'model'}", f"trainer.seed={seed}"])
        rewards = {"ccc": ("ccc", "format"), "neg_abs_error": ("neg_abs_error", "format"),
                   "verifier": ("verifier", "format")}[arm]  # verifier: plain GRPO, exact match as reward
        cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, rewards=rewards))
        task = cfg.data.source
        examples = [task.example(i, "eval") for i in range(400)]
        trainer = GRPOTrainer(cfg, initial_model(cfg), tokenizer)
        if compiled is None:
            results["sft"] = evaluate_regression(nnx.merge(trainer.graphdef, trainer.params), task, examples, tokenizer)
            compiled = (cfg, trainer.step_fn, trainer.logprob_fn)
        else:  # the arms differ only in their rewards and seeds: reuse the compiled update
            assert dataclasses.replace(cfg.algorithm, rewards=compiled[0].algorithm.rewards) == compiled[0].algorithm
            trainer.step_fn, trainer.logprob_fn = compiled[1], compiled[2]
        state = jax.device_put(trainer.init_state(), jax.devices()[0])  # committed: no recompiles
        for k in range(cfg.trainer.steps):
            state, _, _ = trainer.iteration(state, k)
        results[arm][seed] = evaluate_regression(nnx.merge(trainer.graphdef, state.params), task, examples, tokenizer)
    results["seconds"] = time.time() - t0

    def show(r):
        return {m: round(x, 3) for m, x in r.items()}

    print({"sft": show(results["sft"]), "seconds": round(results["seconds"]),
           **{f"{arm}/{seed}": show(r) for arm in ("ccc", "neg_abs_error", "verifier")
              for seed, r in results[arm].items()}})
    return results


@pytest.mark.slow
def test_miniature_grpo_improves_on_the_sft_start(miniature):
    """The GRPO core in miniature, with the plain exact-match verifier as the reward: the
    held-out error on the tail drops by more than a quarter and exact-match accuracy does
    not drop (the answers move closer, not exactly onto the target; docs/rl.md)."""
    sft, r = miniature["sft"], miniature["verifier"][RL_SEEDS[0]]
    assert r["mae_few"] < 0.75 * sft["mae_few"], (r, sft)
    for arm in ("ccc", "neg_abs_error", "verifier"):
        for seed, res in miniature[arm].items():
            assert res["accuracy"] >= sft["accuracy"], (arm, seed, res, sft)


@pytest.mark.slow
def test_miniature_both_rewards_fix_the_tail_without_hurting_the_head(miniature):
    sft = miniature["sft"]
    assert sft["mae_few"] > 5.0 and sft["mae_many"] < 1.0, sft  # SFT leaves a long-tail error
    for arm in ("ccc", "neg_abs_error"):
        for seed, r in miniature[arm].items():
            assert r["mae_few"] < 0.75 * sft["mae_few"], (arm, seed, r, sft)
            assert r["ccc"] > sft["ccc"] + 0.2, (arm, seed, r, sft)
            assert r["mae_many"] < 1.0 and r["invalid"] < 0.02, (arm, seed, r)


# Kept (not deleted, not loosened) so the suite records the paper's claim and how weakly it
# holds; non-strict because it passes for some RL seeds and not others (of 0, 1, 2 it passes all).
@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason=(
    "the paper's claim holds only on average in this miniature: at the recipe's 256 prompts "
    "per iteration the swap-in CCC reward beat -|error| in 13 of 20 RL seeds (7/10 in seeds "
    "0-9, 6/10 in seeds 10-19; mean few-shot MAE 6.65 vs 7.69, paired t = -1.7; seed 3 fails), "
    "and in 3 of 10 at 32 prompts (docs/rl.md, CCC-GRPO)"
))
def test_miniature_ccc_reward_beats_pointwise_on_few_shot_or_ccc(miniature):
    """The paper's claim (card B.2): the swap-in CCC reward beats -|error| on the few-shot
    bucket's error or on CCC, in each RL seed, with the recipe's 256-prompt batches. After
    RL the tail's error is a pull toward the head (negative ``bias_few``)."""
    for seed in RL_SEEDS:
        c, b = miniature["ccc"][seed], miniature["neg_abs_error"][seed]
        assert c["mae_few"] < b["mae_few"] or c["ccc"] > b["ccc"], (seed, c, b)
        assert c["bias_few"] < 0 and b["bias_few"] < 0, (seed, c, b)
