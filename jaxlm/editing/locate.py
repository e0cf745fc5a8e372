"""Locate-then-edit baselines on the same API: MEMIT (Meng et al., ICLR 2023) and
AlphaEdit (Fang et al., ICLR 2025), closed-form updates of ``mlp.down_proj`` at several
layers. jaxlm stores kernels ``[d_in, d_out]``; keys ``K [N, d_in]`` are the kernel's
inputs at each request's subject-last token, residuals ``R [N, d_out]``.

* MEMIT (``memit_main.py``): ``dW = (lam C0 + K^T K)^{-1} K^T R`` (paper form
  ``Delta = R K^T (lam C0 + K K^T)^{-1}`` with keys as columns).
* AlphaEdit (``AlphaEdit_main.py``): with ``P`` the projector onto the null space of the
  key covariance ``C0`` (eigenvalues below ``tau``) and ``C_p`` the sum of earlier edits'
  ``K^T K``, ``dW = (P (K^T K + C_p) + lam I)^{-1} P K^T R`` (paper form
  ``Delta = R K^T P (K_p K_p^T P + K K^T P + lam I)^{-1}``). The update lies in range(P),
  so keys in the preserved subspace see no change.

Target values come from ``compute_targets``: per request, a vector ``delta`` added to the
residual stream after the last edited layer at the subject's last token is optimised so
the model predicts ``target_new`` (ROME/MEMIT ``compute_z``: Adam, weight decay on
``|delta|^2 / |h|^2``, norm clamp ``clamp_norm_factor |h|``); the residual
``z - h_current`` is spread over the layers, ``R / (n_layers_left)``, re-reading the
current hidden state after each layer's update. The KL "essence" term and the random
context prefixes of the reference code are not used (documented simplification).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxlm.editing.crispedit import EditResult, target_nll_sums
from jaxlm.editing.kfac import KFACFactors, check_module
from jaxlm.editing.requests import EncodedPairs, rewrite_pairs
from jaxlm.editing.weights import layer_kernels, with_layer_kernels
from jaxlm.interp.interventions import perturb


# ------------------------------------------------------------------ closed forms
def memit_update(K: jax.Array, R: jax.Array, C0: jax.Array, lam: float) -> jax.Array:
    """``(lam C0 + K^T K)^{-1} K^T R``: ``K [N, d_in]``, ``R [N, d_out]``, ``C0 [d_in, d_in]``."""
    chex.assert_rank((K, R, C0), 2)
    return jnp.linalg.solve(lam * C0 + K.T @ K, K.T @ R)


def nullspace_projector(C0: jax.Array, tau: float) -> jax.Array:
    """``U_hat U_hat^T`` over the eigenvectors of ``C0`` with eigenvalue ``< tau``
    (AlphaEdit's ``get_project``: SVD of the key covariance, ``nullspace_threshold``)."""
    U, S, _ = jnp.linalg.svd(C0)
    keep = (S < tau).astype(C0.dtype)
    return (U * keep) @ U.T


def alphaedit_update(K: jax.Array, R: jax.Array, P: jax.Array, C_prev: jax.Array, lam: float) -> jax.Array:
    """``(P (K^T K + C_prev) + lam I)^{-1} P K^T R``."""
    chex.assert_rank((K, R, P, C_prev), 2)
    d = P.shape[0]
    return jnp.linalg.solve(P @ (K.T @ K + C_prev) + lam * jnp.eye(d, dtype=P.dtype), P @ K.T @ R)


# ------------------------------------------------------------------ the editor
@dataclasses.dataclass(frozen=True)
class LocateEditConfig:
    """MEMIT / AlphaEdit hyperparameters (reference values in comments)."""

    layers: tuple[int, ...] = (1, 2)
    """Layers whose MLP down projection is edited."""
    module: str = "mlp.down_proj"
    """The edited projection (MEMIT / AlphaEdit edit mlp.down_proj only)."""
    lam_memit: float = 1e2
    """MEMIT: weight of the key covariance C0 (mom2_update_weight; 15000 on GPT-J with C0 from 100k Wikipedia samples)."""
    lam_alphaedit: float = 10.0
    """AlphaEdit: L2 regulariser of the update."""
    nullspace_tau: float = 2e-2
    """AlphaEdit: eigenvalues of C0 below this fraction of the largest span the null space (nullspace_threshold)."""
    v_steps: int = 25
    """Gradient steps of the target value optimisation (v_num_grad_steps)."""
    v_lr: float = 0.5
    """Learning rate of the target value optimisation (v_lr)."""
    v_weight_decay: float = 0.5
    """Weight decay of the target value optimisation (v_weight_decay)."""
    clamp_norm_factor: float = 0.75
    """The target value's change is clamped to this factor of the original value's norm."""
    batch_size: int = 64
    """Requests per target-optimisation batch."""

    def __post_init__(self):
        if self.module != "mlp.down_proj":
            raise ValueError(f"module={self.module!r} is invalid: MEMIT/AlphaEdit edit 'mlp.down_proj'")
        for name in ("lam_memit", "lam_alphaedit", "nullspace_tau", "v_lr", "clamp_norm_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: must be > 0")
        # v_steps <= 0 optimised nothing: the "edited" model came back unchanged, with no error
        for name in ("v_steps", "batch_size"):
            v = getattr(self, name)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}={v!r} is invalid: must be an int >= 1")
        v = self.v_weight_decay
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.number)) or not 0 <= v < np.inf:
            raise ValueError(f"v_weight_decay={v!r} is invalid: must be a finite number >= 0")
        layers = tuple(self.layers)
        if list(layers) != sorted(set(layers)):  # the residual is spread from the first layer on
            raise ValueError(f"layers={layers!r} is invalid: MEMIT/AlphaEdit edit the layers in ascending order "
                             f"without repeats (e.g. {tuple(sorted(set(layers)))})")


