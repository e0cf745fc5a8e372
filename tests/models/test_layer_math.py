"""RoPE and SwiGLU against float64 numpy: values, gradients, forward-mode derivatives."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.models.layers.mlp import swiglu
from jaxlm.models.layers.rope import rotate, rotate_per_head


def _complex_rotation(x, angles):
    """RoFormer eq. 34 as complex multiplication: pair ``(x_i, x_{i + H/2})`` is the number
    ``x_i + i x_{i + H/2}``, turned by ``exp(i angle_i)``."""
    h = x.shape[-1] // 2
    z = (x[..., :h] + 1j * x[..., h:]) * np.exp(1j * angles)
    return np.concatenate([z.real, z.imag], -1)


def test_rotate_matches_complex_multiplication():
    rng = np.random.RandomState(0)
    x = rng.randn(2, 7, 3, 8)
    angles = rng.randn(2, 7, 4) * 5
    ref = _complex_rotation(x, angles[:, :, None, :])
    out = jax.jit(rotate)(jnp.asarray(x, jnp.float32), jnp.asarray(angles, jnp.float32))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    # a rotation is orthogonal: the gradient of <c, R x> is R^T c, the inverse rotation of c
    c = rng.randn(*x.shape)
    g = jax.grad(lambda x: jnp.sum(jnp.asarray(c, jnp.float32) * rotate(x, jnp.asarray(angles, jnp.float32))))(
        jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(g, _complex_rotation(c, -angles[:, :, None, :]), rtol=1e-5, atol=1e-5)


def test_rotate_per_head_matches_complex_multiplication():
    rng = np.random.RandomState(1)
    x = rng.randn(2, 6, 3, 8)
    positions = rng.randint(0, 50, (2, 6))
    inv_freq = rng.rand(3, 4)
    ref = _complex_rotation(x, positions[:, :, None, None] * inv_freq)
    out = rotate_per_head(jnp.asarray(x, jnp.float32), jnp.asarray(positions), jnp.asarray(inv_freq, jnp.float32))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_swiglu_value_gradient_and_jvp_match_numpy():
    rng = np.random.RandomState(0)
    g, u, c = rng.randn(4, 9) * 3, rng.randn(4, 9), rng.randn(4, 9)
    s = 1 / (1 + np.exp(-g))
    ref = g * s * u
    d_gate = c * u * (s + g * s * (1 - s))
    d_up = c * g * s
    gj, uj, cj = (jnp.asarray(a, jnp.float32) for a in (g, u, c))
    np.testing.assert_allclose(swiglu(gj, uj), ref, rtol=1e-5, atol=1e-6)
    grads = jax.grad(lambda g, u: jnp.sum(cj * swiglu(g, u)), (0, 1))(gj, uj)
    np.testing.assert_allclose(grads[0], d_gate, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads[1], d_up, rtol=1e-5, atol=1e-6)
    tg, tu = rng.randn(4, 9), rng.randn(4, 9)
    _, tangent = jax.jvp(swiglu, (gj, uj), (jnp.asarray(tg, jnp.float32), jnp.asarray(tu, jnp.float32)))
    np.testing.assert_allclose(tangent, tg * u * (s + g * s * (1 - s)) + tu * g * s, rtol=1e-5, atol=1e-6)
