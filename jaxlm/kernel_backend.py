"""A switch between a Pallas kernel and its jnp reference, read when a function is traced.

Modes: ``auto`` (the kernel on the platforms named at construction, the reference
elsewhere), ``kernel``, ``interpret`` (the kernel in Pallas interpret mode: slow, for
tests) and ``reference``. The mode is part of every ``jax.jit`` cache key (a
`jax.make_user_context`), so a function jitted under one mode is traced again, not reused,
under another.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import jax

MODES = ("auto", "kernel", "interpret", "reference")


class KernelBackend:
    """One family's switch (e.g. the quantized matmuls, the grammar mask)."""

    def __init__(self, what: str, *, auto_kernel_on: Sequence[str] = ("gpu", "tpu")):
        """``what`` names the switch in errors; ``auto_kernel_on``: the platforms on which
        ``auto`` runs the compiled kernel."""
        self.what = what
        self.auto_kernel_on = tuple(auto_kernel_on)
        self._mode = jax.make_user_context("auto")

    def set(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"{self.what} {mode!r} is invalid: must be one of {MODES}")
        self._mode.set_global(mode)

    @contextlib.contextmanager
    def use(self, mode: str) -> Iterator[None]:
        """``with switch.use("interpret"): ...``; the previous mode is restored on exit."""
        previous = self._mode.get_global()
        self.set(mode)
        try:
            yield
        finally:
            self.set(previous)

    def resolved(self) -> str:
        """``kernel``, ``interpret`` or ``reference``: what a function traced now runs."""
        mode = self._mode.value
        if mode == "auto":
            return "kernel" if jax.default_backend() in self.auto_kernel_on else "reference"
        return mode
