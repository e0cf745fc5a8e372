"""The run harness: `train(config)` sets up, runs, evaluates, checkpoints, resumes and plots
any registered algorithm (`trainers.algorithm.ALGORITHMS`: SFT, GRPO, ...).

Setup, once per run: ``jax.distributed.initialize()`` with ``trainer.multihost``, the
output directory and its lock (a second run on it is refused, `jaxlm.fileio.DirectoryLock`),
the tokenizer (and the check that the model's vocabulary holds it), the initial model
(random init or ``init_from``), the mesh, then the algorithm named by ``cfg.algorithm.name``
and its step-0 state.

Restarting with the same config resumes from the newest checkpoint in
``trainer.out_dir/checkpoints`` that verifies against its digest (older ones are tried when
one is corrupt) and continues bit-identically: the state and the algorithm's data state
(e.g. the data iterator's position) are restored exactly. A different config is refused
(``config.json``, or the copy in the checkpoint when that file is unreadable). Re-running a
finished run changes nothing. A non-finite loss or gradient stops with `TrainingDiverged`;
checkpoints written before it stay intact. At the end the run directory holds
``checkpoints/``, ``model/`` (a jaxlm checkpoint that `jaxlm generate` and `jaxlm eval`
load, written atomically), ``metrics.jsonl``, ``tensorboard/``, ``curves.png`` and
``config.json``. docs/reliability.md describes what survives a kill at each moment.

Hooks (``train(cfg, hooks=[...])``) are called after every step with a `StepEnd`: live
plots in a notebook, extra logging, early stopping (a hook returning True stops the run
like ``trainer.stop_after``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

import jaxlm
import trainers.diffusion  # noqa: F401  (registers the "diffusion" algorithm)
import trainers.omni  # noqa: F401  (registers the "omni" algorithm)
import trainers.rl.loop  # noqa: F401  (registers the "grpo" algorithm)
import trainers.sft  # noqa: F401  (registers the "sft" algorithm)
from jaxlm.fileio import (
    DirectoryLock,
    JSONFileError,
    atomic_write_text,
    read_json,
    read_jsonl,
    recover_directory,
)
from jaxlm.models.omni import is_omni_checkpoint
from trainers.algorithm import ALGORITHMS, Algorithm, RunSetup
from trainers.checkpointing import CheckpointCorruptError, TrainCheckpointer, abstract_like
from trainers.config import ConfigError, ExperimentConfig
from trainers.logger import MetricsLogger
from trainers.setup import (
    check_resume_config,
    check_same_tokenizer,
    check_vocabulary,
    initial_model,
    initialize_distributed,
    make_tokenizer,
    run_mesh,
)
from trainers.step import TrainState

log = logging.getLogger(__name__)

__all__ = ["StepEnd", "TrainResult", "TrainingDiverged", "initial_model", "make_tokenizer", "train"]


class TrainingDiverged(RuntimeError):
    """The loss or the gradient became NaN/Inf."""


@dataclasses.dataclass
class TrainResult:
    out_dir: Path
    step: int
    final_eval: dict[str, Any]
    samples: list[dict[str, Any]]
    stopped_early: bool = False


@dataclasses.dataclass
class StepEnd:
    """What a hook sees after step ``step`` (1-based: steps done so far)."""

    step: int
    state: TrainState
    metrics: dict[str, Any]
    algorithm: Algorithm
    logger: MetricsLogger


Hook = Callable[[StepEnd], Any]


def train(cfg: ExperimentConfig, *, hooks: Sequence[Hook] = (), data_iterator_wrapper=None) -> TrainResult:
    """Run (or resume) the experiment ``cfg``. ``hooks``: called after every step (a hook that
    returns True ends the run early, without the final evaluation and save).
    ``data_iterator_wrapper`` (tests) wraps an algorithm's batch iterator (``algorithm.batches``)."""
    t = cfg.trainer
    if t.multihost:
        initialize_distributed()
    out_dir = Path(t.out_dir)
    # paths the run reads, checked before the lock creates out_dir (a usage error left it behind)
    if cfg.init_from and not Path(cfg.init_from).exists():
        raise ConfigError(f"init_from={cfg.init_from!r} does not exist")
    if cfg.tokenizer != "byte" and not Path(cfg.tokenizer).exists():
        raise ConfigError(f"tokenizer={cfg.tokenizer!r} does not exist: 'byte' or a directory holding tokenizer.json")
    lock = DirectoryLock(out_dir, what=f"training run ({cfg.algorithm.name})", process_index=jax.process_index())
    with lock:
        return _run(cfg, out_dir, hooks, data_iterator_wrapper)


