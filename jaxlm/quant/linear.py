"""`linear(x, w)` for `QArray` weights: the Pallas W4A16 kernel on GPU/TPU, its jnp
reference elsewhere. Registered on import of `jaxlm.quant`.

The backend is read when a function is traced: ``auto`` (kernel on GPU/TPU, reference on
CPU), ``kernel``, ``interpret`` (the kernel in Pallas interpret mode: slow, for tests) or
``reference``. It is part of every ``jax.jit`` cache key (a `jax.make_user_context`), so a
function jitted under one backend is traced again, not reused, under another.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.models.layers.linear import linear
from jaxlm.quant.formats import QArray, dequantize
from kernels_pallas import w4a16

_MODES = ("auto", "kernel", "interpret", "reference")
# in the jit cache key: without it, a function jitted under one backend (e.g. `generate`'s
# compiled loop) would silently reuse that trace under another
_mode = jax.make_user_context("auto")


def set_backend(mode: str) -> None:
    if mode not in _MODES:
        raise ValueError(f"quantized linear backend {mode!r} is invalid: must be one of {_MODES}")
    _mode.set_global(mode)


@contextlib.contextmanager
def backend(mode: str):
    """``with jaxlm.quant.backend("interpret"): ...``"""
    previous = _mode.get_global()
    set_backend(mode)
    try:
        yield
    finally:
        set_backend(previous)


def resolved_backend() -> str:
    mode = _mode.value
    if mode == "auto":
        return "kernel" if jax.default_backend() in ("gpu", "tpu") else "reference"
    return mode


def _forward(x2, w: QArray, mode: str):
    fmt = w.fmt
    kw = dict(element=fmt.element, block=fmt.block, scale_kind=fmt.scale_kind, alpha=fmt.alpha)
    if mode == "reference":
        return w4a16.reference(x2, w.codes, w.scales, w.global_scale.reshape(()), **kw)
    return w4a16.w4a16_matmul(x2, w.codes, w.scales, w.global_scale.reshape(()), interpret=(mode == "interpret"), **kw)


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


@linear.register(QArray)
def quantized_linear(x: jax.Array, w: QArray) -> jax.Array:
    """``x @ W`` for a quantized ``[K, N]`` weight; differentiable in ``x`` (QLoRA-style)."""
    if w.axis != -2 or w.ndim != 2:
        return linear(x, dequantize(w, x.dtype))
    K, N = w.shape
    y = _qmatmul(x.reshape(-1, K), w, resolved_backend())
    return y.reshape(*x.shape[:-1], N)
