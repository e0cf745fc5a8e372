"""PEAR: importance-reweighted SFT that prepares for RL (Zhang et al., ICML 2026; method card
B.5). Off-policy data ``y ~ mu`` is reweighted toward the policy RL will sample from, ``pi``:
with ``l_t = log pi(y_t | .) - log mu(y_t | .)`` (no gradient),

* ``sequence``: ``log w = sum_t l_t`` for every token of the document;
* ``token``:    ``log w_t = sum_{k >= t} gamma^(k - t) l_k`` (discounted suffix; gamma = 0 is the
  per-token ratio, gamma = 1 the full suffix product);
* ``block``:    the same over blocks of ``block_size`` trained tokens,
  ``log w_b = sum_{b' >= b} gamma^(b' - b) sum_{k in b'} l_k``, shared by the block's tokens;

``log w`` clipped to ``[-clip, clip]``; with ``normalize`` the weights are self-normalised over
the batch, ``w~ = w / mean(w)``, i.e. the loss is ``sum_t w_t CE_t / sum_t w_t`` (a sum/count
pair, exact under gradient accumulation). Suffixes run over a document's trained tokens in
order (``k - t`` counts trained tokens), never across documents packed in one row.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

PEAR_VARIANTS = ("sequence", "token", "block")
#: |log w| never exceeds this, whatever ``clip``: e^50 ~ 5e21, so a batch's sums of w and w CE
#: stay finite in float32 up to ~1e15 tokens (at e^80 ~ 5.5e34, 6100 tokens at the limit overflowed
#: and the self-normalised loss was inf / inf = NaN)
LOG_WEIGHT_LIMIT = 50.0


@dataclasses.dataclass(frozen=True)
class PEARConfig:
    """PEAR token weights for SFT (``SFTConfig.pear``). The data rows carry the behaviour
    policy's per-token log-probs (``behavior_logprobs``, written by ``jaxlm logprobs``)."""

    variant: Literal["sequence", "token", "block"] = "token"
    """sequence | token (discounted suffix) | block (discounted suffix over blocks)."""
    gamma: float = 0.9
    """Suffix discount in [0, 1] (token and block) [INFERRED: the paper's value is not public]."""
    block_size: int = 16
    """Trained tokens per block (block) [INFERRED]."""
    clip: float = 1.0
    """log w is clipped to [-clip, clip] [INFERRED]; with 5.0 the self-normalised weights
    concentrated on few tokens and SFT collapsed in `bench/pear_claim.py` (docs/benchmarks.md).
    inf: no clipping, up to `LOG_WEIGHT_LIMIT` (50), past which a batch's float32 sums overflow."""
    normalize: bool = True
    """Self-normalise over the batch: the loss is sum w CE / sum w (else sum w CE / tokens)."""
    target: Literal["current", "fixed"] = "current"
    """The target policy pi: the model being trained (stop-gradient), or a fixed model whose
    log-probs the rows carry (``target_logprobs``, e.g. the pre-SFT model via ``jaxlm logprobs``)."""

    def __post_init__(self):
        if self.variant not in PEAR_VARIANTS:
            raise ValueError(f"algorithm.pear.variant={self.variant!r} is invalid: must be one of {list(PEAR_VARIANTS)}")
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, (int, float)) or not 0 <= self.gamma <= 1:
            raise ValueError(f"algorithm.pear.gamma={self.gamma!r} is invalid: must be in [0, 1]")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"algorithm.pear.block_size={self.block_size!r} is invalid: must be an int >= 1")
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float)) or not (
                self.clip > 0 and not math.isnan(self.clip)):
            raise ValueError(f"algorithm.pear.clip={self.clip!r} is invalid: must be > 0 (inf: no clipping)")
        if self.target not in ("current", "fixed"):
            raise ValueError(f"algorithm.pear.target={self.target!r} is invalid: must be current | fixed")
        if not isinstance(self.normalize, bool):  # a truthy string ("no") self-normalised
            raise ValueError(f"algorithm.pear.normalize={self.normalize!r} is invalid: must be true or false")

    @property
    def fields(self) -> tuple[str, ...]:
        """The per-token data fields this configuration reads."""
        return ("behavior_logprobs",) + (("target_logprobs",) if self.target == "fixed" else ())