def _gather(x, pos):  # x [B, T, D], pos [B] -> [B, D]
    return jnp.take_along_axis(x, pos[:, None, None], axis=1)[:, 0]


@functools.partial(jax.jit, static_argnames=("graphdef", "layer", "steps", "lr", "wd", "clamp"))
def _optimise_delta(graphdef, state, tokens, valid, target_mask, key_pos, *, layer, steps, lr, wd, clamp):
    model = nnx.merge(graphdef, state)
    L, D = model.config.n_layers, model.config.d_model
    h0 = _gather(model(tokens, mask=valid, collect=("hidden",)).collected["hidden"][layer], key_pos)
    h_norm = jnp.linalg.norm(h0, axis=-1, keepdims=True)
    where = jnp.arange(tokens.shape[1])[None, :] == key_pos[:, None]

    def loss_of(delta):
        vec = jnp.zeros((L, *tokens.shape, D)).at[layer].set(where[..., None] * delta[:, None, :])
        logits = model(tokens, mask=valid, interventions=(perturb("hidden", vec, layers=[layer]),)).logits
        lp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]
        m = target_mask[:, 1:].astype(jnp.float32)
        per_request = jnp.sum(nll * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
        decay = wd * jnp.sum(delta**2, axis=-1) / jnp.sum(h0**2, axis=-1)
        return jnp.sum(per_request + decay)

    tx = optax.adam(lr)

    def body(carry, _):
        delta, opt = carry
        g = jax.grad(loss_of)(delta)
        upd, opt = tx.update(g, opt, delta)
        delta = delta + upd
        n = jnp.linalg.norm(delta, axis=-1, keepdims=True)
        delta = delta * jnp.minimum(1.0, clamp * h_norm / jnp.maximum(n, 1e-12))
        return (delta, opt), None

    delta0 = jnp.zeros_like(h0)
    (delta, _), _ = jax.lax.scan(body, (delta0, tx.init(delta0)), None, length=steps)
    return h0 + delta


def compute_targets(model, pairs: EncodedPairs, layer: int, cfg: LocateEditConfig) -> jax.Array:
    """``z [N, D]``: the residual stream after ``layer`` at each key position that makes
    the model predict the target (ROME/MEMIT ``compute_z``)."""
    graphdef, state = nnx.split(model)
    out = []
    for i in range(0, pairs.tokens.shape[0], cfg.batch_size):
        s = slice(i, i + cfg.batch_size)
        out.append(_optimise_delta(
            graphdef, state, jnp.asarray(pairs.tokens[s]), jnp.asarray(pairs.valid[s]),
            jnp.asarray(pairs.target_mask[s]), jnp.asarray(pairs.key_position[s]), layer=layer,
            steps=cfg.v_steps, lr=cfg.v_lr, wd=cfg.v_weight_decay, clamp=cfg.clamp_norm_factor,
        ))
    return jnp.concatenate(out)


@functools.partial(jax.jit, static_argnames=("graphdef", "layer", "last"))
def _keys_and_hidden(graphdef, state, tokens, valid, key_pos, *, layer, last):
    out = nnx.merge(graphdef, state)(tokens, mask=valid, collect=("mlp_act", "hidden"))
    return _gather(out.collected["mlp_act"][layer], key_pos), _gather(out.collected["hidden"][last], key_pos)


def locate_edit(
    model,
    requests: Sequence[dict[str, Any]],
    capability: KFACFactors,
    cfg: LocateEditConfig,
    *,
    tokenizer,
    method: str = "memit",
    previous_keys: jax.Array | None = None,
) -> EditResult:
    """One batch of MEMIT or AlphaEdit edits. ``capability.A`` (the K-FAC input factor of
    ``mlp.down_proj`` = the key second moment ``C0``) must cover ``cfg.layers``.
    ``previous_keys``: AlphaEdit's ``C_p`` per layer ``[n, d_in, d_in]`` (returned in
    ``info["keys_cov"]`` for the next batch of a sequential run)."""
    if method not in ("memit", "alphaedit"):
        raise ValueError(f"method={method!r} is invalid: locate-then-edit methods are 'memit', 'alphaedit'")
    layers = check_module(cfg.module, cfg.layers, model.config.n_layers)
    if capability.module != cfg.module or tuple(capability.layers) != layers:
        raise ValueError(
            f"capability statistics are for {capability.module} layers {capability.layers}, "
            f"the edit needs {cfg.module} layers {layers}"
        )
    last = max(layers)
    if last >= model.config.n_layers - 1:
        raise ValueError(
            f"layers={layers} is invalid for {method}: the target layer {last} must be followed by at "
            f"least one layer (the model has {model.config.n_layers}) so the value written at the subject "
            "token can reach the prediction"
        )
    t0 = time.perf_counter()
    pairs = rewrite_pairs(tokenizer, requests)
    z = compute_targets(model, pairs, last, cfg)
    graphdef, state = nnx.split(model)
    d_in = capability.A.shape[-1]
    C_prev = previous_keys if previous_keys is not None else jnp.zeros((len(layers), d_in, d_in))
    new_cov = []
    args = (jnp.asarray(pairs.tokens), jnp.asarray(pairs.valid), jnp.asarray(pairs.key_position))
    for j, layer in enumerate(layers):
        K, h = _keys_and_hidden(graphdef, state, *args, layer=layer, last=last)
        R = (z - h) / (len(layers) - j)
        C0 = capability.A[j]
        if method == "memit":
            dW = memit_update(K, R, C0, cfg.lam_memit)
        else:
            tau = cfg.nullspace_tau * jnp.linalg.eigvalsh(C0)[-1]
            dW = alphaedit_update(K, R, nullspace_projector(C0, tau), C_prev[j], cfg.lam_alphaedit)
        new_cov.append(C_prev[j] + K.T @ K)
        W = layer_kernels(state, model.config, cfg.module, [layer])
        state = with_layer_kernels(state, model.config, cfg.module, [layer], W + dW[None])
    if not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state)):
        raise FloatingPointError(f"{method} produced non-finite weights; the model is returned unchanged")
    return EditResult(model=nnx.merge(graphdef, state), losses=[], seconds=time.perf_counter() - t0,
                      info={"keys_cov": jnp.stack(new_cov)})


def target_loss(model, pairs: EncodedPairs) -> float:
    """Mean target NLL of ``pairs`` (a diagnostic)."""
    s, n = target_nll_sums(model(jnp.asarray(pairs.tokens), mask=jnp.asarray(pairs.valid)).logits,
                           jnp.asarray(pairs.tokens), jnp.asarray(pairs.target_mask))
    return float(s / jnp.maximum(n, 1.0))

