"""Orbax save/restore of a model with its `ModelConfig` stored beside the arrays.

Layout of a checkpoint directory (one orbax composite)::

    path/params/   the parameters (orbax standard format, tensorstore)
    path/config/   the ModelConfig as JSON
    path/tokenizer*.json   the model's tokenizer, when it has one

`load_checkpoint` reads the config first, builds the model's abstract shapes
with `nnx.eval_shape` (no random weights are materialised) and restores straight
into them, sharded by the parameters' logical axes when a mesh is given.

`save_checkpoint` writes through `jaxlm.fileio.atomic_directory`: a kill at any moment
leaves the complete old or the complete new directory, and the loaders first finish or
undo a swap that a killed writer left half done (docs/reliability.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

from jaxlm.data.tokenizers import load_tokenizer, save_tokenizer
from jaxlm.fileio import atomic_directory, describe_leftovers, recover_directory, staging_token
from jaxlm.models.config import ModelConfig
from jaxlm.models.hf.io import CheckpointError, load_hf
from jaxlm.models.layers.rope import RopeFrequencies
from jaxlm.models.transformer import Transformer, abstract_model
from jaxlm.quant.storage import abstract_targets, from_storable, to_storable
from jaxlm.sharding import model_shardings


def _shared_staging() -> tuple[str | None, bool]:
    """(staging token, primary): process 0's token broadcast to every process."""
    if jax.process_count() == 1:
        return None, True
    raw = np.zeros(128, np.uint8)
    if jax.process_index() == 0:
        token = staging_token().encode()
        raw[: len(token)] = np.frombuffer(token, np.uint8)
    raw = np.asarray(multihost_utils.broadcast_one_to_all(raw))
    return bytes(raw).rstrip(b"\0").decode(), jax.process_index() == 0


def recover(path: str | os.PathLike) -> None:
    """Finish or undo a swap of ``path`` that a killed writer left half done
    (`jaxlm.fileio.recover_directory`); on a read-only filesystem, do nothing."""
    try:
        recover_directory(path)
    except OSError:
        pass


def _missing(path: Path, expected: str) -> CheckpointError:
    found = describe_leftovers(path)
    if not path.exists():
        return CheckpointError(f"{path} does not exist" + (f"; {found}" if found else ""))
    return CheckpointError(f"{path} is not a jaxlm checkpoint (expected {expected})" + (f"; {found}" if found else ""))


def save_checkpoint(model: Transformer, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write ``model``'s parameters and config to ``path`` (a new directory).

    overwrite: replace an existing ``path``. The new directory is written beside it and
    swapped in at the end, so ``path`` is the complete old or new one at every moment
    (``model`` may have been loaded from ``path`` itself).
    """
    path = Path(path).absolute()

    # parameters and buffers (a compressed model's per-head RoPE frequencies)
    params, specs = to_storable(nnx.to_pure_dict(nnx.state(model, nnx.Any(nnx.Param, RopeFrequencies))))
    items = dict(params=ocp.args.StandardSave(params), config=ocp.args.JsonSave(model.config.to_dict()))
    if specs:  # quantized / structured weights: their types and static fields
        items["quant"] = ocp.args.JsonSave(specs)
    token, primary = _shared_staging()
    with atomic_directory(path, overwrite=overwrite, token=token, primary=primary) as staging:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            ckptr.save(staging, ocp.args.Composite(**items), force=True)  # staging is empty
        if model.tokenizer is not None and primary:
            save_tokenizer(model.tokenizer, staging)
    if token is not None:
        multihost_utils.sync_global_devices(f"jaxlm.save_checkpoint:{path}")
    return path


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` stored in a checkpoint directory."""
    path = Path(path).absolute()
    recover(path)
    if not (path / "config").exists() or not (path / "params").exists():
        raise _missing(path, "config/ and params/")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        stored = ckptr.restore(path, ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    try:
        return ModelConfig.from_dict(stored)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}/config holds an invalid ModelConfig: {e}") from None


def load_checkpoint(
    path: str | os.PathLike,
    *,
    config: ModelConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> Transformer:
    """Restore a model saved by `save_checkpoint`.

    config: when given, must equal the stored config (else `CheckpointError`
    listing the fields that differ). mesh: place each parameter on its shards.
    """
    path = Path(path).absolute()
    stored = read_config(path)
    if config is not None and config != stored:
        diff = stored.diff(config)
        lines = ", ".join(f"{k}: stored {a!r} vs requested {b!r}" for k, (a, b) in diff.items())
        raise CheckpointError(f"config mismatch restoring {path}: {lines}")
    model = abstract_model(stored)
    graphdef, abstract_state = nnx.split(model)
    if mesh is not None:
        shardings = model_shardings(model, mesh)
    else:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract_state)
    targets = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings
    )
    target_dict = nnx.to_pure_dict(targets)
    specs = None
    if (path / "quant").exists():
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            specs = ckptr.restore(path, ocp.args.Composite(quant=ocp.args.JsonRestore()))["quant"]
        single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target_dict = abstract_targets(target_dict, specs, single)
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            restored = ckptr.restore(
                path, ocp.args.Composite(params=ocp.args.StandardRestore(target_dict))
            )["params"]
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise CheckpointError(f"{path}: stored parameters do not match the stored config: {e}") from None
    if specs:
        restored = from_storable(restored, specs)
        model = nnx.merge(graphdef, restored)
    else:
        nnx.replace_by_pure_dict(abstract_state, restored)
        model = nnx.merge(graphdef, abstract_state)

    model.tokenizer = load_tokenizer(path)
    return model


def load_model(path: str | os.PathLike, *, mesh: jax.sharding.Mesh | None = None, **hf_kwargs) -> Transformer:
    """Load either a jaxlm (orbax) checkpoint or a HuggingFace directory, by what ``path`` holds."""
    path = Path(path)
    recover(path)
    if (path / "config").is_dir() and (path / "params").is_dir():
        return load_checkpoint(path, mesh=mesh)
    if (path / "config.json").exists():
        return load_hf(path, mesh=mesh, **hf_kwargs)
    found = describe_leftovers(path)
    raise CheckpointError(
        f"{path} is neither a jaxlm checkpoint (config/ + params/) nor a HF directory (config.json)"
        + ("" if path.exists() else " (it does not exist)") + (f"; {found}" if found else "")
    )