def _blocks(valid: jax.Array, segment_ids: jax.Array, block_size: int | None) -> jax.Array:
    """Per position of one row, the index of its block among the row's blocks (in order), for
    valid positions; a block is ``block_size`` consecutive trained tokens of one document
    (None: the whole document)."""
    T = valid.shape[0]
    v = valid.astype(jnp.int32)
    doc_start = jnp.concatenate([jnp.ones((1,), bool), segment_ids[1:] != segment_ids[:-1]])
    # trained-token index within the document
    csum = jnp.cumsum(v)
    before_doc = jax.lax.cummax(jnp.where(doc_start, csum - v, 0), axis=0)
    idx = csum - v - before_doc
    blk = jnp.zeros_like(idx) if block_size is None else idx // block_size
    # a new block starts at a valid token whose (document, block) differs from the last valid token's
    key = segment_ids * (T + 1) + blk
    last_key = jax.lax.cummax(jnp.where(valid, jnp.arange(T), -1), axis=0)  # last valid position <= t
    prev = jnp.concatenate([jnp.full((1,), -1), last_key[:-1]])
    prev_key = jnp.where(prev >= 0, key[jnp.maximum(prev, 0)], -1)
    new = valid & (key != prev_key)
    return jnp.cumsum(new.astype(jnp.int32)) - 1


def _row_log_weights(ell, valid, seg, gamma: float, block_size: int | None) -> jax.Array:
    T = ell.shape[0]
    g = jnp.where(valid, _blocks(valid, seg, block_size), T)  # invalid -> a dropped segment
    block_sum = jax.ops.segment_sum(jnp.where(valid, ell, 0.0), g, num_segments=T + 1)[:T]
    block_doc = jax.ops.segment_max(jnp.where(valid, seg, -1), g, num_segments=T + 1)[:T]

    def back(carry, xs):  # R_b = L_b + gamma R_{b+1} within a document
        acc, next_doc = carry
        total, doc = xs
        # gamma = 0: no carry at all (0 * an infinite later log-ratio would be NaN)
        r = total + jnp.where(doc == next_doc, gamma * acc, 0.0) if gamma != 0 else total
        return (r, doc), r

    _, suffix = jax.lax.scan(back, (jnp.zeros(()), jnp.full((), -2, block_doc.dtype)), (block_sum, block_doc),
                             reverse=True)
    return jnp.where(valid, suffix[jnp.minimum(g, T - 1)], 0.0)


def pear_log_weights(log_ratio: jax.Array, valid: jax.Array, segment_ids: jax.Array, cfg: PEARConfig) -> jax.Array:
    """Unclipped ``log w [B, T]`` from per-position ``log pi - log mu`` (position t scores the
    target ``t + 1``, as `trainers.losses.next_token_targets`); 0 where ``valid`` is False."""
    if cfg.variant == "sequence":
        gamma, size = 1.0, None
    elif cfg.variant == "token":
        gamma, size = cfg.gamma, 1
    else:
        gamma, size = cfg.gamma, cfg.block_size
    fn = jax.vmap(lambda e, v, s: _row_log_weights(e, v, s, gamma, size))
    return fn(log_ratio.astype(jnp.float32), valid, segment_ids)


def shifted(field: jax.Array) -> jax.Array:
    """A per-token field aligned with ``tokens`` (entry t scores token t) -> aligned with
    positions (entry t scores the target ``t + 1``)."""
    return jnp.concatenate([field[:, 1:], jnp.zeros_like(field[:, :1])], axis=1)


def pear_weights(target_logp: jax.Array, batch, valid: jax.Array, cfg: PEARConfig) -> jax.Array:
    """``w [B, T]`` (0 off ``valid``, no gradient): ``target_logp`` is ``log pi`` of each
    position's target (the current model's, used when ``cfg.target == "current"``)."""
    if cfg.target == "fixed":
        target_logp = shifted(batch["target_logprobs"])
    ell = jax.lax.stop_gradient(target_logp) - shifted(batch["behavior_logprobs"])
    # float32's exp overflows past 88.7: without a bound (clip=inf) one long document's weight
    # became inf and the self-normalised loss inf / inf = NaN
    bound = min(float(cfg.clip), LOG_WEIGHT_LIMIT)
    log_w = jnp.clip(pear_log_weights(ell, valid, batch["segment_ids"], cfg), -bound, bound)
    return jnp.where(valid, jnp.exp(log_w), 0.0)
