"""`load_hf` / `save_hf`: local HuggingFace directories <-> jaxlm models, through safetensors.

Reads ``config.json`` and one or many ``*.safetensors`` files (with
``model.safetensors.index.json`` when sharded); never unpickles ``*.bin``. Every
tensor goes through its family's table (`jaxlm.models.hf.families`); a missing,
unexpected or mis-shaped tensor and a truncated or corrupt file raise
`CheckpointError` naming the key or file. Weights are read one tensor at a time
into the target dtype and, with a mesh, placed straight onto their shards.
`save_hf` writes through `jaxlm.fileio.atomic_directory` (a kill leaves the complete old
or new directory; see docs/reliability.md).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

from jaxlm.data.tokenizers import load_tokenizer, save_tokenizer
from jaxlm.dtypes import optional_dtype_name
from jaxlm.fileio import LOCK_FILE, atomic_directory, describe_leftovers, recover_directory
from jaxlm.models.hf import llada
from jaxlm.models.hf.configs import config_from_hf, config_to_hf
from jaxlm.models.hf.families import FAMILIES, UnsupportedConfigError
from jaxlm.models.params import flat_params, init_params, model_from_flat, param_axes, param_shapes
from jaxlm.models.transformer import Transformer
from jaxlm.sharding import LOGICAL_RULES, param_sharding

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint on disk is missing pieces, has the wrong shapes or is corrupt."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def _safetensors_files(path: Path) -> list[Path]:
    if (path / "model.safetensors").exists():  # first, as transformers: other files beside it (a PEFT
        return [path / "model.safetensors"]  # adapter, a backup, a stale index of old shards) are not read
    index = path / INDEX_FILE
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).exists()]
        if missing:
            raise CheckpointError(f"{index} lists shard files that do not exist: {missing}")
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (found {pickles}: jaxlm never unpickles; convert to safetensors)" if pickles else ""
        raise CheckpointError(f"no *.safetensors files in {path}{hint}")
    return files


def _iter_tensors(file: Path):
    """Yield (name, numpy array) from one safetensors file, with clear errors."""
    from safetensors import SafetensorError, safe_open

    size = file.stat().st_size
    if size < 8:
        raise CheckpointError(f"{file} is truncated ({size} bytes): not a safetensors file")
    try:
        handle = safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from None
    with handle as f:
        for name in f.keys():
            try:
                yield name, f.get_tensor(name)
            except (SafetensorError, OSError, ValueError, TypeError) as e:
                raise CheckpointError(f"{file}: tensor {name!r} could not be read: {e}") from None


def _tensor_names(file: Path) -> list[str]:
    """The tensor names of one safetensors file (its header only)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="numpy") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from None


@functools.partial(jax.jit, static_argnames=("transpose", "dtype"))
def _transpose_cast(x, *, transpose: bool, dtype):
    return (x.T if transpose else x).astype(dtype)


def _device_tensor(tensor: np.ndarray, transpose: bool, dtype, sharding) -> jax.Array:
    """A tensor as read from the file -> a device array in ``dtype`` (on its shards when
    ``sharding`` is given), transposed and cast on the device: numpy's strided copy of a
    bf16 matrix is several times slower, and the host keeps no second copy of the weights."""
    x = jax.numpy.asarray(tensor)
    if transpose or x.dtype != dtype:
        x = _transpose_cast(x, transpose=transpose, dtype=jax.numpy.dtype(dtype))
    return x if sharding is None else jax.device_put(x, sharding)


