"""OnlineSPEC: the distillation loss against a numpy/scipy KL written from its definition
(draft model and Medusa heads, padding, fractional weights); feedback weights and OSD's
mismatch set; softmax(-L/T) ensemble weights and parameter averaging; the persisted SGD
momentum; a served stream whose outputs are the target's plain greedy outputs while the
draft adapts; config errors; and (slow) the paper's claim in miniature: after a shift in the
task mix the adapted draft accepts more and serves faster than the static draft, and the
ensemble is at least as good as its best single learning rate."""

import dataclasses
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from scipy import special, stats

import jaxlm
from jaxlm.inference.online_spec import (
    Feedback, OnlineSpecConfig, average_params, chunked, distill_loss, ensemble_weights, feedback_weights,
    fit_draft, serve_stream,
)
from jaxlm.inference.speculative import MedusaHeads

V = 24
CFG = jaxlm.ModelConfig.tiny(vocab_size=V, init_std=0.5, max_seq_len=64)
DRAFT_CFG = jaxlm.ModelConfig.tiny(vocab_size=V, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                                   init_std=0.5, max_seq_len=64)


@pytest.fixture(scope="module")
def models():
    heads = MedusaHeads(CFG.d_model, 3)
    heads.w.set_value(0.3 * jax.random.normal(jax.random.key(3), heads.w.shape))
    return jaxlm.build_model(CFG, seed=0), jaxlm.build_model(DRAFT_CFG, seed=1), heads


def _padded_batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, V, (3, 9)).astype(np.int32)
    mask = np.ones((3, 9), bool)
    mask[1, 6:] = False  # right padding
    mask[2, 4:] = False
    tokens[~mask] = 0
    return tokens, mask


def _kl(p_logits, q_logits):
    return stats.entropy(special.softmax(np.float64(p_logits)), special.softmax(np.float64(q_logits)))


def test_distill_loss_of_a_draft_model_against_scipy(models):
    target, draft, _ = models
    tokens, mask = _padded_batch()
    rng = np.random.default_rng(1)
    w = np.where(mask, rng.choice([0.0, 0.3, 1.0, 2.5], mask.shape), 0.0)[:, :, None].astype(np.float32)
    w[:, 0] = 0.0  # no prediction of the first token
    t_logits = np.asarray(target(jnp.asarray(tokens), mask=jnp.asarray(mask)).logits)
    d_logits = np.asarray(draft(jnp.asarray(tokens), mask=jnp.asarray(mask)).logits)
    num = sum(w[b, s, 0] * _kl(t_logits[b, s - 1], d_logits[b, s - 1])
              for b in range(3) for s in range(1, 9) if w[b, s, 0])
    want = num / w.sum()
    got = float(distill_loss(draft, target, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(w)))
    np.testing.assert_allclose(got, want, rtol=2e-5)
    # weights summing below one are still a weighted mean
    small = np.zeros_like(w)
    small[0, 3, 0], small[1, 2, 0] = 0.2, 0.05
    want = (0.2 * _kl(t_logits[0, 2], d_logits[0, 2]) + 0.05 * _kl(t_logits[1, 1], d_logits[1, 1])) / 0.25
    got = float(distill_loss(draft, target, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(small)))
    np.testing.assert_allclose(got, want, rtol=2e-5)


def test_distill_loss_of_medusa_heads_against_scipy(models):
    """Head ``j`` at hidden position ``t`` predicts token ``t + j + 2``, distilled towards the
    target's distribution for that token (from position ``t + j + 1``)."""
    target, _, heads = models
    tokens, mask = _padded_batch()
    J = heads.num_heads
    rng = np.random.default_rng(2)
    w = rng.choice([0.0, 0.5, 1.0], (3, 9, J)).astype(np.float32) * mask[:, :, None]
    for j in range(J):
        w[:, : j + 2, j] = 0.0
    out = target.backbone(jnp.asarray(tokens), mask=jnp.asarray(mask))
    t_logits = np.asarray(target.unembed(out.hidden))
    h_logits = np.asarray(target.unembed(jax.vmap(heads, in_axes=1, out_axes=1)(out.hidden)))  # [B, T, J, V]
    num = sum(w[b, s, j] * _kl(t_logits[b, s - 1], h_logits[b, s - j - 2, j])
              for b in range(3) for s in range(9) for j in range(J) if w[b, s, j])
    got = float(distill_loss(heads, target, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(w)))
    np.testing.assert_allclose(got, num / w.sum(), rtol=2e-5)
    # all weights zero: a zero loss, not NaN
    assert float(distill_loss(heads, target, jnp.asarray(tokens), jnp.asarray(mask), jnp.zeros_like(w))) == 0.0