def _stored_config(out_dir: Path, ckpt: TrainCheckpointer, step: int) -> dict[str, Any] | None:
    """The config a run directory was started with: ``config.json``, else (missing or
    unreadable) the copy saved with checkpoint ``step``, else with the newest older checkpoint
    whose copy reads (every checkpoint of a run holds the same config)."""
    try:
        return read_json(out_dir / "config.json", what="the run's config")
    except FileNotFoundError:
        pass
    except JSONFileError as e:
        log.warning("%s; using the config stored with checkpoint step %d instead", e, step)
    candidates = [step, *sorted((s for s in ckpt.all_steps() if s < step), reverse=True)]
    for candidate in candidates[:-1]:
        try:
            return ckpt.stored_config(candidate)
        except CheckpointCorruptError as e:
            log.warning("%s; trying an older checkpoint's copy", e)
    return ckpt.stored_config(candidates[-1])


def _has_model(path: Path) -> bool:
    """``path`` holds a complete jaxlm (or omni) checkpoint (models are swapped in whole, so a
    present directory is complete once a half-done swap is finished:
    `jaxlm.fileio.recover_directory`)."""
    recover_directory(path)
    return ((path / "config").is_dir() and (path / "params").is_dir()) or is_omni_checkpoint(path)


def _finished(out_dir: Path, start: int, steps: int, logger: MetricsLogger) -> bool:
    """The run in ``out_dir`` is complete: resumed at its last step, with its model saved and
    its final evaluation logged (decided on process 0, which holds the metrics, for all)."""
    done = start == steps and _has_model(out_dir / "model") and logger.logged(start, "eval")
    if jax.process_count() > 1:
        done = bool(np.asarray(multihost_utils.broadcast_one_to_all(np.int32(done))))
    return done


def _finished_eval(logger: MetricsLogger, step: int) -> dict[str, Any]:
    """The final evaluation record of a finished run (from ``metrics.jsonl``)."""
    records = read_jsonl(logger.jsonl, warn=False).records
    last = [r for r in records if r.get("kind") == "eval" and r.get("step") == step]
    return {k: v for k, v in (last[-1] if last else {}).items() if k not in ("step", "kind", "time")}


def _run(cfg: ExperimentConfig, out_dir: Path, hooks: Sequence[Hook], data_iterator_wrapper) -> TrainResult:
    t = cfg.trainer
    tokenizer = make_tokenizer(cfg.tokenizer)
    model = initial_model(cfg)
    if cfg.init_from:  # its weights were trained under its own tokenizer's ids
        check_same_tokenizer(model.tokenizer, tokenizer,
                             f"init_from={cfg.init_from!r} (pass its tokenizer directory as tokenizer=)")
    check_vocabulary(model, tokenizer)
    model.tokenizer = tokenizer
    if cfg.algorithm.name not in ALGORITHMS:
        raise ConfigError(f"algorithm.name={cfg.algorithm.name!r} is not a registered training algorithm: "
                          f"must be one of {sorted(ALGORITHMS)} (trainers.algorithm.ALGORITHMS)")
    algo: Algorithm = ALGORITHMS[cfg.algorithm.name](RunSetup(cfg=cfg, model=model, tokenizer=tokenizer,
                                                              mesh=run_mesh(cfg)))
    state = algo.init_state()
    del model  # the algorithm holds what it needs

    with contextlib.ExitStack() as stack:
        ckpt = TrainCheckpointer(out_dir / "checkpoints", keep=t.keep_checkpoints, async_save=t.async_checkpoint)
        stack.callback(ckpt.close)
        start, state = _resume(cfg, out_dir, ckpt, algo, state)
        if data_iterator_wrapper is not None:
            if not hasattr(algo, "batches"):
                raise ConfigError(f"algorithm {cfg.algorithm.name!r} has no batch iterator to wrap")
            algo.batches = data_iterator_wrapper(algo.batches)
        logger = MetricsLogger(out_dir, total_steps=t.steps, start_step=start, progress=t.progress,
                               process_index=jax.process_index())
        stack.callback(logger.close)
        if _finished(out_dir, start, t.steps, logger):
            log.info("%s already finished at %s %d; nothing to do", out_dir, algo.unit, start)
            return TrainResult(out_dir=out_dir, step=start, final_eval=_finished_eval(logger, start), samples=[])
        return _loop(cfg, out_dir, algo, state, start, ckpt, logger, hooks)


