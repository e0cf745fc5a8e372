"""`linear(x, w)`: the one matmul every projection calls, dispatched on the weight type.

A weight is a plain ``[in, out]`` array or a registered pytree weight type (a
quantized array, a low-rank + residual pair, ...). New weight types register an
implementation with ``@linear.register(MyWeight)``; the model code never changes,
so ``params = quantize(params, recipe)`` is all it takes to run a quantized model.
`jaxlm.quant.QArray` (the 4-bit block-scaled array every quantized weight builds on) is
registered here; the structured types register themselves in their own modules.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.quant.formats import QArray, fake_quant, fake_quant_tokens, quantize
from jaxlm.quant.linear import quantized_linear
from kernels_pallas import w4a16


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
linear.register(QArray)(quantized_linear)


def param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """An ``nnx.Param`` carrying logical axis names (mapped to a mesh by `jaxlm.sharding`).

    Eager sharding is off: placement happens once, in `jaxlm.sharding.shard_model`,
    so the same module builds on one CPU and on a mesh.
    """
    if len(axes) != jnp.ndim(value):
        raise ValueError(f"logical axes {axes} do not match the parameter's shape {value.shape}")
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def qat_linear(x: jax.Array, w: jax.Array, fmt: str) -> jax.Array:
    """Quantization-aware ``x @ w``: ``fake_quant_tokens(x) @ Q(w)`` with ``Q(w)`` the weight
    quantized in blocks along its input axis (one tensor scale per matrix). The forward pass
    runs the stored-weight path, ``linear(x_q, quantize(w))``, so a model exported with
    `jaxlm.quant.qat_export.export_qat` computes the same numbers bit for bit; the backward
    pass is straight-through (the gradient of ``fake_quant_tokens(x) @ fake_quant(w)``).
    The matmul runs the jnp reference of the quantized linear on every platform (plain XLA
    ops, so training shards as usual); an exported model uses the W4A16 kernel on GPU/TPU."""
    q = quantize(jax.lax.stop_gradient(w), fmt, axis=-2)
    f = q.fmt
    K, N = q.shape
    # exactly what linear(x, q) runs under the reference backend (`jaxlm.quant.linear`)
    y = w4a16.reference(fake_quant_tokens(x, fmt).reshape(-1, K), q.codes, q.scales, q.global_scale.reshape(()),
                        element=f.element, block=f.block, scale_kind=f.scale_kind, alpha=f.alpha)
    return y.reshape(*x.shape[:-1], N)


def _qat_linear_fwd(x, w, fmt):
    return qat_linear(x, w, fmt), (x, w)


def _qat_linear_bwd(fmt, res, dy):
    _, vjp = jax.vjp(lambda x, w: linear(fake_quant_tokens(x, fmt), fake_quant(w, fmt, axis=-2)), *res)
    return vjp(dy)


qat_linear.defvjp(_qat_linear_fwd, _qat_linear_bwd)


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
            # quantization-aware training: inputs (per token) and weights (one tensor scale per
            # matrix) quantized in blocks along the reduction axis, straight-through gradients
            # (ReQAT's W4A4 fake quant)
            y = qat_linear(x, w, self.fake_quant)
        else:
            y = linear(x, w)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y
