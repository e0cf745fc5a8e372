"""Class directions in activation space: capture activations at each sequence's last real
token, then the centred mean-difference directions of the emotion-circuit paper (Wang et
al. 2025, "Do LLMs 'Feel'? Emotion Circuits Discovery and Control", arXiv 2510.11328,
Sec. 3; code: Aurora-cx/EmotionCircuits-LLM ``2_compute_emotion_directions.py``) or a
PCA direction::

    acts = capture(model, tokens, mask, sites=("hidden", "attn_out"))   # {site: [L, B, D]}
    v = mean_difference_directions(acts["hidden"], labels, groups)      # [E, L, D], unit
    iv = steer("hidden", v[e], alpha=4.0, n_layers=L, layers=[l], where="last", rms_scale=True)

Sites are the tap names of `jaxlm.models.taps.COLLECTABLE` (``attn_probs`` excepted) plus
``"resid_mid"``, the residual stream between the attention and MLP sublayers
(``hidden - mlp_out``: the input of layer ``l`` plus ``attn_out``). The paper's
"attention" directions are read at ``resid_mid``, its "MLP" directions at ``hidden`` (the
residual after each sublayer's output is added, "residual-aligned" in the reference code);
``attn_out`` / ``mlp_out`` give the sublayer outputs themselves.
"""

from __future__ import annotations

import functools
from typing import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.interp.interventions import Intervention
from jaxlm.models.taps import COLLECTABLE

#: Derived sites `capture` computes from collected ones: name -> (needed taps, what it is).
DERIVED_SITES = {"resid_mid": (("hidden", "mlp_out"), "residual after attention, before the MLP [B, T, D]")}
#: (``mlp_beta``, MeGan's gate slopes, needs a condition text, which `capture` does not take)
CAPTURE_SITES = tuple(sorted((set(COLLECTABLE) - {"attn_probs", "mlp_beta"}) | set(DERIVED_SITES)))


def last_token_index(mask: jax.Array) -> jax.Array:
    """``[B]`` index of each row's last real token (the last True of ``mask [B, T]``), for
    right or left padding."""
    mask = jnp.asarray(mask, bool)
    chex.assert_rank(mask, 2)
    if not isinstance(mask, jax.core.Tracer):
        empty = np.flatnonzero(~np.asarray(mask).any(axis=1))
        if empty.size:
            raise ValueError(f"mask rows {empty.tolist()} have no real token")
    T = mask.shape[1]
    return (T - 1 - jnp.argmax(jnp.flip(mask, axis=1), axis=1)).astype(jnp.int32)


def check_sites(sites: Sequence[str] | str) -> tuple[str, ...]:
    sites = (sites,) if isinstance(sites, str) else tuple(sites)
    bad = [s for s in sites if s not in CAPTURE_SITES]
    if bad or not sites:
        raise ValueError(f"sites={list(sites)!r} is invalid: each must be one of {list(CAPTURE_SITES)}")
    return sites


@functools.partial(jax.jit, static_argnames=("graphdef", "names"))
def _collect_at(graphdef, state, tokens, mask, index, interventions, *, names):
    """The requested taps ``{name: [L, B, ...]}`` at position ``index [B]`` of each row."""
    model = nnx.merge(graphdef, state)
    out = model.backbone(tokens, mask=mask, collect=names, interventions=interventions)
    rows = jnp.arange(tokens.shape[0])
    # a tuple of per-layer arrays where widths differ per layer (A^3 mixed ranks)
    return {n: tuple(x[rows, index] for x in v) if isinstance(v, tuple) else v[:, rows, index]
            for n, v in out.collected.items()}


