"""The training loop: `train(config)` runs, evaluates, checkpoints, resumes and plots.

Restarting with the same config resumes from the newest checkpoint in
``trainer.out_dir/checkpoints`` and continues bit-identically (the state and the data
iterator's position are restored exactly). A non-finite loss or gradient stops with
`TrainingDiverged`; checkpoints written before it stay intact. At the end the run
directory holds ``checkpoints/``, ``model/`` (a jaxlm checkpoint that `jaxlm generate`
and `jaxlm eval` load), ``metrics.jsonl``, ``tensorboard/``, ``curves.png`` and
``config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import jaxlm
from jaxlm.data.pipeline import eval_batches, eval_examples, train_dataset
from jaxlm.data.tokenizers import ByteTokenizer, load_tokenizer
from jaxlm.sharding import make_mesh, model_shardings
from trainers.checkpointing import TrainCheckpointer, abstract_like
from trainers.config import ConfigError, ExperimentConfig
from trainers.evaluate import heldout_metrics, task_accuracy
from trainers.logger import MetricsLogger
from trainers.losses import TOKEN_WEIGHTS
from trainers.optim import make_optimizer, param_names
from trainers.step import init_state, make_eval_loss, make_train_step

log = logging.getLogger(__name__)

# Fields that may differ when a run is resumed: they change how, not what, is computed.
_RESUMABLE_DIFFS = {"trainer.stop_after", "trainer.progress"}


class TrainingDiverged(RuntimeError):
    """The loss or the gradient became NaN/Inf."""


@dataclasses.dataclass
class TrainResult:
    out_dir: Path
    step: int
    final_eval: dict[str, Any]
    samples: list[dict[str, Any]]
    stopped_early: bool = False


def make_tokenizer(spec: str):
    if spec == "byte":
        return ByteTokenizer()
    tok = load_tokenizer(spec)
    if tok is None:
        raise ConfigError(f"tokenizer={spec!r}: no tokenizer.json in that directory (or use 'byte')")
    return tok


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def _check_resume_config(stored: dict[str, Any], current: dict[str, Any], out_dir: Path) -> None:
    a, b = _flatten(stored), _flatten(current)
    diffs = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and k not in _RESUMABLE_DIFFS)
    if diffs:
        shown = ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in diffs[:8])
        raise ConfigError(
            f"{out_dir} holds a run with a different config ({shown}); resume with the same "
            f"config or choose another trainer.out_dir"
        )


def initial_model(cfg: ExperimentConfig):
    """Random init, or ``init_from``'s weights loaded into ``cfg.model`` (its variant-only
    parameters keep their initial, neutral values)."""
    if not cfg.init_from:
        return jaxlm.build_model(cfg.model, seed=cfg.trainer.seed)
    from jaxlm.models.params import flat_params, init_params, model_from_flat, param_shapes

    base = flat_params(jaxlm.load_model(cfg.init_from))
    expected = param_shapes(cfg.model)
    for name, value in base.items():
        if name not in expected or tuple(expected[name].shape) != tuple(value.shape):
            want = tuple(expected[name].shape) if name in expected else "absent"
            raise ConfigError(
                f"init_from={cfg.init_from!r}: parameter {name!r} {tuple(value.shape)} does not fit "
                f"model ({want}); make model match the checkpoint's shapes"
            )
    missing = [n for n in expected if n not in base]
    log.info("weights from %s; %d variant parameter(s) at their initial values", cfg.init_from, len(missing))
    return model_from_flat(cfg.model, {**init_params(cfg.model, missing, seed=cfg.trainer.seed), **base})


def train(cfg: ExperimentConfig, *, data_iterator_wrapper=None) -> TrainResult:
    """Run (or resume) the experiment ``cfg``. ``data_iterator_wrapper`` (tests) wraps the
    training iterator."""
    from trainers.config import GRPOConfig

    if isinstance(cfg.algorithm, GRPOConfig):
        from trainers.rl.loop import train_grpo

        return train_grpo(cfg)
    t = cfg.trainer
    if t.multihost:
        jax.distributed.initialize()
    out_dir = Path(t.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config_dict = cfg.to_dict()

    tokenizer = make_tokenizer(cfg.tokenizer)
    model = initial_model(cfg)
    if model.config.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size={model.config.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({tokenizer.vocab_size})"
        )
    model.tokenizer = tokenizer

    mesh = make_mesh(t.mesh.data, t.mesh.fsdp, t.mesh.tensor)
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if (cfg.data.batch_size // t.grad_accum) % batch_shards:
        raise ConfigError(
            f"the micro-batch data.batch_size/trainer.grad_accum = {cfg.data.batch_size // t.grad_accum} "
            f"is not divisible by the mesh's data x fsdp = {batch_shards} devices"
        )
    graphdef, state = nnx.split(model)
    shardings = nnx.to_pure_dict(model_shardings(model, mesh))
    params = jax.device_put(nnx.to_pure_dict(state), shardings)
    tx, schedule = make_optimizer(cfg.optimizer, t.steps)
    if cfg.optimizer.trainable:
        import re

        names = [n for n in jax.tree.leaves(param_names(params))]
        trained = [n for n in names if re.search(cfg.optimizer.trainable, n)]
        if not trained:
            raise ConfigError(f"optimizer.trainable={cfg.optimizer.trainable!r} matches no parameter; e.g. {names[:5]}")
        log.info("training %d of %d parameter arrays", len(trained), len(names))
    train_state = init_state(params, tx, t.seed)
    replicated = NamedSharding(mesh, PartitionSpec())
    train_state = train_state.replace(
        step=jax.device_put(train_state.step, replicated), rng=jax.device_put(train_state.rng, replicated)
    )

    # data.batch_size is global: each process loads its share of every batch
    if cfg.data.batch_size % jax.process_count():
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} is not divisible by the {jax.process_count()} processes"
        )
    local_data = dataclasses.replace(cfg.data, batch_size=cfg.data.batch_size // jax.process_count())
    data = train_dataset(local_data, tokenizer, shard_index=jax.process_index(), shard_count=jax.process_count())
    data_it = iter(data)
    ckpt = TrainCheckpointer(out_dir / "checkpoints", keep=t.keep_checkpoints, async_save=t.async_checkpoint)
    latest = ckpt.latest_step()
    if latest is not None:
        stored = out_dir / "config.json"
        if stored.exists():
            _check_resume_config(json.loads(stored.read_text()), config_dict, out_dir)
        train_state, data_state = ckpt.restore(latest, abstract_like(train_state))
        data_it.set_state(data_state)
        log.info("resumed from step %d", latest)
    (out_dir / "config.json").write_text(json.dumps(config_dict, indent=2))
    if data_iterator_wrapper is not None:
        data_it = data_iterator_wrapper(data_it)

    batch_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))

    def place(batch):
        return {k: jax.make_array_from_process_local_data(batch_sharding, np.asarray(v)) for k, v in batch.items()}

    c = model.config
    step_fn = make_train_step(
        graphdef, tx, schedule, grad_accum=t.grad_accum, sliding_window=c.sliding_window,
        weight_fn=TOKEN_WEIGHTS[cfg.algorithm.token_weights], beta_l1=cfg.algorithm.beta_l1,
        sem_lambda=cfg.algorithm.sem_lambda, sem_threshold=cfg.algorithm.sem_threshold,
    )
    eval_fn = make_eval_loss(graphdef, sliding_window=c.sliding_window, attention_stats=t.eval_attention_stats)
    heldout = eval_batches(cfg.data, tokenizer)
    examples, verify = eval_examples(cfg.data)
    examples = examples[: t.eval_generate]

    start = int(jax.device_get(train_state.step))
    logger = MetricsLogger(out_dir, total_steps=t.steps, start_step=start, progress=t.progress)

    def evaluate(step: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        result: dict[str, Any] = heldout_metrics(eval_fn, train_state.params, heldout, place)
        samples: list[dict[str, Any]] = []
        if verify is not None and examples:
            acc = task_accuracy(
                nnx.merge(graphdef, train_state.params), examples, verify, tokenizer=tokenizer,
                max_new_tokens=t.eval_max_new_tokens, batch_size=min(64, len(examples)),
            )
            result["accuracy"], samples = acc.accuracy, acc.samples
        logger.log(step, result, kind="eval")
        return result, samples

    step = start
    final_eval: dict[str, Any] = {}
    samples: list[dict[str, Any]] = []
    stopped_early = False
    try:
        while step < t.steps:
            batch = next(data_it)
            logger.count_tokens(float((batch["segment_ids"] > 0).sum()))
            train_state, metrics = step_fn(train_state, place(batch))
            metrics = jax.device_get(metrics)
            if not bool(metrics["finite"]):
                done = ckpt.latest_step()
                raise TrainingDiverged(
                    f"non-finite loss or gradient at step {step + 1} (loss={float(metrics['loss'])}, "
                    f"grad_norm={float(metrics['grad_norm'])}); training stopped. Last good checkpoint: "
                    + (f"step {done} in {ckpt.directory}" if done is not None else "none yet")
                )
            step += 1
            logger.advance()
            if step % t.log_every == 0 or step == t.steps:
                logger.log(step, {k: v for k, v in metrics.items() if k != "finite"})
            if step % t.save_every == 0 or step == t.steps:
                ckpt.save(step, train_state, data_it.get_state(), config_dict)
            if t.eval_every and step % t.eval_every == 0 and step != t.steps:
                evaluate(step)
            if t.stop_after is not None and step - start >= t.stop_after and step < t.steps:
                stopped_early = True
                break
        if not stopped_early:
            final_eval, samples = evaluate(step)
            ckpt.wait()
            final = nnx.merge(graphdef, train_state.params)
            final.tokenizer = tokenizer
            jaxlm.save_checkpoint(final, out_dir / "model", overwrite=True)
    finally:
        ckpt.close()
        logger.close()
    return TrainResult(out_dir=out_dir, step=step, final_eval=final_eval, samples=samples, stopped_early=stopped_early)
