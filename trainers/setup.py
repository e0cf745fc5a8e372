"""What every training run sets up before its first step, whatever the algorithm: the
tokenizer, the initial model (random init or ``init_from``'s weights), the device mesh and
the check that a resumed run is the run its directory holds."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

import jaxlm
from jaxlm.data.tokenizers import ByteTokenizer, load_tokenizer
from jaxlm.models.params import flat_params, init_params, model_from_flat, param_shapes
from jaxlm.models.transformer import Transformer
from jaxlm.sharding import make_mesh
from trainers.config import ConfigError, ExperimentConfig

log = logging.getLogger(__name__)

#: fields that may differ when a run is resumed: they change how, not what, is computed
RESUMABLE_FIELDS = frozenset({"trainer.stop_after", "trainer.progress", "trainer.out_dir"})


def make_tokenizer(spec: str):
    """``"byte"`` (the embedded default) or a directory holding ``tokenizer.json``."""
    if spec == "byte":
        return ByteTokenizer()
    tok = load_tokenizer(spec)
    if tok is None:
        raise ConfigError(f"tokenizer={spec!r}: no tokenizer.json in that directory (or use 'byte')")
    return tok


#: a text whose ids two tokenizers must agree on to be the same vocabulary
TOKENIZER_PROBE = "The quick brown fox, 12 + 30 = 42.\n{\"a\": [1, 2]}"


def check_same_tokenizer(theirs, ours, what: str) -> None:
    """``theirs`` (a checkpoint's tokenizer; None: nothing to compare) must give the ids
    ``ours`` gives for a probe text: weights trained under one vocabulary are meaningless
    under another of the same size."""
    if theirs is None or ours is None:
        return
    a, b = list(theirs.encode(TOKENIZER_PROBE)), list(ours.encode(TOKENIZER_PROBE))
    if a != b:
        raise ConfigError(f"{what} uses a different tokenizer than this run's (the probe text encodes to "
                          f"{a[:8]}... vs {b[:8]}...)")


def initial_model(cfg: ExperimentConfig) -> Transformer:
    """Random init, or ``init_from``'s weights loaded into ``cfg.model`` (its variant-only
    parameters keep their initial, neutral values)."""
    if not cfg.init_from:
        return jaxlm.build_model(cfg.model, seed=cfg.trainer.seed)
    loaded = jaxlm.load_model(cfg.init_from)
    theirs = loaded.tokenizer
    base = flat_params(loaded)
    del loaded
    expected = param_shapes(cfg.model)
    for name, value in base.items():
        if name not in expected or tuple(expected[name].shape) != tuple(value.shape):
            want = tuple(expected[name].shape) if name in expected else "absent"
            raise ConfigError(
                f"init_from={cfg.init_from!r}: parameter {name!r} {tuple(value.shape)} does not fit "
                f"model ({want}); make model match the checkpoint's shapes"
            )
    missing = [n for n in expected if n not in base]
    # a layer the checkpoint does not have is not a variant's parameter: it would start random
    layer_of = lambda n: (m.group(0) if (m := re.match(r"(.*?\blayers\.\d+\.)", n)) else None)  # noqa: E731
    have = {layer_of(n) for n in base} - {None}
    new_layers = sorted({layer_of(n) for n in missing} - {None} - have)
    if new_layers:
        raise ConfigError(
            f"init_from={cfg.init_from!r}: model has layers the checkpoint lacks ({', '.join(x + '*' for x in new_layers[:4])}"
            f"{', ...' if len(new_layers) > 4 else ''}): make model.n_layers match the checkpoint's")
    # a tied checkpoint's output layer is its embedding: an untied model starts from that copy
    untied = {n: n[: -len("lm_head.kernel")] + "embed" for n in missing if n.endswith("lm_head.kernel")}
    for head, embed in untied.items():
        if embed not in base or tuple(np.shape(base[embed]))[::-1] != tuple(expected[head].shape):
            raise ConfigError(f"init_from={cfg.init_from!r}: model has {head!r}, which the checkpoint lacks and "
                              f"cannot be taken from its embedding {embed!r}")
        base[head] = base[embed].T
        log.info("init_from %s: %s starts as the checkpoint's tied output layer (%s transposed)", cfg.init_from,
                 head, embed)
    missing = [n for n in missing if n not in untied]
    log.info("weights from %s; %d variant parameter(s) at their initial values", cfg.init_from, len(missing))
    model = model_from_flat(cfg.model, {**init_params(cfg.model, missing, seed=cfg.trainer.seed), **base})
    model.tokenizer = theirs  # the checkpoint's, for `check_same_tokenizer`
    return model


def check_vocabulary(model: Transformer, tokenizer) -> None:
    if model.config.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size={model.config.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({tokenizer.vocab_size})"
        )


def run_mesh(cfg: ExperimentConfig) -> Mesh:
    """``trainer.mesh`` over every device of every process."""
    m = cfg.trainer.mesh
    try:
        return make_mesh(m.data, m.fsdp, m.tensor)
    except ValueError as e:
        raise ConfigError(f"trainer.mesh={m}: {e}") from None


def check_batch_split(cfg: ExperimentConfig, mesh: Mesh) -> None:
    """``data.batch_size`` (global) splits into ``trainer.grad_accum`` micro-batches whose rows
    divide over the mesh's ``data`` x ``fsdp`` devices, and over the processes."""
    if cfg.data.batch_size % cfg.trainer.grad_accum:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size} is not divisible by "
                          f"trainer.grad_accum={cfg.trainer.grad_accum}")
    micro = cfg.data.batch_size // cfg.trainer.grad_accum
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if micro % shards:
        raise ConfigError(f"the micro-batch data.batch_size/trainer.grad_accum = {micro} is not divisible by the "
                          f"mesh's data x fsdp = {shards} devices")
    if cfg.data.batch_size % jax.process_count():
        raise ConfigError(f"data.batch_size={cfg.data.batch_size} is not divisible by the {jax.process_count()} "
                          "processes")


