"""Orbax save/restore of a model with its `ModelConfig` stored beside the arrays.

Layout of a checkpoint directory (one orbax composite)::

    path/params/   the parameters (orbax standard format, tensorstore)
    path/config/   the ModelConfig as JSON
    path/tokenizer*.json   the model's tokenizer, when it has one
    path/generation_config.json   the sampling settings of the HF directory the model was
                   loaded from (`load_hf`), when it has them, for a later `save_hf`

`load_checkpoint` reads the config first, builds the model's abstract shapes
with `nnx.eval_shape` (no random weights are materialised) and restores straight
into them, sharded by the parameters' logical axes when a mesh is given.

`save_checkpoint` writes through `jaxlm.fileio.atomic_directory`: a kill at any moment
leaves the complete old or the complete new directory, and the loaders first finish or
undo a swap that a killed writer left half done (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from jaxlm.data.tokenizers import load_tokenizer, save_tokenizer
from jaxlm.eval.accuracy import heldout_accuracy
from jaxlm.fileio import (
    DirectoryLock,
    atomic_directory,
    describe_leftovers,
    recover_directory,
    staging_token,
)
from jaxlm.models.config import ModelConfig
from jaxlm.models.hf.io import GENERATION_CONFIG, CheckpointError, load_hf, save_hf
from jaxlm.models.layers.rope import RopeFrequencies
from jaxlm.models.transformer import Transformer, abstract_model
from jaxlm.quant.storage import abstract_targets, from_storable, to_storable
from jaxlm.sharding import model_shardings

log = logging.getLogger(__name__)


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


def _global_leaves(tree):
    """In a multi-process run, every leaf that only this process holds (a jax.Array on its
    own devices, e.g. a model built or loaded without a mesh) becomes a global array
    replicated over all processes' devices, which orbax can serialize (orbax refuses
    host-local arrays). Every process holds the same model, so process 0's copy is what is
    written. Arrays already spread over the processes' devices are kept as they are."""
    if jax.process_count() == 1:
        return tree
    replicated = NamedSharding(Mesh(np.array(jax.devices()), ("all",)), PartitionSpec())

    def one(x):
        if isinstance(x, jax.Array) and x.is_fully_addressable:
            return jax.device_put(np.asarray(x), replicated)
        return x

    return jax.tree.map(one, tree)


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
    _refuse_run_directory(path)
    return CheckpointError(f"{path} is not a jaxlm checkpoint (expected {expected})" + (f"; {found}" if found else ""))


def orbax_error_summary(e: BaseException) -> str:
    """The innermost cause of a failed restore, on one line (orbax wraps tensorstore's
    errors, e.g. ``OUT_OF_RANGE: Error reading ...``, in a bare Exception)."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip().splitlines()[0][:400] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@contextlib.contextmanager
def quiet_orbax_read_errors():
    """orbax's failed array reads leave coroutines (and callbacks on their closed event
    loop) whose exceptions Python prints as 'Exception ignored in ...'; the restore error
    says it once, so drop those."""
    previous = sys.unraisablehook

    def hook(unraisable):
        from_read = "_read_array_index_and_device_put" in repr(getattr(unraisable, "object", ""))
        closed_loop = isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(
            unraisable.exc_value)
        if not (from_read or closed_loop):
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        gc.collect()
        sys.unraisablehook = previous


@contextlib.contextmanager
def _quiet_item_reads():
    """Reading one item of a checkpoint on its own is deliberate: orbax's warnings about the
    items it was not asked for, or a step metadata file an item directory does not have,
    are dropped (errors still show)."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(level)