def _resume(cfg: ExperimentConfig, out_dir: Path, ckpt: TrainCheckpointer, algo: Algorithm, state: TrainState):
    """``(start step, state)``: the newest checkpoint that verifies, if the run directory
    holds this config's run (else `ConfigError`); ``config.json`` written."""
    config_dict = cfg.to_dict()
    start = 0
    latest = ckpt.latest_step()
    if latest is not None:
        check_resume_config(_stored_config(out_dir, ckpt, latest), config_dict, out_dir)
    elif (out_dir / "config.json").exists():  # started, no checkpoint yet: its logs are this config's
        check_resume_config(read_json(out_dir / "config.json", what="the run's config"), config_dict, out_dir)
    if latest is not None:
        restored = ckpt.restore_verified(abstract_like(state))
        if restored is not None:
            start, state, data_state = restored
            algo.load_data_state(data_state)
            log.info("resumed from %s %d", algo.unit, start)
    if jax.process_index() == 0:
        atomic_write_text(out_dir / "config.json", json.dumps(config_dict, indent=2))
    return start, state


def _loop(cfg: ExperimentConfig, out_dir: Path, algo: Algorithm, state: TrainState, start: int,
          ckpt: TrainCheckpointer, logger: MetricsLogger, hooks: Sequence[Hook]) -> TrainResult:
    """Steps ``start .. trainer.steps``: log, save, evaluate, stop; the final evaluation and model."""
    t = cfg.trainer
    config_dict = cfg.to_dict()

    def evaluate(k: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        with logger.untimed():  # not in the next record's tokens_per_s
            result, samples = algo.evaluate(state, k)
            logger.log(k, result, kind="eval")
        return result, samples

    k = start
    final_eval: dict[str, Any] = {}
    samples: list[dict[str, Any]] = []
    stopped_early = False
    logger.start_clock()
    if start == 0 and t.eval_every:
        evaluate(0)
    elif t.eval_every and 0 < start < t.steps and start % t.eval_every == 0:
        # resumed at a checkpoint whose periodic evaluation did not get logged (the run died
        # between the save and the evaluation): evaluate it now (decided on process 0, for all)
        missing = not logger.logged(start, "eval")
        if jax.process_count() > 1:
            missing = bool(np.asarray(multihost_utils.broadcast_one_to_all(np.int32(missing))))
        if missing:
            evaluate(start)
    while k < t.steps:
        batch, info = algo.batch(state, k)
        tokens = algo.tokens(batch)
        state, metrics = algo.step(state, batch)
        if not bool(metrics.pop("finite", True)):
            done = ckpt.latest_step()
            raise TrainingDiverged(
                f"non-finite loss or gradient at {algo.unit} {k + 1} (loss={float(metrics['loss'])}, "
                f"grad_norm={float(metrics['grad_norm'])}); training stopped. Last good checkpoint: "
                + (f"{algo.unit} {done} in {ckpt.directory}" if done is not None else "none yet")
            )
        k += 1
        logger.count_tokens(tokens)
        logger.advance()
        metrics = {**info, **metrics}
        if k % t.log_every == 0 or k == t.steps:
            logger.log(k, metrics)
        if k % t.save_every == 0 or k == t.steps:
            ckpt.save(k, state, algo.data_state(), config_dict)
        if t.eval_every and k % t.eval_every == 0 and k != t.steps:
            evaluate(k)
        end = StepEnd(step=k, state=state, metrics=metrics, algorithm=algo, logger=logger)
        stop = [bool(hook(end)) for hook in hooks]  # every hook runs, then any may stop the run
        if k < t.steps and (any(stop) or (t.stop_after is not None and k - start >= t.stop_after)):
            stopped_early = True
            break
    if not stopped_early:
        final_eval, samples = evaluate(k)
        ckpt.wait()
        if hasattr(algo, "save_model"):  # a model with parts beside the language model (omni)
            algo.save_model(state, out_dir / "model")
        else:
            jaxlm.save_checkpoint(algo.final_model(state), out_dir / "model", overwrite=True)
    return TrainResult(out_dir=out_dir, step=k, final_eval=final_eval, samples=samples, stopped_early=stopped_early)