def _untie_if_head_differs(path, config, family, flat, head, mesh, rules):
    """A checkpoint whose config ties the embeddings but which stores an ``lm_head.weight``
    unlike its embedding matrix is loaded untied, with the stored head, as transformers does
    (it warns and does not tie). Returns the config, shapes and axes to load with."""
    embed_name, embed_transpose = family.to_jaxlm("model.embed_tokens.weight")
    embed = flat.get(embed_name)
    expected = param_shapes(config)
    if embed is None and tuple(head.shape) == tuple(expected[embed_name].shape):
        # only the shared matrix's head copy is stored: it is the embedding, as transformers ties it
        sharding = None if mesh is None else param_sharding(tuple(head.shape), param_axes(config)[embed_name], mesh,
                                                            rules)
        flat[embed_name] = _device_tensor(head, embed_transpose, config.weight_dtype, sharding)
        return config, expected, param_axes(config)
    if embed is None or tuple(head.shape) != tuple(embed.shape):
        raise CheckpointError(f"{path}: lm_head.weight {tuple(head.shape)} does not match model.embed_tokens.weight "
                              f"{None if embed is None else tuple(embed.shape)} though config.json ties them")
    if np.array_equal(np.asarray(jax.numpy.asarray(head).astype(embed.dtype)), np.asarray(embed)):
        return config, param_shapes(config), param_axes(config)
    warnings.warn(f"{path}: config.json ties the embeddings (tie_word_embeddings=true) but lm_head.weight differs "
                  "from model.embed_tokens.weight; loading the stored head untied, as transformers does",
                  stacklevel=3)
    config = dataclasses.replace(config, tie_embeddings=False)
    expected, axes = param_shapes(config), param_axes(config)
    name, transpose = family.to_jaxlm("lm_head.weight")
    sharding = None if mesh is None else param_sharding(tuple(expected[name].shape), axes[name], mesh, rules)
    flat[name] = _device_tensor(head, transpose, config.weight_dtype, sharding)
    return config, expected, axes


def load_hf(
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    param_dtype: Any = None,
    scan_layers: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    rules: Mapping[str, Any] | None = None,
    tokenizer: bool = True,
    **config_overrides: Any,
) -> Transformer:
    """Load a local HF ``*ForCausalLM`` directory (Llama, Qwen2, Qwen3, Mistral), or a LLaDA
    diffusion LM (``LLaDAModelLM`` or the Llama-named ``LLaDAForCausalLM``, with ME-DLM's
    next-token head when present; `jaxlm.models.hf.llada`) as a ``mode="diffusion"`` model.

    dtype: compute dtype, a name (``"bfloat16"``) or a jnp/numpy dtype (default: the
    checkpoint's dtype if float32/bfloat16/float16, else float32); param_dtype defaults to
    ``dtype``. With ``mesh`` every tensor is
    placed on its shards as it is read, by the parameters' logical axes under ``rules``
    (default `jaxlm.sharding.LOGICAL_RULES`). A tokenizer beside the weights
    (``tokenizer.json``) is loaded into ``model.tokenizer`` (None otherwise).
    """
    rules = LOGICAL_RULES if rules is None else rules
    dtype = optional_dtype_name(dtype, field="load_hf(dtype)")
    param_dtype = optional_dtype_name(param_dtype, field="load_hf(param_dtype)")
    path = Path(path)
    try:
        recover_directory(path)
    except OSError:
        pass
    if not path.is_dir():
        found = describe_leftovers(path)
        raise CheckpointError(f"{path} is not a directory" + (f"; {found}" if found else ""))
    hf_config = _read_json(path / "config.json")
    ckpt_dtype = hf_config.get("dtype") or hf_config.get("torch_dtype")
    if dtype is None:
        dtype = ckpt_dtype if ckpt_dtype in ("float32", "bfloat16", "float16") else "float32"
    is_llada = llada.is_llada(hf_config)
    if is_llada:
        names = [llada.tensor_name(n) for file in _safetensors_files(path) for n in _tensor_names(file)]
        config_overrides = {**llada.diffusion_overrides(hf_config, names), **config_overrides}
        hf_config = llada.as_llama(hf_config)
    config = config_from_hf(
        hf_config, dtype=dtype, param_dtype=param_dtype or dtype, scan_layers=scan_layers,
        **config_overrides,
    )
    family = FAMILIES[config.family]
    expected = param_shapes(config)
    axes = param_axes(config)

    flat: dict[str, jax.Array] = {}
    stored_head = None  # a tied checkpoint's lm_head.weight, kept until it is compared with the embedding
    for file in _safetensors_files(path):
        for hf_name, tensor in _iter_tensors(file):
            if is_llada:
                hf_name = llada.tensor_name(hf_name)
            if family.ignored(hf_name):
                continue
            mapped = family.to_jaxlm(hf_name)
            if mapped is None or mapped[0] not in expected:
                if hf_name == "lm_head.weight" and config.tie_embeddings:
                    stored_head = tensor  # tied checkpoints sometimes store the shared matrix twice
                    continue
                raise CheckpointError(
                    f"{file.name}: unexpected tensor {hf_name!r} {tuple(tensor.shape)} for "
                    f"{family.architecture} with this config.json"
                )
            name, transpose = mapped
            got = tuple(tensor.shape)
            want = tuple(expected[name].shape)
            if (tuple(reversed(got)) if transpose else got) != want:
                hf_want = tuple(reversed(want)) if transpose else want
                raise CheckpointError(
                    f"{file.name}: tensor {hf_name!r} has shape {got}, expected {hf_want} "
                    f"from config.json"
                )
            if name in flat:
                raise CheckpointError(f"tensor {hf_name!r} appears in more than one file")
            sharding = None if mesh is None else param_sharding(want, axes[name], mesh, rules)
            flat[name] = _device_tensor(tensor, transpose, config.weight_dtype, sharding)
    if stored_head is not None:
        config, expected, axes = _untie_if_head_differs(path, config, family, flat, stored_head, mesh, rules)
    # Parameters the family has no tensor for belong to a jaxlm variant (e.g. affine-scaled
    # attention, MeGan's hypernetwork): they take their initial values, which reproduce the
    # base model exactly.
    variant_only = sorted(n for n in expected if family.to_hf(n) is None)
    if variant_only:
        flat.update(init_params(config, variant_only))
    missing = sorted(set(expected) - set(flat))
    if missing:
        hf_missing = [family.to_hf(m)[0] for m in missing]
        raise CheckpointError(
            f"{path}: missing tensors {hf_missing[:8]}{' ...' if len(missing) > 8 else ''} "
            f"(expected shapes {[tuple(reversed(expected[m].shape)) if family.to_hf(m)[1] else tuple(expected[m].shape) for m in missing[:8]]})"
        )

    place = None
    if mesh is not None:
        def place(name, axes, value):
            return jax.device_put(value, param_sharding(value.shape, axes, mesh, rules))

    model = model_from_flat(config, flat, place=place, release=True)
    if tokenizer:
        model.tokenizer = load_tokenizer(path)
    generation = None
    if (path / GENERATION_CONFIG).is_file():  # its sampling defaults travel to a save_hf of this model
        try:
            generation = _read_json(path / GENERATION_CONFIG)
        except CheckpointError:
            generation = None
    # config.json's special ids travel too (under the generation config's own): a model loaded
    # without its tokenizer still saves the ids transformers' generate stops on
    ids = {k: hf_config[k] for k in _SPECIAL_IDS if hf_config.get(k) is not None}
    carried = {**ids, **(generation if isinstance(generation, dict) else {})}
    if carried:
        model.hf_generation_config = json.dumps(carried, sort_keys=True)  # a str: static and hashable
    return model


