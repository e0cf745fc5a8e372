"""The data-scheduling hook of SFT: a pool of upcoming train-units (batches) ordered with the
live model, one refresh every ``units`` steps (`ScheduleConfig`).

``SCHEDULERS`` maps a name to ``order(ctx) -> list[int]``: ``fifo``, ``random`` (seeded),
``loss`` (a loss curriculum: lowest loss under the live model first) and ``d3``
(`trainers.schedule.d3`). A checkpoint stores the iterator's position before the pool was
read, the order and how much of it was served, so a resumed run trains on the same batches in
the same order.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxlm.registry import Registry
from trainers.optim import param_names
from trainers.schedule.config import ScheduleConfig
from trainers.schedule.d3 import d3_order, influence_matrix

SCHEDULERS: Registry = Registry("data scheduler")


@dataclasses.dataclass
class OrderContext:
    """What a scheduler sees at a refresh."""

    cfg: ScheduleConfig
    units: dict[str, jax.Array]  # the pool's measured rows, stacked [N, rows, T]
    params: Any
    opt_state: Any
    refresh: int  # how many refreshes came before
    unit_loss: Callable  # jitted (params, units) -> [N] mean losses
    influence: Callable  # jitted (params, units, mask, precond) -> [N, N]
    mask: Any
    adam: tuple[float, float]  # (b2, eps) of the optimizer, for the preconditioner


@SCHEDULERS.register("fifo")
def fifo_order(ctx: OrderContext) -> list[int]:
    return list(range(ctx.cfg.units))


@SCHEDULERS.register("random")
def random_order(ctx: OrderContext) -> list[int]:
    return [int(i) for i in np.random.default_rng([ctx.cfg.seed, ctx.refresh]).permutation(ctx.cfg.units)]


@SCHEDULERS.register("loss")
def loss_order(ctx: OrderContext) -> list[int]:
    losses = np.asarray(ctx.unit_loss(ctx.params, ctx.units))
    return [int(i) for i in np.argsort(losses, kind="stable")]


def adam_preconditioner(opt_state, params, b2: float, eps: float):
    """``1 / (sqrt(nu / (1 - b2^count)) + eps)`` from the optimizer state's Adam second moment,
    or None before the first step. Parameters the optimizer freezes (``optimizer.trainable``:
    masked leaves of the Adam state) get 0, so the lookahead does not move them either."""
    nodes = [n for n in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
             if isinstance(n, optax.ScaleByAdamState)]
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    if len(nodes) != 1 or jax.tree.structure(nodes[0].nu, is_leaf=masked) != jax.tree.structure(params):
        raise ValueError("algorithm.schedule.precondition=True needs one Adam state laid out like the "
                         f"parameters; the optimizer state holds {len(nodes)} Adam state(s)"
                         + (" of another layout" if len(nodes) == 1 else "") + ": set precondition=False")
    count = int(nodes[0].count)
    if count == 0:
        return None
    corr = 1.0 - b2**count
    return jax.tree.map(lambda v, p: jnp.zeros_like(p) if masked(v) else 1.0 / (jnp.sqrt(v / corr) + eps),
                        nodes[0].nu, params, is_leaf=masked)


@SCHEDULERS.register("d3")
def d3_schedule(ctx: OrderContext) -> list[int]:
    precond = adam_preconditioner(ctx.opt_state, ctx.params, *ctx.adam) if ctx.cfg.precondition else None
    if precond is None:
        precond = jax.tree.map(jnp.ones_like, ctx.params)
    w = np.asarray(ctx.influence(ctx.params, ctx.units, ctx.mask, precond))
    return d3_order(w, delta=ctx.cfg.delta)


class UnitScheduler:
    """Serves ``iterator``'s batches in the order the configured scheduler gives each pool."""

    def __init__(self, iterator, cfg: ScheduleConfig, loss_fn: Callable, params, *, adam: tuple[float, float]):
        """``loss_fn(params, batch) -> (sum, count)`` is the SFT loss."""
        self.iterator, self.cfg, self.adam = iterator, cfg, adam
        pattern = re.compile(cfg.params)
        names = param_names(params)
        self.mask = jax.tree.map(lambda n: 1.0 if pattern.search(n) else 0.0, names)
        if cfg.name == "d3" and not any(jax.tree.leaves(self.mask)):
            raise ValueError(f"algorithm.schedule.params={cfg.params!r} matches no parameter "
                             f"(e.g. {jax.tree.leaves(names)[:3]})")

        def mean_loss(p, unit):
            total, count = loss_fn(p, unit)
            return total / jnp.where(count > 0, count, 1.0)

        self._unit_loss = jax.jit(jax.vmap(mean_loss, in_axes=(None, 0)))
        self._influence = jax.jit(lambda p, u, m, pc: influence_matrix(mean_loss, p, u, lr=cfg.lr, mask=m,
                                                                      precond=pc))
        self.pool: list[dict[str, np.ndarray]] = []
        self.order: list[int] = []
        self.served = 0
        self.refreshes = 0
        self.pool_start: Any = None

    def _fill(self):
        self.pool_start = self.iterator.get_state()
        self.pool = [next(self.iterator) for _ in range(self.cfg.units)]

    def _measured(self):
        """The pool's first ``rows`` rows of every field the loss reads (conditions, attention
        masks and per-token columns included: the units are ranked by the loss trained on)."""
        rows, B = self.cfg.rows, np.shape(self.pool[0]["tokens"])[0]

        def head(x):
            x = np.asarray(x)
            return x[:rows] if x.ndim and x.shape[0] == B else x

        fields = [k for k, v in self.pool[0].items()
                  if np.asarray(v).dtype.kind in "biuf" and all(k in b for b in self.pool)]
        return {k: jnp.asarray(np.stack([head(b[k]) for b in self.pool])) for k in fields}

    def next(self, params, opt_state) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        info: dict[str, float] = {}
        if self.served >= len(self.order):
            start = time.perf_counter()
            self._fill()
            ctx = OrderContext(self.cfg, self._measured(), params, opt_state, self.refreshes, self._unit_loss,
                               self._influence, self.mask, self.adam)
            order = SCHEDULERS[self.cfg.name](ctx)
            if sorted(order) != list(range(self.cfg.units)):
                raise RuntimeError(f"scheduler {self.cfg.name!r} returned {order}, not a permutation")
            self.order, self.served = order, 0
            self.refreshes += 1
            info["schedule_refresh_s"] = time.perf_counter() - start
        batch = self.pool[self.order[self.served]]
        self.served += 1
        return batch, info

    def get_state(self) -> dict[str, Any]:
        return {"pool_start": self.pool_start, "order": list(self.order), "served": self.served,
                "refreshes": self.refreshes}

    def set_state(self, state: dict[str, Any]) -> None:
        self.order, self.served, self.refreshes = list(state["order"]), int(state["served"]), int(state["refreshes"])
        if state["pool_start"] is not None:
            self.iterator.set_state(state["pool_start"])
            self._fill()
