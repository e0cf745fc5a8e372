"""`linear(x, w)`: the one matmul every projection calls, dispatched on the weight type.

A weight is a plain ``[in, out]`` array or a registered pytree weight type (a
quantized array, a low-rank + residual pair, ...). New weight types register an
implementation with ``@linear.register(MyWeight)``; the model code never changes,
so ``params = quantize(params, recipe)`` is all it takes to run a quantized model.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def _dense(x: jax.Array, w) -> jax.Array:
    # A 2-D matmul over flattened leading axes: the same math, but XLA:CPU runs the
    # backward of [B, T, D] x [D, F] about 1.8x slower than of [B*T, D] x [D, F].
    w = jnp.asarray(w).astype(x.dtype)
    y = jnp.dot(x.reshape(-1, x.shape[-1]), w)
    return y.reshape(*x.shape[:-1], w.shape[-1])


_IMPLS = functools.singledispatch(lambda w: _dense)  # dispatch on the weight's type


def linear(x: jax.Array, w) -> jax.Array:
    """``x @ w`` over the last axis of ``x``. A plain ``w`` is ``[in, out]`` and is used in
    ``x.dtype``; a registered weight type runs its own implementation."""
    return _IMPLS.dispatch(type(w))(w)(x, w)


def register(weight_type: type):
    """Decorator: ``@linear.register(QArray) def _(x, w): ...`` adds a weight type."""

    def add(fn):
        _IMPLS.register(weight_type)(lambda w: fn)
        return fn

    return add


linear.register = register


def param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """An ``nnx.Param`` carrying logical axis names (mapped to a mesh by `jaxlm.sharding`).

    Eager sharding is off: placement happens once, in `jaxlm.sharding.shard_model`,
    so the same module builds on one CPU and on a mesh.
    """
    if len(axes) != jnp.ndim(value):
        raise ValueError(f"logical axes {axes} do not match the parameter's shape {value.shape}")
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


class Linear(nnx.Module):
    """A projection ``y = linear(x, kernel) (+ bias)`` with ``kernel`` stored ``[in, out]``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        axes: tuple[str | None, str | None],
        use_bias: bool = False,
        std: float = 0.02,
        param_dtype=jnp.float32,
        fake_quant: str | None = None,
        rngs: nnx.Rngs,
    ):
        self.in_features, self.out_features = in_features, out_features
        self.fake_quant = fake_quant  # QAT: format name (`jaxlm.quant.formats`) or None
        w = std * jax.random.normal(rngs.params(), (in_features, out_features), param_dtype)
        self.kernel = param(w, axes)
        self.bias = param(jnp.zeros((out_features,), param_dtype), (axes[1],)) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.kernel.get_value()
        if self.fake_quant is not None and isinstance(w, jax.Array):  # structured weights: already quantized
            # quantization-aware training: inputs and weights quantize-dequantized in blocks
            # along the reduction axis, straight-through gradients (ReQAT's W4A4 fake quant)
            from jaxlm.quant.formats import fake_quant

            x = fake_quant(x, self.fake_quant, axis=-1).astype(x.dtype)
            w = fake_quant(w, self.fake_quant, axis=-2)
        y = linear(x, w)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y