_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")

#: a tokenizer's files in a HF directory (fast and slow formats): a model saved with its own
#: tokenizer leaves an old one's out (a stale special_tokens_map.json gave transformers an EOS
#: id past the vocabulary)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "additional_chat_templates",
                    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt",
                    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


# What a jaxlm (orbax) checkpoint holds beside its tokenizer: a model written over one
# replaces it, so none of it is carried into the new directory.
_ORBAX_ENTRIES = ("config", "params", "quant", "_CHECKPOINT_METADATA", "commit_success.txt")


# the old model's weights in any format (a carried pytorch_model.bin beside the new
# model.safetensors would be a second, different model), their indexes and Llama's original/
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".gguf", ".ckpt", ".h5", ".msgpack", ".index.json")


def _is_weights(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name == "original"


def _carry_over(old: Path, new: Path, *, skip: tuple[str, ...] = ()) -> None:
    """Bring the files of an existing directory ``old`` that ``new`` lacks into ``new``
    (hard links where possible), except weights (safetensors, pickles, GGUF, ``original/``,
    their indexes; orbax), lock files and the names in ``skip``."""
    if not old.is_dir():
        return
    for entry in old.iterdir():
        name = entry.name
        if (new / name).exists() or _is_weights(name) or name.startswith(LOCK_FILE) or name in _ORBAX_ENTRIES \
                or name in skip:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / name, symlinks=True, copy_function=_link_or_copy)
        elif entry.is_symlink():
            os.symlink(os.readlink(entry), new / name)
        else:
            _link_or_copy(str(entry), str(new / name))


GENERATION_CONFIG = "generation_config.json"


