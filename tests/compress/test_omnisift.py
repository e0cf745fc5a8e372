"""OmniSIFT: pruning picks exactly the most redundant patches on constructed clips (against a
numpy ranking), the straight-through mask's forward and gradient, retention 1.0 is no
compression, the kept counts, that only the selector trains, and the score-function
estimator (Plackett-Luce probabilities, Gumbel top-k frequencies, unbiased gradient)."""

import itertools
from fractions import Fraction

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlm
from jaxlm.compress.omnisift import AudioSelector, ClipLayout, OmniSIFTConfig, audio_logits, compress, drop_highest, \
    gumbel_top_k, plackett_luce_logprob, random_keep, selector_loss, spatial_redundancy, straight_through, \
    temporal_redundancy, video_keep
from jaxlm.data.tokenizers import ByteTokenizer
from jaxlm.inference.omni import omni_inputs_embeds
from jaxlm.models.omni import AudioVisual, OmniConfig, batch_sequences, build_omni, build_sequence

TOK = ByteTokenizer()


def np_cos(a, b):
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.fixture(scope="module")
def model():
    lm = jaxlm.ModelConfig.tiny(vocab_size=261, rope="mrope", max_seq_len=256, init_std=0.2)
    return build_omni(OmniConfig(lm=lm, patch_dim=8, audio_dim=4, video_token_id=259, audio_token_id=260,
                                 encoder_hidden=32), seed=0, tokenizer=TOK)


def clip(rng, F=4, g=3, na=8):
    return AudioVisual(rng.normal(size=(F, g, g, 8)).astype(np.float32), rng.normal(size=(na, 4)).astype(np.float32),
                       frames_per_chunk=2, frame_ticks=2)


def test_spatial_pruning_drops_the_patches_most_like_the_frame_mean():
    rng = np.random.default_rng(0)
    base = rng.normal(size=16)
    frame = base + 0.05 * rng.normal(size=(9, 16))  # background: near the mean
    frame[[2, 7]] = rng.normal(size=(2, 16)) * 3  # two distinct patches
    keep = np.asarray(drop_highest(spatial_redundancy(jnp.asarray(frame)), 7))
    assert np.flatnonzero(keep).tolist() == [2, 7]
    # the general case against a numpy ranking
    f = rng.normal(size=(3, 10, 6))
    score = np_cos(f, f.mean(1, keepdims=True))
    for k in (0, 3, 9):
        got = np.asarray(drop_highest(spatial_redundancy(jnp.asarray(f)), k))
        for b in range(3):
            assert set(np.flatnonzero(~got[b])) == set(np.argsort(-score[b])[:k])


def test_temporal_pruning_keeps_what_changed_at_each_location():
    rng = np.random.default_rng(1)
    prev = rng.normal(size=(9, 16))
    cur = prev + 0.01 * rng.normal(size=(9, 16))
    cur[[0, 5, 6]] = rng.normal(size=(3, 16))
    keep = np.asarray(drop_highest(temporal_redundancy(jnp.asarray(cur), jnp.asarray(prev)), 6))
    assert np.flatnonzero(keep).tolist() == [0, 5, 6]


def test_ties_drop_the_earlier_index_first():
    keep = np.asarray(drop_highest(jnp.asarray([1.0, 1.0, 0.0, 1.0]), 2))
    assert keep.tolist() == [False, False, True, True]


def test_video_keep_uses_spatial_then_temporal_per_chunk():
    rng = np.random.default_rng(2)
    seq = build_sequence(["q", clip(rng)], TOK, OmniConfig(
        lm=jaxlm.ModelConfig.tiny(vocab_size=261), patch_dim=8, audio_dim=4, video_token_id=259, audio_token_id=260))
    lay = ClipLayout.of(seq)
    video = rng.normal(size=(1, 4, 9, 5))
    cfg = OmniSIFTConfig(video_ratio=0.5)
    got = np.asarray(video_keep(jnp.asarray(video), lay, cfg))[0]
    for f in range(4):
        ref = np_cos(video[0, f], video[0, f].mean(0)) if f % 2 == 0 else np_cos(video[0, f], video[0, f - 1])
        assert set(np.flatnonzero(~got[f])) == set(np.argsort(-ref)[:4]), f


