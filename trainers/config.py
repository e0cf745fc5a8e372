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
from trainers.rl.environments import RPSConfig


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
    sem_lambda: float = 0.0
    """Selective entropy minimisation (ReQAT): adds sem_lambda * (1/N) sum_t w_t H_t (reference 0.01; README 0.1)."""
    sem_threshold: float = 0.25
    """SEM: tau is the floor(N * sem_threshold)-th smallest token entropy (reference 0.25; README 0.75)."""

    def __post_init__(self):
        if not self.sem_lambda >= 0:
            raise ValueError(f"algorithm.sem_lambda={self.sem_lambda!r} is invalid: must be >= 0")
        if not 0 < self.sem_threshold <= 1:
            raise ValueError(f"algorithm.sem_threshold={self.sem_threshold!r} is invalid: must be in (0, 1]")


@dataclasses.dataclass(frozen=True)
class PrefixConfig:
    """PrefixRL (Setlur et al. 2026, method card B.1; `trainers.rl.prefix`): GRPO on hard
    problems prefixed with the start of a correct trace. Setting ``GRPOConfig.prefix`` makes
    the single_turn collector build the trace pool and choose the prefixes with the base
    policy before the first iteration."""

    problems: int = 64
    """Hard training problems: train examples 0 .. problems-1 of data.source."""
    trace_source: Literal["policy", "reference", "both"] = "policy"
    """Correct traces: rejection-sampled from the base policy, the task's reference solution
    (a trace from another source, which the paper allows), or both."""
    pool_samples: int = 64
    """Rejection-sampling budget per problem (trace_source policy/both)."""
    pass_rate_samples: int = 16
    """Samples per (problem, prefix) for the base pass-rate estimate."""
    fractions: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    """Candidate cut points, as fractions of the trace's tokens [INFERRED]."""
    band_lo: float = 0.2
    band_hi: float = 0.8
    """Keep the cut whose base pass rate lies in [band_lo, band_hi], closest to the band's
    centre [INFERRED]; problems without one are dropped."""
    recalibrate_every: int = 0
    """Re-choose the cuts with the current policy every N iterations, a curriculum toward
    shorter prefixes as it improves (card B.1, optional [INFERRED]); 0 = never."""
    rows_per_call: int = 256
    """Sequences per sampler call while building the pool and estimating pass rates."""

    def __post_init__(self):
        if self.trace_source not in ("policy", "reference", "both"):
            raise ValueError(f"PrefixConfig.trace_source={self.trace_source!r} must be policy | reference | both")
        _positive("PrefixConfig", problems=self.problems, pass_rate_samples=self.pass_rate_samples,
                  rows_per_call=self.rows_per_call)
        if self.trace_source != "reference":
            _positive("PrefixConfig", pool_samples=self.pool_samples)
        if isinstance(self.recalibrate_every, bool) or not isinstance(self.recalibrate_every, int) \
                or self.recalibrate_every < 0:
            raise ValueError(f"PrefixConfig.recalibrate_every={self.recalibrate_every!r} must be an int >= 0")
        if not self.fractions or not all(0 < f < 1 for f in self.fractions):
            raise ValueError(f"PrefixConfig.fractions={self.fractions!r} must be non-empty, each in (0, 1)")
        if not 0 <= self.band_lo <= self.band_hi <= 1:
            raise ValueError(
                f"PrefixConfig.band_lo={self.band_lo!r}, band_hi={self.band_hi!r}: need 0 <= band_lo <= band_hi <= 1"
            )


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Group-relative policy optimisation (Shao et al. 2024) and its variants, assembled from
    the registries in `trainers.rl` by name. One iteration: ``data.batch_size`` prompts x
    ``num_generations`` rollouts, rewards, advantages, then ``mu`` epochs of ``minibatches``
    optimizer steps over the rollouts with the log-probs recorded before the first update."""

    name: Literal["grpo"] = "grpo"
    collector: str = "single_turn"
    """Where rollouts come from (`trainers.rl.collectors.COLLECTORS`): single_turn samples the
    data source's prompts; multi-turn environments register their own."""
    num_generations: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float | None = None
    advantage: str = "grpo"
    """grpo | dr_grpo | rloo | turn_level (`trainers.rl.advantages.ADVANTAGES`)."""
    adv_eps: float = 1e-6
    turn_gamma: float | None = None
    """turn_level only: per-turn rewards -> returns-to-go with this discount (None: per-turn reward)."""
    policy_loss: str = "ppo_clip"
    """ppo_clip | gspo (`POLICY_LOSSES`)."""
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    aggregation: str = "token_mean"
    """token_mean | seq_mean_token_mean | seq_mean_token_sum_norm (`AGGREGATORS`)."""
    beta: float = 0.0
    """KL-to-reference coefficient (0: no reference model is kept)."""
    kl_estimator: str = "k3"
    """k1 | k2 | k3 | k3+ (`KL_ESTIMATORS`)."""
    mu: int = 1
    """Optimisation epochs over each batch of rollouts."""
    minibatches: int = 1
    """Optimizer steps per epoch (the rollouts are split into this many minibatches)."""
    rewards: tuple[str, ...] = ("verifier",)
    """Reward functions (`trainers.rl.rewards.REWARDS`), summed with ``reward_weights``."""
    reward_weights: tuple[float, ...] = (1.0,)
    filter_zero_variance: bool = False
    """Dynamic sampling (DAPO): groups whose rewards are all equal carry no loss."""
    use_sampler_logprobs: bool = False
    """Use the sampler's log-probs as the old policy's (skip the recompute), as Tunix allows."""
    tis_cap: float | None = None
    """Truncated importance sampling: weight tokens by min(pi_old/pi_sampler, cap)."""
    buffer_sampler: str = "uniform"
    """How minibatches are drawn from the rollouts (`trainers.rl.buffer.BUFFER_SAMPLERS`)."""
    qpas_quantile: float = 0.25
    qpas_alpha: float = 1.0
    qpas_beta: float = 1.0
    ccc_invalid_reward: float = -1.0
    """CCC-GRPO (reward ``ccc``): the reward of a rollout whose answer does not parse, r_min
    ([INFERRED] in the method card B.2; -1 is the worst CCC)."""
    cf_quality: float = 1.0
    """counterfactual_bonus: only rollouts whose verifier reward is >= this get the bonus."""
    logprob_chunk: int = 256
    """Rows of logits materialised at a time in the log-prob / entropy computation."""
    shared_prompt_forward: bool = True
    """Log-probs and gradients run each distinct prompt once (its keys/values gathered into the
    G rollouts that continue it) instead of once per rollout; the same loss, less compute.
    Used when the collector's rows share a prompt block (single-turn and PrefixRL)."""
    prefix: PrefixConfig | None = None
    """PrefixRL (B.1): train on problems prefixed with part of a correct trace (None: off)."""
    environment: RPSConfig | None = None
    """Multi-turn collectors' environment (rps_memory: MemoPilot's Rock-Paper-Scissors)."""

    def __post_init__(self):
        from trainers.rl.registries import check_grpo_config

        check_grpo_config(self)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    model: ModelConfig = ModelConfig.tiny()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    trainer: TrainerConfig = TrainerConfig()
    algorithm: SFTConfig | GRPOConfig = SFTConfig()
    tokenizer: str = "byte"
    """'byte' (the embedded default) or a directory holding tokenizer.json."""
    init_from: str | None = None
    """Start from the weights of a HF directory or jaxlm checkpoint, loaded into `model` (which
    may add variant parameters, e.g. meta_swiglu; those start at their neutral init)."""

    def __post_init__(self):
        if not isinstance(self.algorithm, GRPOConfig) and self.data.batch_size % self.trainer.grad_accum:
            raise ValueError(
                f"data.batch_size={self.data.batch_size} is not divisible by "
                f"trainer.grad_accum={self.trainer.grad_accum}"
            )
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}"
            )
        from trainers.losses import TOKEN_WEIGHTS

        if isinstance(self.algorithm, GRPOConfig):
            if self.data.batch_size * self.algorithm.num_generations % (
                self.algorithm.minibatches * self.trainer.grad_accum
            ):
                raise ValueError(
                    f"data.batch_size x algorithm.num_generations = "
                    f"{self.data.batch_size * self.algorithm.num_generations} rollouts are not divisible "
                    f"by algorithm.minibatches x trainer.grad_accum = "
                    f"{self.algorithm.minibatches * self.trainer.grad_accum}"
                )
        elif self.algorithm.token_weights not in TOKEN_WEIGHTS:
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