def capture(model, tokens, mask=None, sites: Sequence[str] | str = ("hidden",), position="last",
            interventions=()) -> dict[str, jax.Array]:
    """Activations ``{site: [L, B, ...]}`` (``[L, B, D]`` for the residual-width sites) of
    ``tokens [B, T]`` at each row's last real token (``position="last"``, the last True of the
    padding ``mask [B, T]``; every token is real without a mask) or at explicit positions
    ``position [B]``. ``interventions`` are applied in the forward (e.g. read a steered run)."""
    sites = check_sites(sites)
    tokens = jnp.asarray(tokens)
    chex.assert_rank(tokens, 2)
    B, T = tokens.shape
    if B == 0:
        raise ValueError("tokens holds no rows (B = 0): capture needs at least one prompt")
    mask = jnp.ones((B, T), bool) if mask is None else jnp.asarray(mask, bool)
    if mask.shape != (B, T):
        raise ValueError(f"mask must be [B, T] = {(B, T)} like tokens, got shape {mask.shape}")
    if isinstance(position, str):
        if position != "last":
            raise ValueError(f"position={position!r} is invalid: must be 'last' or a [B] int array")
        index = last_token_index(mask)
    else:
        given = jnp.asarray(position)
        if given.dtype == bool or not jnp.issubdtype(given.dtype, jnp.integer):  # 1.7 was read as 1
            raise ValueError(f"position must be 'last' or [B] = ({B},) ints, got {given.dtype} values "
                             f"{np.asarray(position)!r}")
        index = given.astype(jnp.int32)
        if index.shape != (B,) or not bool(jnp.all((index >= 0) & (index < T))):
            raise ValueError(f"position must be 'last' or [B] = ({B},) ints in [0, {T}), got {np.asarray(position)!r}")
    names = set()
    for s in sites:
        names.update(DERIVED_SITES[s][0] if s in DERIVED_SITES else (s,))
    if isinstance(interventions, Intervention):
        interventions = (interventions,)
    graphdef, state = nnx.split(model)
    got = _collect_at(graphdef, state, tokens, mask, index, tuple(interventions), names=tuple(sorted(names)))
    out = {}
    for s in sites:
        out[s] = got["hidden"] - got["mlp_out"] if s == "resid_mid" else got[s]
        if isinstance(out[s], tuple):  # per-layer widths: one [B, ...] array per layer
            assert len(out[s]) == model.config.n_layers and all(x.shape[0] == B for x in out[s])
        else:
            chex.assert_shape(out[s], (model.config.n_layers, B, ...))
    return out


def _class_cells(acts, labels, groups, n_classes):
    """Cell means ``M [G, E, L, D]`` of the activations of each (group, class), less the first
    example's activations (a shift that every direction, a difference of cell means, ignores)."""
    acts = jnp.asarray(acts, jnp.float32)
    if acts.ndim != 3:
        raise ValueError(f"acts must be [L, N, D] (layers, examples, width), got shape {acts.shape}")
    N = acts.shape[1]
    labels = np.asarray(labels)
    if labels.shape != (N,) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be [N] = ({N},) ints (class ids), got {labels.dtype} {labels.shape}")
    if N == 0:
        raise ValueError("acts holds no examples (N = 0): directions need examples of at least 2 classes")
    E = int(labels.max()) + 1 if n_classes is None else n_classes
    if isinstance(E, (bool, np.bool_)) or not isinstance(E, (int, np.integer)) or E < 2:
        raise ValueError(f"n_classes={n_classes!r} is invalid: need at least 2 classes")
    if labels.min() < 0 or labels.max() >= E:
        raise ValueError(f"labels must be in [0, {E}), got values in [{labels.min()}, {labels.max()}]")
    E = int(E)
    if groups is None:
        group_ids, G = np.zeros(N, np.int64), 1
    else:
        groups = np.asarray(groups)
        if groups.shape != (N,):
            raise ValueError(f"groups must be [N] = ({N},) group ids (one per example) or None, got shape {groups.shape}")
        keys, group_ids = np.unique(groups, return_inverse=True)
        G = len(keys)
    counts = np.zeros((G, E), np.int64)
    np.add.at(counts, (group_ids, labels), 1)
    if (counts == 0).any():
        g, e = np.argwhere(counts == 0)[0]
        what = "the data" if groups is None else f"group {keys[g].item()!r}"
        raise ValueError(
            f"{what} has no example of class {e}: every group needs every class of 0..{E - 1} "
            f"({int((counts == 0).any(axis=1).sum())} incomplete group(s))"
        )
    cell = jnp.asarray(group_ids * E + labels)
    # relative to one example's activations: every direction is a difference of cell means, so
    # the shift changes nothing but rounding; rows equal to it are exactly 0, so classes with
    # identical activations and unequal counts give u = 0 (their float32 means differed by an ulp
    # of the activations' size, normalised to a unit vector of noise)
    shifted = jnp.moveaxis(acts - acts[:, :1], 1, 0)
    sums = jax.ops.segment_sum(shifted, cell, num_segments=G * E)  # [G*E, L, D]
    cells = sums / jnp.asarray(counts.reshape(-1), jnp.float32)[:, None, None]
    L, _, D = acts.shape
    return cells.reshape(G, E, L, D)


