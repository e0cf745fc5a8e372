"""OmniSIFT: pruning picks exactly the most redundant patches on constructed clips (against a
numpy ranking), the straight-through mask's forward and gradient, retention 1.0 is no
compression, the kept counts, and that only the selector trains."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlm
from jaxlm.compress.omnisift import AudioSelector, ClipLayout, OmniSIFTConfig, compress, drop_highest, random_keep, \
    spatial_redundancy, straight_through, temporal_redundancy, video_keep
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
        assert (kinds == 1).sum(1).tolist() == [F * (P - int(P * (1 - rho)))] * 2
        assert (kinds == 2).sum(1).tolist() == [C * (A - int(A * (1 - rho)))] * 2
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


def test_layout_needs_an_audio_visual_clip(model):
    seq = build_sequence(["plain text"], TOK, model.config)
    with pytest.raises(ValueError, match="AudioVisual"):
        ClipLayout.of(seq)
    with pytest.raises(ValueError, match="video_ratio"):
        OmniSIFTConfig(video_ratio=1.0)
