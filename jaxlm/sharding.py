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
from jax.experimental import multihost_utils
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

#: ``LOGICAL_RULES`` with the embedding table split along the vocabulary over ``fsdp`` too
#: (``[V / (tensor * fsdp), D]`` instead of ``[V / tensor, D / fsdp]``; an untied LM head,
#: ``("embed", "vocab")``, keeps ``fsdp`` on ``embed``): a tied LM head then computes each
#: device's slice of the vocabulary for all tokens, with no all-gather of the table and no
#: ``[V, D]`` float32 partial gradient per device. It pays when a step's tokens are few next
#: to the vocabulary, and when forced host devices share one memory (8 CPU devices,
#: Qwen3-0.6B shape, batch 8 x 128: XLA's temporaries 2.13 -> 0.76 GiB per device;
#: docs/benchmarks.md).
VOCAB_SPLIT_RULES: dict[str, str | tuple[str, ...] | None] = {**LOGICAL_RULES, "vocab": ("tensor", "fsdp")}


def make_mesh(
    data: int = 1, fsdp: int = -1, tensor: int = 1, *, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh with Auto axis types; one axis may be -1 (= the
    remaining devices). Multi-host: call ``jax.distributed.initialize()`` first."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or (size <= 0 and size != -1):
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
    axes: Sequence[str | None] | None, rules: Mapping[str, object] = LOGICAL_RULES, mesh: Mesh | None = None,
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """Logical names -> PartitionSpec; a mesh axis is used at most once per array and
    axes of size 1 in ``mesh`` are dropped. With ``shape`` (and ``mesh``) each dimension keeps
    those of its mesh axes that still divide it, in the rule's order, and only the kept ones
    are used up (a vocabulary of 32004 over tensor x fsdp = 2 x 4 keeps ``tensor``, and an
    axis a dimension could not take stays free for the next dimension)."""
    if axes is None:
        return PartitionSpec()
    if shape is not None and len(axes) > len(shape):
        raise ValueError(
            f"logical axes {tuple(axes)} name {len(axes)} dimensions but the array has shape "
            f"{tuple(shape)} ({len(shape)} dimensions)"
        )
    used: set[str] = set()
    out = []
    for k, name in enumerate(axes):
        target = rules.get(name) if name is not None else None
        if name is not None and name not in rules:
            raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        targets = tuple(
            t for t in targets if t not in used and (mesh is None or mesh.shape[t] > 1)
        )
        if shape is not None and mesh is not None:
            kept, size = [], 1
            for t in targets:
                if shape[k] % (size * mesh.shape[t]) == 0:
                    kept.append(t)
                    size *= mesh.shape[t]
            targets = tuple(kept)
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
    return NamedSharding(mesh, _fits(shape, logical_to_spec(axes, rules, mesh, shape), mesh))


def model_shardings(model: nnx.Module, mesh: Mesh, rules: Mapping[str, object] = LOGICAL_RULES):
    """An ``nnx.State`` of NamedShardings matching ``nnx.state(model)``. A structured value (a
    quantized weight: codes, scales and transforms) is replicated, each of its arrays whole
    on every device."""
    state = nnx.state(model)
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(var):
        value = var.get_value()
        leaves = jax.tree.leaves(value)
        if not (len(leaves) == 1 and leaves[0] is value):  # a pytree of arrays (jaxlm.quant.storage types)
            return var.replace(jax.tree.map(lambda _: replicated, value))
        axes = var.get_metadata().get("out_sharding")
        return var.replace(param_sharding(value.shape, axes, mesh, rules))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules: Mapping[str, object] = LOGICAL_RULES) -> nnx.Module:
    """Place every parameter by its logical axes (in place; returns the model)."""
    state = nnx.state(model)
    shardings = model_shardings(model, mesh, rules)
    nnx.update(model, place(state, shardings))
    return model


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Shard the leading (batch) axis over ``data`` x ``fsdp``."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), LOGICAL_RULES, mesh))


def place(tree, shardings):
    """`jax.device_put` of ``tree`` onto ``shardings``, also where those span several processes
    (multi-host): an array that only this process holds (e.g. a model loaded or built without
    a mesh) goes through host memory, each process putting its own devices' slices, so every
    process must hold the same values."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(x, sharding):
        if isinstance(x, jax.Array) and x.is_fully_addressable and not sharding.is_fully_addressable:
            x = np.asarray(x)
        return jax.device_put(x, sharding)

    return jax.tree.map(one, tree, shardings)


def to_host(tree):
    """Numpy copies of a pytree's arrays, also of arrays split over devices of several
    processes (multi-host): those are gathered so every process gets the whole array, a
    collective that every process must reach with the same tree."""

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(one, tree)