def save_checkpoint(model: Transformer, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write ``model``'s parameters and config to ``path`` (a new directory).

    overwrite: replace an existing ``path``. The new directory is written beside it and
    swapped in at the end, so ``path`` is the complete old or new one at every moment
    (``model`` may have been loaded from ``path`` itself).
    """
    path = Path(path).absolute()

    # parameters and buffers (a compressed model's per-head RoPE frequencies)
    params, specs = to_storable(nnx.to_pure_dict(nnx.state(model, nnx.Any(nnx.Param, RopeFrequencies))))
    params = _global_leaves(params)
    items = dict(params=ocp.args.StandardSave(params), config=ocp.args.JsonSave(model.config.to_dict()))
    if specs:  # quantized / structured weights: their types and static fields
        items["quant"] = ocp.args.JsonSave(specs)
    token, primary = _shared_staging()
    with atomic_directory(path, overwrite=overwrite, token=token, primary=primary) as staging:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            ckptr.save(staging, ocp.args.Composite(**items), force=True)  # staging is empty
        if model.tokenizer is not None and primary:
            save_tokenizer(model.tokenizer, staging)
        carried = getattr(model, "hf_generation_config", None)
        if carried and primary:  # the HF sampling settings travel on to a later save_hf
            (staging / GENERATION_CONFIG).write_text(carried)
    if token is not None:
        multihost_utils.sync_global_devices(f"jaxlm.save_checkpoint:{path}")
    return path


def _read_json_item(path: Path, item: str):
    """One JSON item of a checkpoint (``path/<item>/``), read on its own."""
    try:
        with _quiet_item_reads(), ocp.Checkpointer(ocp.JsonCheckpointHandler()) as ckptr:
            return ckptr.restore(path / item)
    except Exception as e:  # noqa: BLE001 (a damaged item: name it)
        raise CheckpointError(f"{path}/{item} could not be read ({orbax_error_summary(e)})") from None


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` stored in a checkpoint directory."""
    path = Path(path).absolute()
    recover(path)
    if not (path / "config").exists() or not (path / "params").exists():
        raise _missing(path, "config/ and params/")
    stored = _read_json_item(path, "config")
    try:
        return ModelConfig.from_dict(stored)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}/config holds an invalid ModelConfig: {e}") from None


def _dotted(key_path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in key_path)


def _check_stored_shapes(path: Path, target_dict, quantized: tuple[str, ...] = ()) -> None:
    """The stored arrays' shapes (orbax metadata) against those the stored config implies:
    a `CheckpointError` naming the first parameters that differ (an edited config/).
    ``quantized``: dotted names of structured weights (stored as several arrays under the
    name; checked by `_check_quantized_shapes`), left out here."""
    try:
        with _quiet_item_reads(), ocp.StandardCheckpointer() as ckptr:
            metadata = ckptr.metadata(path / "params")
    except Exception as e:  # noqa: BLE001 (damaged metadata: the restore below reports it)
        log.debug("no array metadata in %s: %s", path, e)
        return
    tree = getattr(metadata, "item_metadata", metadata)

    def structured(name: str) -> bool:
        return any(name == q or name.startswith(q + ".") for q in quantized)

    leaves = [(_dotted(kp), leaf) for kp, leaf in jax.tree_util.tree_leaves_with_path(tree)
              if getattr(leaf, "shape", None) is not None and not structured(_dotted(kp))]
    stored = {name: tuple(leaf.shape) for name, leaf in leaves}
    stored_dtypes = {name: np.dtype(leaf.dtype).name for name, leaf in leaves if getattr(leaf, "dtype", None) is not None}
    targets = [(kp, leaf) for kp, leaf in jax.tree_util.tree_leaves_with_path(target_dict)
               if not structured(_dotted(kp))]
    wanted = {_dotted(kp): tuple(leaf.shape) for kp, leaf in targets}
    bad = [f"{name} is {stored[name]} in params/ but {shape} by config/" for name, shape in wanted.items()
           if name in stored and stored[name] != shape]
    # an edited param_dtype / dtype: the restore cast every weight silently
    bad += [f"{name} is {stored_dtypes[name]} in params/ but {np.dtype(leaf.dtype).name} by config/"
            for name, leaf in ((_dotted(kp), leaf) for kp, leaf in targets)
            if name in stored_dtypes and stored_dtypes[name] != np.dtype(leaf.dtype).name]
    missing = [f"{name} is missing from params/" for name in wanted if stored and name not in stored]
    extra = [f"params/ holds {name}, which config/ has no place for" for name in stored if name not in wanted]
    problems = bad[:4] + missing[:4] + extra[:4]
    more = len(bad) + len(missing) + len(extra) - len(problems)
    if problems:
        raise CheckpointError(
            f"{path}: the stored parameters do not match the stored config ("
            + "; ".join(problems) + (f"; {more} more" if more else "")
            + "): config/ was edited or belongs to another model"
        )


