"""A^3 (arXiv 2505.12942): analytical QK / OV / MLP compression that shrinks the model in place.

Claims in miniature: at full rank the compressed model is the same function (RoPE + GQA and
NoPE); each closed form matches an independent numpy reference; at equal parameter budget
A^3 beats per-matrix truncated SVD in every component's output error and in held-out loss of
a small trained (NoPE) model; the KV cache shrinks by the stated factor and decoding with it
agrees with the full forward; compressed checkpoints round-trip and run through the CLI.
Mixed ranks (section 6): per-layer widths in the model and the KV cache, and
``allocation="global"`` against uniform at the same parameter count.

Under RoPE, A3-QK is pair *selection* (the only head-width reduction that commutes with the
rotations) followed by a least-squares refit of the kept query columns on the scores
(``qk_rope_refit``, the default). Checked here: the selection picks the best-scoring pairs,
the refit's streamed normal equations equal those of the explicit pair-by-pair problem (with
explicit RoPE rotations) and its solution is numpy's lstsq, full rank stays exact, and the
refit lowers the score error of selection alone. That selection alone loses to per-matrix SVD
on the tiny trained RoPE model while selection + refit beats it is measured by
`bench/compress_a3.py` (docs/compression.md), not asserted here.
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlm
from jaxlm.compress import (
    A3Config, a3_compress, a3_statistics, component_errors, compress_model, kv_cache_bytes, qk_rope_refit, svd_model,
)
from jaxlm.compress.a3.mlp import mlp_cur
from jaxlm.compress.a3.ov import ov_factors
from jaxlm.compress.a3.qk import qk_factors, qk_pair_scores, select_rope_pairs
from jaxlm.compress.a3.refit import rope_pair_selection
from jaxlm.compress.a3.weights import _augmented
from jaxlm.compress.calibrate import qk_refit_sums
from jaxlm.compress.metrics import example_batches, mean_token_nll
from jaxlm.data.tasks import Arithmetic
from jaxlm.editing.kfac import token_batches
from jaxlm.inference.cache import KVCache
from jaxlm.models.hf.families import UnsupportedConfigError
from jaxlm.models.layers.rope import RopeFrequencies
from jaxlm.models.params import flat_params, model_from_flat
from jaxlm.models.taps import Taps
from tiny_training import train_tiny

TASK = Arithmetic(digits=2)


def _texts(split, n):
    return [e["prompt"] + e["completion"] for e in (TASK.example(i, split) for i in range(n))]


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens, valid):
    return nnx.merge(graphdef, state)(tokens, mask=valid).logits


def _logits(model, tokens, valid):
    return np.asarray(_forward(*nnx.split(model), jnp.asarray(tokens), jnp.asarray(valid)))


def _random_batches(n=3, B=8, T=20, seed=0):
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        valid = np.arange(T)[None] < rng.randint(T // 2, T + 1, (B, 1))
        out.append((rng.randint(0, 259, (B, T)).astype(np.int32), valid))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A NoPE model (all three closed forms apply) trained briefly on 2-digit arithmetic."""
    model = jaxlm.load_checkpoint(train_tiny(
        tmp_path_factory.mktemp("a3"), TASK, steps=100, eval_examples=16,
        model=jaxlm.ModelConfig.tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64,
                                     rope="none"),
    ))
    examples = lambda split, n: [TASK.example(i, split) for i in range(n)]  # noqa: E731
    cal = example_batches(model.tokenizer, examples("train", 128), batch_size=64, seq_len=16)
    held = example_batches(model.tokenizer, examples("eval", 128), batch_size=128, seq_len=16)
    return model, cal, held


@pytest.fixture(scope="module")
def rope_model():
    """A random RoPE + GQA model with a tokenizer, and calibration batches (no training needed
    for shapes, caches and checkpoints)."""
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(init_std=0.3, max_seq_len=64), seed=4,
                              tokenizer=jaxlm.ByteTokenizer())
    cal = list(token_batches(model.tokenizer, _texts("train", 64), batch_size=32, seq_len=16))
    return model, cal


def _with_random_biases(model, seed=1):
    """qkv biases are zero at init; make them nonzero so the bias folding is exercised."""
    flat = flat_params(model)
    rng = np.random.RandomState(seed)
    for k in flat:
        if k.endswith(".bias"):
            flat[k] = 0.3 * rng.randn(*flat[k].shape).astype(np.float32)
    return model_from_flat(model.config, flat)


