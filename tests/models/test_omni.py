"""The omni front end: three-axis RoPE against a reference written from Qwen2-VL's
definition, positions and splicing on hand-built cases, text-only inputs bit-identical to
the text model, media-shape errors, and generation with media against a no-cache forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlm
from jaxlm.data.tokenizers import ByteTokenizer
from jaxlm.inference.omni import omni_generate, omni_inputs_embeds
from jaxlm.models.layers.rope import apply_rope, multimodal_rope
from jaxlm.models.omni import Audio, AudioVisual, OmniConfig, Video, batch_sequences, build_omni, build_sequence, \
    check_media, load_omni, save_omni, splice

TOK = ByteTokenizer()
VID, AUD = 259, 260


def omni_config(**lm_kw):
    lm = jaxlm.ModelConfig.tiny(vocab_size=261, rope="mrope", max_seq_len=256, init_std=0.2, **lm_kw)
    return OmniConfig(lm=lm, patch_dim=12, audio_dim=6, video_token_id=VID, audio_token_id=AUD, encoder_hidden=32)


@pytest.fixture(scope="module")
def model():
    return build_omni(omni_config(), seed=0, tokenizer=TOK)


def jitted_logits(model):
    """The model's forward as one compiled program (eager NNX dispatches op by op)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def logits(tokens, positions, video, audio, mask):
        return nnx.merge(graphdef, state)(tokens, positions, video=video, audio=audio, mask=mask).logits
    return logits


def reference_mrope(x, positions, section, theta):
    """Qwen2-VL's `apply_multimodal_rotary_pos_emb`, in numpy: cos/sin per axis in the
    rotate-half layout [3, B, T, H], split along H into ``section * 2`` chunks, chunk i taken
    from axis i % 3."""
    H = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, H, 2, dtype=np.float64) / H)
    ang = positions.transpose(2, 0, 1)[..., None].astype(np.float64) * inv  # [3, B, T, H/2]
    emb = np.concatenate([ang, ang], -1)
    cos, sin = np.cos(emb), np.sin(emb)
    bounds = np.cumsum(list(section) * 2)[:-1]
    pick = lambda a: np.concatenate([c[i % 3] for i, c in enumerate(np.split(a, bounds, axis=-1))], -1)
    cos, sin = pick(cos)[:, :, None], pick(sin)[:, :, None]
    rot = np.concatenate([-x[..., H // 2:], x[..., : H // 2]], -1)
    return x * cos + rot * sin


@pytest.mark.parametrize("section", [None, (2, 3, 3), (0, 8, 0)])
def test_mrope_matches_the_qwen2_vl_definition(section):
    cfg = jaxlm.ModelConfig.tiny(rope="mrope", mrope_section=section)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 3, cfg.head_dim)).astype(np.float32)
    pos = rng.integers(0, 50, size=(2, 5, 3)).astype(np.int32)
    got = multimodal_rope(jnp.asarray(x), jnp.asarray(pos), cfg)
    sec = section or (2, 3, 3)  # the default at head_dim 16: a quarter for time
    np.testing.assert_allclose(np.asarray(got), reference_mrope(x, pos, sec, cfg.rope_theta), atol=2e-5)


def test_mrope_on_the_diagonal_is_standard_rope_exactly():
    cfg = jaxlm.ModelConfig.tiny(rope="mrope")
    x = jnp.asarray(np.random.default_rng(1).normal(size=(1, 6, 2, cfg.head_dim)), jnp.float32)
    p = jnp.arange(6, dtype=jnp.int32)[None] + 3
    np.testing.assert_array_equal(multimodal_rope(x, jnp.stack([p] * 3, -1), cfg), apply_rope(x, p, cfg))


def test_bad_mrope_section_names_the_field():
    with pytest.raises(ValueError, match="mrope_section"):
        jaxlm.ModelConfig.tiny(rope="mrope", mrope_section=(1, 2, 3))


def test_positions_of_text_video_audio_hand_built():
    cfg = omni_config()
    frames = np.arange(2 * 2 * 2 * 12, dtype=np.float32).reshape(2, 2, 2, 12)
    seq = build_sequence(["ab", Video(frames), "c", Audio(np.ones((3, 6)), audio_ticks=2), "d"], TOK, cfg)
    expected = ([(0, 0, 0), (1, 1, 1)]
                + [(2, 2, 2), (2, 2, 3), (2, 3, 2), (2, 3, 3), (3, 2, 2), (3, 2, 3), (3, 3, 2), (3, 3, 3)]
                + [(4, 4, 4)] + [(5, 5, 5), (7, 7, 7), (9, 9, 9)] + [(10, 10, 10)])
    assert seq.positions.tolist() == [list(p) for p in expected]
    assert seq.tokens.tolist() == TOK.encode("ab") + [VID] * 8 + TOK.encode("c") + [AUD] * 3 + TOK.encode("d")
    np.testing.assert_array_equal(seq.video, frames.reshape(8, 12))  # row-major: frame, row, column
    assert seq.kind.tolist() == [0, 0] + [1] * 8 + [0] + [2] * 3 + [0]


def test_audio_visual_chunks_interleave_on_one_time_axis():
    cfg = omni_config()
    video = np.zeros((4, 1, 2, 12), np.float32)
    seq = build_sequence(["x", AudioVisual(video, np.zeros((8, 6)), frames_per_chunk=2, frame_ticks=2)], TOK, cfg)
    t = seq.positions[:, 0].tolist()
    # chunk 0: frames 0, 1 (t = 1, 3), audio 0..3 (t = 1..4); chunk 1: frames 2, 3 (t = 5, 7), audio 4..7
    assert t == [0, 1, 1, 3, 3, 1, 2, 3, 4, 5, 5, 7, 7, 5, 6, 7, 8]
    assert seq.chunk.tolist() == [-1] + [0] * 8 + [1] * 8
    assert seq.kind.tolist() == [0] + [1] * 4 + [2] * 4 + [1] * 4 + [2] * 4


def test_splice_places_the_kth_media_row_at_the_kth_placeholder():
    x = jnp.zeros((2, 5, 3))
    tokens = jnp.asarray([[7, VID, 7, VID, VID], [VID, 7, 7, 7, 7]])
    media = jnp.arange(2 * 3 * 3, dtype=jnp.float32).reshape(2, 3, 3) + 1
    got = np.asarray(splice(x, tokens, VID, media))
    np.testing.assert_array_equal(got[0, [1, 3, 4]], media[0])
    np.testing.assert_array_equal(got[1, 0], media[1, 0])
    assert not got[0, [0, 2]].any() and not got[1, 1:].any()


def test_text_only_inputs_are_bit_identical_to_the_text_model(model):
    ids = jnp.asarray([TOK.encode("hello omni", add_bos=True)])
    plain = model.lm(ids).logits
    diag = jnp.stack([jnp.arange(ids.shape[1], dtype=jnp.int32)[None]] * 3, -1)
    np.testing.assert_array_equal(model(ids).logits, plain)
    np.testing.assert_array_equal(model(ids, diag).logits, plain)
    prompts = ["hi", "a longer prompt"]
    seqs = [build_sequence([[TOK.bos_id], p], TOK, model.config) for p in prompts]
    got = omni_generate(model, batch_sequences(seqs, TOK.pad_id), max_new_tokens=6)
    ref = jaxlm.generate(model.lm, prompts, max_new_tokens=6, temperature=0, bucket=1)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))


