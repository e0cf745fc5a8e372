"""K-FAC curvature statistics of chosen linear layers, accumulated over a corpus.

For a linear layer ``y = a @ W`` (jaxlm stores kernels ``[d_in, d_out]``) the curvature
of the capability loss restricted to ``W`` is approximated by a Kronecker product
(Martens & Grosse 2015; CrispEdit, Ikram et al. ICML 2026, arXiv 2602.15823, Sec. 3)::

    G_W ~= A (x) B,   A = E[a a^T]  (d_in x d_in),   B = E[d d^T]  (d_out x d_out),

where ``d`` is the output-side cotangent. The three estimation modes differ only in the
cotangent on the logits ``z`` that is pulled back to ``y`` (``p = softmax(z)``):

* ``"empirical_fisher"``: ``p - onehot(next token)``, the gradient of the summed
  teacher-forced cross-entropy with the true labels (what CrispEdit's code computes);
* ``"sampled_fisher"``: ``p - onehot(y~p)``, labels sampled from the model;
* ``"ggn"``: ``S r`` with ``S = diag(sqrt p) - p sqrt(p)^T`` and Rademacher ``r``, so
  ``E[S r r^T S^T] = diag(p) - p p^T``, the Hessian of the log-softmax loss: ``E[d d^T]``
  is the Gauss-Newton (GGN) factor the paper's Bregman-constraint theory calls for
  (curvature propagation, Martens et al. 2012). In expectation the sampled Fisher equals
  the GGN for softmax cross-entropy; the Rademacher form has lower variance.

Both factors are sums over valid tokens divided once by the token count, so batches of
any size accumulate exactly; `merge_factors` forms CrispEdit's sample-weighted average of
statistics from several corpora (``A = sum_k n_k A_k / sum_k n_k``, ``n_k`` samples).

Why not ``kfac-jax``: its estimator tags layers by pattern-matching ``dense`` ops in the
traced jaxpr and tracks every such layer; jaxlm's blocks run under ``lax.scan`` with
stacked weights, where one traced dense op stands for all layers, and an edit needs the
factors of two or three named layers only. Here the output cotangent ``d`` is read exactly
as the gradient of a zero perturbation added at the layer's output tap
(`jaxlm.interp.perturb`), with the layer's input read through ``collect``.
"""

from __future__ import annotations

import functools
from typing import Iterable, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxlm.interp.interventions import perturb

#: editable module -> (input tap, output tap): the layer's input and output in the block.
EDITABLE_MODULES: dict[str, tuple[str, str]] = {
    "mlp.down_proj": ("mlp_act", "mlp_out"),
    "attn.o_proj": ("attn_ctx", "attn_out"),
}
ESTIMATORS = ("empirical_fisher", "sampled_fisher", "ggn")


@struct.dataclass
class KFACFactors:
    """Per edited layer: ``A [n, d_in, d_in]``, ``B [n, d_out, d_out]`` (means over ``tokens``)."""

    A: jax.Array
    B: jax.Array
    tokens: jax.Array  # scalar float: how many tokens the means are over
    samples: jax.Array  # scalar float: how many sequences
    layers: tuple[int, ...] = struct.field(pytree_node=False)
    module: str = struct.field(pytree_node=False)


def check_module(module: str, layers: Sequence[int], n_layers: int) -> tuple[int, ...]:
    if module not in EDITABLE_MODULES:
        raise ValueError(f"module={module!r} is invalid: editable modules are {sorted(EDITABLE_MODULES)}")
    if any(np.ndim(i) != 0 or not np.issubdtype(np.asarray(i).dtype, np.integer) for i in layers):
        raise ValueError(f"layers={tuple(layers)!r} is invalid: layer indices must be ints (0.7 was read as 0)")
    layers = tuple(int(i) for i in layers)
    if not layers or len(set(layers)) != len(layers):
        raise ValueError(f"layers={layers!r} is invalid: need distinct layer indices")
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"layers={bad} are out of range: the model has layers 0..{n_layers - 1}")
    return layers


def output_cotangent(logits: jax.Array, tokens: jax.Array, valid: jax.Array, mode: str, key) -> jax.Array:
    """The cotangent on ``logits [B, T, V]`` whose pull-back is the K-FAC output statistic
    (see the module docstring); zero where position t does not predict a valid t+1."""
    if mode not in ESTIMATORS:
        raise ValueError(f"mode={mode!r} is invalid: estimation modes are {ESTIMATORS}")
    z = logits[:, :-1].astype(jnp.float32)
    p = jax.nn.softmax(z, axis=-1)
    if mode == "empirical_fisher":
        cot = p - jax.nn.one_hot(tokens[:, 1:], z.shape[-1], dtype=p.dtype)
    elif mode == "sampled_fisher":
        y = jax.random.categorical(key, z, axis=-1)
        cot = p - jax.nn.one_hot(y, z.shape[-1], dtype=p.dtype)
    else:
        r = jax.random.rademacher(key, z.shape, dtype=p.dtype)
        sq = jnp.sqrt(p)
        cot = sq * r - p * jnp.sum(sq * r, axis=-1, keepdims=True)
    cot = cot * (valid[:, :-1] & valid[:, 1:])[..., None]
    return jnp.pad(cot, ((0, 0), (0, 1), (0, 0)))


