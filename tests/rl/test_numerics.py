"""The RL registries against independent numpy references (TRL/verl/Tunix formulas)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from trainers.rl.advantages import ADVANTAGES, returns_to_go
from trainers.rl.aggregation import AGGREGATORS
from trainers.rl.buffer import BUFFER_SAMPLERS, qpas_probabilities
from trainers.rl.kl import KL_ESTIMATORS
from trainers.rl.policy_losses import POLICY_LOSSES


@pytest.fixture
def rewards():
    rng = np.random.default_rng(0)
    r = rng.integers(0, 3, size=(5, 4)).astype(np.float32)
    r[2] = 1.0  # a zero-variance group
    return r


def test_grpo_advantage_bessel_std_and_eps_outside_sqrt(rewards):
    eps = 1e-4
    got = np.asarray(ADVANTAGES["grpo"](rewards, eps=eps))
    mean = rewards.mean(1, keepdims=True)
    std = rewards.std(1, ddof=1, keepdims=True)
    np.testing.assert_allclose(got, (rewards - mean) / (std + eps), rtol=1e-6, atol=1e-6)
    assert np.all(got[2] == 0)


def test_dr_grpo_and_rloo(rewards):
    np.testing.assert_allclose(ADVANTAGES["dr_grpo"](rewards), rewards - rewards.mean(1, keepdims=True), atol=1e-6)
    G = rewards.shape[1]
    loo = (rewards.sum(1, keepdims=True) - rewards) / (G - 1)
    np.testing.assert_allclose(ADVANTAGES["rloo"](rewards), rewards - loo, atol=1e-6)
    np.testing.assert_allclose(ADVANTAGES["rloo"](rewards), G / (G - 1) * (rewards - rewards.mean(1, keepdims=True)), atol=1e-5)


def test_invalid_rollouts_leave_the_baseline(rewards):
    valid = np.ones(rewards.shape, bool)
    valid[0, 3] = False
    got = np.asarray(ADVANTAGES["grpo"](rewards, valid))
    r = rewards[0, :3]
    np.testing.assert_allclose(got[0, :3], (r - r.mean()) / (r.std(ddof=1) + 1e-6), atol=1e-5)
    assert got[0, 3] == 0


def test_turn_level_pools_rollouts_at_each_turn_index():
    rng = np.random.default_rng(1)
    R = rng.normal(size=(2, 5, 3)).astype(np.float32)
    valid = np.ones(R.shape, bool)
    valid[0, 0, 2] = valid[0, 1, 2] = False  # two episodes ended after turn 1
    valid[1, :4, 2] = False  # only one rollout reached turn 2: no baseline
    got = np.asarray(ADVANTAGES["turn_level"](R, valid))
    for b in range(2):
        for k in range(3):
            v = valid[b, :, k]
            for g in range(5):
                if not v[g] or v.sum() < 2:
                    assert got[b, g, k] == 0
                    continue
                x = R[b, v, k]
                assert got[b, g, k] == pytest.approx((R[b, g, k] - x.mean()) / (x.std(ddof=1) + 1e-6), abs=1e-5)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("G", [2, 3, 8, 16, 17])
@pytest.mark.parametrize("B", [1, 5, 256])
def test_a_constant_group_gets_exactly_zero_advantage(name, G, B):
    # non-dyadic constants (0.7 and 1.373 are not binary fractions: their float32 group mean
    # is off by an ulp), a different constant per group, and invalid rollouts that differ
    rng = np.random.default_rng([G, B])
    values = rng.choice(np.array([0.7, 1.373, 0.1, -2.3, 1e-3, 123.456, 1 / 3], np.float32), size=(B, 1))
    rewards = np.repeat(values, G, axis=1).astype(np.float32)
    valid = np.ones((B, G), bool)
    valid[::2, 0] = False
    rewards[::2, 0] = 5.0  # an uncounted rollout with another reward does not break the tie
    for v in (None, valid):
        r = np.repeat(values, G, axis=1).astype(np.float32) if v is None else rewards
        got = np.asarray(ADVANTAGES[name](r, v))
        assert np.all(got == 0.0), (name, G, B, got[np.nonzero(got)][:4])


@pytest.mark.parametrize("gamma", [None, 1.0, 0.9, 0.37])
@pytest.mark.parametrize("G", [2, 8, 16])
def test_turn_level_constant_turns_get_exactly_zero(gamma, G):
    rng = np.random.default_rng(G)
    B, K = 7, 4
    per_turn = rng.choice(np.array([0.7, 1.373, 0.1, 1 / 3], np.float32), size=(B, 1, K))
    R = np.repeat(per_turn, G, axis=1).astype(np.float32)  # every rollout gets the same turn rewards
    valid = np.ones(R.shape, bool)
    got = np.asarray(ADVANTAGES["turn_level"](R, valid, gamma=gamma))
    assert np.all(got == 0.0), got[np.nonzero(got)][:4]
    # and a non-constant group still matches a float64 reference of the definition
    R2 = R.copy()
    R2[0, 0, :] += np.float32(0.5)
    got = np.asarray(ADVANTAGES["turn_level"](R2, valid, gamma=gamma))
    ret = R2.astype(np.float64)
    if gamma is not None:
        ret = np.stack([sum(gamma ** (j - k) * R2[..., j].astype(np.float64) for j in range(k, K))
                        for k in range(K)], -1)
    mean, std = ret.mean(1, keepdims=True), ret.std(1, ddof=1, keepdims=True)
    np.testing.assert_allclose(got, (ret - mean) / (std + 1e-6), rtol=1e-5, atol=1e-5)


def test_non_constant_groups_match_a_float64_reference():
    rng = np.random.default_rng(3)
    r = (rng.normal(size=(64, 8)) * 3 + 100).astype(np.float32)  # a large offset: cancellation
    x = r.astype(np.float64)
    mean, std = x.mean(1, keepdims=True), x.std(1, ddof=1, keepdims=True)
    np.testing.assert_allclose(ADVANTAGES["grpo"](r), (x - mean) / (std + 1e-6), rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(ADVANTAGES["dr_grpo"](r), x - mean, atol=2e-5)
    np.testing.assert_allclose(ADVANTAGES["rloo"](r), x - (x.sum(1, keepdims=True) - x) / 7, atol=2e-5)


@pytest.mark.parametrize("name", ["grpo", "turn_level"])
def test_eps_zero_gives_zero_for_a_constant_group_and_the_plain_z_score_otherwise(name):
    """``adv_eps = 0`` is allowed: a constant group's std is 0 and its advantages are 0
    (not 0/0 = NaN, which made the whole batch's loss NaN); other groups get
    ``(r - mean) / std`` exactly."""
    r = np.array([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 1.0], [0.7, 0.7, 0.2, 0.7]], np.float32)
    if name == "turn_level":
        r = r[..., None]
    got = np.asarray(ADVANTAGES[name](r, np.ones(r.shape, bool), eps=0.0))
    x = r.astype(np.float64)
    want = (x - x.mean(1, keepdims=True)) / np.where(x.std(1, ddof=1, keepdims=True) > 0,
                                                    x.std(1, ddof=1, keepdims=True), np.inf)
    assert np.isfinite(got).all() and np.all(got[0] == 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_a_nan_reward_is_left_out_of_its_group(name):
    """NaN = no opinion: the rollout is not counted (grpo gave the whole group 0, the others NaN,
    and a zero advantage passed the trainer's non-finite guard); an infinite reward is refused."""
    r = np.array([[1.0, 0.0, np.nan, 1.0], [0.7, 0.2, 0.4, 0.9]], np.float32)
    got = np.asarray(ADVANTAGES[name](r))
    want = np.asarray(ADVANTAGES[name](np.nan_to_num(r), ~np.isnan(r)))
    np.testing.assert_array_equal(got, want)
    assert got[0, 2] == 0 and np.all(got[0, [0, 3]] > 0) and got[0, 1] < 0
    r[1, 2] = np.inf
    with pytest.raises(ValueError, match=r"reward \[1, 2\] is inf: rewards must be finite"):
        ADVANTAGES[name](r)


def test_turn_level_leaves_a_nan_turn_out():
    r = np.zeros((1, 3, 2), np.float32)
    r[0, :, 0], r[0, :, 1] = [1.0, 0.0, 3.0], [np.nan, 1.0, 0.0]
    got = np.asarray(ADVANTAGES["turn_level"](r))
    valid = ~np.isnan(r)
    np.testing.assert_array_equal(got, np.asarray(ADVANTAGES["turn_level"](np.nan_to_num(r), valid)))
    assert got[0, 0, 1] == 0 and np.all(got[0, :, 0] != 0)  # turn 0 keeps all three rollouts


def test_returns_to_go():
    r = np.array([[1.0, 0.0, 2.0, 5.0]], np.float32)
    valid = np.array([[True, True, True, False]])
    got = np.asarray(returns_to_go(r, valid, 0.5))
    np.testing.assert_allclose(got, [[1 + 0 + 0.25 * 2, 0 + 0.5 * 2, 2, 0]], atol=1e-6)


def test_group_of_one_is_rejected():
    with pytest.raises(ValueError, match="G >= 2"):
        ADVANTAGES["grpo"](np.zeros((3, 1)))


def _np_ppo(logp, old, adv, el, eh, c=None):
    ratio = np.exp(logp - old)
    loss = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - el, 1 + eh))
    if c is not None:
        loss = np.where(adv < 0, np.minimum(loss, -adv * c), loss)
    return loss