def test_straight_through_forward_is_hard_and_gradient_is_soft():
    s = jnp.asarray([0.2, 0.9, 0.6, 0.4])
    keep = jnp.asarray([False, True, True, False])
    np.testing.assert_array_equal(straight_through(s, keep), keep.astype(jnp.float32))
    w = jnp.asarray([1.0, -2.0, 3.0, 0.5])
    g_ste = jax.grad(lambda s: jnp.sum(straight_through(s, keep) * w))(s)
    g_soft = jax.grad(lambda s: jnp.sum(s * w))(s)
    np.testing.assert_array_equal(g_ste, g_soft)


def batch_of(model, n=2, seed=3):
    rng = np.random.default_rng(seed)
    seqs = [build_sequence([[TOK.bos_id], "what?", clip(rng)], TOK, model.config) for _ in range(n)]
    b = batch_sequences(seqs, TOK.pad_id)
    E = omni_inputs_embeds(model, b["tokens"], b["video"], b["audio"])
    return seqs, b, E


def test_retention_one_is_no_compression(model):
    seqs, b, E = batch_of(model)
    lay = ClipLayout.of(seqs[0])
    cfg = OmniSIFTConfig.retention(1.0)
    sel = AudioSelector(model.config.lm.d_model, cfg, rngs=nnx.Rngs(0))
    c = compress(sel, E, jnp.asarray(b["positions"]), jnp.asarray(b["mask"]), jnp.asarray(b["tokens"]), lay, cfg)
    np.testing.assert_array_equal(c.index, np.broadcast_to(np.arange(E.shape[1]), c.index.shape))
    np.testing.assert_array_equal(c.embeds, E)
    g, st = nnx.split(model.lm)
    lm = jax.jit(lambda t, p, e: nnx.merge(g, st)(t, p, embeds=e).logits)
    np.testing.assert_array_equal(lm(c.tokens, c.positions, c.embeds), lm(jnp.asarray(b["tokens"]),
                                                                           jnp.asarray(b["positions"]), E))


@pytest.mark.parametrize("rho", [0.25, 0.35, 0.5])
def test_kept_counts_order_and_positions(model, rho):
    seqs, b, E = batch_of(model)
    lay = ClipLayout.of(seqs[0])
    cfg = OmniSIFTConfig.retention(rho)
    sel = AudioSelector(model.config.lm.d_model, cfg, rngs=nnx.Rngs(0))
    args = (E, jnp.asarray(b["positions"]), jnp.asarray(b["mask"]), jnp.asarray(b["tokens"]), lay, cfg)
    for c in (compress(sel, *args), random_keep(jax.random.key(0), *args)):
        idx = np.asarray(c.index)
        assert idx.shape == (2, lay.kept_length(cfg))
        assert (np.diff(idx, axis=1) > 0).all()  # sequence order kept
        np.testing.assert_array_equal(c.positions, np.take_along_axis(b["positions"], idx[..., None], 1))
        kinds = seqs[0].kind[idx]
        F, P = lay.frames.shape
        C, A = lay.audio.shape
        drop = lambda n: int(n * (1 - Fraction(str(rho))))  # noqa: E731  exact floor(n (1 - rho))
        assert (kinds == 1).sum(1).tolist() == [F * (P - drop(P))] * 2
        assert (kinds == 2).sum(1).tolist() == [C * (A - drop(A))] * 2
        assert (kinds == 0).sum(1).tolist() == [len(lay.text)] * 2  # text is never dropped


def test_audio_selector_keeps_the_top_scores_and_only_it_trains(model):
    seqs, b, E = batch_of(model)
    lay = ClipLayout.of(seqs[0])
    cfg = OmniSIFTConfig(video_ratio=0.5, audio_ratio=0.5, selector_dim=16, selector_heads=2)
    sel = AudioSelector(model.config.lm.d_model, cfg, rngs=nnx.Rngs(1))
    args = (jnp.asarray(b["positions"]), jnp.asarray(b["mask"]), jnp.asarray(b["tokens"]), lay, cfg)
    c = compress(sel, E, *args)
    kept_audio = [set(np.asarray(c.index[0])) & set(lay.audio[ch]) for ch in range(lay.audio.shape[0])]
    for ch, kept in enumerate(kept_audio):
        top = lay.audio[ch][np.argsort(-np.asarray(c.audio_scores[0, ch]))[: len(kept)]]
        assert kept == set(top)
    graphdef, sel_state = nnx.split(sel)
    lm_graph, lm_state = nnx.split(model.lm)
    target = jnp.asarray(TOK.encode("Z"))[0]

    def loss(state):
        cc = compress(nnx.merge(graphdef, state), E, *args)
        logits = nnx.merge(lm_graph, lm_state)(cc.tokens, cc.positions, embeds=cc.embeds).logits[:, -1]
        return -jnp.mean(jax.nn.log_softmax(logits)[:, target])
    grads = jax.jit(jax.grad(loss))(sel_state)
    # the scores carry the task gradient into every selector weight matrix (the LM is not an argument)
    assert all(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(grads) if g.ndim == 2)
    # the forward uses the hard mask: kept audio embeddings enter unscaled
    np.testing.assert_array_equal(c.embeds, jnp.take_along_axis(E, c.index[..., None], axis=1))