@functools.partial(jax.jit, static_argnames=("graphdef", "module", "layers", "mode", "samples"))
def _factor_sums(graphdef, state, tokens, valid, key, *, module, layers, mode, samples):
    model = nnx.merge(graphdef, state)
    c = model.config
    in_site, out_site = EDITABLE_MODULES[module]
    d_out = c.d_model
    idx = jnp.asarray(layers)

    def logits_of(delta):
        out = model(tokens, mask=valid, collect=(in_site,), interventions=(perturb(out_site, delta),))
        return out.logits, out.collected[in_site]

    delta = jnp.zeros((c.n_layers, *tokens.shape, d_out), jnp.float32)
    logits, pullback, acts = jax.vjp(logits_of, delta, has_aux=True)
    m = valid.astype(jnp.float32)[None, ..., None]
    if isinstance(acts, (tuple, list)):  # per-layer widths (layer_ffn_dims): one array per layer
        widths = {int(acts[i].shape[-1]) for i in layers}
        if len(widths) > 1:
            raise ValueError(f"K-FAC of {module} over layers {list(layers)}: their input widths differ "
                             f"({sorted(widths)}, ModelConfig.layer_ffn_dims); estimate the layers separately")
        a = jnp.stack([acts[i] for i in layers])
    else:
        a = acts[idx]
    a = a.astype(jnp.float32) * m
    A = jnp.einsum("nbti,nbtj->nij", a, a)

    def one(key):
        (d,) = pullback(output_cotangent(logits, tokens, valid, mode, key))
        d = d[idx] * m
        return jnp.einsum("nbti,nbtj->nij", d, d)

    # lax.map in chunks of 16, not one vmap over all samples: on XLA:CPU (jax 0.10.2) a
    # jitted vmap of this pullback over 512 cotangents returned wrong rows from ~170 on
    # (tests/editing/test_curvature.py checks the estimate against the dense GGN).
    B = jnp.mean(jax.lax.map(one, jax.random.split(key, samples), batch_size=16), axis=0)
    return A, B, valid.sum().astype(jnp.float32)


def kfac_factors(
    model,
    batches: Iterable[tuple[np.ndarray, np.ndarray]],
    *,
    module: str = "mlp.down_proj",
    layers: Sequence[int],
    mode: str = "empirical_fisher",
    samples: int = 1,
    seed: int = 0,
) -> KFACFactors:
    """Stream ``(tokens [B, T], valid [B, T])`` batches (right-padded) and return the
    K-FAC factors of ``module`` at ``layers`` (sums in float32, divided once)."""
    layers = check_module(module, layers, model.config.n_layers)
    if mode not in ESTIMATORS:
        raise ValueError(f"mode={mode!r} is invalid: estimation modes are {ESTIMATORS}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples={samples!r} is invalid: must be a positive int")
    graphdef, state = nnx.split(model)
    A = B = None
    n = rows = 0.0
    key = jax.random.key(seed)
    for tokens, valid in batches:
        tokens, valid = jnp.asarray(tokens, jnp.int32), jnp.asarray(valid, bool)
        chex.assert_equal_shape((tokens, valid))
        key, sub = jax.random.split(key)
        a, b, t = _factor_sums(
            graphdef, state, tokens, valid, sub, module=module, layers=layers, mode=mode, samples=samples
        )
        A, B = (a, b) if A is None else (A + a, B + b)
        n += float(t)
        rows += float(np.sum(np.asarray(valid).any(axis=1)))
    if A is None or n == 0:
        raise ValueError("kfac_factors: the corpus has no valid tokens")
    return KFACFactors(A=A / n, B=B / n, tokens=jnp.asarray(n, jnp.float32), samples=jnp.asarray(rows, jnp.float32),
                       layers=layers, module=module)


def merge_factors(factors: Sequence[KFACFactors], weight: str = "samples") -> KFACFactors:
    """Average of statistics over corpora weighted by ``"samples"`` (sequences: CrispEdit's
    sample-weighted cache merging, ``A = sum_k n_k A_k / sum_k n_k``) or by ``"tokens"``
    (the exact statistics of the pooled corpora)."""
    if weight not in ("samples", "tokens"):
        raise ValueError(f"weight={weight!r} is invalid: must be 'samples' or 'tokens'")
    factors = list(factors)
    if not factors:
        raise ValueError("merge_factors needs at least one KFACFactors")
    first = factors[0]
    for f in factors[1:]:
        if f.layers != first.layers or f.module != first.module:
            raise ValueError(
                f"cannot merge factors of {f.module} layers {f.layers} with {first.module} layers {first.layers}"
            )
    w = [f.samples if weight == "samples" else f.tokens for f in factors]
    A = sum(f.A * wk for f, wk in zip(factors, w)) / sum(w)
    B = sum(f.B * wk for f, wk in zip(factors, w)) / sum(w)
    return KFACFactors(A=A, B=B, tokens=sum(f.tokens for f in factors), samples=sum(f.samples for f in factors),
                       layers=first.layers, module=first.module)


def token_batches(tokenizer, texts: Sequence[str], *, batch_size: int, seq_len: int, add_bos: bool = True):
    """Right-padded ``(tokens, valid)`` batches of plain texts (a capability corpus). The
    arguments are checked here, before the first batch is asked for."""
    if isinstance(texts, str):
        raise ValueError("texts is one string: pass a list of texts (a string would be read as its characters)")
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}={v!r} is invalid: must be an int >= 1")
    return _token_batches(tokenizer, texts, int(batch_size), int(seq_len), add_bos)


def _token_batches(tokenizer, texts, batch_size, seq_len, add_bos):
    rows = []
    for t in texts:
        ids = tokenizer.encode(t, add_bos=add_bos)
        if tokenizer.eos_id is not None:
            ids = ids + [tokenizer.eos_id]
        rows.append(ids[:seq_len])
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        tok = np.zeros((len(chunk), seq_len), np.int32)
        valid = np.zeros((len(chunk), seq_len), bool)
        for r, ids in enumerate(chunk):
            tok[r, : len(ids)] = ids
            valid[r, : len(ids)] = True
        yield tok, valid
