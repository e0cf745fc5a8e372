"""Floating-point dtypes as names: every public ``dtype`` argument and config field accepts a
name (``"bfloat16"``), a jnp dtype (``jnp.bfloat16``) or a numpy dtype (``np.float32``,
``np.dtype("float16")``) and stores the name, so configs, checkpoints, JSON and the command
line see the same strings."""

from __future__ import annotations

from typing import Any

import numpy as np

#: the floating-point dtypes a model computes, stores weights or caches keys/values in
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def dtype_name(value: Any, *, field: str, allowed: tuple[str, ...] = FLOAT_DTYPES) -> str:
    """The canonical name of ``value`` (a name, a jnp/numpy dtype or scalar type).

    Raises ``ValueError`` naming ``field`` and the allowed names for anything else."""
    name = None
    if isinstance(value, str):
        name = value
    elif not isinstance(value, (bool, int, float, np.ndarray, np.generic)) and value is not None and not (
        # an array (jax or other) is data, not a dtype; scalar types such as np.float32 are classes
        not isinstance(value, type) and hasattr(value, "shape") and hasattr(value, "dtype")
    ):
        try:
            name = np.dtype(value).name  # numpy and jnp dtypes, scalar types (ml_dtypes for bfloat16)
        except TypeError:
            name = None
    if name not in allowed:
        raise ValueError(
            f"{field}={value!r} is invalid: must be one of {allowed} (a name, a jnp dtype or a numpy dtype)"
        )
    return name


def optional_dtype_name(value: Any, *, field: str, allowed: tuple[str, ...] = FLOAT_DTYPES) -> str | None:
    """`dtype_name`, with None passed through (meaning: the default)."""
    return None if value is None else dtype_name(value, field=field, allowed=allowed)
