"""Task-vector arithmetic and extrapolation in weight space.

A task vector is the weight difference ``tau = R - M`` between a tuned model ``R`` and
the base ``M`` it was tuned from (same architecture). Task arithmetic (Ilharco et al.,
"Editing Models with Task Arithmetic", ICLR 2023) adds (coefficient 1) or negates
(coefficient -1) such vectors: ``O = M + sum_i c_i tau_i``. "Overthinking task vectors"
(ICML 2026) moves along one vector past the tuned model::

    O_alpha = M + alpha (R - M)            (alpha > 1 extrapolates; 1 -> R, 0 -> M)

with layer-wise attenuation: parameter ``l`` gets ``alpha_l = 1 + (alpha - 1) w_l`` where
``w_l in [0, 1]`` comes from a schedule (`SCHEDULES`: ``uniform``, ``linear_depth``,
``blocks_only``, ``middle``, ``head_only``; a ``{regex: weight}`` dict or a callable), so
``w_l = 0`` keeps that parameter at the tuned value. The matched control
(`random_direction_control`) replaces ``R_l - M_l`` by a Gaussian ``xi_l`` of the same
Frobenius norm.

Every function is pure and takes either `Transformer` s or flat ``{name: array}`` dicts
(`jaxlm.models.params.flat_params` names: ``embed``, ``layers.3.attn.q_proj.kernel``,
``final_norm.scale``, ``lm_head.kernel``). A parameter is one entry of that flat view, so
each layer of a stacked (``scan_layers``) leaf is its own parameter and results do not
depend on ``scan_layers``. A model in gives a new model out (built on the first model
argument's graph); dicts in give a dict of jax arrays out. Inputs are never modified.
Arithmetic runs in (at least) float32 and is cast back to the parameters' dtype; mixing
uses ``(1 - a) M + a R`` so that ``a = 1`` returns ``R`` and ``a = 0`` returns ``M``
bitwise.
"""

from __future__ import annotations

import math
import numbers
import re
import zlib
from typing import Any, Callable, Mapping, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.models.params import flat_params
from jaxlm.registry import Registry

#: ``(name, layer index or None, n_layers) -> w in [0, 1]``
ScheduleFn = Callable[[str, Union[int, None], int], float]
Schedule = Union[str, Mapping[str, float], ScheduleFn]
Params = Any  # a Transformer or a flat {name: array} mapping

SCHEDULES: Registry = Registry("task-vector schedule")

