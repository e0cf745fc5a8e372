"""One mesh helper and logical-axis rules: the same model on one CPU, 8 fake devices or a pod.

Every parameter carries logical axis names (``vocab``, ``embed``, ``q_heads``,
``kv_heads``, ``mlp``, ``head_dim``, ``norm``, ``layers``). ``LOGICAL_RULES`` maps them
to mesh axes (``data``, ``fsdp``, ``tensor``): FSDP shards the model dimension,
tensor parallelism shards heads, the MLP width and the vocabulary. Activations are
left to GSPMD propagation from the sharded parameters and the batch.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "norm": None,
    "layers": None,
}


def make_mesh(
    data: int = 1, fsdp: int = -1, tensor: int = 1, *, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh with Auto axis types; one axis may be -1 (= the
    remaining devices). Multi-host: call ``jax.distributed.initialize()`` first."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for name, size in sizes.items():
        if not isinstance(size, int) or (size <= 0 and size != -1):
            raise ValueError(f"mesh axis {name}={size!r} is invalid: must be a positive int or -1")
    unknown = [n for n, s in sizes.items() if s == -1]
    if len(unknown) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {unknown}")
    known = int(np.prod([s for s in sizes.values() if s != -1]))
    if unknown:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices are not divisible by the fixed axes' product {known}")
        sizes[unknown[0]] = len(devices) // known
    total = int(np.prod(list(sizes.values())))
    if total != len(devices):
        raise ValueError(f"mesh {sizes} needs {total} devices, {len(devices)} are available")
    # Auto axes: GSPMD propagates activation shardings from the parameters and the batch.
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(tuple(sizes.values()), MESH_AXES, devices=devices, axis_types=auto)


def logical_to_spec(
    axes: Sequence[str | None] | None, rules: Mapping[str, object] = LOGICAL_RULES, mesh: Mesh | None = None
) -> PartitionSpec:
    """Logical names -> PartitionSpec; a mesh axis is used at most once per array and
    axes of size 1 in ``mesh`` are dropped."""
    if axes is None:
        return PartitionSpec()
    used: set[str] = set()
    out = []
    for name in axes:
        target = rules.get(name) if name is not None else None
        if name is not None and name not in rules:
            raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        targets = tuple(
            t for t in targets if t not in used and (mesh is None or mesh.shape[t] > 1)
        )
        used.update(targets)
        out.append(None if not targets else targets[0] if len(targets) == 1 else targets)
    return PartitionSpec(*out)


def _fits(shape, spec: PartitionSpec, mesh: Mesh) -> PartitionSpec:
    """Drop mesh axes that do not divide the dimension (replicate it instead)."""
    out = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        size = int(np.prod([mesh.shape[n] for n in names])) if names else 1
        out.append(entry if size and dim % size == 0 else None)
    return PartitionSpec(*out)


def param_sharding(shape, axes, mesh: Mesh, rules: Mapping[str, object] = LOGICAL_RULES) -> NamedSharding:
    return NamedSharding(mesh, _fits(shape, logical_to_spec(axes, rules, mesh), mesh))


def model_shardings(model: nnx.Module, mesh: Mesh, rules: Mapping[str, object] = LOGICAL_RULES):
    """An ``nnx.State`` of NamedShardings matching ``nnx.state(model)``."""
    state = nnx.state(model)

    def one(var):
        axes = var.get_metadata().get("out_sharding")
        return var.replace(param_sharding(var.shape, axes, mesh, rules))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules: Mapping[str, object] = LOGICAL_RULES) -> nnx.Module:
    """Place every parameter by its logical axes (in place; returns the model)."""
    state = nnx.state(model)
    shardings = model_shardings(model, mesh, rules)
    nnx.update(model, jax.device_put(state, shardings))
    return model


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Shard the leading (batch) axis over ``data`` x ``fsdp``."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), LOGICAL_RULES, mesh))