def check_trainable(cfg: ExperimentConfig, names: list[str]) -> None:
    """``optimizer.trainable`` must select at least one of the parameter ``names``."""
    if not cfg.optimizer.trainable:
        return
    trained = [n for n in names if re.search(cfg.optimizer.trainable, n)]
    if not trained:
        raise ConfigError(f"optimizer.trainable={cfg.optimizer.trainable!r} matches no parameter; e.g. {names[:5]}")
    log.info("training %d of %d parameter arrays", len(trained), len(names))


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def check_resume_config(stored: dict[str, Any], current: dict[str, Any], out_dir: Path) -> None:
    """A run directory is resumed only by the config that started it (up to `RESUMABLE_FIELDS`)."""
    a, b = _flatten(stored), _flatten(current)
    diffs = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and k not in RESUMABLE_FIELDS)
    if diffs:
        shown = ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in diffs[:8])
        raise ConfigError(
            f"{out_dir} holds a run with a different config ({shown}); resume with the same "
            f"config or choose another trainer.out_dir"
        )


def initialize_distributed() -> None:
    """``jax.distributed.initialize()`` once, one process per host. Its arguments come from the
    cluster (SLURM, TPU, MPI, ... auto-detection) or from the environment:
    ``JAX_COORDINATOR_ADDRESS`` (host:port of process 0), ``JAX_NUM_PROCESSES`` and
    ``JAX_PROCESS_ID``. CPU processes exchange their collectives over gloo (TCP) unless
    ``JAX_CPU_COLLECTIVES_IMPLEMENTATION`` chooses another implementation (``mpi``)."""
    if jax.distributed.is_initialized():
        return
    kwargs = {}
    for var, arg in (("JAX_NUM_PROCESSES", "num_processes"), ("JAX_PROCESS_ID", "process_id")):
        if os.environ.get(var):
            try:
                kwargs[arg] = int(os.environ[var])
            except ValueError:
                raise ConfigError(f"{var}={os.environ[var]!r} must be an int") from None
    if not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
        # without cross-process collectives a CPU computation over several processes fails;
        # the setting only affects the CPU backend (GPU/TPU use their own collectives)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(**kwargs)
    except RuntimeError as e:
        if "must be called before" in str(e):
            raise ConfigError(
                "trainer.multihost=true: jax.distributed.initialize() must run before anything uses JAX "
                "(devices, arrays); start the run from a fresh process (jaxlm train --multihost) or call "
                "trainers.setup.initialize_distributed() first"
            ) from e
        raise
