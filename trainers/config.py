"""Experiment configs: typed frozen dataclasses, loaded from ``configs/*.py`` and overridden
from the command line.

A config file exposes ``get_config() -> ExperimentConfig``. Overrides are ``a.b=value``
strings; they are parsed and type-checked by `tyro` (an unknown key fails with the
closest valid keys, a badly typed value names the field and the expected type)::

    cfg = load_config("quickstart", ["model.n_layers=4", "trainer.steps=200"])
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import io
import json
import os
from pathlib import Path
from typing import Any, Literal, Sequence

import tyro

from jaxlm.data.pipeline import DataConfig
from jaxlm.models.config import ModelConfig


class ConfigError(ValueError):
    """A config file or an override is invalid."""


def _positive(owner: str, **values: Any) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{owner}.{name}={v!r} is invalid: must be a positive int")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (Loshchilov & Hutter 2019) with linear warmup, then cosine decay to
    ``min_lr_ratio * lr``; global-norm clipping at ``clip_norm`` (None = off)."""

    lr: float = 1e-3
    warmup_steps: int = 100
    schedule: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float | None = 1.0
    trainable: str = ""
    """Regex over parameter names (e.g. 'meta_gate' to train only MeGan's hypernetwork);
    empty = everything. Frozen parameters get no update and no optimizer state."""

    def __post_init__(self):
        if self.trainable:
            import re

            try:
                re.compile(self.trainable)
            except re.error as e:
                raise ValueError(f"OptimizerConfig.trainable={self.trainable!r} is not a valid regex: {e}") from None
        if not self.lr > 0:
            raise ValueError(f"OptimizerConfig.lr={self.lr!r} is invalid: must be > 0")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimizerConfig.warmup_steps={self.warmup_steps!r} must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"OptimizerConfig.min_lr_ratio={self.min_lr_ratio!r} must be in [0, 1]")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"OptimizerConfig.clip_norm={self.clip_norm!r} must be > 0 or None")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes; one may be -1 (= all remaining devices)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    steps: int = 1000
    grad_accum: int = 1
    """Micro-batches per step; data.batch_size must be divisible by it."""
    seed: int = 0
    out_dir: str = "runs/default"
    log_every: int = 10
    eval_every: int = 0
    """Evaluate every N steps (0: only at the end)."""
    eval_generate: int = 64
    """Held-out examples decoded greedily for task accuracy (0: loss only)."""
    eval_max_new_tokens: int = 16
    eval_attention_stats: bool = False
    """Also report attention entropy and first-token mass on the held-out batches."""
    save_every: int = 100
    keep_checkpoints: int = 3
    async_checkpoint: bool = True
    mesh: MeshConfig = MeshConfig()
    multihost: bool = False
    """Call jax.distributed.initialize() first (one process per host)."""
    progress: bool = True
    stop_after: int | None = None
    """End this invocation after N steps without a final checkpoint (a preemption, for tests)."""

    def __post_init__(self):
        _positive("TrainerConfig", steps=self.steps, grad_accum=self.grad_accum,
                  log_every=self.log_every, save_every=self.save_every,
                  keep_checkpoints=self.keep_checkpoints,
                  eval_max_new_tokens=self.eval_max_new_tokens)
        for name in ("eval_every", "eval_generate"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainerConfig.{name}={getattr(self, name)!r} must be >= 0")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning: next-token cross-entropy on trained tokens, each weighted
    by ``TOKEN_WEIGHTS[token_weights](batch, logits)`` (`trainers.losses`)."""

    name: Literal["sft"] = "sft"
    token_weights: str = "uniform"
    beta_l1: float = 0.0
    """MeGan regulariser: adds beta_l1 * sum |beta| (per real token) to the loss."""


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    model: ModelConfig = ModelConfig.tiny()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    trainer: TrainerConfig = TrainerConfig()
    algorithm: SFTConfig = SFTConfig()
    tokenizer: str = "byte"
    """'byte' (the embedded default) or a directory holding tokenizer.json."""
    init_from: str | None = None
    """Start from the weights of a HF directory or jaxlm checkpoint, loaded into `model` (which
    may add variant parameters, e.g. meta_swiglu; those start at their neutral init)."""

    def __post_init__(self):
        if self.data.batch_size % self.trainer.grad_accum:
            raise ValueError(
                f"data.batch_size={self.data.batch_size} is not divisible by "
                f"trainer.grad_accum={self.trainer.grad_accum}"
            )
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}"
            )
        from trainers.losses import TOKEN_WEIGHTS

        if self.algorithm.token_weights not in TOKEN_WEIGHTS:
            raise ValueError(
                f"algorithm.token_weights={self.algorithm.token_weights!r} is invalid: must be one of "
                f"{sorted(TOKEN_WEIGHTS)}"
            )

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))


def _load_module(name_or_path: str):
    path = Path(name_or_path)
    if path.suffix == ".py":
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        spec = importlib.util.spec_from_file_location(f"jaxlm_config_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(f"configs.{name_or_path}")
    except ModuleNotFoundError:
        import configs

        known = sorted(p.stem for p in Path(configs.__file__).parent.glob("*.py") if p.stem != "__init__")
        raise ConfigError(f"no config named {name_or_path!r}; known: {known} (or pass a .py path)") from None


def apply_overrides(config: ExperimentConfig, overrides: Sequence[str]) -> ExperimentConfig:
    """``["model.n_layers=4", ...]`` -> a new config, parsed and type-checked by tyro."""
    args: list[str] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is invalid: expected key=value (e.g. trainer.steps=100)")
        if value.lower() in ("true", "false"):
            value = value.capitalize()
        args += [f"--{key.strip()}", value]
    if not args:
        return config
    err = io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "400"  # keep tyro's messages on one line each
    try:
        with contextlib.redirect_stderr(err):
            return tyro.cli(
                type(config), default=config, args=args, use_underscores=True,
                config=(tyro.conf.AvoidSubcommands, tyro.conf.FlagConversionOff),
            )
    except SystemExit:
        raise ConfigError(_unbox(err.getvalue()) or f"invalid overrides {list(overrides)}") from None
    except ValueError as e:  # a config's own validation (e.g. n_heads not divisible)
        raise ConfigError(str(e)) from None
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns


def _unbox(text: str) -> str:
    """tyro's boxed message as plain lines."""
    lines = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "╭╰" or set(line) <= set("│─ "):
            continue
        lines.append(line.strip("│").strip())
    return "\n".join(l for l in lines if l and not l.startswith("For full helptext"))


def load_config(name_or_path: str, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """``configs/<name>.py`` (or any ``.py`` path) -> ``get_config()`` -> overrides applied."""
    module = _load_module(name_or_path)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"{name_or_path} has no get_config() function")
    config = module.get_config()
    if not isinstance(config, ExperimentConfig):
        raise ConfigError(f"{name_or_path}: get_config() returned {type(config).__name__}, not ExperimentConfig")
    return apply_overrides(config, overrides)
