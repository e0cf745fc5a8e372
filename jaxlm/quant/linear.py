"""``x @ W`` for a `QArray` weight: the Pallas W4A16 kernel on GPU/TPU, its jnp reference
elsewhere, chosen by `jaxlm.quant.backend` when a function is traced. `linear`
(`jaxlm.models.layers.linear`) dispatches QArray weights here."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.quant.backend import resolved_backend
from jaxlm.quant.formats import QArray, dequantize
from kernels_pallas import w4a16


def _forward(x2, w: QArray, mode: str):
    fmt = w.fmt
    kw = dict(element=fmt.element, block=fmt.block, scale_kind=fmt.scale_kind, alpha=fmt.alpha)
    if mode == "reference":
        return w4a16.reference(x2, w.codes, w.scales, w.global_scale.reshape(()), **kw)
    # the K tile holds whole blocks of any group size (an INT4 group of 48 or 512 does not divide 256)
    return w4a16.w4a16_matmul(x2, w.codes, w.scales, w.global_scale.reshape(()), interpret=(mode == "interpret"),
                              bk=math.lcm(256, fmt.block), **kw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _qmatmul(x2, w: QArray, mode: str):
    return _forward(x2, w, mode)


def _qmatmul_fwd(x2, w, mode):
    return _forward(x2, w, mode), w


def _qmatmul_bwd(mode, w, dy):
    """``dx = dy @ dequant(W)^T``; the codes and scales are constants (zero cotangents)."""
    dx = jnp.dot(dy, dequantize(w, dy.dtype).T, preferred_element_type=jnp.float32).astype(dy.dtype)

    def zero(leaf):
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            return np.zeros(leaf.shape, jax.dtypes.float0)
        return jnp.zeros_like(leaf)

    return dx, jax.tree.map(zero, w)


_qmatmul.defvjp(_qmatmul_fwd, _qmatmul_bwd)


def quantized_linear(x: jax.Array, w: QArray) -> jax.Array:
    """``x @ W`` for a quantized ``[K, N]`` weight; differentiable in ``x`` (QLoRA-style)."""
    if w.axis != -2 or w.ndim != 2:  # not a stored projection layout: dequantize and multiply
        y = jnp.dot(x.reshape(-1, x.shape[-1]), dequantize(w, x.dtype))
        return y.reshape(*x.shape[:-1], y.shape[-1])
    K, N = w.shape
    y = _qmatmul(x.reshape(-1, K), w, resolved_backend())
    return y.reshape(*x.shape[:-1], N)
