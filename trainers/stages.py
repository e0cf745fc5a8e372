"""A stage schedule (pretrain -> mid-train -> SFT -> RL, PRISM-style) run back to back, each
stage starting from the previous stage's model, with a retention evaluation of every domain
after each stage.

    report = run_stages([Stage("pretrain", cfg_a), Stage("midtrain", cfg_b), ...], "runs/prism",
                        domains={"math": Arithmetic(), "general": MarkovText()})

Each stage is an `ExperimentConfig` run by the harness (`trainers.loop.train`) in
``out_dir/<stage name>``, so a re-run resumes or skips finished stages. The report (also
``out_dir/retention.json``) has, per stage and domain, the held-out loss (nats per trained
token, teacher-forced) and, for domains with a verifier, greedy accuracy.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.checkpoint import load_model
from jaxlm.data.pipeline import DataConfig, eval_batches
from jaxlm.data.tasks import Task
from jaxlm.eval import heldout_accuracy
from jaxlm.fileio import atomic_write_text
from jaxlm.models.omni import is_omni_checkpoint, load_omni
from trainers.config import ExperimentConfig
from trainers.loop import train
from trainers.step import make_eval_loss

#: the retention report's file name in ``out_dir`` (no stage may take it as its directory)
REPORT = "retention.json"


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage: a name (its directory) and the experiment it runs."""

    name: str
    config: ExperimentConfig

    def __post_init__(self):
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name) or self.name in (".", ".."):
            raise ValueError(f"Stage.name={self.name!r} must be a non-empty file name ([A-Za-z0-9_.-], not '.' or '..')")
        if not isinstance(self.config, ExperimentConfig):
            raise ValueError(f"Stage {self.name!r}: config must be an ExperimentConfig, got {type(self.config).__name__}")


def _check_retention_args(n, seq_len, max_new_tokens, n_name, seq_len_name):
    for name, v, optional in ((n_name, n, False), (seq_len_name, seq_len, True), ("max_new_tokens", max_new_tokens, False)):
        if v is None and optional:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} is invalid: must be an int >= 1")


def retention(model, domains: Mapping[str, Task], *, n: int = 100, seq_len: int | None = None,
              max_new_tokens: int = 8) -> dict[str, dict[str, float]]:
    """Per domain: held-out ``loss`` (rows of ``seq_len`` tokens; default 64, or the model's
    ``max_seq_len`` if shorter) and (where the task has a generative verifier) ``accuracy``."""
    _check_retention_args(n, seq_len, max_new_tokens, "n", "seq_len")
    limit = model.config.max_seq_len
    if seq_len is None:
        seq_len = min(64, limit)
    elif seq_len > limit:
        raise ValueError(f"retention: seq_len={seq_len} is more than the model's ModelConfig.max_seq_len={limit}")
    tok = model.tokenizer
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    eval_fn = make_eval_loss(graphdef, sliding_window=model.config.sliding_window)
    out: dict[str, dict[str, float]] = {}
    for name, task in domains.items():
        sums = {"loss": 0.0, "tokens": 0.0}
        for b in eval_batches(DataConfig(source=task, seq_len=seq_len, batch_size=min(n, 64), eval_examples=n), tok):
            got = jax.device_get(eval_fn(params, {k: jnp.asarray(v) for k, v in b.items()}))
            sums["loss"] += float(got["loss"])
            sums["tokens"] += float(got["tokens"])
        scores = {"loss": sums["loss"] / max(sums["tokens"], 1.0)}
        if getattr(task, "generative_eval", True):
            scores["accuracy"] = heldout_accuracy(model, task, n, max_new_tokens=max_new_tokens,
                                                  batch_size=min(n, 200)).accuracy
        out[name] = scores
    return out


def run_stages(stages: Sequence[Stage], out_dir: str | Path, *, domains: Mapping[str, Task], eval_n: int = 100,
               eval_seq_len: int | None = None, max_new_tokens: int = 8) -> list[dict[str, Any]]:
    """Run ``stages`` in order (each ``init_from`` the previous stage's model; the first keeps
    its own), evaluating every domain after each; returns and writes the retention report."""
    if not stages:
        raise ValueError("run_stages needs at least one Stage")
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise ValueError(f"stage names {names} repeat: each stage needs its own directory")
    if REPORT in names:  # its directory took the report's path: the report failed after every stage trained
        raise ValueError(f"a stage named {REPORT!r}: that is the path of the retention report in out_dir; "
                         "rename the stage")
    omni = [s.config.algorithm.name == "omni" for s in stages]
    if any(a and b for a, b in zip(omni, omni[1:])):
        raise ValueError(f"stages {names}: an omni stage follows an omni stage; a stage starts from the previous "
                         "stage's language model (init_from), so the encoders would start over")
    # the retention arguments are checked before the first stage trains, not after it
    _check_retention_args(eval_n, eval_seq_len, max_new_tokens, "eval_n", "eval_seq_len")
    for stage in stages:
        if eval_seq_len is not None and eval_seq_len > stage.config.model.max_seq_len:
            raise ValueError(f"eval_seq_len={eval_seq_len} is more than stage {stage.name!r}'s "
                             f"ModelConfig.max_seq_len={stage.config.model.max_seq_len}")
    out_dir = Path(out_dir).resolve()  # one spelling: init_from paths must match on a re-run
    report: list[dict[str, Any]] = []
    previous: Path | None = None
    for stage in stages:
        cfg = stage.config
        cfg = dataclasses.replace(
            cfg, trainer=dataclasses.replace(cfg.trainer, out_dir=str(out_dir / stage.name)),
            init_from=str(previous) if previous is not None else cfg.init_from)
        result = train(cfg)
        if result.stopped_early:
            raise RuntimeError(f"stage {stage.name!r} stopped at step {result.step} before its "
                               f"{cfg.trainer.steps} steps (trainer.stop_after); run again to resume it")
        saved = out_dir / stage.name / "model"
        if is_omni_checkpoint(saved):  # retention and the next stage read its language model
            model, previous = load_omni(saved).lm, saved / "lm"
        else:
            model, previous = load_model(saved), saved
        scores = retention(model, domains, n=eval_n, seq_len=eval_seq_len, max_new_tokens=max_new_tokens)
        report.append({"stage": stage.name, "algorithm": cfg.algorithm.name, "steps": result.step, "domains": scores})
    atomic_write_text(out_dir / REPORT, json.dumps(report, indent=1))
    return report