def test_feedback_weights_and_osd_mismatches(models):
    target, draft, heads = models
    tokens, mask = _padded_batch()
    generated = mask.copy()
    generated[:, :2] = False  # a 2-token prompt
    w = feedback_weights(draft, target, tokens, mask, generated, mismatch_only=False)
    np.testing.assert_array_equal(w[:, :, 0], generated)
    wh = feedback_weights(heads, target, tokens, mask, generated, mismatch_only=False)
    for j in range(3):  # head j needs a hidden state at s - j - 2 >= 0
        want = generated & (np.arange(9)[None] >= j + 2)
        np.testing.assert_array_equal(wh[:, :, j], want)
    # OSD: only where the draft's argmax (teacher-forced) is not the served token
    d_logits = np.asarray(draft(jnp.asarray(tokens), mask=jnp.asarray(mask)).logits)
    wrong = np.zeros_like(generated)
    wrong[:, 1:] = d_logits[:, :-1].argmax(-1) != tokens[:, 1:]
    w_osd = feedback_weights(draft, target, tokens, mask, generated, mismatch_only=True)
    np.testing.assert_array_equal(w_osd[:, :, 0], generated & wrong)
    # a draft that is the target itself and a target-greedy sequence: no mismatch at all
    seq = jaxlm.generate(target, [[3, 4]], max_new_tokens=7, temperature=0, stop_tokens=()).sequences()[0]
    t = np.asarray([seq], np.int32)
    gen = np.arange(9)[None] >= 2
    assert feedback_weights(target, target, t, np.ones_like(gen), gen, mismatch_only=True).sum() == 0


def test_ensemble_weights_and_parameter_average():
    losses = [0.37, 1.1, 0.73]
    np.testing.assert_allclose(ensemble_weights(losses, 1.2), special.softmax(-np.asarray(losses) / 1.2))
    # a diverged learner gets no weight; all diverged: uniform
    np.testing.assert_allclose(ensemble_weights([0.5, np.nan, np.inf], 1.2), [1.0, 0.0, 0.0])
    np.testing.assert_allclose(ensemble_weights([np.nan, np.nan], 1.2), [0.5, 0.5])
    np.testing.assert_allclose(ensemble_weights([2.0, 2.0, 2.0], 0.7), [1 / 3] * 3)  # ties: equal
    a = {"w": jnp.asarray([1.0, 2.0, 3.0]), "b": jnp.asarray([[0.1]], jnp.bfloat16)}
    b = {"w": jnp.asarray([-1.0, 0.5, 7.0]), "b": jnp.asarray([[0.7]], jnp.bfloat16)}
    avg = average_params([a, b], [0.3, 0.7])
    np.testing.assert_allclose(avg["w"], 0.3 * np.asarray([1.0, 2.0, 3.0]) + 0.7 * np.asarray([-1.0, 0.5, 7.0]),
                               rtol=1e-6)
    assert avg["b"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.float32(avg["b"]), 0.3 * np.float32(a["b"]) + 0.7 * np.float32(b["b"]), rtol=1e-2)


def _feedback(target, prompts, n):
    res = jaxlm.generate(target, prompts, max_new_tokens=n, temperature=0, stop_tokens=())
    seqs = res.sequences()
    W = max(map(len, seqs))
    tokens = np.zeros((len(seqs), W), np.int32)
    mask = np.zeros((len(seqs), W), bool)
    gen = np.zeros((len(seqs), W), bool)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)], mask[i, : len(s)] = s, True
        gen[i, len(s) - n: len(s)] = True
    return Feedback(tokens, mask, gen[:, :, None].astype(np.float32))