def test_ppo_clip_matches_numpy_at_and_around_the_boundaries():
    el, eh = 0.2, 0.28
    # ratios straddling 1 - eps_low and 1 + eps_high, both advantage signs, and a huge ratio
    ratios = np.array([0.5, 0.8 - 1e-4, 0.8, 0.8 + 1e-4, 1.0, 1.28 - 1e-4, 1.28, 1.28 + 1e-4, 2.0, 50.0])
    logp = np.log(ratios).astype(np.float32)[None].repeat(2, 0)
    old = np.zeros_like(logp)
    adv = np.array([[1.5], [-0.7]], np.float32) * np.ones_like(logp)
    mask = np.ones(logp.shape, bool)
    for c in (None, 3.0):
        got, _ = POLICY_LOSSES["ppo_clip"](jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                                           eps_low=el, eps_high=eh, dual_clip=c)
        np.testing.assert_allclose(got, _np_ppo(logp, old, adv, el, eh, c), rtol=1e-5)
    # gradient is zero exactly where clipping binds: A > 0 above 1 + eps_high, A < 0 below 1 - eps_low
    g = jax.grad(lambda lp: POLICY_LOSSES["ppo_clip"](lp, old, adv, mask, eps_low=el, eps_high=eh)[0].sum())(jnp.asarray(logp))
    g = np.asarray(g)
    assert np.all(g[0, ratios > 1.28] == 0) and np.all(g[0, ratios < 1.28] != 0)
    assert np.all(g[1, ratios < 0.8] == 0) and np.all(g[1, ratios > 0.8] != 0)


