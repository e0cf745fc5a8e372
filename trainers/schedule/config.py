"""`ScheduleConfig`: how upcoming train-units are ordered (``SFTConfig.schedule``)."""

from __future__ import annotations

import dataclasses
import math
import re

SCHEDULER_NAMES = ("fifo", "random", "loss", "d3")


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """Every ``units`` steps, the next ``units`` batches are read and ordered with the live
    model (`trainers.schedule.scheduler`), then trained on in that order."""

    name: str = "d3"
    """fifo (the data order) | random (a seeded shuffle of each pool) | loss (lowest loss under the
    live model first) | d3 (directed-influence graph order, `trainers.schedule.d3`)."""
    units: int = 8
    """Train-units (batches) ordered together; also the refresh interval in steps."""
    rows: int = 4
    """Rows of each unit its loss and influence are measured on."""
    params: str = r"layers\.\d+\.mlp\."
    """d3: regex over parameter names, the subset the lookahead step moves [INFERRED]."""
    lr: float = 1e-2
    """d3: eta, the lookahead step size (> 0) [INFERRED]."""
    delta: float = 0.0
    """d3: keep edge i -> j when w[i, j] - w[j, i] > delta."""
    precondition: bool = True
    """d3: scale the lookahead step by Adam's 1 / (sqrt(nu_hat) + eps) (after the first step)."""
    seed: int = 0
    """random: seed of the shuffles."""

    def __post_init__(self):
        if self.name not in SCHEDULER_NAMES:
            raise ValueError(f"algorithm.schedule.name={self.name!r} is invalid: must be one of {list(SCHEDULER_NAMES)}")
        for k in ("units", "rows"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"algorithm.schedule.{k}={v!r} is invalid: must be an int >= 1")
        try:
            re.compile(self.params)
        except re.error as e:
            raise ValueError(f"algorithm.schedule.params={self.params!r} is not a valid regex: {e}") from None
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"algorithm.schedule.seed={self.seed!r} is invalid: must be an int >= 0")
        if not isinstance(self.precondition, bool):
            raise ValueError(f"algorithm.schedule.precondition={self.precondition!r} is invalid: must be true or false")
        for k in ("lr", "delta"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"algorithm.schedule.{k}={v!r} is invalid: must be a finite number >= 0")
        if self.lr == 0:  # no lookahead step: every influence is 0 and the order is the data order
            raise ValueError("algorithm.schedule.lr=0 is invalid: the lookahead step must be > 0")