def test_sgd_momentum_persists_across_chunks(models):
    """Two chunks fitted with the optimizer state carried over equal one SGD-momentum run
    over both chunks' batches; restarting the state gives a different (momentum-free) step."""
    target, draft, _ = models
    fb1 = _feedback(target, [[1, 2, 3], [4, 5, 6, 7]], 5)
    fb2 = _feedback(target, [[9, 8], [7, 6, 5]], 6)
    lr, mu = 0.05, 0.9
    p1, s1, _ = fit_draft(draft, target, fb1, learning_rate=lr, momentum=mu, batch_size=2)
    p2, _, _ = fit_draft(draft, target, fb2, params=p1, opt_state=s1, batch_size=2)
    p2_reset, _, _ = fit_draft(draft, target, fb2, params=p1, learning_rate=lr, momentum=mu, batch_size=2)

    graphdef, params = nnx.split(draft)
    opt = optax.sgd(lr, momentum=mu)
    state = opt.init(params)
    loss = jax.jit(lambda p, t, m, w: distill_loss(nnx.merge(graphdef, p), target, t, m, w))
    grad = lambda p, fb: jax.grad(loss)(p, fb.tokens, fb.mask, fb.weights)  # noqa: E731
    snapshots = []
    for fb in (fb1, fb2):
        updates, state = opt.update(grad(params, fb), state, params)
        params = optax.apply_updates(params, updates)
        snapshots.append(params)
    p_after_1 = snapshots[0]
    for got, want in zip(jax.tree.leaves(p2), jax.tree.leaves(params)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    fresh = optax.sgd(lr, momentum=mu)
    upd, _ = fresh.update(grad(p_after_1, fb2), fresh.init(p_after_1), p_after_1)
    for got, want in zip(jax.tree.leaves(p2_reset), jax.tree.leaves(optax.apply_updates(p_after_1, upd))):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(p2_reset)))


PROMPTS = [[1, 5, 9, 17], [3], [4, 5, 6, 7, 8, 9, 10], [20, 7], [11, 12, 13], [2, 2, 2, 2, 2], [6], [8, 9]]


@pytest.mark.parametrize("method", ["static", "opt_hydra", "osd", "ensemble"])
def test_served_stream_is_the_targets_greedy_output_while_the_draft_adapts(models, method):
    target, draft, _ = models
    before = jax.tree.map(np.array, nnx.split(draft)[1])
    cfg = OnlineSpecConfig(method=method, chunk_size=3, batch_size=2, max_new_tokens=8, num_draft_tokens=3,
                           learning_rate=0.05, ensemble_learning_rates=(1e-3, 3e-2), epochs=2)
    chunks = chunked(PROMPTS, cfg.chunk_size)
    assert [len(c) for c in chunks] == [3, 3, 2]
    rep = serve_stream(target, draft, chunks, cfg, stop_tokens=(), keep_completions=True)
    plain = jaxlm.generate(target, PROMPTS, max_new_tokens=8, temperature=0, stop_tokens=()).completions()
    assert [c for ch in rep.chunks for c in ch.completions] == plain
    for ch in rep.chunks:
        assert ch.generated_tokens == 8 * ch.prompts
        # each row's first token is the prefill's; the rounds produced the rest
        assert ch.tokens_per_round == pytest.approx((ch.generated_tokens - ch.prompts) / ch.verify_rounds)
        # bookkeeping bounds, not the behaviour under test (the outputs are compared above): a
        # verify round emits at least one token and at most k drafts + the bonus
        assert 1.0 <= ch.tokens_per_round <= cfg.num_draft_tokens + 1
    # the caller's draft is never modified; the returned one changed unless static
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(nnx.split(draft)[1])):
        np.testing.assert_array_equal(a, b)
    moved = any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                         jax.tree.leaves(nnx.split(rep.draft)[1])))
    assert moved == (method != "static")
    if method == "ensemble":
        for ch in rep.chunks:
            assert len(ch.ensemble_weights) == 2 and sum(ch.ensemble_weights) == pytest.approx(1.0)