def test_retention_drops_exactly_floor_n_times_one_minus_rho():
    """1 - 0.9 is 0.0999...98 in binary: 10 tokens at retention 0.9 dropped none (19 of the
    (rho, n) pairs on this grid were off by one)."""
    from jaxlm.compress.omnisift import dropped

    for k in range(1, 21):
        rho = k / 20
        cfg = OmniSIFTConfig.retention(rho) if rho < 1 else None
        for n in range(1, 65):
            want = int(n * (1 - Fraction(str(rho))))
            if cfg is not None:
                assert dropped(n, cfg.video_ratio) == want == dropped(n, cfg.audio_ratio), (rho, n)


def test_a_batch_whose_rows_have_media_elsewhere_is_refused(model):
    """Left-padded rows with different text after the clip put their media at other indices:
    one layout would prune their text silently."""
    rng = np.random.default_rng(3)
    seqs = [build_sequence([[TOK.bos_id], "what?", clip(rng), tail], TOK, model.config) for tail in ("a", "longer")]
    b = batch_sequences(seqs, TOK.pad_id)
    E = omni_inputs_embeds(model, b["tokens"], b["video"], b["audio"])
    lay = ClipLayout.of(seqs[0], pad=b["tokens"].shape[1] - len(seqs[0].tokens))
    cfg = OmniSIFTConfig(video_ratio=0.5, audio_ratio=0.5, selector_dim=16, selector_heads=2)
    sel = AudioSelector(model.config.lm.d_model, cfg, rngs=nnx.Rngs(0))
    args = (E, jnp.asarray(b["positions"]), jnp.asarray(b["mask"]), jnp.asarray(b["tokens"]), lay, cfg)
    with pytest.raises(ValueError, match="row 1 has no video placeholder at the layout's video positions"):
        compress(sel, *args)
    with pytest.raises(ValueError, match="row 1 has no video placeholder"):
        random_keep(jax.random.key(0), *args)


def test_layout_needs_an_audio_visual_clip(model):
    seq = build_sequence(["plain text"], TOK, model.config)
    with pytest.raises(ValueError, match="AudioVisual"):
        ClipLayout.of(seq)
    # two clips: the second's frame ids overwrote the first's, silently (48 of 72 video tokens kept at 0.25)
    rng = np.random.default_rng(0)
    two = build_sequence([[TOK.bos_id], clip(rng), "and", clip(rng), "?"], TOK, model.config)
    with pytest.raises(ValueError, match="one AudioVisual clip per sequence"):
        ClipLayout.of(two)
    with pytest.raises(ValueError, match="video_ratio"):
        OmniSIFTConfig(video_ratio=1.0)
    with pytest.raises(ValueError, match="estimator='gumbel'"):
        OmniSIFTConfig(estimator="gumbel")
    with pytest.raises(ValueError, match="samples=1"):
        OmniSIFTConfig(estimator="score_function", samples=1)
    for kwargs, match in [(dict(selector_heads=0), "selector_heads=0 must be an int >= 1"),
                          (dict(selector_heads=-4), "selector_heads=-4 must be an int >= 1"),
                          (dict(estimator="score_function", samples=2.5), "samples=2.5 must be an int >= 1")]:
        with pytest.raises(ValueError, match=match):
            OmniSIFTConfig(**kwargs)


def sequential_probability(p, order):
    """P(drawing ``order`` one by one without replacement with probabilities ``p [..., N]``)."""
    prob, left = 1.0, 1.0
    for o in order:
        prob = prob * p[..., o] / left
        left = left - p[..., o]
    return prob


