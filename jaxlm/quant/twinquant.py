"""TwinQuant (ICML 2026, arXiv 2606.01556; abstract only, no code): a weight is a
high-precision low-rank part plus a 4-bit residual, with the subspace and the residual's
transform learned to minimise the *post-quantization* output error.

For ``y = x @ W`` (``W [C, R]``, jaxlm's ``[in, out]``), rank ``r``:

    y ~= (x P) L + Q(x A) . Q(A^{-1} (I - P P^T) W),      L = P^T W,

* ``P in St(C, r)`` (orthonormal columns), optimised on the Stiefel manifold: Riemannian
  gradient ``G - P sym(P^T G)``, Adam moments, QR retraction (``qf(P - step)``);
* ``A = diag(A_1 .. A_{C/B})`` block-diagonal in ``GL(B)`` per quantization block,
  initialised to the shared Hadamard and trained unconstrained (a general linear
  transform; its conditioning is reported);
* the objective is ``E ||y - y_hat||^2`` on calibration inputs with a straight-through
  quantizer (`jaxlm.quant.formats.fake_quant`).

``act_format=None`` gives the weight-only (W4A16) setting, where the forward is exactly the
fused kernel `kernels_pallas.lowrank_w4a16` on ``x A`` with ``P' = A^{-1} P``.
The baseline `svd_split` is SVDQuant's decomposition without smoothing: ``P`` = the top-r
left singular vectors of ``W``, plain RTN residual (``A = I``).

Model level: `LowRankTransformedWeight` (a weight type ``linear`` dispatches on, stored by
`jaxlm.quant.storage`) and `twinquant_quantize_model` (per layer and projection, on samples
of the layer's actual inputs); ``jaxlm quantize --method twinquant``. Under the ``kernel`` /
``interpret`` backend W4A4 runs the low-rank branch in jnp plus the residual through the
fused W4A4 kernels, and weight-only runs `kernels_pallas.lowrank_w4a16` (interpret mode
verified; compiled lowering not run).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxlm.models.layers.linear import linear
from jaxlm.quant.backend import resolved_backend
from jaxlm.quant.calibrate import INPUT_TAPS, input_samples
from jaxlm.quant.formats import QFormat, fake_quant, fake_quant_tokens, get_format, quantize
from jaxlm.quant.transforms import hadamard_transform, identity_transform, transform_activations
from jaxlm.quant.w4a4 import (
    TransformedWeight,
    kernel_weight,
    kernel_with_jnp_gradient,
    map_projections,
    transformed_linear,
)
from kernels_pallas import lowrank_w4a16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowRankPlusResidual:
    """``P [C, r]``, ``L [r, R]`` (high precision), block transform ``T [C/B, B, B]``
    (``T_i = A_i^T`` so the activations are ``T x`` blockwise) and the residual
    ``A^{-1} (I - P P^T) W [C, R]`` (dense; quantize with `quantize`)."""

    P: jax.Array
    L: jax.Array
    T: jax.Array
    residual: jax.Array


def _blockwise_left_solve(T, M):
    """``T^{-T} M`` per block of rows: ``A^{-1} M`` with ``A_i = T_i^T``."""
    n, B, _ = T.shape
    return jnp.linalg.solve(jnp.swapaxes(T, 1, 2), M.reshape(n, B, -1)).reshape(M.shape)


def decompose(W, P, T) -> LowRankPlusResidual:
    W = jnp.asarray(W, jnp.float32)
    L = P.T @ W
    return LowRankPlusResidual(P=P, L=L, T=T, residual=_blockwise_left_solve(T, W - P @ L))


def forward(x, d: LowRankPlusResidual, fmt: QFormat, act_format: QFormat | None):
    """``(x P) L + Q_a(T x) . Q(residual)`` (straight-through in the quantizers)."""
    xt = transform_activations(x, d.T)
    if act_format is not None:
        xt = fake_quant_tokens(xt, act_format)
    return (x @ d.P) @ d.L + xt @ fake_quant(d.residual, fmt, axis=-2)


def svd_split(W, rank: int, block: int) -> LowRankPlusResidual:
    """SVDQuant-style split (no smoothing): top-``rank`` left singular vectors, RTN residual."""
    W = np.asarray(W, np.float64)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 < rank <= min(W.shape):
        raise ValueError(f"rank={rank!r} is invalid for a {list(W.shape)} weight: must be in [1, {min(W.shape)}]")
    U, _, _ = np.linalg.svd(W, full_matrices=False)
    return decompose(W, jnp.asarray(U[:, :rank], jnp.float32), identity_transform(W.shape[0], block))


def _stiefel_project(P, G):
    PtG = P.T @ G
    return G - P @ (PtG + PtG.T) / 2


def _qr_retract(Y):
    Q, Rm = jnp.linalg.qr(Y)
    return Q * jnp.sign(jnp.diagonal(Rm))[None, :]  # fix signs: a continuous retraction


@dataclasses.dataclass(frozen=True)
class TwinQuantConfig:
    rank: int = 16
    steps: int = 300
    lr_subspace: float = 1e-2
    lr_transform: float = 1e-3
    init_transform: str = "hadamard"  # or "identity"
    batch: int = 256
    seed: int = 0

    def __post_init__(self):
        if self.init_transform not in ("hadamard", "identity"):
            raise ValueError(f"init_transform={self.init_transform!r} must be 'hadamard' or 'identity'")
        for name in ("rank", "steps", "batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}={v!r} is invalid: must be a positive int")
        for name in ("lr_subspace", "lr_transform"):  # NaN / inf gave all-NaN weights, < 0 ascent
            v = getattr(self, name)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real) or not 0 < v < math.inf:
                raise ValueError(f"TwinQuantConfig.{name}={v!r} is invalid: must be a finite number > 0")
            object.__setattr__(self, name, float(v))  # a static argument of the compiled loop


@functools.partial(jax.jit, static_argnames=("fmt", "act", "steps", "batch", "lr_P", "lr_T"))
def _optimize(W, X, P, T, key, *, fmt, act, steps, batch, lr_P, lr_T):
    """``steps`` Adam steps on minibatches of ``X``: Riemannian (Stiefel) for ``P``, plain
    for ``T``; one compiled loop (`lax.scan`), cached per shape and setting."""
    Y = X @ W
    opt_P, opt_T = optax.adam(lr_P), optax.adam(lr_T)

    def loss_fn(P, T, xb, yb):
        d = decompose(W, P, T)
        return jnp.mean(jnp.sum((forward(xb, d, fmt, act) - yb) ** 2, axis=-1))

    def step(carry, _):
        P, T, sP, sT, key = carry
        key, sub = jax.random.split(key)
        idx = jax.random.choice(sub, X.shape[0], (batch,), replace=False)
        loss, (gP, gT) = jax.value_and_grad(loss_fn, argnums=(0, 1))(P, T, X[idx], Y[idx])
        uP, sP = opt_P.update(_stiefel_project(P, gP), sP)
        uT, sT = opt_T.update(gT, sT)
        return (_qr_retract(P + uP), T + uT, sP, sT, key), loss

    (P, T, _, _, _), losses = jax.lax.scan(step, (P, T, opt_P.init(P), opt_T.init(T), key), None, length=steps)
    return P, T, losses


def twinquant(W, X_calib, fmt: str | QFormat, cfg: TwinQuantConfig = TwinQuantConfig(), *,
              act_format: str | QFormat | None = "same") -> tuple[LowRankPlusResidual, dict]:
    """Learn ``P`` (Stiefel) and the block transform (GL) for ``W [C, R]`` on calibration
    inputs ``X_calib [N, C]``; starts from the SVD split with a Hadamard residual transform."""
    fmt = get_format(fmt)
    act = fmt if act_format == "same" else (None if act_format is None else get_format(act_format))
    W = jnp.asarray(W, jnp.float32)
    X = jnp.asarray(X_calib, jnp.float32)
    C, R = W.shape
    if X.ndim != 2 or X.shape[1] != C or X.shape[0] < 1:  # no rows: NaN losses, zero gradients, nothing learnt
        raise ValueError(f"X_calib must be [N >= 1, C = {C}] calibration inputs of the layer, got shape {X.shape}")
    top = min(C - 1, R)  # P [C, r] spans directions of W's column space, which has at most R
    if not 0 < cfg.rank <= top:
        raise ValueError(f"rank={cfg.rank} is invalid for a [{C}, {R}] weight: must be in [1, {top}] "
                         "(below the input width and at most the output width)")
    init = svd_split(W, cfg.rank, fmt.block)
    T0 = hadamard_transform(C, fmt.block) if cfg.init_transform == "hadamard" else identity_transform(C, fmt.block)
    P, T = init.P, T0
    P, T, losses = _optimize(W, X, P, T, jax.random.key(cfg.seed), fmt=fmt, act=act, steps=cfg.steps,
                             batch=min(cfg.batch, X.shape[0]), lr_P=cfg.lr_subspace, lr_T=cfg.lr_transform)
    losses = [float(v) for v in np.asarray(losses)]
    d = decompose(W, P, T)
    info = {
        "losses": losses,
        "orthonormality_error": float(jnp.max(jnp.abs(P.T @ P - jnp.eye(cfg.rank)))),
        "max_condition_number": float(jnp.max(jnp.linalg.cond(T))),
    }
    return d, info


def fused_operands(d: LowRankPlusResidual, fmt: str | QFormat):
    """Operands of `kernels_pallas.lowrank_w4a16` for the weight-only forward: the kernel
    sees ``x' = T x`` (blockwise), so the low-rank input projection is ``P' = A^{-1} P``
    (``x' P' = x P``) and the residual is quantized as stored. Returns
    ``(qarray, P', L)``; call ``lowrank_w4a16_matmul(x', q.codes, q.scales,
    q.global_scale, P', L, ...)``."""
    fmt = get_format(fmt)
    return quantize(d.residual, fmt, axis=-2), _blockwise_left_solve(d.T, d.P), d.L


# ---------------------------------------------------------------- model level


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowRankTransformedWeight:
    """TwinQuant as a weight type the unchanged model runs: ``linear(x, w) = (x P) L +
    Q_a(T x) . Q(A^{-1} (I - P P^T) W)``. ``P [C, r]`` and ``L [r, R]`` stay in high
    precision; ``residual`` is a `TransformedWeight` (block transform ``T``, the residual
    quantized with ``quantize(..., axis=-2)`` or dense, and the activation format, ``None``
    for weight-only W4A16). Stacks over layers like any pytree (``scan_layers=True``)."""

    P: jax.Array
    L: jax.Array
    residual: TransformedWeight

    @property
    def T(self) -> jax.Array:
        return self.residual.T


@linear.register(LowRankTransformedWeight)
def lowrank_transformed_linear(x: jax.Array, w: LowRankTransformedWeight) -> jax.Array:
    """``(x P) L + Q_a(T x) . R``. Under the ``kernel``/``interpret`` backend: W4A4 runs the
    low-rank branch in jnp plus the residual through the fused W4A4 kernels
    (`transformed_linear`); weight-only with a kernel `QArray` residual runs the fused
    low-rank + residual kernel `kernels_pallas.lowrank_w4a16` (`fused_lowrank_supported`).
    Under ``reference`` (CPU ``auto``): the jnp path `jnp_lowrank_linear`."""
    mode = resolved_backend()
    if mode != "reference" and fused_lowrank_supported(x, w):
        return _fused_lowrank(x, w, mode)
    return jnp_lowrank_linear(x, w)


def jnp_lowrank_linear(x: jax.Array, w: LowRankTransformedWeight) -> jax.Array:
    return linear(linear(x, w.P), w.L) + transformed_linear(x, w.residual)


def fused_lowrank_supported(x: jax.Array, w: LowRankTransformedWeight) -> bool:
    """Weight-only (``act_format=None``), a 2-D kernel-format `QArray` residual
    (`jaxlm.quant.w4a4.kernel_weight`) and 2-D ``P``/``L``."""
    q = w.residual.weight
    return (w.residual.act_format is None and kernel_weight(q) and w.P.ndim == 2 and w.L.ndim == 2
            and x.shape[-1] == q.shape[0] == w.P.shape[0] and w.L.shape == (w.P.shape[1], q.shape[1]))


def _fused_lowrank_forward(x: jax.Array, w: LowRankTransformedWeight, mode: str) -> jax.Array:
    """The kernel sees ``x' = T x`` (blockwise, rounded to ``x.dtype`` as the jnp path
    rounds the residual's input), so the down-projection is ``P' = A^{-1} P`` (``x' P' =
    x P``, `fused_operands`). ``P'`` is solved per call (``C/B`` ``B x B`` solves, ``O(C B r)``
    flops, small next to the ``C N`` residual when ``r << N``): storing it would change the
    checkpoint format."""
    q = w.residual.weight
    C, N = q.shape
    xt = transform_activations(x, w.T).astype(x.dtype).reshape(-1, C)
    P_t = _blockwise_left_solve(w.T, w.P.astype(jnp.float32))
    f = q.fmt
    y = lowrank_w4a16.lowrank_w4a16_matmul(
        xt, q.codes, q.scales, q.global_scale.reshape(()), P_t, w.L, element=f.element, block=f.block,
        scale_kind=f.scale_kind, alpha=f.alpha, bk=math.lcm(256, f.block), interpret=mode == "interpret",
        out_dtype=x.dtype,
    )
    return y.reshape(*x.shape[:-1], N)


_fused_lowrank = kernel_with_jnp_gradient(_fused_lowrank_forward, jnp_lowrank_linear)


def _resolve_rank(rank: int | float, C: int, R: int | None = None) -> int:
    """An int rank as given; a fraction of the input width ``C``, rounded and kept in
    ``[1, min(C - 1, R)]`` (a GQA key/value projection is narrower than its input)."""
    if isinstance(rank, float):
        if not 0 < rank < 1:
            raise ValueError(f"rank={rank!r} is invalid: a fraction of the input width must be in (0, 1)")
        return max(1, min(int(round(rank * C)), C - 1, C if R is None else R))
    return rank


#: model-level default: few optimisation steps per projection (the quickstart model's
#: 21 projections then quantize in about a minute on 2 CPU cores; docs/quantization.md)
MODEL_CONFIG = TwinQuantConfig(rank=16, steps=40, batch=256)


def twinquant_quantize_model(
    model,
    fmt: str | QFormat,
    calibration,
    *,
    rank: int | float | None = None,
    cfg: TwinQuantConfig | None = None,
    modules: tuple[str, ...] | None = None,
    samples: int = 512,
    quantize_weights: bool = True,
    quantize_activations: bool = True,
):
    """A new model whose ``modules`` run TwinQuant (`LowRankTransformedWeight`): per layer
    and projection, ``twinquant(W, X, fmt, cfg)`` on up to ``samples`` of the layer's actual
    input rows (`jaxlm.quant.calibrate.input_samples`, seeded by ``cfg.seed``) from the
    ``calibration`` ``(tokens, valid)`` batches (``cfg=None``: `MODEL_CONFIG`). ``rank``: an int, or a fraction of each
    projection's input width (``None``: ``cfg.rank``). The objective is W4A4 with
    ``quantize_activations`` and W4A16 without. ``quantize_weights=quantize_activations=False``
    keeps the residual dense and unquantized: the model then computes the original function."""
    fmt = get_format(fmt)
    cfg = MODEL_CONFIG if cfg is None else cfg
    modules = tuple(INPUT_TAPS) if modules is None else tuple(modules)
    if calibration is None:
        raise ValueError("twinquant needs calibration batches (input samples of each layer)")
    X = input_samples(model, calibration, modules, n=samples, seed=cfg.seed)
    rank = cfg.rank if rank is None else rank
    act = "same" if quantize_activations else None

    def build(module, layer, W):
        layer_cfg = dataclasses.replace(cfg, rank=_resolve_rank(rank, W.shape[0], W.shape[1]))
        d, _ = twinquant(W, X[module][layer], fmt, layer_cfg, act_format=act)
        res = quantize(d.residual, fmt, axis=-2) if quantize_weights else d.residual.astype(W.dtype)
        return LowRankTransformedWeight(
            P=d.P.astype(W.dtype), L=d.L.astype(W.dtype),
            residual=TransformedWeight(d.T, res, fmt if quantize_activations else None),
        )

    return map_projections(model, modules, build)