def test_ensemble_meta_draft_is_the_weighted_average_of_its_learners(models):
    target, draft, _ = models
    lrs = (1e-3, 3e-2, 0.2)
    cfg = OnlineSpecConfig(method="ensemble", chunk_size=4, batch_size=4, max_new_tokens=6, num_draft_tokens=2,
                           ensemble_learning_rates=lrs, ensemble_loss="post_fit")
    rep = serve_stream(target, draft, [PROMPTS[:4]], cfg, stop_tokens=())
    fb = _feedback(target, PROMPTS[:4], 6)
    graphdef = nnx.split(draft)[0]
    loss = jax.jit(lambda p, t, m, w: distill_loss(nnx.merge(graphdef, p), target, t, m, w))
    learners, losses = [], []
    for lr in lrs:
        p, _, _ = fit_draft(draft, target, fb, optimizer="adam", learning_rate=lr, batch_size=4, seed=0)
        learners.append(p)
        losses.append(float(loss(p, fb.tokens, fb.mask, fb.weights)))
    w = special.softmax(-np.asarray(losses) / 1.2)
    np.testing.assert_allclose(rep.chunks[0].ensemble_weights, w, rtol=1e-4)
    for got, *ps in zip(jax.tree.leaves(nnx.split(rep.draft)[1]), *map(jax.tree.leaves, learners)):
        np.testing.assert_allclose(got, sum(wk * np.asarray(p) for wk, p in zip(w, ps)), rtol=1e-4, atol=1e-6)


def test_a_diverged_learner_does_not_poison_the_draft(models):
    """A learner whose update blew up: weight 0 times NaN parameters made the meta draft NaN
    (and a running loss measured before the last update still read finite). The meta draft is
    the other learners'; a plain draft whose update diverged keeps its last parameters."""
    target, draft, _ = models
    a = {"w": jnp.asarray([1.0, 2.0])}
    np.testing.assert_array_equal(average_params([a, {"w": jnp.asarray([np.nan, np.inf])}], [1.0, 0.0])["w"], [1, 2])
    with pytest.raises(ValueError, match="must be finite, >= 0 and not all 0"):
        average_params([a, a], [0.0, 0.0])
    prompts = [[3, 4, 5], [7, 8], [1, 2, 9, 10], [11]]
    cfg = OnlineSpecConfig(method="ensemble", chunk_size=4, batch_size=4, max_new_tokens=6, num_draft_tokens=2,
                           ensemble_learning_rates=(1e-3, 1e10), ensemble_epochs=2)
    rep = serve_stream(target, draft, [prompts], cfg, stop_tokens=(), warmup=False)
    assert rep.chunks[0].ensemble_weights == [1.0, 0.0] and np.isfinite(rep.chunks[0].train_loss)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.split(rep.draft)[1]))
    for method in ("ensemble", "opt_hydra"):
        kw = dict(ensemble_learning_rates=(1e10, 1e12)) if method == "ensemble" else dict(learning_rate=1e12)
        cfg = OnlineSpecConfig(method=method, chunk_size=4, batch_size=4, max_new_tokens=6, num_draft_tokens=2,
                               epochs=2, ensemble_epochs=2, **kw)
        rep = serve_stream(target, draft, [prompts], cfg, stop_tokens=(), warmup=False)
        assert rep.chunks[0].train_loss == np.inf
        for got, want in zip(jax.tree.leaves(nnx.split(rep.draft)[1]), jax.tree.leaves(nnx.split(draft)[1])):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("field,value", [
    ("method", "hedge"), ("chunk_size", 0), ("batch_size", 2.5), ("epochs", True), ("optimizer", "rmsprop"),
    ("learning_rate", 0.0), ("learning_rate", float("nan")), ("momentum", 1.0), ("temperature", -1.0),
    ("temperature", float("nan")), ("temperature", float("inf")),
    ("ensemble_learning_rates", ()), ("ensemble_learning_rates", [1e-3]), ("ensemble_learning_rates", (1e-3, -1.0)),
    ("ensemble_temperature", 0.0), ("ensemble_loss", "final"), ("persist_optimizer_state", 1),
])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"OnlineSpecConfig.{field}="):
        OnlineSpecConfig(**{field: value})


