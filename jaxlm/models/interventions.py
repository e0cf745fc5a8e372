"""Interventions: the hook by which a forward pass rewrites one of its tapped activations.

An `Intervention` names a tap site (`jaxlm.models.taps.COLLECTABLE`, e.g. ``"hidden"`` or
``"attn_ctx"``), the layers and positions it touches and how it rewrites the value there;
``model(tokens, interventions=(iv,))`` and `jaxlm.generate` apply it at every forward. This
module is the model's side of the contract (the type, its application and its checks);
`jaxlm.interp` builds steering, ablation, head masking and gradient capture from it.

Kinds (the `kind` field):

* ``"add"``: ``h + alpha * v`` (times the per-position RMS of ``h`` with ``rms_scale``, as
  the emotion-circuit steering code scales it: Wang et al. 2025, arXiv 2510.11328).
* ``"ablate"``: directional ablation ``h - alpha * (h . u) u`` with a unit ``u``.
* ``"scale_heads"``: multiply head ``n``'s channels of a ``[..., N*H]`` site by ``v[n]``
  (head masking at the o_proj input when ``site="attn_ctx"`` and ``v`` is 0/1);
* ``"fake_quant"``: quantize-dequantize the site in blocks along its last axis with a
  straight-through gradient (a KV4 cache simulated at ``k_rot`` / ``v``).

``vector`` always has a leading layer axis ``[L, ...]``; the rest broadcasts against the
site's value (``[D]``, ``[B, T, D]``, ...). ``where`` picks positions: ``"all"``,
``"last"`` (the last position of each forward call: the last prompt token at prefill
and every new token while decoding), or a ``[B, T]`` boolean mask for a plain forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxlm.models.taps import COLLECTABLE
from jaxlm.quant.formats import fake_quant

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
        feature = x.shape[2:]  # a site's values are [B, T, ...features]
        # one direction for every position ([...features]), or a full [B|1, T|1, ...features]
        # array (per row or position: perturbations, per-row noise) that broadcasts to the site
        full = v.ndim == x.ndim and all(a in (1, b) for a, b in zip(v.shape, x.shape))
        fits = full or (v.ndim <= len(feature) and v.shape == feature[len(feature) - v.ndim:])
        if self.kind in ("add", "ablate") and not fits:  # it would broadcast the site, or fail to
            raise ValueError(f"a {self.kind!r} intervention at site {self.site!r}: its per-layer vector "
                             f"{tuple(v.shape)} does not fit the site's values {tuple(feature)} (per position)")
        if self.kind == "add":
            delta = self.alpha * v
            if self.rms_scale:
                delta = delta * jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True))
            new = x + delta
        elif self.kind == "fake_quant":
            new = fake_quant(x, self.fmt, axis=-1)
        elif self.kind == "ablate":
            new = x - self.alpha * jnp.sum(x * v, axis=-1, keepdims=True) * v
        else:  # scale_heads
            n = v.shape[-1]
            if v.ndim != 1 or x.shape[-1] % n:
                raise ValueError(f"scale_heads at site {self.site!r}: a [layers, heads] scale of {n} heads does not "
                                 f"split the site's width {x.shape[-1]}")
            heads = x.reshape(*x.shape[:-1], n, x.shape[-1] // n)
            new = (heads * v[..., None]).reshape(x.shape)
        pos = self._positions(x.shape)
        sel = on & pos if pos is not None else on
        return jnp.where(sel, new, x).astype(value.dtype)

    def _positions(self, shape):
        """``[B|1, T, 1, ...]``: the positions to rewrite, broadcast over the site's feature
        axes (``[D]``, or ``[heads, H]`` at q / k / v)."""
        if self.where == "all":
            return None
        if self.where == "last":
            T = shape[1]
            pos = (jnp.arange(T) == T - 1)[None, :]
        else:
            pos = self.mask
        return pos.reshape(*pos.shape, *(1,) * (len(shape) - 2))


#: tap sites an intervention may rewrite (probabilities and gate slopes are read-only)
SITES = tuple(sorted(set(COLLECTABLE) - {"attn_probs", "mlp_beta"}))


def check_site(site: str) -> None:
    if site not in SITES:
        raise ValueError(f"site={site!r} cannot be intervened on: allowed sites are {list(SITES)}")


def layer_mask(layers, n_layers: int) -> jax.Array:
    """``[n_layers]`` bool: True at ``layers`` (every layer when None)."""
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers <= 0:
        raise ValueError(f"n_layers={n_layers!r} is invalid: must be a positive int")
    if layers is None:
        return jnp.ones((n_layers,), bool)
    arr = np.atleast_1d(np.asarray(layers))
    if arr.size == 0:  # no layer: the intervention changes nothing
        return jnp.zeros((n_layers,), bool)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"layers={layers!r} is invalid: layer indices (ints), not a boolean mask or floats")
    layers = [int(i) for i in arr]
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"layers={bad} are out of range: the model has layers 0..{n_layers - 1}")
    return jnp.zeros((n_layers,), bool).at[jnp.asarray(layers, jnp.int32)].set(True)


def check_interventions(interventions, n_layers: int, n_heads: int | None = None,
                        tokens_shape: tuple[int, int] | None = None) -> tuple[Intervention, ...]:
    """The interventions as a tuple, each built for ``n_layers`` layers (and a head scale for
    ``n_heads`` heads, a ``where`` mask for ``tokens_shape = (B, T)``), or an error naming the
    one that is not."""
    if isinstance(interventions, Intervention):
        interventions = (interventions,)
    interventions = tuple(interventions or ())
    for i, iv in enumerate(interventions):
        if not isinstance(iv, Intervention):
            raise TypeError(f"interventions[{i}] is a {type(iv).__name__}, expected a jaxlm Intervention")
        if iv.vector.shape[0] != n_layers or iv.layers.shape != (n_layers,):
            raise ValueError(
                f"interventions[{i}] (site {iv.site!r}) is built for {iv.vector.shape[0]} layers, "
                f"the model has {n_layers}"
            )
        if iv.kind == "scale_heads" and n_heads is not None and iv.vector.shape[1:] != (n_heads,):
            raise ValueError(f"interventions[{i}] scales {iv.vector.shape[1:]} heads per layer; the model has "
                             f"n_heads={n_heads} (head_scale must be [{n_heads}] or [{n_layers}, {n_heads}])")
        if iv.where == "mask" and tokens_shape is not None and (
                iv.mask.ndim != 2 or any(m not in (1, t) for m, t in zip(iv.mask.shape, tokens_shape))):
            raise ValueError(f"interventions[{i}] (site {iv.site!r}): its where mask has shape {tuple(iv.mask.shape)}, "
                             f"the tokens are [B, T] = {list(tokens_shape)}")
    return interventions
