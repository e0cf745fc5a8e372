"""Align-TI's IVA: instruction-to-vision attention and the instruction-relevance score on
hand-built attention maps, the salient-token choice, and the alignment loss against a direct
numpy KL, on real omni teacher/student forwards."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from jaxlm.data.tokenizers import ByteTokenizer
from jaxlm.inference.omni import omni_inputs_embeds
from jaxlm.models.omni import OmniConfig, Video, batch_sequences, build_omni, build_sequence
from trainers.distill.iva import instruction_relevance, instruction_to_vision_attention, iva_loss, salient_tokens

TOK = ByteTokenizer()


def test_instruction_to_vision_attention_hand_built():
    # one layer, one row, two heads, T = S = 4: tokens 0, 1 vision; 3 the instruction
    probs = np.zeros((1, 1, 2, 4, 4), np.float32)
    probs[0, 0, 0, 3] = [0.6, 0.2, 0.0, 0.2]
    probs[0, 0, 1, 3] = [0.1, 0.3, 0.4, 0.2]
    probs[0, 0, :, 2] = [0.5, 0.5, 0.0, 0.0]  # a non-instruction query: ignored
    instr = np.array([[False, False, False, True]])
    vision = np.array([[True, True, False, False]])
    got = np.asarray(instruction_to_vision_attention(jnp.asarray(probs), jnp.asarray(instr), jnp.asarray(vision)))
    mean = np.array([0.35, 0.25])  # head mean on the vision keys
    np.testing.assert_allclose(got[0, 0], np.r_[mean / mean.sum(), 0, 0], atol=1e-7)


def test_instruction_relevance_is_one_minus_mean_cosine():
    a1 = np.array([[[1.0, 0.0], [0.5, 0.5]], [[0.9, 0.1], [0.2, 0.8]]])  # [L=2, B=2, S=2]
    a2 = np.array([[[1.0, 0.0], [0.5, 0.5]], [[0.1, 0.9], [0.8, 0.2]]])
    cos = lambda u, v: u @ v / np.linalg.norm(u) / np.linalg.norm(v)
    expected = [1 - np.mean([cos(a1[l, b], a2[l, b]) for b in range(2)]) for l in range(2)]
    got = np.asarray(instruction_relevance(jnp.asarray(a1), jnp.asarray(a2)))
    np.testing.assert_allclose(got, expected, atol=1e-7)
    assert got[0] == pytest.approx(0.0, abs=1e-7) and int(np.argmax(got)) == 1  # the instruction-following layer


def test_salient_tokens_are_the_top_k_vision_tokens():
    alpha = jnp.asarray([[0.5, 0.1, 0.9, 0.3, 0.0], [0.2, 0.2, 0.0, 0.0, 0.0]])
    vision = jnp.asarray([[True, True, False, True, True], [True, True, False, False, False]])
    got = np.asarray(salient_tokens(alpha, vision, 2))
    assert got.tolist() == [[True, False, False, True, False], [True, True, False, False, False]]


@pytest.fixture(scope="module")
def pair():
    def make(seed, d):
        lm = jaxlm.ModelConfig.tiny(vocab_size=261, rope="mrope", d_model=d, max_seq_len=128, init_std=0.3)
        return build_omni(OmniConfig(lm=lm, patch_dim=6, audio_dim=4, video_token_id=259, audio_token_id=260,
                                     encoder_hidden=16), seed=seed, tokenizer=TOK)
    return make(0, 64), make(1, 32)


def test_iva_on_omni_models_against_numpy_kl(pair):
    teacher, student = pair
    rng = np.random.default_rng(0)
    video = Video(rng.normal(size=(2, 2, 2, 6)))
    seqs = [build_sequence([[TOK.bos_id], video, q], TOK, teacher.config) for q in ("left?", "right")]
    b = batch_sequences(seqs, TOK.pad_id)
    tokens, pos = jnp.asarray(b["tokens"]), jnp.asarray(b["positions"])
    vision = tokens == 259
    instr = jnp.asarray(np.stack([s.kind == 0 for s in seqs])) & (jnp.arange(tokens.shape[1]) > 8)
    E_t = omni_inputs_embeds(teacher, b["tokens"], b["video"])
    out_t = teacher.lm(tokens, pos, embeds=E_t, collect=("attn_probs",))
    alpha = instruction_to_vision_attention(out_t.collected["attn_probs"], instr, vision)
    np.testing.assert_allclose(np.asarray(alpha.sum(-1)), 1.0, atol=1e-5)
    irs = instruction_relevance(alpha[:, :1], alpha[:, 1:])  # same clip, two instructions
    layer = int(jnp.argmax(irs))
    sal = salient_tokens(alpha[layer], vision, 3)
    assert (np.asarray(sal).sum(1) == 3).all() and not np.asarray(sal & ~vision).any()
    logits_s = student.lm(tokens, pos, embeds=omni_inputs_embeds(student, b["tokens"], b["video"])).logits
    got = float(iva_loss(out_t.logits, logits_s, sal))
    lp = np.asarray(jax.nn.log_softmax(out_t.logits), np.float64)
    lq = np.asarray(jax.nn.log_softmax(logits_s), np.float64)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    assert got == pytest.approx(kl[np.asarray(sal)].mean(), rel=1e-4)
    assert float(iva_loss(out_t.logits, out_t.logits, sal)) == pytest.approx(0.0, abs=1e-6)
    assert float(iva_loss(out_t.logits, logits_s, jnp.zeros_like(sal))) == 0.0
    jsd = float(iva_loss(out_t.logits, logits_s, sal, divergence="jsd", jsd_beta=0.5))
    assert 0 < jsd < got
    grads = jax.grad(lambda s: iva_loss(out_t.logits, s, sal))(logits_s)
    assert np.abs(np.asarray(grads)[~np.asarray(sal)]).max() == 0  # only the salient positions align
    with pytest.raises(ValueError, match="target='pixels'"):
        iva_loss(out_t.logits, logits_s, sal, target="pixels")
    for beta in (1.5, -0.5, 0.0):  # a NaN loss before, where DistillConfig refuses the value
        with pytest.raises(ValueError, match=f"jsd_beta={beta} is invalid"):
            iva_loss(out_t.logits, logits_s, sal, divergence="jsd", jsd_beta=beta)
    for beta in (-5.0, float("nan")):  # a negative "divergence", or NaN, silently
        with pytest.raises(ValueError, match=f"tail_beta={beta} is invalid"):
            iva_loss(out_t.logits, logits_s, sal, divergence="tail_aware", tail_beta=beta)
    with pytest.raises(ValueError, match="top_k=2.5 is invalid"):
        iva_loss(out_t.logits, logits_s, sal, divergence="tail_aware", top_k=2.5)
    with pytest.raises(ValueError, match="divergence='kl' is invalid"):
        iva_loss(out_t.logits, logits_s, sal, divergence="kl")


def test_hidden_state_target_is_mean_squared_error_on_salient_positions():
    rng = np.random.default_rng(1)
    t, s = rng.normal(size=(2, 5, 4)), rng.normal(size=(2, 5, 4))
    sal = np.zeros((2, 5), bool)
    sal[0, [1, 3]] = sal[1, 0] = True
    got = float(iva_loss(jnp.asarray(t), jnp.asarray(s), jnp.asarray(sal), target="hidden"))
    assert got == pytest.approx(((t - s) ** 2).mean(-1)[sal].mean(), rel=1e-6)
