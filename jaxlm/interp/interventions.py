"""Interventions on tapped activations: steering, directional ablation, head masking,
gradient capture and a simulated low-bit KV cache, built as `jaxlm.models.interventions.Intervention` s
(the hook the forward pass applies at its tap sites)::

    iv = steer("hidden", direction, alpha=8.0, layers=[1, 2], n_layers=3, rms_scale=True)
    out = model(tokens, interventions=(iv,))
    jaxlm.generate(model, prompts, max_new_tokens=8, interventions=(iv,))

``where`` picks positions: ``"all"``, ``"last"`` (the last position of each forward call:
the last prompt token at prefill and every new token while decoding, the ``last_k=1`` hook
of the emotion-circuit code, Wang et al. 2025, arXiv 2510.11328), or a ``[B, T]`` boolean
mask for a plain forward.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from jaxlm.models.interventions import WHERE, Intervention, check_site, layer_mask
from jaxlm.quant.formats import get_format

__all__ = ["Intervention", "ablate", "kv_fake_quant", "mask_heads", "perturb", "steer"]


#: sites whose values are per head, ``[B, T, heads, H]``: a direction is ``[H]`` or ``[heads, H]``
HEAD_SITES = ("k", "k_rot", "q", "q_rot", "v")


def _per_layer(vector, n_layers: int, *, site: str | None = None, per_layer: bool | None = None) -> jax.Array:
    """``vector`` as ``[L, ...]``: already per layer (``per_layer=True``, or by default when its
    first axis is ``n_layers`` and it has more axes than one layer's direction), else the same
    direction for every layer. At a per-head site a 2-D ``[n_layers, H]`` could also be one
    ``[heads, H]`` direction: ``per_layer`` must then say which."""
    vector = jnp.asarray(vector, jnp.float32)
    if per_layer is None:
        per_layer = vector.ndim >= 2 and vector.shape[0] == n_layers
        if per_layer and site in HEAD_SITES and vector.ndim == 2:
            raise ValueError(f"a direction of shape {tuple(vector.shape)} at site {site!r} is ambiguous: per layer "
                             f"([L={n_layers}, H]) or per head ([heads, H]); pass per_layer=True or False")
    if per_layer:
        if vector.ndim < 2 or vector.shape[0] != n_layers:
            raise ValueError(f"per_layer=True needs a direction [L={n_layers}, ...], got shape {tuple(vector.shape)}")
        return vector
    return jnp.broadcast_to(vector, (n_layers, *vector.shape))


def _where(where) -> tuple[str, jax.Array | None]:
    if isinstance(where, str):
        if where not in WHERE:
            raise ValueError(f"where={where!r} is invalid: must be one of {WHERE} or a [B, T] bool mask")
        return where, None
    mask = jnp.asarray(where, bool)
    if mask.ndim != 2:
        raise ValueError(f"where mask must be [B, T], got shape {mask.shape}")
    return "mask", mask


def _check_finite(value, name: str) -> None:
    """A concrete ``value`` (not traced under jit) must be finite: NaN made every logit NaN."""
    if not isinstance(value, jax.core.Tracer) and not bool(jnp.all(jnp.isfinite(jnp.asarray(value)))):
        raise ValueError(f"{name} holds a non-finite value ({value if jnp.ndim(value) == 0 else 'NaN or inf'})")


def steer(site: str, direction, *, alpha: float, n_layers: int, layers: Sequence[int] | None = None,
          where="all", rms_scale: bool = False, per_layer: bool | None = None) -> Intervention:
    """Add ``alpha * direction`` (``[D]`` or per-layer ``[L, D]``; at a per-head site ``[H]``,
    ``[heads, H]`` or those per layer) at ``site``."""
    check_site(site)
    where, mask = _where(where)
    _check_finite(alpha, "steer: alpha")
    _check_finite(direction, "steer: direction")
    return Intervention(
        vector=_per_layer(direction, n_layers, site=site, per_layer=per_layer), alpha=jnp.asarray(alpha, jnp.float32),
        layers=layer_mask(layers, n_layers), mask=mask, site=site, kind="add", where=where,
        rms_scale=rms_scale,
    )


def ablate(site: str, direction, *, n_layers: int, layers: Sequence[int] | None = None,
           where="all", strength: float = 1.0, per_layer: bool | None = None) -> Intervention:
    """Directional ablation ``h - strength * (h . u) u`` with ``u = direction / |direction|``
    (shapes as for `steer`)."""
    check_site(site)
    where, mask = _where(where)
    _check_finite(strength, "ablate: strength")
    _check_finite(direction, "ablate: direction")
    d = _per_layer(direction, n_layers, site=site, per_layer=per_layer)
    norms = jnp.linalg.norm(d, axis=-1, keepdims=True)
    chosen = layer_mask(layers, n_layers)
    if not isinstance(d, jax.core.Tracer):  # a zero direction has no u: the ablation would remove nothing
        zero = [layer for layer in range(n_layers) if bool(chosen[layer]) and bool(jnp.any(norms[layer] == 0))]
        if zero:
            raise ValueError(f"ablate: direction has zero norm at layer(s) {zero} (nothing to project out); "
                             "pass a non-zero direction or leave those layers out of layers=")
    d = d / jnp.maximum(norms, 1e-12)
    return Intervention(
        vector=d, alpha=jnp.asarray(strength, jnp.float32), layers=chosen,
        mask=mask, site=site, kind="ablate", where=where,
    )


def mask_heads(head_scale, *, n_layers: int, layers: Sequence[int] | None = None, where="all") -> Intervention:
    """Scale attention heads at the o_proj input (``attn_ctx``): ``head_scale`` is ``[N]`` or
    ``[L, N]`` (0 removes a head)."""
    where, mask = _where(where)
    return Intervention(
        vector=_per_layer(head_scale, n_layers), alpha=jnp.ones((), jnp.float32),
        layers=layer_mask(layers, n_layers), mask=mask, site="attn_ctx", kind="scale_heads",
        where=where,
    )


def perturb(site: str, delta: jax.Array, *, layers: Sequence[int] | None = None) -> Intervention:
    """Add ``delta [L, B, T, D]`` (usually zeros) at ``site``: ``d loss / d delta`` is the
    gradient with respect to the site's value, e.g. a linear layer's output gradient."""
    check_site(site)
    n_layers = delta.shape[0]
    return Intervention(
        vector=delta, alpha=jnp.ones((), delta.dtype), layers=layer_mask(layers, n_layers),
        site=site, kind="add",
    )


def kv_fake_quant(fmt, *, n_layers: int, layers: Sequence[int] | None = None) -> tuple[Intervention, ...]:
    """Fake-quantize the post-RoPE keys and the values (what a KV cache stores) in ``fmt``
    (e.g. ``"e1m2"``, ReQAT's KV4 grid) at ``layers``: pass to a forward or `generate`."""
    fmt = get_format(fmt)
    zeros = jnp.zeros((n_layers, 1), jnp.float32)
    return tuple(
        Intervention(vector=zeros, alpha=jnp.ones((), jnp.float32), layers=layer_mask(layers, n_layers),
                     site=site, kind="fake_quant", fmt=fmt)
        for site in ("k_rot", "v")
    )


