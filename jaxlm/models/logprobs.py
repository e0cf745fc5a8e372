"""Selected-token log-probabilities straight from hidden states, chunked, with a custom VJP.

``log p(target) = h w[:, target] - logsumexp(h w)`` is computed ``chunk`` rows at a time,
so the float32 ``[N, V]`` logits never exist whole, and the backward pass recomputes each
chunk's logits instead of storing them: ``d logits = c * (onehot(target) - softmax)``,
then ``dh = d logits w^T`` and ``dw = h^T d logits``. Used by the SFT loss (and RL
log-probs); equal to ``log_softmax(h @ w)[target]`` (tested).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    n = x.shape[0]
    pad = (-n) % chunk
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape(-1, chunk, *x.shape[1:])


def _chunk_logits(h, w):
    return jnp.dot(h, w.astype(h.dtype), preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _token_logprobs(h, w, targets, chunk):
    return _token_logprobs_fwd(h, w, targets, chunk)[0]


def _token_logprobs_fwd(h, w, targets, chunk):
    n = h.shape[0]

    def one(args):
        hc, tc = args
        logits = _chunk_logits(hc, w)
        lse = jax.nn.logsumexp(logits, axis=-1)
        V = logits.shape[-1]
        picked = jnp.take_along_axis(logits, jnp.clip(tc, 0, V - 1)[:, None], axis=-1)[:, 0]
        # a target outside [0, V) (an ignore id such as -100, a vocabulary mismatch) has no
        # log-prob: NaN, never another token's (a negative index would wrap to V + t)
        return jnp.where((tc >= 0) & (tc < V), picked - lse, jnp.nan), lse

    logp, lse = jax.lax.map(one, (_chunks(h, chunk), _chunks(targets, chunk)))
    logp, lse = logp.reshape(-1)[:n], lse.reshape(-1)[:n]
    return logp, (h, w, targets, lse)


def _token_logprobs_bwd(chunk, res, g):
    h, w, targets, lse = res
    n, V = h.shape[0], w.shape[1]

    def one(dw, args):
        hc, tc, lc, gc = args
        probs = jnp.exp(_chunk_logits(hc, w) - lc[:, None])
        valid = (tc >= 0) & (tc < V)
        dlogits = jnp.where(valid, gc, 0.0)[:, None] * (jax.nn.one_hot(tc, V, dtype=probs.dtype) - probs)
        dh = jnp.dot(dlogits, w.astype(jnp.float32).T).astype(h.dtype)
        dw = dw + jnp.dot(hc.astype(jnp.float32).T, dlogits)
        return dw, dh

    dw, dh = jax.lax.scan(
        one, jnp.zeros(w.shape, jnp.float32),
        (_chunks(h, chunk), _chunks(targets, chunk), _chunks(lse, chunk), _chunks(g, chunk)),
    )
    return dh.reshape(-1, h.shape[1])[:n], dw.astype(w.dtype), None


_token_logprobs.defvjp(_token_logprobs_fwd, _token_logprobs_bwd)


def token_logprobs(h: jax.Array, w: jax.Array, targets: jax.Array, *, chunk: int = 512) -> jax.Array:
    """``log softmax(h @ w)[targets]`` for ``h [..., D]``, ``w [D, V]``, ``targets [...]``,
    float32, ``chunk`` rows of logits at a time (forward and backward). A target outside
    ``[0, V)`` gives NaN (and no gradient): mask such positions with ``jnp.where``."""
    lead = h.shape[:-1]
    out = _token_logprobs(h.reshape(-1, h.shape[-1]), w, targets.reshape(-1).astype(jnp.int32), chunk)
    return out.reshape(lead)


def token_entropy(h: jax.Array, w: jax.Array, *, chunk: int = 512) -> jax.Array:
    """Entropy of ``softmax(h @ w)`` per row, float32, ``chunk`` rows at a time (no
    gradient: for logging)."""
    lead = h.shape[:-1]
    flat = jax.lax.stop_gradient(h.reshape(-1, h.shape[-1]))
    n = flat.shape[0]

    def one(hc):
        logits = _chunk_logits(hc, jax.lax.stop_gradient(w))
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.sum(jnp.exp(logp) * logp, axis=-1)

    return jax.lax.map(one, _chunks(flat, chunk)).reshape(-1)[:n].reshape(lead)


def unembedding(model) -> jax.Array:
    """The LM head as a dense ``[D, V]`` matrix (the transposed embedding when tied)."""
    if model.lm_head is None:
        return model.embed[...].T
    kernel = model.lm_head.kernel.get_value()
    if not isinstance(kernel, jax.Array):
        raise TypeError(
            f"chunked log-probs need a dense LM head, got {type(kernel).__name__}; keep the LM "
            f"head unquantized (the default recipes do)"
        )
    return kernel