def test_media_embeddings_reach_the_logits(model):
    rng = np.random.default_rng(0)
    a = build_sequence([[TOK.bos_id], Video(rng.normal(size=(1, 2, 2, 12))), "?"], TOK, model.config)
    b = build_sequence([[TOK.bos_id], Video(rng.normal(size=(1, 2, 2, 12))), "?"], TOK, model.config)
    batch = batch_sequences([a, b], TOK.pad_id)
    logits = jitted_logits(model)(jnp.asarray(batch["tokens"]), jnp.asarray(batch["positions"]),
                                  jnp.asarray(batch["video"]), None, jnp.asarray(batch["mask"]))
    assert not np.allclose(logits[0, -1], logits[1, -1])
    E = omni_inputs_embeds(model, batch["tokens"], batch["video"])
    enc = model.video_encoder(jnp.asarray(batch["video"]))
    np.testing.assert_allclose(E[0, 1:5], enc[0], atol=1e-6)
    np.testing.assert_array_equal(E[0, 0], model.lm.embed[...][TOK.bos_id])


def test_generation_with_media_continues_the_positions(model):
    rng = np.random.default_rng(2)
    clip = AudioVisual(rng.normal(size=(2, 2, 2, 12)), rng.normal(size=(4, 6)), frames_per_chunk=2, frame_ticks=3)
    seqs = [build_sequence([[TOK.bos_id], "see", clip, "say"], TOK, model.config),
            build_sequence([[TOK.bos_id], clip, "?"], TOK, model.config)]
    batch = batch_sequences(seqs, TOK.pad_id)
    N = 3
    got = np.asarray(omni_generate(model, batch, max_new_tokens=N, stop_tokens=()).tokens)
    logits = jitted_logits(model)
    L = max(len(s.tokens) for s in seqs) + N  # one right-padded width: causal, so padding changes nothing
    for b, s in enumerate(seqs):  # no cache: the whole sequence each step, positions continuing at max + 1
        n = len(s.tokens)
        toks = np.full((1, L), TOK.pad_id, np.int32)
        pos = np.zeros((1, L, 3), np.int32)
        toks[0, :n], pos[0, :n] = s.tokens, s.positions
        nxt = int(s.positions.max()) + 1
        for j in range(N):
            out = logits(jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(s.video[None]), jnp.asarray(s.audio[None]),
                         jnp.asarray(np.arange(L)[None] < n + j))
            t = int(jnp.argmax(out[0, n + j - 1]))
            assert t == got[b, j], (b, j)
            toks[0, n + j] = t
            pos[0, n + j] = nxt + j