def _config_shapes_of(path: Path, target_dict, specs) -> dict[str, tuple[int, ...]]:
    """``{quant path: the shape config/ gives that parameter}``; a `CheckpointError` for a
    quantized weight config/ has no place for."""
    shapes = {}
    for name in specs:
        node = target_dict
        try:
            for k in name.split("/"):
                node = node[int(k)] if isinstance(node, list) else node[k if k in node else int(k)]
        except (KeyError, IndexError, ValueError, TypeError):
            raise CheckpointError(f"{path}: the stored parameters do not match the stored config (params/ holds "
                                  f"the quantized {name.replace('/', '.')}, which config/ has no place for): "
                                  "config/ was edited or belongs to another model") from None
        shapes[name] = tuple(node.shape)
    return shapes


def _logical_shape(obj) -> tuple[int, ...] | None:
    """The unquantized shape of a structured weight (its `QArray`'s, found through wrappers)."""
    if hasattr(obj, "shape"):
        return tuple(obj.shape)
    for f in dataclasses.fields(obj) if dataclasses.is_dataclass(obj) else ():
        inner = getattr(obj, f.name)
        if dataclasses.is_dataclass(inner) and not isinstance(inner, type):
            found = _logical_shape(inner)
            if found is not None:
                return found
    return None


def _check_quantized_shapes(path: Path, restored, wanted: dict[str, tuple[int, ...]]) -> None:
    bad = []
    for name, shape in wanted.items():
        node = restored
        for k in name.split("/"):
            node = node[int(k)] if isinstance(node, list) else node[k if k in node else int(k)]
        got = _logical_shape(node)
        if got is not None and got != shape:
            bad.append(f"the quantized {name.replace('/', '.')} is {got} in params/ but {shape} by config/")
    if bad:
        raise CheckpointError(f"{path}: the stored parameters do not match the stored config ("
                              + "; ".join(bad[:4]) + (f"; {len(bad) - 4} more" if len(bad) > 4 else "")
                              + "): config/ was edited or belongs to another model")