def _special_token_ids(tokenizer) -> dict[str, Any]:
    """HF's ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of a tokenizer (the EOS
    entry a list when it has several stop ids); none for no tokenizer."""
    if tokenizer is None:
        return {}
    eos = getattr(tokenizer, "eos_id", None)
    stops = [int(i) for i in getattr(tokenizer, "stop_ids", ()) or (() if eos is None else (eos,))]
    # a PAD id the tokenizer does not name (HFTokenizer falls back to EOS, or 0) is not written
    pad = getattr(tokenizer, "pad_id", None) if getattr(tokenizer, "pad_named", True) else None
    ids = {"bos_token_id": getattr(tokenizer, "bos_id", None), "pad_token_id": pad,
           "eos_token_id": stops[0] if len(stops) == 1 else (stops or None)}
    # None where the tokenizer has no such token: written as null, so an old generation
    # config's id (a BOS the new tokenizer lacks) does not survive
    return {k: (v if v is None or isinstance(v, list) else int(v)) for k, v in ids.items()}


def save_hf(
    model: Transformer,
    path: str | os.PathLike,
    *,
    family: str | None = None,
    max_shard_bytes: int = 5 * 1024**3,
) -> Path:
    """Write ``model`` as a HF directory that `transformers.AutoModelForCausalLM` loads.

    family: ``llama | qwen2 | qwen3 | mistral`` (default: ``model.config.family``).
    Tensors are written in ``config.param_dtype``; above ``max_shard_bytes`` the
    weights are split into numbered shards with an index file.

    An existing ``path`` is replaced atomically: the new directory is written beside it
    and swapped in, so ``path`` holds the complete old or new model at every moment. Other
    files of the old directory are carried over; its weights (``*.safetensors``, the index,
    a jaxlm checkpoint's ``config/`` and ``params/``) are not, nor its tokenizer files when
    ``model`` has a tokenizer of its own. The tokenizer's BOS, PAD and end-of-sequence ids
    (all of them, as a list when there are several) go into ``config.json`` and
    ``generation_config.json`` (an old one's other settings kept), so `transformers`'
    ``generate`` stops where jaxlm's does.
    """
    from safetensors.numpy import save_file

    config = model.config
    fam = FAMILIES[family or config.family]
    hf_config = config_to_hf(config, fam)
    path = Path(path)
    special_ids = _special_token_ids(model.tokenizer)
    hf_config.update({k: v for k, v in special_ids.items() if v is not None})
    carried = getattr(model, "hf_generation_config", None)
    if model.tokenizer is None and carried:  # no tokenizer: the ids the model was loaded with
        hf_config.update({k: v for k, v in json.loads(carried).items() if k in _SPECIAL_IDS and v is not None})

    tensors: dict[str, np.ndarray] = {}
    for name, value in flat_params(model).items():
        mapped = fam.to_hf(name)
        if mapped is None:
            raise ValueError(f"parameter {name!r} has no {fam.architecture} tensor; this model cannot be saved as HF")
        hf_name, transpose = mapped
        if not isinstance(value, (jax.Array, np.ndarray)):
            raise UnsupportedConfigError(
                f"parameter {name!r} is a {type(value).__name__} (a quantized or transformed weight); HF "
                "safetensors hold plain tensors, so this model cannot be saved as HF: save it with "
                "jaxlm.save_checkpoint instead"
            )
        array = np.asarray(jax.device_get(value))
        tensors[hf_name] = np.ascontiguousarray(array.T if transpose else array)

    shards: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if sizes[-1] and sizes[-1] + nbytes > max_shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensors[name]
        sizes[-1] += nbytes
    metadata = {"format": "pt"}
    with atomic_directory(path, overwrite=True) as staging:
        if len(shards) == 1:
            save_file(shards[0], str(staging / "model.safetensors"), metadata=metadata)
        else:
            weight_map = {}
            for k, shard in enumerate(shards, 1):
                fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(staging / fname), metadata=metadata)
                weight_map.update({name: fname for name in shard})
            index = {"metadata": {"total_size": int(sum(sizes))}, "weight_map": weight_map}
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
        if special_ids or carried:
            try:  # an old generation config's other settings (sampling defaults) are kept
                generation = _read_json(path / GENERATION_CONFIG)
            except CheckpointError:  # none there: the one the model was loaded with, if any
                generation = json.loads(carried) if carried else {}
            generation = {**generation, **special_ids}
            (staging / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2, sort_keys=True))
        if model.tokenizer is not None:  # the model's own tokenizer replaces the old one's files
            save_tokenizer(model.tokenizer, staging)
        _carry_over(path, staging, skip=_TOKENIZER_FILES if model.tokenizer is not None else ())
    return path
