"""Gradient editing: plain fine-tuning of the edited layers, and CrispEdit (Ikram et al.,
ICML 2026, arXiv 2602.15823), whose gradients are projected onto the low-curvature
subspace of the capability loss before each optimizer step.

The edit objective is the cross-entropy of the new targets given the rewrite prompts
(prompt tokens carry no loss; the reference code's ``objective_optimization:
target_new``). Each epoch walks the requests in minibatches; a minibatch whose loss is
already below ``stop_loss`` is skipped and the edit stops once an epoch's mean loss is
below it, as in the reference ``crispedit.py`` training loop.

`sequential_edit` applies batches of requests one after another: the capability
statistics are recomputed when an edited weight has drifted by more than
``recompute_threshold`` (relative Frobenius norm) since they were computed, and the
statistics of earlier edit batches are merged in (weighted by samples, as the reference
merges its caches; ``merge_weight="tokens"`` weights by tokens), so later edits also
avoid undoing earlier ones (the reference code's cache merging).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Iterable, Literal, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxlm.editing.kfac import ESTIMATORS, KFACFactors, check_module, kfac_factors, merge_factors
from jaxlm.editing.projection import (
    KroneckerProjector,
    check_energy,
    project_updates,
    projector_from_factors,
)
from jaxlm.editing.requests import EncodedPairs, rewrite_pairs
from jaxlm.editing.weights import layer_kernels, with_layer_kernels


@dataclasses.dataclass(frozen=True)
class GradientEditConfig:
    """Hyperparameters of fine-tuning / CrispEdit edits (reference defaults in comments)."""

    module: str = "mlp.down_proj"
    """The projection that is edited in each of layers (model.layers.{i}.mlp.down_proj)."""
    layers: tuple[int, ...] = (1, 2)
    """Layers whose module is edited."""
    lr: float = 5e-3
    """Adam learning rate of the edit (reference 5e-4 on Llama-3-8B)."""
    epochs: int = 50
    """Optimisation steps over the requests (reference 25 on Llama-3-8B; the tiny fact model needs ~50)."""
    batch_size: int = 32
    """Requests per optimisation batch."""
    stop_loss: float = 1e-2
    """Stop once the edit loss is below this."""
    weight_decay: float = 0.0
    """Adam weight decay of the edit."""
    energy: float = 0.8
    """CrispEdit: fraction of the curvature energy whose directions the edit avoids (energy_threshold; README 0.8, llama3-8b.yaml 0.99)."""
    kfac_mode: Literal["empirical_fisher", "sampled_fisher", "ggn"] = "empirical_fisher"
    """How the K-FAC output factor B is estimated (the reference: empirical Fisher)."""
    activation_only: bool = False
    """B = I: rank directions by the input factor A alone (Adam-NSCL-like)."""
    project: Literal["gradient", "update"] = "gradient"
    """gradient: project raw gradients, then Adam (the reference ProjectedAdam; Adam's per-element
    scaling moves the step slightly out of the subspace); update: project Adam's step, so every
    weight change lies exactly in the low-curvature subspace."""
    recompute_threshold: float = 0.25
    """Recompute the projector when this fraction of its statistics changed (recalculate_weight_threshold)."""
    protect_edits: bool = True
    """Merge the curvature statistics of earlier edit batches, so later batches protect them."""
    merge_weight: Literal["samples", "tokens"] = "samples"
    """How statistics are merged: weighted by samples (the reference) or by tokens."""
    seed: int = 0
    """Seed of the edit (sampled Fisher, data order)."""

    def __post_init__(self):
        check_energy(self.energy)
        if self.kfac_mode not in ESTIMATORS:
            raise ValueError(f"kfac_mode={self.kfac_mode!r} is invalid: must be one of {ESTIMATORS}")
        for name in ("epochs", "batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}={v!r} is invalid: must be a positive int")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not 0 < self.lr < float("inf"):
            raise ValueError(f"lr={self.lr!r} is invalid: must be a finite number > 0")
        # a negative decay pushes the edited kernels away from zero; NaN only failed as a divergence
        wd = self.weight_decay
        if isinstance(wd, bool) or not isinstance(wd, (int, float)) or not 0 <= wd < float("inf"):
            raise ValueError(f"weight_decay={wd!r} is invalid: must be a finite number >= 0")
        # any other project value would run plain fine-tuning without a word
        if self.project not in ("gradient", "update"):
            raise ValueError(f"project={self.project!r} is invalid: must be 'gradient' or 'update'")
        if self.merge_weight not in ("samples", "tokens"):
            raise ValueError(f"merge_weight={self.merge_weight!r} is invalid: must be 'samples' or 'tokens'")
        for name in ("stop_loss", "recompute_threshold"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{name}={v!r} is invalid: must be a number >= 0")


@dataclasses.dataclass
class EditResult:
    model: Any
    losses: list[float]  # epoch-mean edit loss
    seconds: float
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


def target_nll_sums(logits, tokens, target_mask):
    """Sum of ``-log p(target token)`` over target positions and their count."""
    lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]
    m = target_mask[:, 1:].astype(jnp.float32)
    return jnp.sum(nll * m), jnp.sum(m)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "module", "layers", "lr", "weight_decay", "stop_loss", "project")
)
def _edit_step(graphdef, state, W, opt_state, projector, tokens, valid, target_mask, *, module, layers, lr,
               weight_decay, stop_loss, project):
    config = nnx.merge(graphdef, state).config

    def loss_of(W):
        model = nnx.merge(graphdef, with_layer_kernels(state, config, module, layers, W))
        s, n = target_nll_sums(model(tokens, mask=valid).logits, tokens, target_mask)
        return s / jnp.maximum(n, 1.0)

    projection = project_updates(projector) if projector is not None else optax.identity()
    tx = optax.chain(
        projection if project == "gradient" else optax.identity(),
        optax.adamw(lr, weight_decay=weight_decay),
        projection if project == "update" else optax.identity(),
    )
    loss, grad = jax.value_and_grad(loss_of)(W)
    updates, new_opt = tx.update(grad, opt_state, W)
    go = loss >= stop_loss
    W = jnp.where(go, optax.apply_updates(W, updates), W)
    opt_state = jax.tree.map(lambda a, b: jnp.where(go, a, b), new_opt, opt_state)
    return W, opt_state, loss


def gradient_edit(
    model,
    pairs: EncodedPairs,
    cfg: GradientEditConfig,
    *,
    projector: KroneckerProjector | None = None,
) -> EditResult:
    """Edit ``cfg.module`` at ``cfg.layers`` until the targets of ``pairs`` are learned;
    with a ``projector`` every gradient is projected first (CrispEdit), else plain FT."""
    layers = check_module(cfg.module, cfg.layers, model.config.n_layers)
    t0 = time.perf_counter()
    graphdef, state = nnx.split(model)
    W = layer_kernels(state, model.config, cfg.module, layers).astype(jnp.float32)
    if projector is not None:
        chex.assert_equal_shape((W, projector.keep))
    opt_state = optax.adamw(cfg.lr, weight_decay=cfg.weight_decay).init(W)
    opt_state = (optax.EmptyState(), opt_state, optax.EmptyState())
    N = pairs.tokens.shape[0]
    rng = np.random.default_rng(cfg.seed)
    losses = []
    for _ in range(cfg.epochs):
        order = rng.permutation(N)
        epoch = []
        for i in range(0, N, cfg.batch_size):
            rows = order[i : i + cfg.batch_size]
            pad = cfg.batch_size - len(rows)
            tmask = pairs.target_mask[rows]
            if pad:  # fixed shapes: padded rows carry no target
                rows = np.concatenate([rows, rows[:1].repeat(pad)])
                tmask = np.concatenate([tmask, np.zeros((pad, tmask.shape[1]), bool)])
            W, opt_state, loss = _edit_step(
                graphdef, state, W, opt_state, projector, jnp.asarray(pairs.tokens[rows]),
                jnp.asarray(pairs.valid[rows]), jnp.asarray(tmask), module=cfg.module, layers=layers,
                lr=cfg.lr, weight_decay=cfg.weight_decay, stop_loss=cfg.stop_loss, project=cfg.project,
            )
            epoch.append(float(loss))
        losses.append(float(np.mean(epoch)))
        if losses[-1] < cfg.stop_loss:
            break
    if not np.all(np.isfinite(losses)):
        raise FloatingPointError(f"edit diverged (epoch losses {losses}); the model is returned unchanged")
    edited = nnx.merge(graphdef, with_layer_kernels(state, model.config, cfg.module, layers, W))
    return EditResult(model=edited, losses=losses, seconds=time.perf_counter() - t0)


def relative_change(W_new: jax.Array, W_ref: jax.Array) -> float:
    """Largest per-layer ``||W_new - W_ref||_F / ||W_ref||_F``."""
    num = jnp.linalg.norm((W_new - W_ref).reshape(W_ref.shape[0], -1), axis=-1)
    den = jnp.linalg.norm(W_ref.reshape(W_ref.shape[0], -1), axis=-1)
    return float(jnp.max(num / jnp.maximum(den, 1e-30)))


def sequential_edit(
    model,
    request_batches: Sequence[Sequence[dict[str, Any]]],
    cfg: GradientEditConfig,
    *,
    tokenizer,
    capability_batches: Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]] | None,
    method: str = "crispedit",
    on_batch: Callable[[int, Any], None] | None = None,
) -> EditResult:
    """Apply ``request_batches`` in order with ``method`` in {"crispedit", "finetune"}.

    ``capability_batches()`` yields ``(tokens, valid)`` batches of the capability corpus
    (needed by CrispEdit). ``on_batch(k, model)`` is called after each batch (metrics)."""
    if method not in ("crispedit", "finetune"):
        raise ValueError(f"method={method!r} is invalid: gradient edits are 'crispedit' or 'finetune'")
    if method == "crispedit" and capability_batches is None:
        raise ValueError("crispedit needs capability_batches (the corpus whose curvature it protects)")
    layers = check_module(cfg.module, cfg.layers, model.config.n_layers)
    t0 = time.perf_counter()
    kfac_kw = dict(module=cfg.module, layers=layers, mode=cfg.kfac_mode, seed=cfg.seed)
    capability: KFACFactors | None = None
    W_ref = None
    edit_stats: list[KFACFactors] = []
    losses, recomputes = [], 0
    for k, requests in enumerate(request_batches):
        pairs = rewrite_pairs(tokenizer, requests)
        projector = None
        if method == "crispedit":
            W_now = layer_kernels(nnx.state(model), model.config, cfg.module, layers)
            if capability is None or relative_change(W_now, W_ref) > cfg.recompute_threshold:
                capability = kfac_factors(model, capability_batches(), **kfac_kw)
                W_ref = W_now
                recomputes += 1
            factors = merge_factors([capability, *edit_stats], cfg.merge_weight) if cfg.protect_edits else capability
            projector = projector_from_factors(factors, cfg.energy, activation_only=cfg.activation_only)
        result = gradient_edit(model, pairs, cfg, projector=projector)
        model = result.model
        losses += result.losses
        if method == "crispedit" and cfg.protect_edits:
            edit_stats.append(kfac_factors(model, [(pairs.tokens, pairs.valid)], **kfac_kw))
        if on_batch is not None:
            on_batch(k, model)
    return EditResult(model=model, losses=losses, seconds=time.perf_counter() - t0,
                      info={"capability_recomputes": recomputes})
