"""The contract between the run harness (`trainers.loop.train`) and a training algorithm.

The harness owns everything a run does whatever it trains: the output directory and its
lock, resume, the tokenizer, the initial model, the mesh, the loop (log, save, evaluate,
stop, divergence) and the final save. An algorithm (SFT, GRPO, ...) is registered by the
name its config carries (``cfg.algorithm.name``) and supplies its state, its batches and
its step::

    @ALGORITHMS.register("sft")
    class SFT:
        def __init__(self, setup: RunSetup): ...

Step ``k`` of a run (0-based) is ``batch, info = algo.batch(state, k)`` then
``state, metrics = algo.step(state, batch)``: the batch may depend on the state (GRPO's
rollouts are sampled from the current policy), the step is where the optimizer runs.
``metrics["finite"]`` False means the step saw a non-finite loss or gradient and left the
state unchanged; the harness then stops with the last good checkpoint kept.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from jax.sharding import Mesh

from jaxlm.models.transformer import Transformer
from jaxlm.registry import Registry
from trainers.config import ExperimentConfig
from trainers.step import TrainState


@dataclasses.dataclass
class RunSetup:
    """What the harness hands an algorithm: the config, the initial model (random init or
    ``init_from``'s weights, with ``model.tokenizer`` set), the tokenizer and the mesh the
    state lives on (every device of every process, ``trainer.mesh``)."""

    cfg: ExperimentConfig
    model: Transformer
    tokenizer: Any
    mesh: Mesh


class Algorithm(Protocol):
    """What a registered algorithm provides (see the module docstring)."""

    #: what one harness step is called in messages: "step" (an optimizer step) or "iteration"
    unit: str

    def init_state(self) -> TrainState:
        """The step-0 state, placed on the mesh (the shape a checkpoint restores into)."""

    def batch(self, state: TrainState, k: int) -> tuple[Any, dict[str, float]]:
        """The batch of step ``k`` and metrics about it (e.g. rewards)."""

    def step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        """One step: the new state and host metrics, including ``finite``."""

    def tokens(self, batch: Any) -> float:
        """Tokens the step processes (for throughput)."""

    def evaluate(self, state: TrainState, k: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Held-out metrics and sampled completions after step ``k``."""

    def data_state(self) -> dict[str, Any]:
        """JSON-able state besides the `TrainState` that a checkpoint stores (the data
        iterator's position, a collector's state): with it, a resumed run repeats an
        uninterrupted one exactly."""

    def load_data_state(self, data_state: dict[str, Any]) -> None:
        """Restore what `data_state` returned."""

    def final_model(self, state: TrainState) -> Transformer:
        """The trained model (with its tokenizer) that the run saves to ``out_dir/model``
        (`jaxlm.save_checkpoint`, unless the algorithm has a ``save_model(state, path)``
        method, e.g. omni training's model with its media encoders)."""


ALGORITHMS: Registry = Registry("training algorithm")