def _optional_section(obj: Any, name: str) -> type | None:
    """The dataclass ``X`` when field ``name`` of dataclass ``obj`` is declared ``X | None``."""
    import types
    import typing

    hint = typing.get_type_hints(type(obj)).get(name)
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if type(None) in typing.get_args(hint) and len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _replace_path(obj: Any, parts: list[str], value: Any) -> Any:
    if not parts:
        return value
    head = getattr(obj, parts[0])
    return dataclasses.replace(obj, **{parts[0]: _replace_path(head, parts[1:], value)})


def _switch_optional_sections(config: ExperimentConfig, items: list[tuple[str, str]]):
    """Optional sections (``algorithm.prefix``, ``algorithm.environment``: ``X | None``) are
    switched here, before tyro sees the rest: ``algorithm.prefix=None`` turns one off, and an
    override of a field inside a section that is None (``algorithm.prefix.problems=32``) turns it
    on with its defaults first. Returns the config and the overrides still to apply."""
    rest = []
    for key, value in items:
        parts = key.split(".")
        obj, consumed = config, False
        for i, name in enumerate(parts):
            if not dataclasses.is_dataclass(obj) or not hasattr(obj, name):
                break
            section = _optional_section(obj, name)
            if section is not None and i == len(parts) - 1 and value in ("None", "none", "null"):
                config, consumed = _replace_path(config, parts, None), True
                break
            if section is not None and i < len(parts) - 1 and getattr(obj, name) is None:
                config = _replace_path(config, parts[: i + 1], section())
            obj = _walk(config, parts[: i + 1])
        if not consumed:
            rest.append((key, value))
    return config, rest


def _walk(obj: Any, parts: list[str]) -> Any:
    for name in parts:
        obj = getattr(obj, name)
    return obj


def apply_overrides(config: ExperimentConfig, overrides: Sequence[str]) -> ExperimentConfig:
    """``["model.n_layers=4", ...]`` -> a new config, parsed and type-checked by tyro."""
    items: list[tuple[str, str]] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is invalid: expected key=value (e.g. trainer.steps=100)")
        items.append((key.strip(), value))
    try:
        config, items = _switch_optional_sections(config, items)
    except ValueError as e:  # a section's own validation
        raise ConfigError(str(e)) from None
    args: list[str] = []
    for key, value in items:
        if value.lower() in ("true", "false"):
            value = value.capitalize()
        args += [f"--{key}", value]
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