def test_numpy_integers_are_ints_and_the_ensemble_temperature_is_checked():
    from jaxlm.inference.online_spec import ensemble_weights

    assert OnlineSpecConfig(num_draft_tokens=np.int64(3)).num_draft_tokens == 3
    for bad in (0.0, float("nan")):  # 0 gave NaN weights
        with pytest.raises(ValueError, match="temperature=.* is invalid"):
            ensemble_weights([1.0, 2.0], bad)


def test_presets_and_bad_stream(models):
    assert OnlineSpecConfig.preset("opt_hydra") == OnlineSpecConfig(method="opt_hydra", chunk_size=80)
    assert OnlineSpecConfig.preset("ens_eagle").ensemble_learning_rates == (5e-4, 1e-3, 1e-1)
    assert OnlineSpecConfig.preset("osd", chunk_size=5).chunk_size == 5
    with pytest.raises(ValueError, match="preset='hydra' is unknown"):
        OnlineSpecConfig.preset("hydra")
    target, draft, _ = models
    with pytest.raises(ValueError, match="chunks is empty"):
        serve_stream(target, draft, [], OnlineSpecConfig(method="static"))
    with pytest.raises(TypeError, match="config must be an OnlineSpecConfig"):
        serve_stream(target, draft, [PROMPTS], {"method": "static"})
    with pytest.raises(ValueError, match="num_draft_tokens=9 exceeds the draft's num_heads=3"):
        serve_stream(target, models[2], [PROMPTS], OnlineSpecConfig(method="static", num_draft_tokens=9, max_new_tokens=8))


def _bench():
    path = Path(__file__).resolve().parents[2] / "bench" / "online_spec.py"
    spec = importlib.util.spec_from_file_location("bench_online_spec", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # trains a target and a draft, serves a 6-chunk stream 5 times (~16 s): kept out of CI's time budget
def test_adapted_draft_beats_the_static_draft_after_a_shift_in_the_task_mix():
    bench = _bench()
    target, draft = bench.make_pair()
    before, n = 2, 24
    stream = bench.shifted_stream(before=before, after=4, chunk=16)
    methods = {k: bench.METHODS[k] for k in ("static", "opt_hydra", "ensemble")}
    methods.update({k: v for k, v in bench.METHODS.items() if k.startswith("ensemble of one")})
    res = bench.run(target, draft, stream, before=before, max_new_tokens=n, batch=8, methods=methods,
                    plain=bench.plain_greedy(target, stream, n))  # raises unless outputs == plain greedy
    tpr = {k: v[1] for k, v in res.items()}
    tps = {k: v[2] for k, v in res.items()}
    print({k: round(v, 2) for k, v in tpr.items()}, {k: round(v) for k, v in tps.items()})
    static_before = res["static"][0].mean("tokens_per_round", slice(0, before))
    assert static_before > 4.0 and tpr["static"] < 1.5  # the shift breaks the offline draft
    assert tpr["opt_hydra"] > 2 * tpr["static"]
    assert tps["opt_hydra"] > 1.2 * tps["static"]
    singles = [v for k, v in tpr.items() if k.startswith("ensemble of one")]
    assert tpr["ensemble"] >= max(singles) and tpr["ensemble"] > tpr["static"]


def test_tokens_per_round_is_mean_accepted_plus_one_with_a_perfect_draft():
    """The target as its own draft accepts every draft: k + 1 tokens per round exactly, not
    more (the prefill's first token is no round's)."""
    target = jaxlm.build_model(jaxlm.ModelConfig.tiny(d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64, n_layers=1),
                               seed=0)
    cfg = OnlineSpecConfig(method="static", num_draft_tokens=3, max_new_tokens=9, temperature=0.0, chunk_size=2)
    rep = serve_stream(target, target, chunked([[1, 5, 6], [1, 7]], 2), cfg, stop_tokens=())
    (ch,) = rep.chunks
    assert ch.accept_rate == 1.0 and ch.tokens_per_round == 4.0 and rep.mean("tokens_per_round") == 4.0
    # a last round cut short by the token limit (8 = 1 + 4 + 3): its needless drafts are not rejections
    cut = serve_stream(target, target, chunked([[1, 5, 6], [1, 7]], 2),
                       dataclasses.replace(cfg, max_new_tokens=8), stop_tokens=())
    assert cut.chunks[0].accept_rate == 1.0
