"""Interventions at tap sites: steering, directional ablation, head masking, perturbation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from jaxlm.interp import ablate, mask_heads, perturb, steer
from jaxlm.models.config import ModelConfig


@pytest.fixture(scope="module")
def model():
    return jaxlm.build_model(ModelConfig.tiny(init_std=0.1), seed=0)


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(1), (2, 7), 3, 259)


def _direction(d, seed=2):
    return jax.random.normal(jax.random.key(seed), (d,))


def test_zero_dose_and_unit_head_scale_are_identity(model, tokens):
    L, D, N = model.config.n_layers, model.config.d_model, model.config.n_heads
    base = model(tokens).logits
    same = model(tokens, interventions=(steer("hidden", _direction(D), alpha=0.0, n_layers=L),)).logits
    np.testing.assert_array_equal(np.asarray(same), np.asarray(base))
    ones = model(tokens, interventions=(mask_heads(jnp.ones(N), n_layers=L),)).logits
    np.testing.assert_array_equal(np.asarray(ones), np.asarray(base))


def test_steering_the_last_layer_equals_adding_before_the_final_norm(model, tokens):
    L, D = model.config.n_layers, model.config.d_model
    v = _direction(D)
    out = model(tokens, collect=("hidden",))
    h = out.collected["hidden"][L - 1]
    rms = jnp.sqrt(jnp.mean(h * h, axis=-1, keepdims=True))
    expected = model.unembed(model.final_norm(h + 3.0 * v * rms))
    iv = steer("hidden", v, alpha=3.0, n_layers=L, layers=[L - 1], rms_scale=True)
    got = model(tokens, interventions=(iv,)).logits
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5)


def test_steering_a_mask_touches_only_those_positions(model, tokens):
    L, D = model.config.n_layers, model.config.d_model
    where = np.zeros(tokens.shape, bool)
    where[:, 4] = True
    iv = steer("hidden", _direction(D), alpha=5.0, n_layers=L, layers=[0], where=where)
    base = model(tokens).logits
    got = model(tokens, interventions=(iv,)).logits
    # causal: positions before 4 are unchanged, position 4 onwards move
    np.testing.assert_array_equal(np.asarray(got[:, :4]), np.asarray(base[:, :4]))
    assert float(jnp.abs(got[:, 4:] - base[:, 4:]).min()) > 0


@pytest.mark.parametrize("where", ["last", "mask"])
def test_position_selection_at_a_per_head_site(model, tokens, where):
    """At ``v`` ([B, T, heads, H]) the chosen positions move on every head, the others not
    (the mask is broadcast over the head axes, never matched against them)."""
    c = model.config
    T = tokens.shape[1]
    pos = np.zeros(tokens.shape, bool)
    pos[:, T - 1 if where == "last" else 3] = True
    iv = steer("v", jnp.ones(c.head_dim), alpha=2.0, n_layers=c.n_layers, layers=[0],
               where="last" if where == "last" else pos)
    base = model(tokens, collect=("v",)).collected["v"][0]
    got = model(tokens, collect=("v",), interventions=(iv,)).collected["v"][0]
    moved = np.asarray(jnp.abs(got - base).max(-1) > 0)  # [B, T, heads]
    np.testing.assert_array_equal(moved, np.broadcast_to(pos[..., None], moved.shape))


def test_a_direction_per_head_or_per_layer_is_never_guessed(model, tokens):
    """A [2, H] direction at ``v`` with 2 layers and 2 KV heads could be either: it must be said."""
    c = model.config
    assert c.n_layers == c.n_kv_heads == 2
    d = jnp.stack([jnp.ones(c.head_dim), -jnp.ones(c.head_dim)])
    with pytest.raises(ValueError, match="ambiguous.*pass per_layer=True or False"):
        steer("v", d, alpha=1.0, n_layers=c.n_layers)
    iv = steer("v", d, alpha=1.0, n_layers=c.n_layers, layers=[0], per_layer=False)
    base = model(tokens, collect=("v",)).collected["v"][0]
    got = model(tokens, collect=("v",), interventions=(iv,)).collected["v"][0]
    np.testing.assert_allclose(np.asarray((got - base)[..., 0]).mean((0, 1)), [1.0, -1.0], atol=1e-6)
    per_layer = steer("v", d, alpha=1.0, n_layers=c.n_layers, per_layer=True)
    assert per_layer.vector.shape == (2, c.head_dim)


def test_ablation_removes_the_direction_at_the_chosen_layer(model, tokens):
    L, D = model.config.n_layers, model.config.d_model
    v = _direction(D)
    u = v / jnp.linalg.norm(v)
    out = model(tokens, collect=("mlp_out",), interventions=(ablate("mlp_out", v, n_layers=L, layers=[0]),))
    proj = jnp.einsum("btd,d->bt", out.collected["mlp_out"][0], u)
    np.testing.assert_allclose(np.asarray(proj), 0.0, atol=1e-5)
    plain = model(tokens, collect=("mlp_out",)).collected["mlp_out"]
    assert float(jnp.abs(jnp.einsum("btd,d->bt", plain[0], u)).max()) > 1e-3
    np.testing.assert_allclose(  # the ablated layer's other components are kept
        np.asarray(out.collected["mlp_out"][0]),
        np.asarray(plain[0] - jnp.einsum("btd,d->bt", plain[0], u)[..., None] * u), atol=1e-5,
    )


def test_head_mask_zeroes_the_heads_channels(model, tokens):
    c = model.config
    scale = jnp.ones((c.n_layers, c.n_heads)).at[1, 2].set(0.0)
    out = model(tokens, collect=("attn_ctx",), interventions=(mask_heads(scale, n_layers=c.n_layers),))
    ctx = np.asarray(out.collected["attn_ctx"]).reshape(c.n_layers, 2, 7, c.n_heads, c.head_dim)
    assert np.all(ctx[1, :, :, 2] == 0)
    assert np.abs(ctx[1, :, :, 1]).min() > 0 and np.abs(ctx[0, :, :, 2]).min() > 0


def test_perturbation_gradient_is_the_output_gradient(model, tokens):
    """d loss / d delta at ``mlp_out`` == the gradient w.r.t. the MLP output (chain rule
    through down_proj): checked against the kernel gradient dW = a^T g."""
    c = model.config
    from flax import nnx

    graphdef, state = nnx.split(model)

    def loss_of(state, delta):
        m = nnx.merge(graphdef, state)
        out = m(tokens, collect=("mlp_act",), interventions=(perturb("mlp_out", delta),))
        return jnp.sum(jax.nn.log_softmax(out.logits)[..., 5]), out.collected["mlp_act"]

    delta = jnp.zeros((c.n_layers, *tokens.shape, c.d_model))
    (g_state, g_delta), acts = jax.grad(loss_of, argnums=(0, 1), has_aux=True)(state, delta)
    for layer in range(c.n_layers):
        kernel_grad = (
            g_state["layers"]["mlp"]["down_proj"]["kernel"][...][layer] if c.scan_layers
            else g_state["layers"][layer]["mlp"]["down_proj"]["kernel"][...]
        )
        a = acts[layer].reshape(-1, c.ffn_dim)
        g = g_delta[layer].reshape(-1, c.d_model)
        np.testing.assert_allclose(np.asarray(a.T @ g), np.asarray(kernel_grad), atol=1e-5)


def test_generate_with_last_position_steering_matches_full_forward(model):
    """``where="last"`` in generate == steering the last prompt token and every new token
    in one full forward over the final sequence."""
    c = model.config
    prompt = [5, 17, 33, 48, 90]
    iv = steer("hidden", _direction(c.d_model, 7), alpha=4.0, n_layers=c.n_layers, layers=[0], where="last")
    res = jaxlm.generate(model, [prompt], max_new_tokens=5, temperature=0.0, interventions=(iv,), stop_tokens=())
    seq = prompt + list(res.completions()[0])
    P = len(prompt)
    where = np.zeros((1, len(seq)), bool)
    where[0, P - 1:] = True
    full = steer("hidden", _direction(c.d_model, 7), alpha=4.0, n_layers=c.n_layers, layers=[0], where=where)
    logits = model(jnp.asarray([seq]), interventions=(full,)).logits
    greedy = np.asarray(jnp.argmax(logits[0, P - 1:-1], axis=-1))
    np.testing.assert_array_equal(greedy, np.asarray(res.completions()[0]))
    plain = jaxlm.generate(model, [prompt], max_new_tokens=5, temperature=0.0, stop_tokens=())
    assert plain.completions()[0] != res.completions()[0]


def test_bad_interventions_are_named():
    with pytest.raises(ValueError, match="site='attn_probs'"):
        steer("attn_probs", jnp.ones(4), alpha=1.0, n_layers=2)
    with pytest.raises(ValueError, match=r"layers=\[5\]"):
        steer("hidden", jnp.ones(4), alpha=1.0, n_layers=2, layers=[5])
    with pytest.raises(ValueError, match="where='first'"):
        steer("hidden", jnp.ones(4), alpha=1.0, n_layers=2, where="first")
    model = jaxlm.build_model(ModelConfig.tiny(n_layers=3), seed=0)
    with pytest.raises(ValueError, match="built for 2 layers, the model has 3"):
        model(jnp.ones((1, 3), jnp.int32), interventions=(steer("hidden", jnp.ones(64), alpha=1.0, n_layers=2),))
    with pytest.raises(ValueError, match="not a boolean mask"):
        steer("hidden", jnp.ones(4), alpha=1.0, n_layers=3, layers=np.array([False, True, True]))
    # an empty layer list is no layer (it was read as floats)
    assert not steer("hidden", jnp.ones(4), alpha=1.0, n_layers=3, layers=[]).layers.any()
    # a NaN dose or direction made every logit NaN; a zero direction ablated nothing
    with pytest.raises(ValueError, match="steer: alpha holds a non-finite value"):
        steer("hidden", jnp.ones(4), alpha=float("nan"), n_layers=2)
    with pytest.raises(ValueError, match="steer: direction holds a non-finite value"):
        steer("hidden", jnp.array([1.0, np.inf, 0.0, 0.0]), alpha=1.0, n_layers=2)
    per_layer = jnp.stack([jnp.ones(4), jnp.zeros(4), jnp.ones(4)])
    with pytest.raises(ValueError, match=r"ablate: direction has zero norm at layer\(s\) \[1\]"):
        ablate("hidden", per_layer, n_layers=3)
    assert ablate("hidden", per_layer, n_layers=3, layers=[0, 2]).layers.tolist() == [True, False, True]
    # a where mask that does not fit the tokens is named (it failed inside the forward)
    with pytest.raises(ValueError, match=r"interventions\[0\].*where mask has shape \(2, 5\), the tokens are \[B, T\] = \[1, 3\]"):
        model(jnp.ones((1, 3), jnp.int32),
              interventions=(steer("hidden", jnp.ones(64), alpha=1.0, n_layers=3, where=np.ones((2, 5), bool)),))


def test_interventions_of_the_wrong_shape_are_refused(model, tokens):
    """A direction or head scale that does not fit the site would broadcast it silently (a
    [3, D] direction on a 2-layer model steered position t with row t; a head scale of
    n_kv_heads entries zeroed heads in pairs; a [heads, H] key direction under MQA grew the
    keys to query width)."""
    L, N = model.config.n_layers, model.config.n_heads
    with pytest.raises(ValueError, match=r"per-layer vector \(3, 64\) does not fit"):
        model(tokens, interventions=(steer("hidden", jnp.ones((3, 64)), alpha=1.0, n_layers=L, per_layer=False),))
    for bad in (N // 2, 2 * N):
        with pytest.raises(ValueError, match=f"scales \\({bad},\\) heads per layer; the model has n_heads={N}"):
            model(tokens, interventions=(mask_heads(jnp.ones(bad), n_layers=L),))
    mqa = jaxlm.build_model(ModelConfig.tiny(n_kv_heads=1), seed=0)
    direction = jnp.ones((mqa.config.n_heads, mqa.config.head_dim))
    with pytest.raises(ValueError, match="does not fit the site's values"):
        mqa(tokens, interventions=(steer("k", direction, alpha=1.0, n_layers=mqa.config.n_layers, per_layer=False),))


def test_kv_fake_quant_quantizes_the_cached_keys_and_values(model, tokens):
    from jaxlm.interp.interventions import kv_fake_quant
    from jaxlm.quant.formats import fake_quant

    L = model.config.n_layers
    plain = model(tokens, collect=("k_rot", "v"))
    out = model(tokens, collect=("k_rot", "v"), interventions=kv_fake_quant("e1m2", n_layers=L, layers=[0]))
    np.testing.assert_allclose(np.asarray(out.collected["v"][0]),
                               np.asarray(fake_quant(plain.collected["v"][0], "e1m2", axis=-1)), atol=1e-6)
    np.testing.assert_allclose(np.asarray(out.collected["k_rot"][0]),
                               np.asarray(fake_quant(plain.collected["k_rot"][0], "e1m2", axis=-1)), atol=1e-6)
    assert float(jnp.abs(out.logits - plain.logits).max()) > 0