@pytest.mark.parametrize("video,audio,match", [
    (np.zeros((1, 4, 5)), None, "video must be \\[B=1, N, 12\\]"),
    (np.zeros((1, 2, 12)), None, "video has 2 entries per row but a row holds 4"),
    (None, None, "4 video placeholders but no video"),
    (np.zeros((1, 4, 12)), np.zeros((1, 1, 6)), None),
])
def test_media_of_the_wrong_shape_is_a_clear_error(model, video, audio, match):
    tokens = jnp.asarray([[TOK.bos_id] + [VID] * 4 + [65]])
    if match is None:
        check_media(tokens, video, audio, model.config)  # extra media rows are allowed
    else:
        with pytest.raises(ValueError, match=match):
            model(tokens, video=video, audio=audio)


def test_bad_pieces_and_config():
    cfg = omni_config()
    with pytest.raises(ValueError, match="patch_dim=12"):
        build_sequence([Video(np.zeros((1, 2, 2, 5)))], TOK, cfg)
    with pytest.raises(TypeError, match="a piece must be"):
        build_sequence([3.5], TOK, cfg)
    # fewer than one tick per frame moves positions backwards, onto earlier tokens
    for piece, match in [(lambda: Video(np.zeros((2, 2, 2, 12)), frame_ticks=-1), r"Video.frame_ticks=-1 is invalid"),
                         (lambda: Audio(np.zeros((3, 6)), audio_ticks=-2), r"Audio.audio_ticks=-2 is invalid"),
                         (lambda: Video(np.zeros((2, 2, 2, 12)), frame_ticks=1.5), r"Video.frame_ticks=1.5 is invalid"),
                         (lambda: Audio(np.zeros((3, 6)), audio_ticks=True), r"Audio.audio_ticks=True is invalid")]:
        with pytest.raises(ValueError, match=match):
            piece()
    with pytest.raises(ValueError, match="AudioVisual.video has no frames"):  # its audio would be dropped
        AudioVisual(np.zeros((0, 2, 2, 12)), np.zeros((5, 6)))
    with pytest.raises(ValueError, match="AudioVisual.frames_per_chunk=0 is invalid"):
        AudioVisual(np.zeros((2, 2, 2, 12)), np.zeros((5, 6)), frames_per_chunk=0)
    with pytest.raises(ValueError, match="audio_token_id"):
        OmniConfig(lm=cfg.lm, patch_dim=4, audio_dim=4, video_token_id=VID, audio_token_id=999)
    with pytest.raises(ValueError, match="OmniConfig.video_token_id=True must be an int token id"):  # was id 1
        OmniConfig(lm=cfg.lm, patch_dim=4, audio_dim=4, video_token_id=True, audio_token_id=AUD)
    numpy_ids = OmniConfig(lm=cfg.lm, patch_dim=4, audio_dim=4, video_token_id=np.int64(VID),
                           audio_token_id=np.int32(AUD))  # refused as "not in [0, 261)" before
    assert (numpy_ids.video_token_id, numpy_ids.audio_token_id) == (VID, AUD)
    assert type(numpy_ids.video_token_id) is int


@pytest.mark.parametrize("kw, match", [
    (dict(max_new_tokens=0), r"max_new_tokens=0 is invalid: must be a positive int"),  # IndexError before
    (dict(max_new_tokens=2.5), r"max_new_tokens=2.5 is invalid"),
    (dict(max_new_tokens=True), r"max_new_tokens=True is invalid"),
    (dict(max_new_tokens=250), r"prompt width 7 \+ max_new_tokens 250 = 257 exceeds ModelConfig.max_seq_len=256"),
    (dict(max_new_tokens=2, temperature=float("nan")), r"temperature=nan is invalid"),
    (dict(max_new_tokens=2, stop_tokens=[999]), r"stop_tokens \[999\] are outside"),
])
def test_bad_generation_settings_are_named(model, kw, match):
    seq = build_sequence([[TOK.bos_id], Video(np.zeros((1, 2, 2, 12))), "AB"], TOK, model.config)
    assert len(seq.tokens) == 7  # BOS, four patches, two bytes
    batch = batch_sequences([seq], TOK.pad_id)
    with pytest.raises(ValueError, match=match):
        omni_generate(model, batch, **kw)


def test_checkpoint_round_trip_is_exact(model, tmp_path):
    rng = np.random.default_rng(4)
    seq = build_sequence([[TOK.bos_id], Video(rng.normal(size=(1, 2, 2, 12))), Audio(rng.normal(size=(2, 6))), "x"],
                         TOK, model.config)
    b = batch_sequences([seq], TOK.pad_id)
    args = tuple(jnp.asarray(b[k]) for k in ("tokens", "positions", "video", "audio", "mask"))
    save_omni(model, tmp_path / "omni")
    back = load_omni(tmp_path / "omni")
    np.testing.assert_array_equal(jitted_logits(back)(*args), jitted_logits(model)(*args))
    assert jaxlm.load_checkpoint(tmp_path / "omni" / "lm").config == model.config.lm  # the LM loads on its own
    with pytest.raises(FileExistsError):
        save_omni(model, tmp_path / "omni")