def test_plackett_luce_logprob_is_sequential_sampling_without_replacement():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(3, 5)) * 2
    for k in (1, 2, 3):
        orders = np.asarray(list(itertools.permutations(range(5), k)))  # [M, k]
        got = np.exp(np.asarray(plackett_luce_logprob(jnp.asarray(logits)[:, None], jnp.asarray(orders)[None])))
        for b in range(3):
            p = np.exp(logits[b]) / np.exp(logits[b]).sum()
            ref = [sequential_probability(p, o) for o in orders]
            np.testing.assert_allclose(got[b], ref, rtol=1e-5)
            assert abs(got[b].sum() - 1) < 1e-5


def test_gumbel_top_k_draws_sets_with_their_plackett_luce_probability():
    logits = jnp.asarray([1.0, -0.5, 0.3, 2.0])
    n = 40_000
    draws = np.sort(np.asarray(gumbel_top_k(jax.random.key(0), logits, 2, n)), -1)
    p = np.exp(np.asarray(logits)) / np.exp(np.asarray(logits)).sum()
    for pair in itertools.combinations(range(4), 2):
        exact = sum(sequential_probability(p, o) for o in itertools.permutations(pair))
        freq = np.mean((draws == pair).all(-1))
        assert abs(freq - exact) < 5 * np.sqrt(exact * (1 - exact) / n), (pair, freq, exact)
    assert (np.diff(draws, axis=-1) > 0).all()  # without replacement


def test_score_function_gradient_is_unbiased_for_the_expected_loss(model):
    """The mean of many estimator gradients equals the exact gradient of the expected loss,
    enumerated over every keep order of both chunks (2 of 4 audio tokens each)."""
    seqs, b, E = batch_of(model)
    lay = ClipLayout.of(seqs[0])
    cfg = OmniSIFTConfig(video_ratio=0.5, audio_ratio=0.5, selector_dim=8, selector_heads=2,
                         estimator="score_function", samples=3)
    graphdef, sel_state = nnx.split(AudioSelector(model.config.lm.d_model, cfg, rngs=nnx.Rngs(2)))
    C, A = lay.audio.shape
    value = np.zeros(lay.length, np.float32)
    value[lay.audio.reshape(-1)] = np.random.default_rng(5).normal(size=C * A)
    value = jnp.asarray(value)
    args = (jnp.asarray(b["positions"]), jnp.asarray(b["mask"]), jnp.asarray(b["tokens"]), lay, cfg)

    def row_loss(c):  # a loss that depends on the kept set, not additively
        return jnp.square(value[c.index].sum(-1))

    def objective(state, rng):
        return selector_loss(nnx.merge(graphdef, state), row_loss, E, *args, rng)[0]

    def expected_loss(state):
        _, logits = audio_logits(nnx.merge(graphdef, state), E, lay, cfg)
        p = jax.nn.softmax(logits, -1)  # [B, C, A]
        total = 0.0
        orders = list(itertools.permutations(range(A), 2))
        for o0, o1 in itertools.product(orders, orders):
            prob = sequential_probability(p[:, 0], o0) * sequential_probability(p[:, 1], o1)
            kept = sum(value[lay.audio[0, i]] for i in o0) + sum(value[lay.audio[1, i]] for i in o1)
            total = total + prob * kept ** 2
        return jnp.mean(total)

    exact = jax.flatten_util.ravel_pytree(jax.grad(expected_loss)(sel_state))[0]
    n = 4000
    draws = jax.jit(jax.vmap(lambda r: jax.flatten_util.ravel_pytree(jax.grad(objective)(sel_state, r))[0]))(
        jax.random.split(jax.random.key(1), n))
    mean, se = draws.mean(0), draws.std(0) / np.sqrt(n)
    assert float(jnp.abs(exact).max()) > 1e-3  # the check is not vacuous
    np.testing.assert_array_less(jnp.abs(mean - exact), 5 * se + 1e-6)
    # the STE estimator's objective is the compressed forward's mean loss
    ste = OmniSIFTConfig(video_ratio=0.5, audio_ratio=0.5, selector_dim=8, selector_heads=2)
    sel = nnx.merge(graphdef, sel_state)
    obj, loss = selector_loss(sel, row_loss, E, *args[:-1], ste)
    assert obj == loss == jnp.mean(row_loss(compress(sel, E, *args[:-1], ste)))
