"""ARS: the shaping loss on a hand-computed 4-sample batch, training lowers it, the one-shot
boundary perturbation touches only the first answer token's logits (why the counterfactual
decode is a perturbed first token then a plain continuation), and zero noise reproduces
greedy decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from jaxlm.data.tokenizers import ByteTokenizer
from jaxlm.eval.ars import ShapingConfig, ars_loss, counterfactual_answers, fit_shaping, shape_embeddings
from jaxlm.models.interventions import Intervention, layer_mask


def test_loss_on_a_hand_computed_batch():
    x = np.array([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0], [-1.0, 0.0]])
    ids = np.array([0, 0, 0, 1])
    labels = np.array([1, 1, 0, 1])
    # tau = 0.5: S01 = 1.2, S02 = 0, S03 = -2, S12 = 1.6, S13 = -1.2. Anchors 2 and 3 have no
    # positive (same question and same label) and are left out.
    l0 = np.log(np.exp(1.2) + np.exp(0.0) + np.exp(-2.0)) - 1.2
    l1 = np.log(np.exp(1.2) + np.exp(1.6) + np.exp(-1.2)) - 1.2
    want = (l0 + l1) / 2 + 1e-3 * 2.0  # ||I||_F^2 = 2
    got = ars_loss(jnp.eye(2), jnp.asarray(x, jnp.float32), jnp.asarray(ids), jnp.asarray(labels), tau=0.5,
                   l2=1e-3)
    assert float(got) == pytest.approx(want, rel=1e-5)
    # scaling x does not change the loss (cosine similarities)
    got2 = ars_loss(jnp.eye(2), jnp.asarray(3 * x, jnp.float32), jnp.asarray(ids), jnp.asarray(labels), tau=0.5,
                    l2=1e-3)
    assert float(got2) == pytest.approx(want, rel=1e-5)


def test_fitting_lowers_the_loss():
    rng = np.random.default_rng(0)
    ids = np.repeat(np.arange(12), 6)
    labels = rng.integers(0, 2, size=ids.size)
    x = rng.normal(size=(ids.size, 8)) + 1.5 * labels[:, None] * np.eye(8)[0]
    W, history = fit_shaping(x, ids, labels, ShapingConfig(epochs=30, learning_rate=1e-2))
    assert W.shape == (8, 8) and history[-1] < history[0]
    h = shape_embeddings(W, x)
    np.testing.assert_allclose(np.linalg.norm(h, axis=1), 1.0, atol=1e-5)
    with pytest.raises(ValueError, match="tau"):
        ShapingConfig(tau=0.0)
    for field in ("tau", "l2"):  # NaN passed "<= 0"
        with pytest.raises(ValueError, match=f"ShapingConfig.{field}=nan must be a finite number"):
            ShapingConfig(**{field: float("nan")})
    # question ids may be strings (they failed inside jit); the fit equals the one with int ids
    names = np.array([f"q{i}" for i in ids])
    W_named, _ = fit_shaping(x, names, labels, ShapingConfig(epochs=2, learning_rate=1e-2))
    W_int, _ = fit_shaping(x, np.unique(names, return_inverse=True)[1], labels, ShapingConfig(epochs=2, learning_rate=1e-2))
    np.testing.assert_array_equal(np.asarray(W_named), np.asarray(W_int))


@pytest.fixture(scope="module")
def model():
    cfg = jaxlm.ModelConfig.tiny(init_std=0.5, max_seq_len=64)
    return jaxlm.build_model(cfg, seed=0, tokenizer=ByteTokenizer())


def test_boundary_noise_only_moves_the_first_answer_token(model):
    L, D = model.config.n_layers, model.config.d_model
    tokens = np.asarray([model.tokenizer.encode("Q: 3+4? A: 7 done", add_bos=True)], np.int32)
    boundary = 8  # the last "prompt" position
    where = np.zeros(tokens.shape, bool)
    where[0, boundary] = True
    noise = 0.5 * np.random.default_rng(0).normal(size=(L, 1, 1, D)).astype(np.float32)
    iv = Intervention(vector=jnp.asarray(noise), alpha=jnp.ones(()), layers=layer_mask([L - 1], L),
                      mask=jnp.asarray(where), site="hidden", kind="add", where="mask")
    plain = np.asarray(model(tokens).logits)
    moved = np.asarray(model(tokens, interventions=(iv,)).logits)
    changed = np.abs(plain - moved).max(axis=-1)[0]
    assert changed[boundary] > 1e-3
    np.testing.assert_allclose(np.delete(changed, boundary), 0.0, atol=1e-6)


def test_zero_noise_is_greedy_decoding(model):
    prompts = ["Q: 1+2? A:", "Q: capital? A:"]
    got = counterfactual_answers(model, prompts, num_variants=2, noise_scale=0.0, max_new_tokens=6)
    greedy = jaxlm.generate(model, prompts, max_new_tokens=6, temperature=0.0)
    for row, text in zip(got, greedy.texts):
        assert row == [text, text]
    noisy = counterfactual_answers(model, prompts, num_variants=3, noise_scale=5.0, max_new_tokens=6)
    assert len(noisy) == 2 and all(len(r) == 3 for r in noisy)


def test_nucleus_of_one_token_samples_the_greedy_answer(model):
    """Top-p keeps the smallest set of most likely tokens reaching mass p: for a tiny p that is
    the argmax alone, so sampled variants (noise 0) equal greedy decoding at any temperature."""
    prompts = ["Q: 1+2? A:", "Q: capital? A:"]
    got = counterfactual_answers(model, prompts, num_variants=2, noise_scale=0.0, max_new_tokens=6,
                                 temperature=1.5, top_p=1e-6)
    greedy = jaxlm.generate(model, prompts, max_new_tokens=6, temperature=0.0)
    for row, text in zip(got, greedy.texts):
        assert row == [text, text]


def test_a_variant_ends_at_any_stop_id_as_generate_does():
    """A tokenizer listing a second end-of-turn id (Llama 3.1's <|eot_id|> beside EOS): a
    variant whose first token is that id ends there, as the greedy answer does (it kept
    decoding past it, so a zero-noise variant disagreed with the greedy answer)."""
    class TwoStops(ByteTokenizer):
        stop_ids = (ByteTokenizer().eos_id, 200)

    tok = TwoStops()
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(init_std=0.1, max_seq_len=64), seed=0, tokenizer=tok)
    V, D = model.config.vocab_size, model.config.d_model
    for block in model.layers:  # logits depend on the last token only
        block.attn.o_proj.kernel[...] = jnp.zeros_like(block.attn.o_proj.kernel[...])
        block.mlp.down_proj.kernel[...] = jnp.zeros_like(block.mlp.down_proj.kernel[...])
    model.embed[...] = jnp.eye(D)[jnp.arange(V) % D]
    prompt = "what is y?"
    last, other = tok.encode(prompt)[-1], tok.encode("h")[0]
    W = np.zeros((D, V), np.float32)
    W[:, other] = 0.5
    W[last % D, 200] = 10.0  # after the prompt: the second stop id
    model.lm_head.kernel[...] = jnp.asarray(W)
    greedy = jaxlm.generate(model, [prompt], max_new_tokens=5, temperature=0.0)
    assert greedy.completions() == [[200]]
    assert counterfactual_answers(model, [prompt], num_variants=1, noise_scale=0.0, max_new_tokens=5) == [
        [greedy.texts[0]]]


def test_a_zero_embedding_row_keeps_the_fit_finite():
    """The normalisation's gradient at a zero row was 0/0: one such row made W NaN."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 4)).astype(np.float32)
    x[3] = 0.0
    ids, labels = np.repeat(np.arange(3), 4), np.tile([0, 1], 6)
    grad = jax.grad(ars_loss)(jnp.eye(4), jnp.asarray(x), jnp.asarray(ids), jnp.asarray(labels))
    assert np.isfinite(np.asarray(grad)).all()
    np.testing.assert_array_equal(np.asarray(shape_embeddings(jnp.eye(4), jnp.asarray(x[3:4]))), 0.0)