# ------------------------------------------------------------------ 1. full rank is exact
@pytest.mark.parametrize("overrides,refit", [
    (dict(qkv_bias=True, scan_layers=True), {}),  # RoPE + GQA (4 query heads on 2 KV heads), stacked layers
    (dict(qkv_bias=True, scan_layers=True), dict(qk_rope_refit=True, qk_refit_als=1, qk_refit_weight="attention")),
    (dict(rope="none"), {}),  # NoPE: the C^1/2 closed form for QK
], ids=["rope_gqa_bias_scan", "rope_gqa_bias_scan_refit_als", "nope_gqa"])
@pytest.mark.parametrize("tokens", [None, 4], ids=["ample_calibration", "four_tokens"])
def test_full_rank_is_function_preserving(overrides, refit, tokens):
    """Also when the calibration reaches only a few directions (4 tokens: every second moment
    rank-deficient), as a short calibration set against a wide FFN does."""
    cfg = jaxlm.ModelConfig.tiny(init_std=0.3, **overrides)
    model = _with_random_biases(jaxlm.build_model(cfg, seed=0))
    cal = _random_batches()
    if tokens is not None:
        t = _random_batches(1, B=1)[0][0]
        cal = [(t, np.arange(t.shape[1])[None] < tokens)]
    full = compress_model(model, cal, A3Config(budget=1.0, mlp_ridge=0.0, **refit))
    assert full.config == cfg
    tokens, valid = _random_batches(1, seed=5)[0]
    got, want = _logits(full, tokens, valid), _logits(model, tokens, valid)
    np.testing.assert_allclose(got[valid], want[valid], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("select", ["energy", "greedy"])
def test_full_width_refits_keep_weights_the_calibration_never_reached(select):
    """Rank-deficient second moments (one direction reached, or none: a dead layer): at full
    width every closed form returns the weights themselves, and the MLP refit below full
    width keeps the unreached directions' rows (the ridge pulls toward them, not toward 0)."""
    rng = np.random.RandomState(3)
    D, H, F = 8, 4, 6
    x = rng.randn(D)
    c = np.outer(x, x)  # rank 1
    wq, wk, wv, wo = rng.randn(2, D, H), rng.randn(D, H), rng.randn(D, H), rng.randn(2, H, D)
    q_new, k_new, _ = qk_factors(wq, wk, c, H)
    np.testing.assert_array_equal(q_new, wq)
    np.testing.assert_array_equal(k_new, wk)
    v_new, o_new, _ = ov_factors(wv, wo, np.stack([c, c]), H)
    np.testing.assert_array_equal(v_new, wv)
    np.testing.assert_array_equal(o_new, wo)
    w_down = rng.randn(F, D)
    for h in (np.diag([1.0, 0, 0, 0, 0, 0]), np.zeros((F, F))):
        keep, w_new = mlp_cur(h, w_down, F, select=select, ridge=0.0)
        np.testing.assert_array_equal(keep, np.arange(F))
        np.testing.assert_array_equal(w_new, w_down)
        keep, w_new = mlp_cur(h, w_down, F - 1, select=select)  # a dead or near-dead layer stays solvable
        assert np.isfinite(w_new).all()
    keep, w_new = mlp_cur(np.zeros((F, F)), w_down, 3, select=select)
    np.testing.assert_allclose(w_new, w_down[keep], atol=1e-9)  # nothing reached: the rows themselves


# ------------------------------------------------------------- 2. closed forms vs numpy
def _sqrtm(c):
    lam, vec = np.linalg.eigh(c)
    return (vec * np.sqrt(lam)) @ vec.T, (vec / np.sqrt(lam)) @ vec.T


def _spd(rng, d):
    a = rng.randn(d, 3 * d)
    return a @ a.T / (3 * d) + 0.1 * np.eye(d)


def test_qk_closed_form_matches_whitened_svd():
    rng = np.random.RandomState(0)
    G, D, H, r = 3, 12, 6, 4
    wq, wk, c = rng.randn(G, D, H), rng.randn(D, H), _spd(rng, D)
    wq_new, wk_new, s = qk_factors(wq, wk, c, r)
    chex.assert_shape(wq_new, (G, D, r))
    chex.assert_shape(wk_new, (D, r))
    half, inv_half = _sqrtm(c)
    stacked = np.concatenate([half @ wq[g] @ wk.T @ half for g in range(G)])  # [G*D, D]
    u, s_ref, vt = np.linalg.svd(stacked)
    np.testing.assert_allclose(s[:H], s_ref[:H], rtol=1e-8)
    best = (u[:, :r] * s_ref[:r]) @ vt[:r]  # Eckart-Young optimum of the stacked whitened map
    for g in range(G):
        want = inv_half @ best[g * D:(g + 1) * D] @ inv_half  # the card's C^-1/2 U S V^T C^-1/2
        np.testing.assert_allclose(wq_new[g] @ wk_new.T, want, atol=1e-8)
    err = sum(np.sum((half @ (wq[g] @ wk.T - wq_new[g] @ wk_new.T) @ half) ** 2) for g in range(G))
    np.testing.assert_allclose(err, np.sum(s_ref[r:] ** 2), rtol=1e-8)


@pytest.mark.parametrize("group", ["average", "average_refit"])
def test_ov_closed_form_error_is_the_discarded_spectrum(group):
    rng = np.random.RandomState(1)
    G, D, Hv, Dout, r = 2, 10, 5, 8, 3
    wv, wo = rng.randn(D, Hv), rng.randn(G, Hv, Dout)
    cz = np.stack([_spd(rng, D) for _ in range(G)])
    wv_new, wo_new, s = ov_factors(wv, wo, cz, r, group=group)
    chex.assert_shape(wv_new, (D, r))
    chex.assert_shape(wo_new, (G, r, Dout))
    half, _ = _sqrtm(cz.mean(0))
    target = half @ wv @ np.concatenate(list(wo), axis=1)  # C_z^1/2 W_V [W_O1 W_O2]
    s_ref = np.linalg.svd(target, compute_uv=False)
    np.testing.assert_allclose(s[:Hv], s_ref[:Hv], rtol=1e-8)
    exact = [np.sum((_sqrtm(cz[g])[0] @ (wv @ wo[g] - wv_new @ wo_new[g])) ** 2) for g in range(G)]
    if group == "average":
        got = np.sum((target - half @ wv_new @ np.concatenate(list(wo_new), axis=1)) ** 2)
        np.testing.assert_allclose(got, np.sum(s_ref[r:] ** 2), rtol=1e-8)
    else:  # the per-head refit never loses on the exact per-head objective
        wv_a, wo_a, _ = ov_factors(wv, wo, cz, r, group="average")
        before = [np.sum((_sqrtm(cz[g])[0] @ (wv @ wo[g] - wv_a @ wo_a[g])) ** 2) for g in range(G)]
        assert sum(exact) <= sum(before) + 1e-9
    # G = 1: the per-head closed form is exact under the head's own C_z
    wv1, wo1, s1 = ov_factors(wv, wo[:1], cz[:1], r)
    h1, _ = _sqrtm(cz[0])
    np.testing.assert_allclose(np.sum((h1 @ (wv @ wo[0] - wv1 @ wo1[0])) ** 2), np.sum(s1[r:] ** 2), rtol=1e-8)


@pytest.mark.parametrize("select", ["energy", "greedy"])
def test_mlp_refit_is_least_squares(select):
    rng = np.random.RandomState(2)
    n, F, D, m = 400, 24, 7, 10
    h = rng.randn(n, F) * rng.gamma(1.0, 1.0, F)
    w = rng.randn(F, D)
    keep, w_new = mlp_cur(h.T @ h / n, w, m, select=select, ridge=0.0)
    chex.assert_shape(w_new, (m, D))
    assert list(keep) == sorted(set(keep.tolist())) and len(keep) == m
    ref = np.linalg.lstsq(h[:, keep], h @ w, rcond=None)[0]
    np.testing.assert_allclose(w_new, ref, atol=1e-8)
    if select == "energy":
        score = np.mean(h**2, 0) * np.sum(w**2, 1)
        assert set(keep) == set(np.argsort(-score)[:m])
    else:  # greedy targets the refit error directly: no worse than the energy choice here
        k_e, w_e = mlp_cur(h.T @ h / n, w, m, select="energy", ridge=0.0)
        assert np.sum((h @ w - h[:, keep] @ w_new) ** 2) <= np.sum((h @ w - h[:, k_e] @ w_e) ** 2)


def test_statistics_streamed_equal_one_batch_and_pair_scores_match_brute_force():
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(init_std=0.3), seed=3)
    parts = _random_batches(3, B=4, T=12, seed=7)
    whole = (np.concatenate([t for t, _ in parts]), np.concatenate([v for _, v in parts]))
    streamed, once = a3_statistics(model, parts), a3_statistics(model, [whole])
    for name in ("attn_in", "attn_z", "mlp_act", "q_pair_energy", "k_pair_energy", "pair_score_energy"):
        want = np.asarray(getattr(once, name))  # float32 sums in another order: equal to rounding
        np.testing.assert_allclose(getattr(streamed, name), want, rtol=1e-5, atol=1e-6 * np.abs(want).max(), err_msg=name)
    c = model.config
    L, N, K, P = c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim // 2
    chex.assert_shape(once.attn_z, (L, K, c.d_model + 1, c.d_model + 1))  # KV-group means
    per_head = a3_statistics(model, [whole], ("ov",), per_head_z=True).attn_z
    chex.assert_shape(per_head, (L, N, c.d_model + 1, c.d_model + 1))
    np.testing.assert_allclose(np.asarray(per_head).reshape(L, K, N // K, *per_head.shape[2:]).mean(2),
                               once.attn_z, rtol=1e-5, atol=1e-6)
    chex.assert_shape(once.pair_score_energy, (L, N, P))
    # brute force: every causal pair of valid tokens, every pair of channels, after RoPE
    tokens, valid = whole
    graphdef, state = nnx.split(model)
    got = jax.jit(lambda s: nnx.merge(graphdef, s)(tokens, mask=valid, collect=("q_rot", "k_rot")).collected)(state)
    q, k = np.asarray(got["q_rot"], np.float64), np.asarray(got["k_rot"], np.float64)
    s = (np.einsum("lbtnp,lbskp->lbnkpts", q[..., :P], k[..., :P])
         + np.einsum("lbtnp,lbskp->lbnkpts", q[..., P:], k[..., P:]))  # per-pair scores, all head pairs
    own = np.stack([s[:, :, n, n // (N // K)] for n in range(N)], axis=2)  # [L, B, N, P, T, S]
    T = tokens.shape[1]
    pairs = valid[:, :, None] & valid[:, None, :] & np.tril(np.ones((T, T), bool))[None]
    want = np.einsum("lbnpts,bts->lnp", own**2, pairs.astype(np.float64)) / pairs.sum()
    np.testing.assert_allclose(once.pair_score_energy, want, rtol=1e-4)
    score = qk_pair_scores(once, 0, K, "score_energy")
    keep = select_rope_pairs(score, 3)
    chex.assert_shape(keep, (K, 3))
    for h in range(K):
        assert set(keep[h]) == set(np.argsort(-score[h])[:3])


def _explicit_rotation(v, t, freq):
    """``v [r]`` (rotate-half layout) rotated by ``t * freq [r/2]`` with explicit 2x2 matrices."""
    h = len(v) // 2
    out = np.empty_like(v)
    for a in range(h):
        c, s = np.cos(t * freq[a]), np.sin(t * freq[a])
        out[a], out[a + h] = c * v[a] - s * v[a + h], s * v[a] + c * v[a + h]
    return out


@pytest.mark.parametrize("weight", ["uniform", "attention"])
def test_rope_refit_normal_equations_and_solution_are_least_squares(weight):
    """The streamed normal equations (both sides) equal those of the explicit feature matrix over
    every causal pair of calibration tokens (features ``x_i (x) R(-t_i) R(t_j) k_S(j)``, targets
    the full model's scores), and the query refit (ridge 0) is numpy's lstsq of that problem."""
    model = _with_random_biases(jaxlm.build_model(jaxlm.ModelConfig.tiny(d_model=32, init_std=0.3, qkv_bias=True), seed=6))
    cfg = model.config
    N, K, D1 = cfg.n_heads, cfg.n_kv_heads, cfg.d_model + 1
    G = N // K
    parts = _random_batches(2, B=3, T=14, seed=8)
    a3 = A3Config(components=("qk",), budget=0.5, qk_rope_refit=True, qk_refit_ridge=0.0, qk_refit_weight=weight)
    stats = a3_statistics(model, parts, ("qk",))
    params = flat_params(model)
    _, cols, freq = rope_pair_selection(params, cfg, stats, a3)[0]
    r = cols.shape[1]
    wq = np.take_along_axis(_augmented(params, "layers.0.attn.q_proj", N), np.repeat(cols, G, 0)[:, None], -1)
    wk = np.take_along_axis(_augmented(params, "layers.0.attn.k_proj", K), cols[:, None], -1)
    wq = wq + 0.1 * np.random.RandomState(0).randn(*wq.shape)  # queries other than the selection's (ALS)
    feats_q, feats_k, targets, weights = [[] for _ in range(N)], [[] for _ in range(K)], [[] for _ in range(N)], \
        [[] for _ in range(N)]
    graphdef, state = nnx.split(model)
    taps = jax.jit(lambda s, t, v: nnx.merge(graphdef, s)(
        t, mask=v, collect=("attn_in", "q_rot", "k_rot", "attn_probs")).collected)
    for tokens, valid in parts:
        got = taps(state, tokens, valid)
        x, q, k, a = (np.asarray(got[n][0], np.float64) for n in ("attn_in", "q_rot", "k_rot", "attn_probs"))
        for b in range(tokens.shape[0]):
            xa = np.concatenate([x[b], np.ones((x.shape[1], 1))], axis=1)
            for i in np.flatnonzero(valid[b]):
                for j in range(i + 1):
                    for n in range(N):
                        kv = n // G
                        key = _explicit_rotation(xa[j] @ wk[kv], j, freq[kv])
                        query = _explicit_rotation(xa[i] @ wq[n], i, freq[kv])
                        feats_q[n].append(np.kron(xa[i], _explicit_rotation(key, -i, freq[kv])))
                        feats_k[kv].append(np.kron(xa[j], _explicit_rotation(query, -j, freq[kv])))
                        targets[n].append(q[b, i, n] @ k[b, j, kv])
                        weights[n].append(1.0 if weight == "uniform" else a[b, n, i, j])
    fq, y, w = (np.array(v) for v in (feats_q, targets, weights))  # [N, pairs, (D+1) r], [N, pairs]
    kept = {0: (wq, wk, freq, np.eye(D1))}
    sq, sk = (qk_refit_sums(model, parts, kept, side=side, weight=weight)[0] for side in ("q", "k"))
    scale = lambda m: 1e-4 * np.abs(m).max()  # noqa: E731 (float32 sums)
    for n in range(N):  # the step's right-hand side: the residual of the current columns
        gram, res = fq[n].T @ (w[n][:, None] * fq[n]), y[n] - fq[n] @ wq[n].reshape(-1)
        np.testing.assert_allclose(sq.gram[n if weight == "attention" else n // G], gram, rtol=1e-3, atol=scale(gram))
        np.testing.assert_allclose(sq.rhs[n], fq[n].T @ (w[n] * res), rtol=1e-3, atol=scale(sq.rhs[n]))
        np.testing.assert_allclose(sq.residual[n], np.sum(w[n] * res**2), rtol=1e-3)
    np.testing.assert_allclose(sq.target, np.sum(w * y * y, 1), rtol=1e-4)
    fk = np.array(feats_k).reshape(K, -1, G, D1 * r)  # [K, pairs, G, .]: the group's heads, same pairs
    yk, wk_ = y.reshape(K, G, -1).transpose(0, 2, 1), w.reshape(K, G, -1).transpose(0, 2, 1)
    for kv in range(K):
        gram = np.einsum("pgi,pg,pgj->ij", fk[kv], wk_[kv], fk[kv])
        np.testing.assert_allclose(sk.gram[kv], gram, rtol=1e-3, atol=scale(gram))
        rhs = np.einsum("pgi,pg->i", fk[kv], wk_[kv] * (yk[kv] - fk[kv] @ wk[kv].reshape(-1)))
        np.testing.assert_allclose(sk.rhs[kv], rhs, rtol=1e-3, atol=scale(rhs))
    np.testing.assert_allclose(sk.residual, sq.residual, rtol=1e-4)
    # the query refit (keys kept: the features above) is the weighted lstsq solution of that problem
    refit = qk_rope_refit(model, parts, stats, a3)
    wq_sel = np.take_along_axis(_augmented(params, "layers.0.attn.q_proj", N), np.repeat(cols, G, 0)[:, None], -1)
    for n in range(N):
        f, sw = fq[n], np.sqrt(w[n])
        assert np.linalg.matrix_rank(f * sw[:, None]) == D1 * r  # a unique solution
        want = np.linalg.lstsq(f * sw[:, None], y[n] * sw, rcond=None)[0]
        got = refit.weights[0][0][n].reshape(-1)
        np.testing.assert_allclose(f @ got, f @ want, atol=2e-3 * np.abs(y[n]).max())
        err = lambda v: np.sum(w[n] * (f @ v - y[n]) ** 2)  # noqa: E731
        np.testing.assert_allclose(err(got), err(want), rtol=1e-3)
        assert err(got) < err(wq_sel[n].reshape(-1))  # the selection alone: the same problem at its columns


def test_rope_refit_lowers_the_score_error(rope_model):
    """Selection + refit vs selection only at the same widths: lower calibration score error in
    every layer (each ALS step lowers it further), and lower relative qk error of the model on
    the calibration batches and on held-out text."""
    model, cal = rope_model
    a3 = A3Config(components=("qk",), budget=0.5, qk_rope_refit=False)
    stats = a3_statistics(model, cal, ("qk",))
    refit = qk_rope_refit(model, cal, stats, dataclasses.replace(a3, qk_rope_refit=True, qk_refit_als=1))
    for errs in refit.errors.values():
        assert len(errs) == 4 and all(b <= a + 1e-9 for a, b in zip(errs, errs[1:])) and errs[-1] < 0.9 * errs[0]
    sel = model_from_flat(*reversed(a3_compress(flat_params(model), model.config, stats, a3)))
    fit = model_from_flat(*reversed(a3_compress(flat_params(model), model.config, stats,
                                                dataclasses.replace(a3, qk_rope_refit=True, qk_refit_als=1),
                                                qk_refit=refit)))
    assert fit.config == sel.config and fit.config.qk_head_dim == 8
    held = list(token_batches(model.tokenizer, _texts("eval", 32), batch_size=32, seq_len=16))
    for batches in (cal, held):
        e_sel, e_fit = component_errors(model, sel, batches, ("qk",)), component_errors(model, fit, batches, ("qk",))
        assert e_fit["qk"] < e_sel["qk"], (e_fit, e_sel)
    with pytest.raises(ValueError, match="qk_rope_refit=True needs a second calibration pass"):
        a3_compress(flat_params(model), model.config, stats, dataclasses.replace(a3, qk_rope_refit=True))


# ------------------------------------------------------ 3. A^3 beats SVD at equal budget
def test_a3_beats_per_matrix_svd_at_equal_budget(trained):
    """Measured (budget 0.25: qk_head_dim 4, v_head_dim 4, ffn_dim 32 of 16, 16, 128): relative
    errors A^3 vs SVD qk 5.2e-4 vs 1.5e-2, ov 3.6e-5 vs 2.8e-3, mlp 5.8e-5 vs 1.7e-2; held-out
    completion NLL 1.3737 (A^3) vs 1.5665 (SVD), uncompressed 1.3749."""
    model, cal, held = trained
    a3 = compress_model(model, cal, A3Config(budget=0.25))
    c = a3.config
    assert (c.qk_head_dim, c.v_head_dim, c.ffn_dim) == (4, 4, 32)
    assert c.num_params() < model.config.num_params()
    svd = svd_model(model, c, ("qk", "ov", "mlp"))
    e_a3, e_svd = component_errors(model, a3, held), component_errors(model, svd, held)
    loss = {name: mean_token_nll(m, held) for name, m in (("base", model), ("a3", a3), ("svd", svd))}
    print("component errors a3", e_a3, "svd", e_svd, "held-out nll", loss)
    for comp in ("qk", "ov", "mlp"):
        assert e_a3[comp] < 0.1 * e_svd[comp], comp
    assert loss["a3"] < loss["svd"] - 0.05
    assert loss["a3"] < loss["base"] + 0.01


@pytest.mark.slow
def test_a3_with_rope_refit_beats_per_matrix_svd_on_a_trained_rope_model(tmp_path):
    """The claim under RoPE + GQA, on the quickstart's shape (d_model 128, 3 layers, 4 query /
    2 KV heads) trained 600 steps on clean 2-digit addition, as `bench/compress_a3.py` measures
    it: A^3 with the pair refit beats per-matrix SVD at equal parameters in every component's
    error and in held-out NLL at budgets 0.5 and 0.75, while pair selection alone loses to SVD
    on qk. (On the 100-step, 64-wide model of the tests above the order is mixed: budget 0.5
    qk error 5.2e-3 vs SVD 7.1e-3 but NLL 1.3483 vs 1.3464; so this claim runs here, slow.)
    Measured (128 s): budget 0.5 qk / ov / mlp error refit 1.2e-4 / 1.0e-6 / 6.7e-6, selection qk
    9.6e-2, SVD 5.0e-4 / 3.6e-3 / 5.6e-3; held-out NLL refit 0.4630, selection 0.7865, SVD
    0.5056 (uncompressed 0.4622). Budget 0.75: qk 4.9e-6 / 1.3e-2 / 2.3e-4; NLL 0.4626 /
    0.5403 / 0.4963."""
    model = jaxlm.load_checkpoint(train_tiny(
        tmp_path, TASK, steps=600, batch_size=64, warmup_steps=50, min_lr_ratio=0.05, eval_examples=16,
        model=jaxlm.ModelConfig.tiny(d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=64),
    ))
    examples = lambda split, n: [TASK.example(i, split) for i in range(n)]  # noqa: E731
    cal = example_batches(model.tokenizer, examples("train", 256), batch_size=64, seq_len=16)
    held = example_batches(model.tokenizer, examples("eval", 256), batch_size=128, seq_len=16)
    base = mean_token_nll(model, held)
    for budget in (0.5, 0.75):
        fit = compress_model(model, cal, A3Config(budget=budget))
        sel = compress_model(model, cal, A3Config(budget=budget, qk_rope_refit=False))
        svd = svd_model(model, fit.config, ("qk", "ov", "mlp"))
        e_fit, e_sel, e_svd = (component_errors(model, m, held) for m in (fit, sel, svd))
        nll = {name: mean_token_nll(m, held) for name, m in (("fit", fit), ("sel", sel), ("svd", svd))}
        print(budget, "refit", e_fit, "selection", e_sel, "svd", e_svd, "nll", nll, "base", base)
        for comp in ("qk", "ov", "mlp"):
            assert e_fit[comp] < e_svd[comp], (budget, comp, e_fit, e_svd)
        assert e_sel["qk"] > e_svd["qk"], (budget, e_sel, e_svd)  # what the refit fixes
        assert nll["fit"] < nll["svd"], (budget, nll)


# ------------------------------------------------ 4. smaller KV cache, decoding agrees
def test_compressed_kv_cache_and_generate(rope_model):
    model, cal = rope_model
    small = compress_model(model, cal, A3Config(components=("qk", "ov"), qk_head_dim=8, v_head_dim=4,
                                                qk_score="norm_product", ov_group="average_refit"))
    c0, c1 = model.config, small.config
    full_cache, cache = KVCache.init(c0, 2, 32), KVCache.init(c1, 2, 32)
    chex.assert_shape(cache.k, (c0.n_layers, 2, c0.n_kv_heads, 32, 8))
    chex.assert_shape(cache.v, (c0.n_layers, 2, c0.n_kv_heads, 32, 4))
    ratio = (cache.k.size + cache.v.size) / (full_cache.k.size + full_cache.v.size)
    assert ratio == (8 + 4) / (2 * c0.head_dim) == 0.375
    assert kv_cache_bytes(c1) / kv_cache_bytes(c0) == ratio
    chex.assert_shape(flat_params(small)["layers.1.attn.rope_inv_freq"], (c0.n_kv_heads, 4))
    prompts = [e["prompt"] for e in (TASK.example(i, "eval") for i in range(4))]
    out = jaxlm.generate(small, prompts, max_new_tokens=5, temperature=0.0)
    assert len(out.texts) == 4
    # greedy decoding through the compressed cache = argmax of the cache-free forward
    rows = out.sequences()
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    valid = np.zeros(tokens.shape, bool)
    for r, row in enumerate(rows):
        tokens[r, :len(row)], valid[r, :len(row)] = row, True
    greedy = _logits(small, tokens, valid).argmax(-1)
    for r, (row, completion) in enumerate(zip(rows, out.completions())):
        start = len(row) - len(completion)
        np.testing.assert_array_equal(np.asarray(completion), greedy[r, start - 1: len(row) - 1])


# --------------------------------------------------- 5. checkpoints, export, CLI, errors
def test_checkpoint_round_trip_and_hf_export_refused(rope_model, tmp_path):
    model, cal = rope_model
    small = compress_model(model, cal, A3Config(budget=0.5))
    freq = np.asarray(flat_params(small)["layers.0.attn.rope_inv_freq"])
    placeholder = np.asarray(flat_params(jaxlm.build_model(small.config))["layers.0.attn.rope_inv_freq"])
    assert not np.array_equal(freq, placeholder)  # the selected pairs' own frequencies
    # stored stacked [L, K, qk_head_dim/2] in the scanned layout, read back per layer
    scanned = model_from_flat(small.config.replace(scan_layers=True), flat_params(small))
    chex.assert_shape(nnx.state(scanned, RopeFrequencies)["layers"]["attn"]["rope_inv_freq"][...],
                      (2, small.config.n_kv_heads, 4))
    jaxlm.save_checkpoint(scanned, tmp_path / "ck")
    back = jaxlm.load_checkpoint(tmp_path / "ck")
    assert back.config == small.config.replace(scan_layers=True)
    a, b = flat_params(small), flat_params(back)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
    tokens, valid = cal[0]
    np.testing.assert_allclose(_logits(back, tokens, valid), _logits(small, tokens, valid), atol=1e-5, rtol=1e-5)
    with pytest.raises(UnsupportedConfigError, match="qk_head_dim=8 != head_dim=16"):
        jaxlm.save_hf(small, tmp_path / "hf")
    # the frequency buffer is no trainable weight: gradients stop at it
    attn = small.layers[0].attn
    graphdef, state = nnx.split(attn)
    x = jnp.asarray(np.random.RandomState(0).randn(1, 5, small.config.d_model), jnp.float32)
    mask = jnp.tril(jnp.ones((5, 5), bool))[None, None]
    loss = lambda s: jnp.sum(nnx.merge(graphdef, s)(x, jnp.arange(5)[None], mask, None, Taps(frozenset()))[0])  # noqa: E731
    g = jax.grad(loss)(state)
    assert float(jnp.abs(g["rope_inv_freq"][...]).max()) == 0.0
    assert float(jnp.abs(g["q_proj"]["kernel"][...]).max()) > 0.0


def test_cli_compress_then_eval(tmp_path, capsys):
    from trainers.cli import main

    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(max_seq_len=64), tokenizer=jaxlm.ByteTokenizer())
    jaxlm.save_checkpoint(model, tmp_path / "ck")
    main(["compress", str(tmp_path / "ck"), "--budget", "0.5", "--out", str(tmp_path / "small"),
          "--components", "qk,ov,mlp", "--calib", "16", "--eval-n", "4"])
    out = capsys.readouterr().out
    assert "a3" in out and "KV cache" in out
    cfg = jaxlm.checkpoint.read_config(tmp_path / "small")
    assert (cfg.qk_head_dim, cfg.v_head_dim, cfg.ffn_dim) == (8, 8, 64)
    main(["eval", "--model", str(tmp_path / "small"), "--n", "4", "--max-new-tokens", "4"])
    assert "exact-match accuracy" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["compress", str(tmp_path / "ck"), "--out", str(tmp_path / "x"), "--components", "qk,attn"])
    assert e.value.code == 2 and "components" in capsys.readouterr().err


def test_clear_errors():
    qwen = jaxlm.ModelConfig.tiny(qk_norm=True)
    model = jaxlm.build_model(qwen, seed=0)
    cal = _random_batches(1)
    with pytest.raises(ValueError, match=r"qk_norm=True.*components=\('ov', 'mlp'\)"):
        compress_model(model, cal, A3Config(components=("qk",)))
    small = compress_model(model, cal, A3Config(components=("ov", "mlp"), budget=0.5))
    assert small.config.v_head_dim == 8 and small.config.qk_head_dim == 16
    with pytest.raises(ValueError, match="budget"):
        A3Config(budget=1.5)
    with pytest.raises(ValueError, match="qk_score"):
        A3Config(qk_score="random")
    # every numeric setting is checked (eig_floor=-1 wrote NaN kernels, eig_floor=NaN all-zero
    # attention; an infinite ridge NaN kernels; budget=True ran at full width)
    for bad in (dict(qk_rope_refit="yes"), dict(qk_refit_ridge=-1.0), dict(qk_refit_als=-1),
                dict(qk_refit_als=1.5), dict(qk_refit_weight="softmax"), dict(eig_floor=-1.0),
                dict(eig_floor=float("nan")), dict(eig_floor=1.0), dict(eig_floor="x"), dict(mlp_ridge=float("inf")),
                dict(mlp_ridge=True), dict(mlp_ridge="x"), dict(qk_refit_ridge=float("inf")), dict(budget=True)):
        with pytest.raises(ValueError, match=f"A3Config.{next(iter(bad))}"):
            A3Config(**bad)
    numpy_scalars = A3Config(budget=np.float32(0.5), mlp_ridge=np.float64(1e-6), eig_floor=np.float32(0.0))
    assert type(numpy_scalars.budget) is float and numpy_scalars.budget == 0.5 and numpy_scalars.eig_floor == 0.0
    with pytest.raises(ValueError, match="qk_head_dim"):
        jaxlm.ModelConfig.tiny(qk_head_dim=7)
    plain = jaxlm.build_model(jaxlm.ModelConfig.tiny(), seed=0)
    stats = a3_statistics(plain, cal, ("mlp",))
    with pytest.raises(ValueError, match="attn_z is missing"):
        a3_compress(flat_params(plain), plain.config, stats, A3Config(components=("ov",)))


# ------------------------------------------------------- 6. mixed ranks (per-layer widths)
MIXED = dict(layer_qk_head_dims=(8, 16), layer_v_head_dims=(4, 12), layer_ffn_dims=(32, 96))


@pytest.fixture(scope="module")
def mixed_model():
    """A random RoPE + GQA model whose two layers have different qk / v / ffn widths."""
    cfg = jaxlm.ModelConfig.tiny(init_std=0.3, max_seq_len=64, **MIXED)
    return jaxlm.build_model(cfg, seed=2, tokenizer=jaxlm.ByteTokenizer())


def test_per_layer_dims_equal_to_the_scalars_are_the_uniform_model(rope_model):
    model, cal = rope_model
    c = model.config
    assert c.layer_config(0) is c and not c.per_layer_dims  # uniform: the model is built from c itself
    same = c.replace(layer_qk_head_dims=(16, 16), layer_v_head_dims=(16, 16), layer_ffn_dims=(128, 128))
    per_layer = model_from_flat(same, flat_params(model))
    assert per_layer.config.per_layer_kv and isinstance(per_layer.init_cache(2, 8).k, tuple)
    tokens, valid = cal[0]
    np.testing.assert_array_equal(_logits(per_layer, tokens, valid), _logits(model, tokens, valid))
    # and through the KV cache (stacked [L, ...] vs one array per layer)
    a = model(jnp.asarray(tokens), mask=jnp.asarray(valid), cache=model.init_cache(*tokens.shape))
    b = per_layer(jnp.asarray(tokens), mask=jnp.asarray(valid), cache=per_layer.init_cache(*tokens.shape))
    np.testing.assert_array_equal(np.asarray(b.logits), np.asarray(a.logits))
    np.testing.assert_array_equal(np.stack(b.cache.k), np.asarray(a.cache.k))


def test_mixed_width_cache_shrinks_and_decoding_matches_the_forward(mixed_model, samples_per_prompt=2):
    model = mixed_model
    c = model.config
    B, S = 3, 24
    cache = model.init_cache(B, S)
    K = c.n_kv_heads
    assert [x.shape for x in cache.k] == [(B, K, S, 8), (B, K, S, 16)]
    assert [x.shape for x in cache.v] == [(B, K, S, 4), (B, K, S, 12)]
    assert (cache.batch_size, cache.max_len) == (B, S)
    per_layer_bytes = sum(B * K * S * (qk + v) * 4 for qk, v in zip(MIXED["layer_qk_head_dims"], MIXED["layer_v_head_dims"]))
    assert cache.nbytes == kv_cache_bytes(c, B, S) == per_layer_bytes
    assert per_layer_bytes / kv_cache_bytes(c.replace(**{k: None for k in MIXED}), B, S) == (8 + 16 + 4 + 12) / 64
    assert "layers.0.attn.rope_inv_freq" in flat_params(model) and "layers.1.attn.rope_inv_freq" not in flat_params(model)
    # greedy decoding through the per-layer cache (prefill, repeat per sample, decode) = the cache-free forward
    rng = np.random.RandomState(3)
    P, N, G = 7, 6, samples_per_prompt
    prompt = rng.randint(3, 259, (B, P)).astype(np.int32)
    prompt_mask = np.arange(P)[None] >= np.array([[0], [2], [4]])  # left-padded
    graphdef, state = nnx.split(model)
    out = jaxlm.inference.generate_tokens(graphdef, state, jnp.asarray(prompt), jnp.asarray(prompt_mask),
                                          jax.random.PRNGKey(0), max_new_tokens=N, greedy=True, samples_per_prompt=G)
    assert [x.shape for x in out.cache.k] == [(B * G, K, P + N, 8), (B * G, K, P + N, 16)]
    gen, logp = np.asarray(out.tokens), np.asarray(out.logprobs)
    tokens = np.concatenate([np.repeat(prompt, G, 0), gen], 1)
    valid = np.concatenate([np.repeat(prompt_mask, G, 0), np.ones(gen.shape, bool)], 1)
    logits = _logits(model, tokens, valid)[:, P - 1: P + N - 1]
    np.testing.assert_array_equal(gen, logits.argmax(-1))
    want = np.take_along_axis(jax.nn.log_softmax(logits, -1), gen[..., None], -1)[..., 0]
    np.testing.assert_allclose(logp, want, atol=2e-5)


def test_mixed_width_shared_prompt_gather(mixed_model):
    """trainers/rl/rollout.py runs each distinct prompt once and gathers its per-layer keys/values."""
    from trainers.rl.rollout import positions_of, row_logprobs, shared_prompts

    rng = np.random.RandomState(4)
    W, T, idx = 6, 10, np.array([0, 0, 1, 2, 2, 1])
    prompt_attend = np.arange(W)[None] >= np.array([[0], [3], [1]])
    rows = {"tokens": rng.randint(3, 259, (len(idx), T)).astype(np.int32), "prompt_index": idx.astype(np.int32)}
    rows["tokens"][:, :W] = rng.randint(3, 259, (3, W))[idx]
    rows["attend"] = np.concatenate([prompt_attend[idx], np.ones((len(idx), T - W), bool)], 1)
    rows["positions"] = positions_of(rows["attend"])
    plain = {k: jnp.asarray(rows[k]) for k in ("tokens", "attend", "positions")}
    shared = {**plain, "prompts": jax.tree.map(jnp.asarray, shared_prompts(rows, W)),
              "prompt_index": jnp.asarray(idx)}
    graphdef, state = nnx.split(mixed_model)
    logprobs = jax.jit(lambda s, b: row_logprobs(nnx.merge(graphdef, s), b))
    lp0, lp1 = logprobs(state, plain), logprobs(state, shared)
    np.testing.assert_allclose(np.asarray(lp1)[:, W:], np.asarray(lp0)[:, W:], atol=2e-5)


def test_mixed_width_checkpoint_round_trip_and_hf_export_refused(mixed_model, tmp_path):
    model = mixed_model
    jaxlm.save_checkpoint(model, tmp_path / "ck")
    back = jaxlm.load_checkpoint(tmp_path / "ck")
    assert back.config == model.config and back.config.layer_v_head_dims == (4, 12)  # tuples again, not lists
    a, b = flat_params(model), flat_params(back)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
    assert back.config.num_params() == sum(np.asarray(x).size for k, x in a.items() if "rope_inv_freq" not in k)
    with pytest.raises(UnsupportedConfigError, match=r"layer_qk_head_dims=\(8, 16\)"):
        jaxlm.save_hf(model, tmp_path / "hf")
    # taps whose width differs per layer come back as one array per layer
    got = back(jnp.zeros((1, 3), jnp.int32), collect=("mlp_act", "hidden")).collected
    assert [x.shape for x in got["mlp_act"]] == [(1, 3, 32), (1, 3, 96)] and got["hidden"].shape == (2, 1, 3, 64)


def test_per_layer_dims_errors_name_the_field():
    tiny = jaxlm.ModelConfig.tiny
    with pytest.raises(ValueError, match=r"layer_qk_head_dims=\(8,\).*n_layers=2"):
        tiny(layer_qk_head_dims=(8,))
    with pytest.raises(ValueError, match=r"layer_v_head_dims=.*scan_layers=False"):
        tiny(layer_v_head_dims=(8, 4), scan_layers=True)
    with pytest.raises(ValueError, match=r"layer_qk_head_dims\[1\]=7.*even"):
        tiny(layer_qk_head_dims=(8, 7))
    with pytest.raises(ValueError, match=r"layer_qk_head_dims\[0\]=18.*<= head_dim=16"):
        tiny(layer_qk_head_dims=(18, 8))
    with pytest.raises(ValueError, match=r"layer_v_head_dims\[1\]=8.*kv_quant"):
        tiny(kv_quant="nvfp4", layer_v_head_dims=(16, 8))  # nvfp4 blocks of 16: 8 does not divide
    with pytest.raises(ValueError, match=r"layer_ffn_dims\[0\]=0"):
        tiny(layer_ffn_dims=(0, 8))
    with pytest.raises(ValueError, match="allocation"):
        A3Config(allocation="per_layer")
    # settings for a part that does not run were ignored (jaxlm compress --components qk --ffn-dim 64)
    with pytest.raises(ValueError, match=r"A3Config.ffn_dim=64 has no effect: component 'mlp' is not in"):
        A3Config(components=("qk",), ffn_dim=64)
    with pytest.raises(ValueError, match=r"A3Config.qk_refit_rank=4 has no effect with qk_rope_refit=False"):
        A3Config(qk_rope_refit=False, qk_refit_rank=4)
    with pytest.raises(ValueError, match="already has per-layer widths"):
        a3_compress({}, tiny(**MIXED), None, A3Config())


def test_widths_keep_the_quantization_blocks_the_model_needs():
    """Global allocation moved widths in steps of 16 whatever kv_quant's block was, and ignored
    qat_format: MXFP4 keys (block 32) got a width of 16 and NVFP4 QAT an ffn_dim of 54, refused by
    ModelConfig only after the whole calibration. A model that already has per-layer widths (what
    global allocation writes) failed inside the statistics with an AttributeError."""
    from jaxlm.compress.a3.config import a3_steps, a3_widths

    tiny = jaxlm.ModelConfig.tiny
    steps = a3_steps(tiny(kv_quant="mxfp4", d_model=128, n_heads=2, n_kv_heads=1))
    assert steps["qk_head_dim"][0] == 32 and steps["v_head_dim"][0] == 32 and steps["ffn_dim"][0] == 1
    steps = a3_steps(tiny(qat_format="nvfp4", n_heads=4, n_kv_heads=2))
    assert (steps["qk_head_dim"][0], steps["v_head_dim"][0], steps["ffn_dim"][0]) == (2, 4, 16)  # 4 heads x 4 = 16
    with pytest.raises(ValueError, match="A3Config.ffn_dim=40 is invalid: .*qat_format='nvfp4'"):
        a3_widths(tiny(qat_format="nvfp4"), A3Config(components=("mlp",), ffn_dim=40))
    rng = np.random.RandomState(0)
    cal = [(rng.randint(0, 259, (4, 12)).astype(np.int32), np.arange(12)[None] < rng.randint(6, 13, (4, 1)))
           for _ in range(2)]
    for cfg, components in ((tiny(d_model=128, n_heads=2, n_kv_heads=1, init_std=0.3, kv_quant="mxfp4", rope="none"),
                             ("qk", "ov")),
                            (tiny(init_std=0.3, qat_format="nvfp4", rope="none"), ("mlp",))):
        flat = {k: np.asarray(v) for k, v in flat_params(jaxlm.build_model(cfg, seed=0)).items()}
        for k in flat:  # layer 0 nearly off: global allocation moves width to layer 1
            if k.startswith("layers.0.") and k.endswith("kernel") and ("attn" in k or "down_proj" in k):
                flat[k] = flat[k] * 0.05
        out = compress_model(model_from_flat(cfg, flat), cal, A3Config(budget=0.5, components=components,
                                                                      allocation="global"))
        c = out.config
        for name, (step, _) in a3_steps(cfg).items():
            widths = getattr(c, {"qk_head_dim": "layer_qk_head_dims", "v_head_dim": "layer_v_head_dims",
                                 "ffn_dim": "layer_ffn_dims"}[name]) or (getattr(c, name),)
            assert all(w % step == 0 for w in widths), (name, widths)
        assert c.per_layer_dims
        with pytest.raises(ValueError, match="already has per-layer widths"):
            compress_model(out, cal, A3Config(budget=0.5, components=components))


def test_allocate_widths_is_optimal_on_convex_curves_and_never_worse_than_uniform():
    import itertools

    from jaxlm.compress import allocate_widths

    rng = np.random.RandomState(0)
    curves = [np.concatenate([np.cumsum(np.sort(rng.gamma(0.5, 1.0, 8))[::-1][::-1])[::-1], [0.0]]) * s
              for s in (1.0, 5.0, 0.2)]  # discarded-spectrum curves (convex), per-layer scales
    for total in (3, 9, 12, 20):
        got = allocate_widths(curves, total)
        best = min(sum(c[w] for c, w in zip(curves, ws)) for ws in itertools.product(range(1, 9), repeat=3)
                   if sum(ws) == total)
        assert sum(got) == total and sum(c[w] for c, w in zip(curves, got)) == pytest.approx(best)
    bumpy = [np.array([9.0, 8.9, 0.0, 0.0]), np.array([9.0, 8.0, 7.5, 7.4])]  # greedy takes layer 1 first
    assert allocate_widths(bumpy, 4) == [2, 2]
    assert allocate_widths([np.repeat([3.0, 2.0, 0.5], 2)[:5]] * 2, 8, step=2) == [4, 4]


def test_global_allocation_beats_uniform_at_equal_budget(trained):
    """Mixed ranks at the same total parameter count, on the trained NoPE model. Measured
    (uniform -> global; calibration objective, held-out relative component error, held-out NLL):
    budget 0.25: qk widths (4, 4) -> (5, 3), calibration qk error 0.0272 -> 0.0178, held-out qk
    5.23e-4 -> 3.03e-4 (ov equal, mlp 5.8354e-5 -> 5.8354e-5), NLL 1.3737 -> 1.3742;
    budget 0.125: qk (2, 2) -> (3, 1), ffn (16, 16) -> (18, 14), calibration qk 0.239 -> 0.146,
    mlp 0.0234 -> 0.0196, held-out qk 5.27e-3 -> 2.66e-3, mlp 1.65e-3 -> 1.37e-3, but NLL
    1.3722 -> 1.3936: lower per-component error does not give a lower end-to-end loss here
    (reported in docs/compression.md, not asserted)."""
    from jaxlm.compress import a3_error_curves

    model, cal, held = trained
    stats = a3_statistics(model, cal)
    flat = flat_params(model)
    base = mean_token_nll(model, held)
    for budget in (0.25, 0.125):
        results = {}
        for alloc in ("uniform", "global"):
            a3 = A3Config(budget=budget, allocation=alloc)
            new_flat, cfg = a3_compress(flat, model.config, stats, a3)
            small = model_from_flat(cfg, new_flat)
            curves = a3_error_curves(flat, model.config, stats, a3)
            widths = {n: [getattr(cfg.layer_config(i), n) for i in range(cfg.n_layers)] for n in curves}
            results[alloc] = dict(
                config=cfg, widths=widths, cal={n: sum(c[w] for c, w in zip(curves[n], widths[n])) for n in curves},
                held=component_errors(model, small, held), nll=mean_token_nll(small, held))
        u, g = results["uniform"], results["global"]
        print(budget, "base nll", base, {a: {k: v for k, v in r.items() if k != "config"} for a, r in results.items()})
        assert g["config"].per_layer_dims and not u["config"].per_layer_dims
        assert g["config"].num_params() == u["config"].num_params()  # the same total budget
        for n, comp in (("qk_head_dim", "qk"), ("v_head_dim", "ov"), ("ffn_dim", "mlp")):
            assert sum(g["widths"][n]) == sum(u["widths"][n])
            assert g["cal"][n] <= u["cal"][n] * (1 + 1e-12), n  # the allocation's own objective: never worse
            if g["cal"][n] < 0.99 * u["cal"][n]:  # a real calibration gain carries over to held-out data
                assert g["held"][comp] < u["held"][comp], comp
            elif g["widths"][n] == u["widths"][n]:  # the same allocation: the same error up to float32 sums
                np.testing.assert_allclose(g["held"][comp], u["held"][comp], rtol=1e-4, err_msg=comp)
            else:  # a different allocation with under 1% calibration gain: held-out within 1% too
                assert g["held"][comp] <= 1.01 * u["held"][comp], comp
        assert g["widths"]["qk_head_dim"] != u["widths"]["qk_head_dim"]  # it really mixes
        assert g["cal"]["qk_head_dim"] < 0.7 * u["cal"]["qk_head_dim"]
        if budget == 0.25:
            assert max(u["nll"], g["nll"]) < base + 0.01


@pytest.mark.slow  # test_cli_compress_then_eval checks the verb by default
def test_cli_compress_global_allocation_then_eval(tmp_path, capsys):
    from trainers.cli import main

    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(max_seq_len=64, scan_layers=True), tokenizer=jaxlm.ByteTokenizer())
    jaxlm.save_checkpoint(model, tmp_path / "ck")
    main(["compress", str(tmp_path / "ck"), "--budget", "0.5", "--out", str(tmp_path / "small"),
          "--allocation", "global", "--calib", "16", "--eval-n", "2"])
    assert "global" in capsys.readouterr().out
    cfg = jaxlm.checkpoint.read_config(tmp_path / "small")
    assert not cfg.scan_layers  # a scanned model comes back unrolled (per-layer widths)
    assert sum(cfg.layer_qk_head_dims) == 2 * 8 and sum(cfg.layer_v_head_dims) == 2 * 8
    assert sum(cfg.layer_ffn_dims) == 2 * 64
    main(["eval", "--model", str(tmp_path / "small"), "--n", "4", "--max-new-tokens", "4"])
    assert "exact-match accuracy" in capsys.readouterr().out


def test_calibration_arguments_are_checked_by_name():
    """A bare string was calibrated on as its characters; seq_len / batch_size of 0 or less
    failed with ZeroDivisionError or numpy's "negative dimensions"."""
    from jaxlm.compress.apply import compress_with
    from jaxlm.editing.kfac import token_batches

    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(), seed=0, tokenizer=jaxlm.ByteTokenizer())
    with pytest.raises(ValueError, match="texts is one string"):
        compress_with(model, "a3", "abc")
    for kw, name in ((dict(seq_len=0), "seq_len=0"), (dict(seq_len=-3), "seq_len=-3"),
                     (dict(batch_size=0), "batch_size=0"), (dict(batch_size=True), "batch_size=True")):
        with pytest.raises(ValueError, match=f"{name} is invalid"):
            compress_with(model, "a3", ["some text"], **kw)
    tok, valid = next(token_batches(jaxlm.ByteTokenizer(), ["ab", "c"], batch_size=np.int64(4), seq_len=np.int32(5)))
    assert tok.shape == (2, 5) and valid.sum(1).tolist() == [4, 3]  # BOS + text + EOS