_LAYER = re.compile(r"^layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """Block index of a flat parameter name (``layers.3.mlp...`` -> 3), None outside blocks."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


# ------------------------------------------------------------------ schedules
@SCHEDULES.register("uniform")
def _uniform(name: str, layer: int | None, n_layers: int) -> float:
    """``w = 1`` everywhere: plain ``O_alpha = M + alpha (R - M)``."""
    return 1.0


@SCHEDULES.register("linear_depth")
def _linear_depth(name: str, layer: int | None, n_layers: int) -> float:
    """``w = 1 - l / (L - 1)`` in block ``l`` (1 at the first block, 0 at the last; 1 when
    ``L = 1``); parameters outside the blocks (embeddings, final norm, LM head) get 1."""
    if layer is None or n_layers <= 1:
        return 1.0
    return 1.0 - layer / (n_layers - 1)


@SCHEDULES.register("blocks_only")
def _blocks_only(name: str, layer: int | None, n_layers: int) -> float:
    """``w = 1`` on the blocks' linear weights (``*.kernel`` / ``*.bias`` under
    ``layers.``); 0 on embeddings, LM head, all norms and other block parameters
    (e.g. attention-sink logits)."""
    return 1.0 if layer is not None and name.endswith((".kernel", ".bias")) else 0.0


@SCHEDULES.register("middle")
def _middle(name: str, layer: int | None, n_layers: int) -> float:
    """``w = 1`` on every parameter of the middle blocks ``L//3 <= l < L - L//3`` (the
    middle third, rounded outward: never empty, symmetric), 0 elsewhere."""
    if layer is None:
        return 0.0
    return 1.0 if n_layers // 3 <= layer < n_layers - n_layers // 3 else 0.0


@SCHEDULES.register("head_only")
def _head_only(name: str, layer: int | None, n_layers: int) -> float:
    """``w = 1`` on the output head (``lm_head.*``), 0 on every other parameter, which stays
    at the tuned value: only the read-out of the reasoning model's features is amplified. A
    model with tied embeddings has no separate head (use ``{"^embed": 1.0}`` there)."""
    return 1.0 if name.startswith("lm_head.") else 0.0


def _check_weight(w: Any, what: str) -> float:
    if isinstance(w, bool) or not isinstance(w, numbers.Real) or not 0.0 <= float(w) <= 1.0:
        raise ValueError(f"schedule weight {what} is {w!r}: must be a number in [0, 1]")
    return float(w)


def _resolve(schedule: Schedule) -> ScheduleFn:
    if isinstance(schedule, str):
        if schedule not in SCHEDULES:
            raise ValueError(
                f"unknown schedule {schedule!r}: allowed names are {sorted(SCHEDULES)} "
                "(or a {regex: weight} dict, or a callable (name, layer, n_layers) -> w)"
            )
        return SCHEDULES[schedule]
    if isinstance(schedule, Mapping):
        rules = []
        for key, w in schedule.items():
            try:
                pattern = re.compile(key)
            except (re.error, TypeError) as e:
                raise ValueError(f"schedule key {key!r} is not a valid regex: {e}") from None
            rules.append((pattern, _check_weight(w, f"for key {key!r}")))

        def from_dict(name: str, layer: int | None, n_layers: int) -> float:
            for pattern, w in rules:
                if pattern.search(name):
                    return w
            return 0.0

        return from_dict
    if callable(schedule):
        return schedule
    raise TypeError(
        f"schedule={schedule!r} must be a name in {sorted(SCHEDULES)}, a dict or a callable"
    )


def schedule_weights(params: Params, schedule: Schedule = "uniform") -> dict[str, float]:
    """``{name: w_l}`` for every parameter of ``params`` (a model or flat dict).

    ``schedule``: a `SCHEDULES` name; a ``{regex: weight}`` dict (``re.search`` on the flat
    name, first match wins, unmatched parameters get 0, i.e. stay at the tuned value); or a
    callable ``(name, layer index or None, n_layers) -> w``. Weights outside [0, 1] raise
    ``ValueError`` naming the dict key or the parameter.
    """
    flat = _as_flat(params, "params")
    return _weights(flat, schedule, _n_layers(params, flat))


def _weights(flat: Mapping[str, Any], schedule: Schedule, n_layers: int) -> dict[str, float]:
    fn = _resolve(schedule)
    return {
        name: _check_weight(fn(name, layer_of(name), n_layers), f"for parameter {name!r}")
        for name in flat
    }


def _moving_weights(flat: Mapping[str, Any], schedule: Schedule, n_layers: int) -> dict[str, float]:
    """`_weights` for a step past the tuned model: a schedule that moves no parameter is an
    error (every alpha would return the tuned model unchanged)."""
    w = _weights(flat, schedule, n_layers)
    if w and not any(w.values()):
        hint = " (this model has no lm_head: with tied embeddings use {'^embed': 1.0})" if (
            schedule == "head_only") else ""
        raise ValueError(f"schedule={schedule!r} gives weight 0 to every parameter, so every alpha would return "
                         f"the tuned model{hint}")
    return w


# ------------------------------------------------------------- flat <-> model
def _is_model(x) -> bool:
    return isinstance(x, nnx.Module)


def _as_flat(x: Params, what: str) -> dict[str, Any]:
    if _is_model(x):
        return flat_params(x)
    if isinstance(x, Mapping):
        return dict(x)
    raise TypeError(f"{what} must be a Transformer or a flat {{name: array}} dict, got {type(x).__name__}")


def _n_layers(x: Params, flat: Mapping[str, Any]) -> int:
    if _is_model(x):
        return x.config.n_layers
    layers = [i for i in map(layer_of, flat) if i is not None]
    return max(layers) + 1 if layers else 0


def _check_same(base: Mapping[str, Any], other: Mapping[str, Any], what: str) -> None:
    for name in base:
        if name not in other:
            raise ValueError(f"parameter {name!r} is in base but not in {what}")
    for name in other:
        if name not in base:
            raise ValueError(f"parameter {name!r} is in {what} but not in base")
    for name, value in base.items():
        a, b = tuple(np.shape(value)), tuple(np.shape(other[name]))
        if a != b:
            raise ValueError(f"parameter {name!r} has shape {a} in base but {b} in {what}")


def _path_name(path) -> str:
    return ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)