def _group_centred(cells):
    """``h~_{g,e} = h_{g,e} - (1/E) sum_e' h_{g,e'}`` (Eq. 1 of the paper)."""
    return cells - cells.mean(axis=1, keepdims=True)


def mean_difference_directions(acts, labels, groups=None, *, n_classes: int | None = None) -> jax.Array:
    """Unit class directions ``v [E, L, D]`` from activations ``acts [L, N, D]`` with class
    ``labels [N]`` (ints in ``0..E-1``) and optional ``groups [N]`` (any ids), per layer:

    * ``h~_{g,e} = h_{g,e} - (1/E) sum_e' h_{g,e'}`` (remove each group's shared content),
    * ``c_e = mean_g h~_{g,e}`` (class centroid across groups),
    * ``v_e = (c_e - (1/E) sum_e' c_e') / ||c_e - (1/E) sum_e' c_e'||``.

    ``h_{g,e}`` is the mean over the examples of class ``e`` in group ``g`` (the paper has one
    per cell); every group must hold every class. ``groups=None`` treats all examples as one
    group: ``v_e`` is then the normalised difference between class ``e``'s mean and the mean
    of the class means (no per-group centring). A zero difference gives a zero vector (the
    norm is ``+ 1e-12`` as in the reference code)."""
    cells = _class_cells(acts, labels, groups, n_classes)
    c = _group_centred(cells).mean(axis=0)  # [E, L, D]
    u = c - c.mean(axis=0, keepdims=True)
    v = u / (jnp.linalg.norm(u, axis=-1, keepdims=True) + 1e-12)
    chex.assert_shape(v, (cells.shape[1], *cells.shape[2:]))
    return v


def pca_directions(acts, labels, groups=None, *, n_classes: int | None = None) -> jax.Array:
    """Per layer, the top principal component of the group-centred cell means ``h~_{g,e}``
    (centred by construction: they sum to zero over classes in every group), returned once
    per class ``[E, L, D]`` with its sign aligned to that class's mean-difference direction
    (``<pc, v_e> >= 0``). With two classes the rows are ``+pc`` and ``-pc``; with more the
    axis is shared and only the sign differs, so it is mainly a two-class tool. A class
    whose mean difference vanishes (identical activations, or differences that cancel over
    groups) has no direction: its row is zero, as `mean_difference_directions` gives. A
    variance-based alternative to `mean_difference_directions`, not in the paper."""
    cells = _class_cells(acts, labels, groups, n_classes)
    G, E, L, D = cells.shape
    centred = _group_centred(cells).reshape(G * E, L, D)
    _, _, vt = jnp.linalg.svd(jnp.moveaxis(centred, 1, 0), full_matrices=False)  # [L, k, D]
    pc = vt[:, 0]  # [L, D], unit
    c = _group_centred(cells).mean(axis=0)
    mean_diff = c - c.mean(axis=0, keepdims=True)  # [E, L, D]
    dot = jnp.einsum("eld,ld->el", mean_diff, pc)
    scale = jnp.max(jnp.linalg.norm(centred, axis=-1), axis=0)  # [L]: the cells' size, per layer
    none = jnp.linalg.norm(mean_diff, axis=-1) <= 1e-6 * scale[None]  # [E, L]
    sign = jnp.where(none, 0.0, jnp.where(dot < 0, -1.0, 1.0))
    if E == 2:  # exactly +pc and -pc (or both zero)
        sign = jnp.stack([sign[0], -sign[0]])
    out = sign[..., None] * pc[None]
    chex.assert_shape(out, (E, L, D))
    return out
