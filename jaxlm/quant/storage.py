"""Quantized weights in checkpoints: structured weight leaves (`QArray`,
`TransformedWeight`, `LowRankTransformedWeight`, `ActQuantWeight`, ...) are stored as plain dicts of their
arrays plus a JSON spec of their types and static fields, so orbax saves them like any
parameter and `jaxlm.load_checkpoint` rebuilds the exact objects (no re-quantization on
load; nested structured fields nest their specs)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxlm.quant.formats import QArray, QFormat
from jaxlm.quant.qat_export import ActQuantWeight
from jaxlm.quant.twinquant import LowRankTransformedWeight
from jaxlm.quant.w4a4 import TransformedWeight


def _types() -> dict[str, type]:
    return {"QArray": QArray, "TransformedWeight": TransformedWeight,
            "LowRankTransformedWeight": LowRankTransformedWeight, "ActQuantWeight": ActQuantWeight}


def _is_structured(x) -> bool:
    return type(x).__name__ in _types() and isinstance(x, tuple(_types().values()))


def _static_to_json(v):
    if isinstance(v, QFormat):
        return {"__qformat__": dataclasses.asdict(v)}
    return v


def _static_from_json(v):
    if isinstance(v, dict) and "__qformat__" in v:
        return QFormat(**v["__qformat__"])
    return v


def _split(obj) -> tuple[dict[str, Any], dict[str, Any]]:
    """(arrays as a nested dict, spec)"""
    arrays, spec = {}, {"type": type(obj).__name__, "static": {}, "fields": {}}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if f.metadata.get("static"):
            spec["static"][f.name] = _static_to_json(v)
        elif _is_structured(v):
            arrays[f.name], spec["fields"][f.name] = _split(v)
        else:
            arrays[f.name] = v
            spec["fields"][f.name] = {"shape": list(np.shape(v)), "dtype": str(v.dtype)}
    return arrays, spec


def _join(arrays: dict[str, Any], spec: dict[str, Any]):
    cls = _types()[spec["type"]]
    kw = {k: _static_from_json(v) for k, v in spec["static"].items()}
    for name, fspec in spec["fields"].items():
        kw[name] = _join(arrays[name], fspec) if "type" in fspec else arrays[name]
    return cls(**kw)


def _abstract(spec: dict[str, Any], sharding) -> dict[str, Any]:
    out = {}
    for name, fspec in spec["fields"].items():
        if "type" in fspec:
            out[name] = _abstract(fspec, sharding)
        else:
            out[name] = jax.ShapeDtypeStruct(tuple(fspec["shape"]), np.dtype(fspec["dtype"]), sharding=sharding)
    return out


def _path(path) -> tuple[str, ...]:
    return tuple(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)


def to_storable(params) -> tuple[Any, dict[str, Any]]:
    """Replace structured leaves by dicts of arrays; ``specs`` maps ``"a/b/c"`` paths to specs."""
    specs: dict[str, Any] = {}

    def one(path, leaf):
        if _is_structured(leaf):
            arrays, spec = _split(leaf)
            specs["/".join(_path(path))] = spec
            return arrays
        return leaf

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_structured), specs


def _get(tree, keys):
    for k in keys:
        tree = tree[int(k)] if isinstance(tree, list) else tree[k if k in tree else int(k)]
    return tree


def _set(tree, keys, value):
    parent = _get(tree, keys[:-1])
    k = keys[-1]
    if isinstance(parent, list):
        parent[int(k)] = value
    else:
        parent[k if k in parent else int(k)] = value


def abstract_targets(target_dict, specs: dict[str, Any], sharding) -> Any:
    """The restore target with each structured entry's abstract arrays."""
    for path, spec in specs.items():
        _set(target_dict, path.split("/"), _abstract(spec, sharding))
    return target_dict


def from_storable(restored, specs: dict[str, Any]) -> Any:
    for path, spec in specs.items():
        keys = path.split("/")
        _set(restored, keys, _join(_get(restored, keys), spec))
    return restored
