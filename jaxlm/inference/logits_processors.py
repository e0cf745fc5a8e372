"""Logits processors: pure functions ``(logits [B, V], state) -> logits [B, V]`` that compose.

Each built-in is a frozen dataclass, so equal settings hash equal and a jitted
sampler is compiled once per setting. Any callable with the same signature
(a grammar mask, a repetition penalty, a steering bias) composes the same way;
`compose` applies them left to right. ``state`` is the decode loop's carry, one row per row of
logits: the sampler's `SamplingState` (early exit's carries the same fields), or under beam
search `jaxlm.inference.beam_search.BeamRows` (each running beam a row); all have ``step``,
``tokens [rows, N]``, ``logprobs``, ``lengths``, ``done`` and ``prompt_lengths``.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

LogitsProcessor = Callable[[jax.Array, object], jax.Array]
NEG_INF = -jnp.inf
MIN_TEMPERATURE = 1e-30
"""The smallest sampling temperature (float32 division stays exact above it; use 0 for greedy)."""


@dataclasses.dataclass(frozen=True)
class Temperature:
    """``(logits - max) / t`` (t > 0, finite): the distribution ``softmax(logits / t)``, with
    each row shifted so its largest logit is exactly 0 first. Unshifted, ``logits / t`` for a
    tiny ``t`` (1e-8) loses the largest entry to rounding (XLA fuses the division and the
    sampler's ``- max`` into one multiply-add) or overflows, and sampling fails."""

    t: float

    def __post_init__(self):
        if isinstance(self.t, (bool, np.bool_)) or not isinstance(self.t, numbers.Real) or not 0 < self.t < float("inf"):
            raise ValueError(f"temperature={self.t!r} is invalid: must be a finite number > 0 (use greedy for 0)")
        object.__setattr__(self, "t", float(self.t))  # numpy scalars too; equal settings hash equal
        if self.t < MIN_TEMPERATURE:  # float32 flushes smaller divisors towards 0 (0 / 0 at the argmax)
            raise ValueError(f"temperature={self.t!r} is invalid: below {MIN_TEMPERATURE:g} sampling is greedy "
                             "decoding; use temperature=0")

    def __call__(self, logits, state=None):
        top = jnp.max(logits, axis=-1, keepdims=True)
        top = jnp.where(jnp.isfinite(top), top, jnp.zeros_like(top))  # a fully masked row stays masked
        return (logits - top) / jnp.asarray(self.t, logits.dtype)


def _ordered_bits(x: jax.Array) -> jax.Array:
    """float32 -> int32 with the same order (the IEEE total-order trick): a sortable key;
    ``-0.0`` and ``+0.0`` get the same key (0), as they compare equal."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, (bits ^ jnp.int32(0x7FFFFFFF)) + 1, bits)


def keep_top(values: jax.Array, enough) -> jax.Array:
    """Mask of ``values >= t`` per row for the largest ``t`` at which ``enough(mask)`` holds.

    ``enough`` must be monotone (true when everything is kept). 32 bisection steps
    over order-preserving int32 keys find the exact threshold without sorting the
    vocabulary; on CPU a sort of ``[16, 32000]`` costs ~100 ms, this ~1 ms. Values
    tied at the threshold are all kept.
    """
    keys = _ordered_bits(values)
    lo = jnp.min(keys, axis=-1, keepdims=True)  # enough(all kept) holds
    hi = jnp.max(keys, axis=-1, keepdims=True)  # search (lo, hi]; hi + 1 keeps nothing

    def step(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1) + ((lo ^ hi) & 1)  # ceil((lo+hi)/2), no overflow
        ok = enough(keys >= mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, step, (lo, hi))
    return keys >= lo


@dataclasses.dataclass(frozen=True)
class TopK:
    """Keep the ``k`` largest logits (ties at the k-th value are kept), mask the rest.
    Found by bisection (`keep_top`); `jax.lax.top_k` inside the decode loop is ~100x slower on CPU."""

    k: int

    def __post_init__(self):
        if isinstance(self.k, bool) or not isinstance(self.k, (int, np.integer)) or self.k <= 0:
            raise ValueError(f"top_k={self.k!r} is invalid: must be a positive int")
        object.__setattr__(self, "k", int(self.k))  # equal settings hash equal (np.int64(5) == 5)

    def __call__(self, logits, state=None):
        keep = keep_top(logits, lambda kept: jnp.sum(kept, -1, keepdims=True) >= self.k)
        return jnp.where(keep, logits, NEG_INF)


@dataclasses.dataclass(frozen=True)
class TopP:
    """Nucleus sampling (Holtzman et al. 2020): keep the smallest set of most likely
    tokens whose probability mass reaches ``p`` (tokens tied at the boundary are all
    kept; the most likely token always is). Found by bisection, not a vocabulary sort."""

    p: float

    def __post_init__(self):
        if isinstance(self.p, (bool, np.bool_)) or not isinstance(self.p, numbers.Real) or not 0 < self.p <= 1:
            raise ValueError(f"top_p={self.p!r} is invalid: must be a number in (0, 1] (True is not one)")
        object.__setattr__(self, "p", float(self.p))

    def __call__(self, logits, state=None):
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        # the mass left out is at most 1 - p (as HF's warper tests it): summing what is dropped
        # keeps the float32 error at the tail's size, where the kept mass near p = 1 is within
        # rounding of p and loses the last tokens of the nucleus
        drop = 1.0 - float(self.p)
        keep = keep_top(
            probs, lambda kept: jnp.sum(jnp.where(kept, 0.0, probs), -1, keepdims=True) <= drop
        )
        return jnp.where(keep, logits, NEG_INF)


def compose(processors: Sequence[LogitsProcessor]) -> LogitsProcessor:
    """Apply ``processors`` left to right."""
    processors = tuple(processors)

    def apply(logits, state=None):
        for p in processors:
            logits = p(logits, state)
        return logits

    return apply