@pytest.mark.parametrize("eps_low, eps_high", [(0.0, 0.2), (0.2, 0.0), (0.0, 0.0)])
def test_ppo_clip_on_policy_with_a_zero_clip_width_is_the_policy_gradient(eps_low, eps_high):
    """On-policy (r = 1) a zero clip width puts r on a bound: differentiating jnp.clip and
    jnp.maximum split the tie's gradient twice, giving 0.75x the policy gradient ``-A``
    (PyTorch's clamp, as in verl, passes it whole). Here the loss is -A r on the side r moves
    for a gradient step, so the gradient is -A; the loss value is unchanged."""
    logp = jnp.full((2, 3), -1.3, jnp.float32)
    adv = jnp.asarray([[0.7], [-1.1]], jnp.float32) * jnp.ones((2, 3))
    mask = jnp.ones((2, 3), bool)
    loss = lambda lp: POLICY_LOSSES["ppo_clip"](lp, logp, adv, mask, eps_low=eps_low, eps_high=eps_high)[0]  # noqa: E731
    np.testing.assert_allclose(np.asarray(loss(logp)), -np.asarray(adv), rtol=1e-6)
    g = np.asarray(jax.grad(lambda lp: loss(lp).sum())(logp))
    np.testing.assert_allclose(g, -np.asarray(adv), rtol=1e-6)
    for dual in (None, 3.0):  # dual-clip does not bind at r = 1
        g2 = jax.grad(lambda lp: POLICY_LOSSES["ppo_clip"](lp, logp, adv, mask, eps_low=eps_low, eps_high=eps_high,
                                                           dual_clip=dual)[0].sum())(logp)
        np.testing.assert_allclose(np.asarray(g2), -np.asarray(adv), rtol=1e-6)


