"""Which implementation the quantized matmuls run: read when a function is traced.

``auto`` (the Pallas kernel on GPU/TPU, the jnp reference on CPU), ``kernel``,
``interpret`` (the kernel in Pallas interpret mode: slow, for tests) or ``reference``. The
mode is part of every ``jax.jit`` cache key (a `jax.make_user_context`), so a function
jitted under one backend is traced again, not reused, under another.
"""

from __future__ import annotations

import contextlib

import jax

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
