"""Pallas kernels, each beside a pure-jnp reference. Depends on jax only (see the
low-bit formats and kernels issue)."""