def test_gspo_uses_the_length_normalised_sequence_ratio():
    rng = np.random.default_rng(2)
    logp = rng.normal(-1, 0.1, (3, 6)).astype(np.float32)
    old = logp + rng.normal(0, 0.01, logp.shape).astype(np.float32)
    mask = np.ones(logp.shape, bool)
    mask[0, 4:] = False
    adv = np.array([[1.0], [-1.0], [0.5]], np.float32) * np.ones_like(logp)
    got, _ = POLICY_LOSSES["gspo"](jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                                   eps_low=3e-4, eps_high=4e-4)
    s = np.exp(((logp - old) * mask).sum(1) / mask.sum(1))[:, None]
    want = np.maximum(-adv * s, -adv * np.clip(s, 1 - 3e-4, 1 + 4e-4)) * mask
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_kl_estimators_and_the_k3_plus_straight_through_gradient():
    rng = np.random.default_rng(3)
    logp = rng.normal(-2, 0.5, 16).astype(np.float32)
    ref = rng.normal(-2, 0.5, 16).astype(np.float32)
    x = ref - logp
    x64 = ref.astype(np.float64) - logp
    np.testing.assert_allclose(KL_ESTIMATORS["k1"](logp, ref), -x, rtol=1e-6)
    np.testing.assert_allclose(KL_ESTIMATORS["k2"](logp, ref), 0.5 * x**2, rtol=1e-6)
    np.testing.assert_allclose(KL_ESTIMATORS["k3"](logp, ref), np.exp(x64) - x64 - 1, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(KL_ESTIMATORS["k3+"](logp, ref), np.exp(x64) - x64 - 1, rtol=1e-5, atol=1e-7)
    g3p = jax.grad(lambda lp: KL_ESTIMATORS["k3+"](lp, ref).sum())(jnp.asarray(logp))
    np.testing.assert_allclose(g3p, logp - ref, rtol=1e-5)  # d/dlogp of (logp - ref)^2 / 2
    g3 = jax.grad(lambda lp: KL_ESTIMATORS["k3"](lp, ref).sum())(jnp.asarray(logp))
    np.testing.assert_allclose(g3, 1 - np.exp(x), rtol=1e-5, atol=1e-6)


def test_aggregators_match_numpy():
    rng = np.random.default_rng(4)
    loss = rng.normal(size=(4, 7)).astype(np.float32)
    mask = np.zeros((4, 7), bool)
    for i, n in enumerate([7, 3, 0, 5]):
        mask[i, :n] = True
    s, c = AGGREGATORS["token_mean"](loss, mask)
    assert float(s / c) == pytest.approx(loss[mask].mean(), rel=1e-5)
    s, c = AGGREGATORS["seq_mean_token_mean"](loss, mask)
    rows = [loss[i][mask[i]].mean() for i in range(4) if mask[i].any()]
    assert float(s / c) == pytest.approx(np.mean(rows), rel=1e-5)
    s, c = AGGREGATORS["seq_mean_token_sum_norm"](loss, mask, norm=7.0)
    # Dr. GRPO's constant normaliser B * L_max: the empty row counts (TRL divides by the batch size)
    assert float(s / c) == pytest.approx((loss * mask).sum() / (4 * 7.0), rel=1e-5)


def test_token_mean_is_exact_under_two_way_accumulation():
    """Two micro-batches of unequal token counts: sums and counts added, divided once ==
    the token mean of the whole batch (the mean of the two means is not)."""
    rng = np.random.default_rng(5)
    loss = rng.normal(size=(4, 6)).astype(np.float32)
    mask = np.zeros((4, 6), bool)
    for i, n in enumerate([6, 1, 2, 2]):
        mask[i, :n] = True
    s1, c1 = AGGREGATORS["token_mean"](loss[:2], mask[:2])
    s2, c2 = AGGREGATORS["token_mean"](loss[2:], mask[2:])
    whole = loss[mask].mean()
    assert float((s1 + s2) / (c1 + c2)) == pytest.approx(whole, rel=1e-6)
    assert abs(float((s1 / c1 + s2 / c2) / 2) - whole) > 1e-3


def test_qpas_sampling_frequencies_chi_square():
    rng = np.random.default_rng(6)
    adv = rng.normal(size=40)
    p = qpas_probabilities(adv, quantile=0.25, alpha=1.0)
    a = np.abs(adv)
    keep = a >= np.quantile(a, 0.25)
    np.testing.assert_allclose(p, np.where(keep, a, 0) / a[keep].sum(), rtol=1e-12)
    assert keep.sum() == 30
    counts = np.zeros(40)
    draws = np.random.default_rng(7)

    class C:
        qpas_quantile, qpas_alpha, qpas_beta = 0.25, 1.0, 1.0

    for _ in range(500):
        idx, w = BUFFER_SAMPLERS["q_pas"](adv, draws, C)
        counts += np.bincount(idx, minlength=40)
        np.testing.assert_allclose(w, (30 * p[idx]) ** -1.0 / ((30 * p[idx]) ** -1.0).max(), rtol=1e-6)
    assert counts[~keep].sum() == 0
    chi2, pval = stats.chisquare(counts[keep], counts.sum() * p[keep])
    assert pval > 1e-3, (chi2, pval)


def test_uniform_sampler_is_a_permutation():
    idx, w = BUFFER_SAMPLERS["uniform"](np.ones(10), np.random.default_rng(0))
    assert sorted(idx) == list(range(10)) and np.all(w == 1)


def test_zero_variance_groups_are_the_groups_without_a_policy_gradient():
    """A group is filtered when its (per-turn) rewards are all equal across its rollouts, as
    the advantage sees them: per turn index for turn-level rewards, after the discount."""
    from trainers.rl.loop import zero_variance_groups

    r2 = np.array([[0.7] * 4, [0.7, 0.7, 0.7, 1.3], [1.373] * 4], np.float32)
    adv = np.asarray(ADVANTAGES["grpo"](r2, None))
    assert zero_variance_groups(adv, None).tolist() == [True, False, True]
    # per-turn rewards: group 0 has the same sequence in every rollout (pooled, its rewards differ)
    r3 = np.array([[[1.0, 0.0, -1.0]] * 3, [[1.0, 0.0, -1.0], [1.0, 0.0, -1.0], [1.0, 0.0, 0.5]]], np.float32)
    valid = np.ones(r3.shape, bool)
    adv = np.asarray(ADVANTAGES["turn_level"](r3, valid))
    assert zero_variance_groups(adv, valid).tolist() == [True, False]
    # the same per-turn rewards but rollouts of different lengths: discounted returns differ
    valid[0, 0, 2] = False
    adv = np.asarray(ADVANTAGES["turn_level"](r3, valid, gamma=0.9))
    returns = [[sum(0.9 ** (j - k) * r3[0, g, j] for j in range(k, 3) if valid[0, g, j]) for k in range(3)]
               for g in range(3)]
    flat_reference = all(len({returns[g][k] for g in range(3) if valid[0, g, k]}) <= 1 for k in range(3))
    assert zero_variance_groups(adv, valid).tolist() == [flat_reference, False] == [False, False]


def test_combined_rewards_skip_nan_and_refuse_infinite_values():
    """NaN is "no opinion" (skipped; all-NaN stays NaN), a weight-0 function does not count
    (0 * inf would be NaN), and an infinite reward is an error naming the function."""
    from trainers.rl.rewards import combine_rewards

    def first(prompts, completions, **_):
        return np.asarray([1.0, np.nan, np.nan, 0.5])

    def second(prompts, completions, **_):
        return np.asarray([2.0, 3.0, np.nan, 0.0])

    total, _ = combine_rewards([first, second], [1.0, 0.5], ["p"] * 4, ["c"] * 4)
    np.testing.assert_allclose(total[[0, 1, 3]], [2.0, 1.5, 0.5])
    assert np.isnan(total[2])
    # a weight-0 function (logged only) does not turn the weighted ones' "no opinion" into 0
    total, _ = combine_rewards([first, second], [1.0, 0.0], ["p"] * 4, ["c"] * 4)
    np.testing.assert_allclose(total[[0, 3]], [1.0, 0.5])
    assert np.isnan(total[1]) and np.isnan(total[2])

    def infinite(prompts, completions, **_):
        return np.asarray([np.inf, 0.0, 1.0, 0.0])

    with pytest.raises(ValueError, match="reward function 'infinite' returned inf for rollout 0"):
        combine_rewards([first, infinite], [1.0, 0.0], ["p"] * 4, ["c"] * 4)

    def grouped(prompts, completions, **_):  # [B, G]: broadcast against the weights, mis-weighted
        return np.asarray([[1.0, 0.0], [0.0, 1.0]])

    def short(prompts, completions, **_):
        return np.asarray([1.0, 0.0, 1.0])

    for fn, shape in ((grouped, r"\(2, 2\)"), (short, r"\(3,\)")):
        with pytest.raises(ValueError, match=rf"reward function '{fn.__name__}' returned shape {shape}: .* shape \(4,\)"):
            combine_rewards([first, fn], [1.0, 0.0], ["p"] * 4, ["c"] * 4)