def _pack(template: Params | None, flat: dict[str, jax.Array]) -> Params:
    """``flat`` as a new model on ``template``'s graph (restacking scanned layers), or as is."""
    if template is None:
        return flat
    config = template.config
    graphdef, state = nnx.split(template)

    def one(path, _):
        name = _path_name(path)
        if config.scan_layers and name.startswith("layers."):
            rest = name[len("layers."):]
            return jnp.stack([flat[f"layers.{i}.{rest}"] for i in range(config.n_layers)])
        return flat[name]

    model = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(one, nnx.to_pure_dict(state)))
    model.tokenizer = getattr(template, "tokenizer", None)
    return model


def _template(*xs: Params) -> Params | None:
    return next((x for x in xs if _is_model(x)), None)


def _check_scalar(x: Any, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(float(x)):
        raise ValueError(f"{what}={x!r} is invalid: must be a finite real number")
    return float(x)


# ------------------------------------------------------------------ kernels
def _dtypes(*xs):
    out = jnp.result_type(*xs)
    return out, jnp.promote_types(out, jnp.float32)


@jax.jit
def _mix(m, r, a):
    """``M + a (R - M)``: exactly R at a = 1 and exactly M at a = 0. (Not ``(1 - a) M + a R``:
    at a = 50 its two large terms cancel and the step ``a (R - M)`` loses ~8 bits.)"""
    dt, ct = _dtypes(m, r)
    mc = m.astype(ct)
    mixed = (mc + a.astype(ct) * (r.astype(ct) - mc)).astype(dt)
    return jnp.where(a == 1, r.astype(dt), jnp.where(a == 0, m.astype(dt), mixed))


@jax.jit
def _sub(r, m):
    dt, ct = _dtypes(m, r)
    return (r.astype(ct) - m.astype(ct)).astype(dt)


@jax.jit
def _add_scaled(m, vs, cs):
    ct = jnp.promote_types(m.dtype, jnp.float32)
    out = m.astype(ct)
    for v, c in zip(vs, cs):
        out = out + c.astype(ct) * v.astype(ct)
    return out.astype(m.dtype)


def _key(seed: int, name: str) -> jax.Array:
    """Per-parameter key: depends on the name only, so stacked and unrolled models agree."""
    return jax.random.fold_in(jax.random.key(seed), zlib.crc32(name.encode()) & 0x7FFFFFFF)


@jax.jit
def _norm_matched(m, r, key):
    """Gaussian ``xi`` shaped like ``R - M`` with ``||xi||_F = ||R - M||_F`` (compute dtype)."""
    _, ct = _dtypes(m, r)
    tau = r.astype(ct) - m.astype(ct)
    g = jax.random.normal(key, tau.shape, ct)
    return g * (jnp.sqrt(jnp.sum(tau * tau)) / jnp.sqrt(jnp.sum(g * g)))


@jax.jit
def _step(start, xi, c):
    ct = jnp.promote_types(start.dtype, jnp.float32)
    return jnp.where(c == 0, start, (start.astype(ct) + c.astype(ct) * xi.astype(ct)).astype(start.dtype))


def _f32(x: float) -> jax.Array:
    return jnp.asarray(x, jnp.float32)


# --------------------------------------------------------------------- API
def task_vector(base: Params, tuned: Params) -> Params:
    """``tau = R - M`` (Ilharco et al. 2023), with the structure and dtype of the inputs."""
    m, r = _as_flat(base, "base"), _as_flat(tuned, "tuned")
    _check_same(m, r, "tuned")
    return _pack(_template(base, tuned), {n: _sub(r[n], m[n]) for n in m})


def apply_task_vectors(
    base: Params, vectors: Params | Sequence[Params], coeffs: float | Sequence[float] = 1.0
) -> Params:
    """``O = M + sum_i c_i tau_i`` (Ilharco et al. 2023): ``c = 1`` adds a task, ``c = -1``
    negates (forgets) it. ``vectors``: one task vector or a sequence; ``coeffs``: one
    number for all or one per vector. The result has ``base``'s structure and dtype."""
    single = _is_model(vectors) or isinstance(vectors, Mapping)
    vectors = [vectors] if single else list(vectors)
    if not vectors:
        raise ValueError("vectors is empty: pass at least one task vector")
    if isinstance(coeffs, numbers.Real):
        coeffs = [coeffs] * len(vectors)
    coeffs = [_check_scalar(c, f"coeffs[{i}]") for i, c in enumerate(coeffs)]
    if len(coeffs) != len(vectors):
        raise ValueError(f"got {len(coeffs)} coeffs for {len(vectors)} vectors")
    m = _as_flat(base, "base")
    taus = [_as_flat(v, f"vectors[{i}]") for i, v in enumerate(vectors)]
    for i, t in enumerate(taus):
        _check_same(m, t, f"vectors[{i}]")
    cs = tuple(_f32(c) for c in coeffs)
    out = {n: _add_scaled(m[n], tuple(t[n] for t in taus), cs) for n in m}
    return _pack(_template(base, *vectors), out)


def interpolate(base: Params, tuned: Params, alpha: float) -> Params:
    """``O_alpha = (1 - alpha) M + alpha R = M + alpha (R - M)`` for every parameter, any
    real ``alpha`` (in [0, 1]: interpolation; > 1: extrapolation; < 0: negation).
    ``alpha = 1`` gives ``R`` and ``alpha = 0`` gives ``M`` bitwise."""
    return extrapolate(base, tuned, alpha, schedule="uniform")


def extrapolate(base: Params, tuned: Params, alpha: float, schedule: Schedule = "uniform") -> Params:
    """"Overthinking task vectors" (ICML 2026), ``O_alpha = M + alpha (R - M)`` with
    layer-wise attenuation: parameter ``l`` uses ``alpha_l = 1 + (alpha - 1) w_l``, ``w_l``
    from ``schedule`` (see `schedule_weights`), so ``w_l = 0`` keeps it at ``R`` exactly."""
    alpha = _check_scalar(alpha, "alpha")
    m, r = _as_flat(base, "base"), _as_flat(tuned, "tuned")
    _check_same(m, r, "tuned")
    w = _moving_weights(m, schedule, _n_layers(base, m))
    out = {n: _mix(m[n], r[n], _f32(1.0 + (alpha - 1.0) * w[n])) for n in m}
    return _pack(_template(base, tuned), out)


def random_direction(base: Params, tuned: Params, seed: int = 0) -> Params:
    """Per parameter a Gaussian ``xi_l`` with ``||xi_l||_F = ||R_l - M_l||_F`` (float32 or
    wider), keyed by ``seed`` and the parameter name: the direction used by
    `random_direction_control`."""
    m, r = _as_flat(base, "base"), _as_flat(tuned, "tuned")
    _check_same(m, r, "tuned")
    return _pack(_template(base, tuned), {n: _norm_matched(m[n], r[n], _key(seed, n)) for n in m})


def random_direction_control(
    base: Params, tuned: Params, alpha: float, schedule: Schedule = "uniform", seed: int = 0,
    *, anchor: str = "base",
) -> Params:
    """Norm-matched control for `extrapolate`: ``R_l - M_l`` replaced by a Gaussian
    ``xi_l`` with ``||xi_l||_F = ||R_l - M_l||_F`` (`random_direction`), per flat parameter
    (each layer of a stacked leaf separately).

    ``anchor="base"``: ``O = M + alpha_l xi_l`` (the paper's ``M + alpha (R - M)`` with the
    direction replaced; ``||O - M||`` matches `extrapolate`'s). ``anchor="tuned"``:
    ``O = R + (alpha_l - 1) xi_l`` (only the step past ``R`` is random; ``||O - R||``
    matches, and ``w_l = 0`` parameters stay at ``R``). ``alpha_l`` as in `extrapolate`.
    """
    if anchor not in ("base", "tuned"):
        raise ValueError(f"anchor={anchor!r} is invalid: must be 'base' or 'tuned'")
    alpha = _check_scalar(alpha, "alpha")
    m, r = _as_flat(base, "base"), _as_flat(tuned, "tuned")
    _check_same(m, r, "tuned")
    w = _moving_weights(m, schedule, _n_layers(base, m))
    out = {}
    for n in m:
        a = 1.0 + (alpha - 1.0) * w[n]
        xi = _norm_matched(m[n], r[n], _key(seed, n))
        start, c = (m[n], a) if anchor == "base" else (r[n], a - 1.0)
        out[n] = _step(jnp.asarray(start, jnp.result_type(m[n], r[n])), xi, _f32(c))
    return _pack(_template(base, tuned), out)