def load_checkpoint(
    path: str | os.PathLike,
    *,
    config: ModelConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> Transformer:
    """Restore a model saved by `save_checkpoint`.

    config: when given, must equal the stored config (else `CheckpointError`
    listing the fields that differ). mesh: place each parameter on its shards
    (default: every parameter on this process's first device).
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
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # this process's own
        shardings = jax.tree.map(lambda _: device, abstract_state)
    targets = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings
    )
    target_dict = nnx.to_pure_dict(targets)
    specs = None
    if (path / "quant").exists():
        specs = _read_json_item(path, "quant")
        # the quantized weights' places and logical shapes by config/ (an edited config loaded
        # with weights of the old shape, or failed as a KeyError or "damaged")
        quantized_shapes = _config_shapes_of(path, target_dict, specs)
        _check_stored_shapes(path, target_dict, tuple(p.replace("/", ".") for p in specs))
        # quantized weights (codes, scales, transforms) are replicated over a mesh: on the first
        # device alone they met mesh-placed activations and every forward failed
        where = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None
                 else jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
        target_dict = abstract_targets(target_dict, specs, where)
    if not specs:
        _check_stored_shapes(path, target_dict)
    try:
        with quiet_orbax_read_errors(), _quiet_item_reads(), ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(path / "params", target_dict)
    except Exception as e:  # orbax/tensorstore raise bare Exceptions for damaged files
        raise CheckpointError(f"{path}/params could not be read ({orbax_error_summary(e)}): the checkpoint is "
                              "damaged (a truncated or overwritten file); restore it from a copy") from None
    if specs:
        restored = from_storable(restored, specs)
        _check_quantized_shapes(path, restored, quantized_shapes)
        model = nnx.merge(graphdef, restored)
    else:
        nnx.replace_by_pure_dict(abstract_state, restored)
        model = nnx.merge(graphdef, abstract_state)

    try:
        model.tokenizer = load_tokenizer(path)
    except ValueError as e:  # a damaged tokenizer file: named, as the other items are
        raise CheckpointError(f"{path}: the tokenizer could not be read: {e}") from None
    tok_vocab = getattr(model.tokenizer, "vocab_size", None)
    if tok_vocab is not None and tok_vocab > stored.vocab_size:  # its top ids gave NaN logits
        raise CheckpointError(f"{path}: the tokenizer has {tok_vocab} ids but ModelConfig.vocab_size="
                              f"{stored.vocab_size}: ids from {stored.vocab_size} on have no embedding row")
    if (path / GENERATION_CONFIG).is_file():
        try:
            generation = json.loads((path / GENERATION_CONFIG).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path / GENERATION_CONFIG} could not be read ({e})") from None
        if not isinstance(generation, dict):
            raise CheckpointError(f"{path / GENERATION_CONFIG} holds a JSON {type(generation).__name__}, not an object")
        model.hf_generation_config = json.dumps(generation, sort_keys=True)
    return model


def _refuse_run_directory(path: Path) -> None:
    """A training run's directory (its experiment ``config.json`` beside ``model/`` or
    ``checkpoints/``) is not a model: name the model inside it."""
    if not (path / "config.json").is_file() or not ((path / "model").is_dir() or (path / "checkpoints").is_dir()):
        return
    try:
        keys = set(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError, TypeError):
        return
    if {"trainer", "algorithm"} <= keys:
        inside = path / "model"
        raise CheckpointError(f"{path} is a training run's directory, not a model: "
                              + (f"its final model is {inside}" if inside.is_dir() else
                                 "it has no final model yet (model/); its checkpoints are in checkpoints/"))


def load_model(path: str | os.PathLike, *, mesh: jax.sharding.Mesh | None = None, **hf_kwargs) -> Transformer:
    """Load either a jaxlm (orbax) checkpoint or a HuggingFace directory, by what ``path`` holds.

    ``hf_kwargs`` (`load_hf`'s options: ``dtype``, ``scan_layers``, ...) apply to a HF
    directory; a jaxlm checkpoint is restored as its stored config says, so passing them
    for one is an error rather than ignored."""
    path = Path(path)
    recover(path)
    if (path / "config").is_dir() and (path / "params").is_dir():
        if hf_kwargs:
            raise TypeError(f"load_model({sorted(hf_kwargs)}): these options apply to HF directories; {path} is a "
                            "jaxlm checkpoint, restored as its stored config says (load_checkpoint)")
        return load_checkpoint(path, mesh=mesh)
    if (path / "omni.json").exists() and (path / "lm").is_dir():
        raise CheckpointError(f"{path} is an omni checkpoint (a language model and media encoders): load it with "
                              f"jaxlm.load_omni({str(path)!r}); {path / 'lm'} is its language model alone")
    _refuse_run_directory(path)
    if (path / "config.json").exists():
        return load_hf(path, mesh=mesh, **hf_kwargs)
    found = describe_leftovers(path)
    raise CheckpointError(
        f"{path} is neither a jaxlm checkpoint (config/ + params/) nor a HF directory (config.json)"
        + ("" if path.exists() else " (it does not exist)") + (f"; {found}" if found else "")
    )


def _check_source_exists(path) -> None:
    """A missing source is named before the output is locked (the lock beside the output
    created its parent directories, left behind empty)."""
    if isinstance(path, (str, os.PathLike)):
        path = Path(path)
        recover(path)  # a killed swap's staging copy may still hold it
        if not path.exists():
            raise CheckpointError(f"{path} is neither a jaxlm checkpoint (config/ + params/) nor a HF directory "
                                  "(config.json) (it does not exist)")


def _check_not_in_use(path: Path) -> None:
    """`DirectoryLockedError` if a process (a training run) holds ``path``'s own lock: a
    directory in use is not replaced under it."""
    if path.is_dir() and not path.is_symlink():
        with DirectoryLock(path, what="directory about to be replaced"):
            pass


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, to: str = "orbax", overwrite: bool = False,
                       hint: str = "pass overwrite=True to replace it", **hf_kwargs) -> Path:
    """Read ``src`` (a jaxlm checkpoint or a HF directory) and write it to ``dst`` as a jaxlm
    checkpoint (``to="orbax"``) or a HF directory (``to="hf"``): what ``jaxlm convert`` runs.
    ``dst`` is locked while it is written and replaced atomically, so it may be ``src``
    itself (with ``overwrite``)."""
    if to not in ("orbax", "hf"):
        raise ValueError(f"to={to!r} is invalid: must be 'orbax' or 'hf'")
    dst = Path(dst)
    _check_source_exists(src)
    with DirectoryLock(dst, beside=True, what="converted model being written"):
        if dst.exists() and not overwrite and (not dst.is_dir() or any(dst.iterdir())):
            raise FileExistsError(f"{dst} exists; {hint}")
        _check_not_in_use(dst)
        model = load_model(src, **hf_kwargs)
        if to == "orbax":
            return save_checkpoint(model, dst, overwrite=True)
        return save_hf(model, dst)


@dataclasses.dataclass
class TransformRun:
    """What `transform_checkpoint` did: the model it read, the one it wrote (at ``out``) and
    held-out accuracy before and after (None when not measured)."""

    source: Transformer
    result: Transformer
    before: float | None
    after: float | None
    out: Path
    n: int


def transform_checkpoint(
    model,
    out: str | os.PathLike,
    transform,
    *,
    task,
    eval_n: int = 200,
    overwrite: bool = False,
    overwrite_hint: str = "pass overwrite=True to replace it",
    desc: str = "transform",
    what: str = "model being written",
    progress: bool = False,
) -> TransformRun:
    """Load ``model`` (a checkpoint or HF directory, or a model), apply ``transform(model) ->
    model`` (a weight-space method: quantization, compression, ...), measure held-out
    accuracy on ``eval_n`` examples of ``task`` before and after (0: skip) and save the
    result to ``out``. ``out`` is locked while it is written (a second writer is refused)
    and replaced atomically, so it may be the input directory itself. ``progress``: a bar
    over the stages, titled ``desc``."""
    if isinstance(eval_n, bool) or not isinstance(eval_n, int) or eval_n < 0:
        raise ValueError(f"eval_n={eval_n!r} is invalid: must be an int >= 0")
    out = Path(out)
    _check_source_exists(model)
    with DirectoryLock(out, beside=True, what=what):
        if out.exists() and not overwrite:
            raise FileExistsError(f"{out} exists; {overwrite_hint}")
        _check_not_in_use(out)
        stages = ["load", desc] + (["accuracy before", "accuracy after"] if eval_n else []) + ["save"]
        with tqdm(total=len(stages), desc=desc, disable=not progress) as bar:
            def stage(name: str) -> None:
                bar.set_postfix_str(name)

            stage("load")
            source = load_model(model) if isinstance(model, (str, os.PathLike)) else model
            if getattr(source, "tokenizer", None) is None:
                raise ValueError(f"{model} has no tokenizer; cannot encode calibration texts")
            bar.update()
            stage(desc)
            result = transform(source)
            bar.update()
            before = after = None
            if eval_n:
                stage("accuracy before")
                before = heldout_accuracy(source, task, eval_n, desc="before", progress=progress).accuracy
                bar.update()
                stage("accuracy after")
                after = heldout_accuracy(result, task, eval_n, desc="after", progress=progress).accuracy
                bar.update()
            stage("save")
            save_checkpoint(result, out, overwrite=overwrite)
            bar.update()
    return TransformRun(source=source, result=result, before=before, after=after, out=out, n=eval_n)
