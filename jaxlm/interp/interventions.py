"""Interventions on tapped activations: the hook steering, ablation, head masking and
K-FAC output-gradient capture attach to.

An `Intervention` rewrites one tap site (a name in `jaxlm.models.taps.COLLECTABLE`,
e.g. ``"hidden"`` or ``"attn_ctx"``) at chosen layers and positions during the forward::

    iv = steer("hidden", direction, alpha=8.0, layers=[1, 2], n_layers=3, rms_scale=True)
    out = model(tokens, interventions=(iv,))
    jaxlm.generate(model, prompts, max_new_tokens=8, interventions=(iv,))

Kinds (the `kind` field):

* ``"add"``: ``h + alpha * v`` (times the per-position RMS of ``h`` with ``rms_scale``, as
  the emotion-circuit steering code scales it: Wang et al. 2025, arXiv 2510.11328).
* ``"ablate"``: directional ablation ``h - alpha * (h . u) u`` with a unit ``u``.
* ``"scale_heads"``: multiply head ``n``'s channels of a ``[..., N*H]`` site by ``v[n]``
  (head masking at the o_proj input when ``site="attn_ctx"`` and ``v`` is 0/1);
* ``"fake_quant"``: quantize-dequantize the site in blocks along its last axis with a
  straight-through gradient (`kv_fake_quant`: a KV4 cache simulated at ``k_rot`` / ``v``).

``vector`` always has a leading layer axis ``[L, ...]``; the rest broadcasts against the
site's value (``[D]``, ``[B, T, D]``, ...). ``where`` picks positions: ``"all"``,
``"last"`` (the last position of each forward call: the last prompt token at prefill
and every new token while decoding, the ``last_k=1`` hook of the emotion-circuit code),
or a ``[B, T]`` boolean mask for a plain forward.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

KINDS = ("add", "ablate", "scale_heads", "fake_quant")
WHERE = ("all", "last")


@struct.dataclass
class Intervention:
    vector: jax.Array  # [L, ...] per-layer direction / perturbation / head scales
    alpha: jax.Array  # scalar dose
    layers: jax.Array  # [L] bool: which layers are touched
    mask: jax.Array | None = None  # [B, T] bool when where == "mask"
    site: str = struct.field(pytree_node=False, default="hidden")
    kind: str = struct.field(pytree_node=False, default="add")
    where: str = struct.field(pytree_node=False, default="all")
    rms_scale: bool = struct.field(pytree_node=False, default=False)
    fmt: object = struct.field(pytree_node=False, default=None)  # QFormat for "fake_quant"

    def apply(self, value: jax.Array, layer: jax.Array) -> jax.Array:
        """The rewritten ``value`` of this site at ``layer`` (a traced int)."""
        v = jnp.take(self.vector, layer, axis=0).astype(jnp.float32)
        on = jnp.take(self.layers, layer, axis=0)
        x = value.astype(jnp.float32)
        if self.kind == "add":
            delta = self.alpha * v
            if self.rms_scale:
                delta = delta * jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True))
            new = x + delta
        elif self.kind == "fake_quant":
            from jaxlm.quant.formats import fake_quant

            new = fake_quant(x, self.fmt, axis=-1)
        elif self.kind == "ablate":
            new = x - self.alpha * jnp.sum(x * v, axis=-1, keepdims=True) * v
        else:  # scale_heads
            n = v.shape[-1]
            heads = x.reshape(*x.shape[:-1], n, x.shape[-1] // n)
            new = (heads * v[..., None]).reshape(x.shape)
        pos = self._positions(x.shape)
        sel = on & pos if pos is not None else on
        return jnp.where(sel, new, x).astype(value.dtype)

    def _positions(self, shape):
        if self.where == "all":
            return None
        if self.where == "last":
            T = shape[1]
            return (jnp.arange(T) == T - 1)[None, :, None]
        return self.mask[..., None]


def _check_site(site: str) -> None:
    from jaxlm.models.taps import COLLECTABLE

    if site not in COLLECTABLE or site in ("attn_probs", "mlp_beta"):
        allowed = sorted(set(COLLECTABLE) - {"attn_probs", "mlp_beta"})
        raise ValueError(f"site={site!r} cannot be intervened on: allowed sites are {allowed}")


def _layer_mask(layers, n_layers: int) -> jax.Array:
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers <= 0:
        raise ValueError(f"n_layers={n_layers!r} is invalid: must be a positive int")
    if layers is None:
        return jnp.ones((n_layers,), bool)
    layers = [int(i) for i in np.atleast_1d(layers)]
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"layers={bad} are out of range: the model has layers 0..{n_layers - 1}")
    return jnp.zeros((n_layers,), bool).at[jnp.asarray(layers, jnp.int32)].set(True)


def _per_layer(vector, n_layers: int) -> jax.Array:
    vector = jnp.asarray(vector, jnp.float32)
    return vector if vector.ndim >= 2 and vector.shape[0] == n_layers else jnp.broadcast_to(vector, (n_layers, *vector.shape))


def _where(where) -> tuple[str, jax.Array | None]:
    if isinstance(where, str):
        if where not in WHERE:
            raise ValueError(f"where={where!r} is invalid: must be one of {WHERE} or a [B, T] bool mask")
        return where, None
    mask = jnp.asarray(where, bool)
    if mask.ndim != 2:
        raise ValueError(f"where mask must be [B, T], got shape {mask.shape}")
    return "mask", mask


def steer(site: str, direction, *, alpha: float, n_layers: int, layers: Sequence[int] | None = None,
          where="all", rms_scale: bool = False) -> Intervention:
    """Add ``alpha * direction`` (``[D]`` or per-layer ``[L, D]``) at ``site``."""
    _check_site(site)
    where, mask = _where(where)
    return Intervention(
        vector=_per_layer(direction, n_layers), alpha=jnp.asarray(alpha, jnp.float32),
        layers=_layer_mask(layers, n_layers), mask=mask, site=site, kind="add", where=where,
        rms_scale=rms_scale,
    )


def ablate(site: str, direction, *, n_layers: int, layers: Sequence[int] | None = None,
           where="all", strength: float = 1.0) -> Intervention:
    """Directional ablation ``h - strength * (h . u) u`` with ``u = direction / |direction|``."""
    _check_site(site)
    where, mask = _where(where)
    d = _per_layer(direction, n_layers)
    d = d / jnp.maximum(jnp.linalg.norm(d, axis=-1, keepdims=True), 1e-12)
    return Intervention(
        vector=d, alpha=jnp.asarray(strength, jnp.float32), layers=_layer_mask(layers, n_layers),
        mask=mask, site=site, kind="ablate", where=where,
    )


def mask_heads(head_scale, *, n_layers: int, layers: Sequence[int] | None = None, where="all") -> Intervention:
    """Scale attention heads at the o_proj input (``attn_ctx``): ``head_scale`` is ``[N]`` or
    ``[L, N]`` (0 removes a head)."""
    where, mask = _where(where)
    return Intervention(
        vector=_per_layer(head_scale, n_layers), alpha=jnp.ones((), jnp.float32),
        layers=_layer_mask(layers, n_layers), mask=mask, site="attn_ctx", kind="scale_heads",
        where=where,
    )


def perturb(site: str, delta: jax.Array, *, layers: Sequence[int] | None = None) -> Intervention:
    """Add ``delta [L, B, T, D]`` (usually zeros) at ``site``: ``d loss / d delta`` is the
    gradient with respect to the site's value, e.g. a linear layer's output gradient."""
    _check_site(site)
    n_layers = delta.shape[0]
    return Intervention(
        vector=delta, alpha=jnp.ones((), delta.dtype), layers=_layer_mask(layers, n_layers),
        site=site, kind="add",
    )


def kv_fake_quant(fmt, *, n_layers: int, layers: Sequence[int] | None = None) -> tuple[Intervention, ...]:
    """Fake-quantize the post-RoPE keys and the values (what a KV cache stores) in ``fmt``
    (e.g. ``"e1m2"``, ReQAT's KV4 grid) at ``layers``: pass to a forward or `generate`."""
    from jaxlm.quant.formats import get_format

    fmt = get_format(fmt)
    zeros = jnp.zeros((n_layers, 1), jnp.float32)
    return tuple(
        Intervention(vector=zeros, alpha=jnp.ones((), jnp.float32), layers=_layer_mask(layers, n_layers),
                     site=site, kind="fake_quant", fmt=fmt)
        for site in ("k_rot", "v")
    )


def check_interventions(interventions, n_layers: int) -> tuple[Intervention, ...]:
    if isinstance(interventions, Intervention):
        interventions = (interventions,)
    interventions = tuple(interventions or ())
    for i, iv in enumerate(interventions):
        if not isinstance(iv, Intervention):
            raise TypeError(f"interventions[{i}] is a {type(iv).__name__}, expected jaxlm.interp.Intervention")
        if iv.vector.shape[0] != n_layers or iv.layers.shape != (n_layers,):
            raise ValueError(
                f"interventions[{i}] (site {iv.site!r}) is built for {iv.vector.shape[0]} layers, "
                f"the model has {n_layers}"
            )
    return interventions
