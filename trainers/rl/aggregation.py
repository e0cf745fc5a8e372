"""Loss aggregators (``AGGREGATORS``): per-token losses ``[B, T]`` and their mask ->
``(sum, count)``. The step adds sums and counts over micro-batches (and devices) and
divides once, so every mode is exact under gradient accumulation and data parallelism:

- ``token_mean`` (DAPO, Yu et al. 2025): ``(sum_it m L, sum_it m)``;
- ``seq_mean_token_mean`` (GRPO, Shao et al. 2024): ``(sum_i mean_t L_i, #non-empty rows)``;
- ``seq_mean_token_sum_norm`` (Dr. GRPO, Liu et al. 2025): ``(sum_it m L / norm, #rows)``
  with a constant ``norm`` (the maximum completion length) and every row counted, empty or
  filtered ones too: the loss is ``sum_it m L / (B * L_max)``, a constant normaliser (TRL's
  ``loss_type="dr_grpo"``).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxlm.registry import Registry

AGGREGATORS: Registry = Registry("loss aggregator")


@AGGREGATORS.register("token_mean")
def token_mean(loss, mask, *, norm=None):
    m = mask.astype(jnp.float32)
    return jnp.sum(loss * m), jnp.sum(m)


@AGGREGATORS.register("seq_mean_token_mean")
def seq_mean_token_mean(loss, mask, *, norm=None):
    m = mask.astype(jnp.float32)
    n = m.sum(-1)
    per_seq = jnp.sum(loss * m, -1) / jnp.maximum(n, 1.0)
    return jnp.sum(jnp.where(n > 0, per_seq, 0.0)), jnp.sum(n > 0, dtype=jnp.float32)


@AGGREGATORS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(loss, mask, *, norm=None):
    if norm is None:
        raise ValueError("seq_mean_token_sum_norm needs norm= (the maximum completion length)")
    m = mask.astype(jnp.float32)
    return jnp.sum(loss * m) / norm, jnp.asarray(mask.shape[0], jnp.float32)
