"""D^3: dynamic directional graph-constrained data scheduling (Xu et al., ICML 2026; method
card B.9, [INFERRED] reading: the toolkit is not released).

Train-units ``u_1..u_N``; the directed influence of training on ``i`` on unit ``j``'s loss is
the lookahead ``w[i, j] = L_j(theta) - L_j(theta - eta P grad L_i(theta))`` with ``P`` the
optimizer's diagonal preconditioner (Adam's ``1 / (sqrt(nu_hat) + eps)``), the step taken on
a subset of the parameters. It is asymmetric, unlike its first-order part
``eta grad L_j^T P grad L_i``. Edges ``i -> j`` keep the pairs with
``w[i, j] - w[j, i] > delta`` (weight: that margin); cycles are broken by dropping the
lightest edge of each strongly connected component until none is left; the order is the
greedy topological one that repeatedly takes, among the units no remaining unit points to,
the one with the largest influence ``sum_k w[i, k]`` on the remaining units.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


def influence_matrix(loss_fn: Callable, params, units, *, lr: float, mask=None, precond=None) -> jax.Array:
    """``w [N, N]``, ``w[i, j] = L_j(params) - L_j(params - lr * precond * mask * grad L_i)``
    for ``units``, a pytree of stacked unit batches (leading axis N); ``loss_fn(params, unit)``
    is a scalar mean loss. ``mask``/``precond``: pytrees like ``params`` (None: all / identity)."""
    grad_fn = jax.grad(loss_fn)
    base = jax.vmap(lambda u: loss_fn(params, u))(units)

    def step_on(unit):
        g = grad_fn(params, unit)
        if mask is not None:
            g = jax.tree.map(lambda x, m: x * m, g, mask)
        if precond is not None:
            g = jax.tree.map(lambda x, p: x * p, g, precond)
        moved = jax.tree.map(lambda p, x: p - lr * x.astype(p.dtype), params, g)
        return base - jax.vmap(lambda u: loss_fn(moved, u))(units)

    return jax.lax.map(step_on, units)


def directed_edges(w: np.ndarray, delta: float) -> dict[tuple[int, int], float]:
    """``{(i, j): w[i, j] - w[j, i]}`` for the pairs whose margin exceeds ``delta``."""
    w = np.asarray(w, np.float64)
    n = w.shape[0]
    return {(i, j): float(w[i, j] - w[j, i]) for i in range(n) for j in range(n)
            if i != j and w[i, j] - w[j, i] > delta}


def strongly_connected_components(n: int, edges) -> list[list[int]]:
    """Tarjan's algorithm (iterative) over nodes ``0..n-1``."""
    succ: list[list[int]] = [[] for _ in range(n)]
    for i, j in edges:
        succ[i].append(j)
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in range(n):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, k = work.pop()
            if k == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack.add(v)
            if k < len(succ[v]):
                work.append((v, k + 1))
                u = succ[v][k]
                if u not in index:
                    work.append((u, 0))
                elif u in on_stack:
                    low[v] = min(low[v], index[u])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    u = stack.pop()
                    on_stack.discard(u)
                    comp.append(u)
                    if u == v:
                        break
                out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return out


def break_cycles(n: int, edges: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """Drop the lightest edge (ties: the smallest ``(i, j)``) inside each strongly connected
    component of more than one unit, until the graph is a DAG."""
    edges = dict(edges)
    while True:
        cyclic = [set(c) for c in strongly_connected_components(n, edges) if len(c) > 1]
        if not cyclic:
            return edges
        for comp in cyclic:
            inside = [(wt, e) for e, wt in edges.items() if e[0] in comp and e[1] in comp]
            edges.pop(min(inside)[1])


def greedy_order(w: np.ndarray, dag: dict[tuple[int, int], float]) -> list[int]:
    """Topological order of ``dag``: at each step the available unit (no incoming edge from a
    remaining unit) with the largest ``sum_{k remaining, k != i} w[i, k]`` (ties: lowest index).
    A NaN score (a lookahead that diverged) ranks below every number, so such a unit is taken
    last, as the loss curriculum takes a NaN loss last."""
    w = np.asarray(w, np.float64)
    n = w.shape[0]
    remaining = set(range(n))
    order = []
    while remaining:
        blocked = {j for (i, j) in dag if i in remaining and j in remaining}
        available = sorted(remaining - blocked)
        score = {i: float(sum(w[i, k] for k in remaining if k != i)) for i in available}
        score = {i: -np.inf if np.isnan(v) else v for i, v in score.items()}
        best = max(available, key=lambda i: (score[i], -i))
        order.append(best)
        remaining.remove(best)
    return order


def d3_order(w: np.ndarray, *, delta: float = 0.0) -> list[int]:
    """The D^3 schedule of ``N`` units from their influence matrix (module docstring)."""
    w = np.asarray(w, np.float64)
    dag = break_cycles(w.shape[0], directed_edges(w, delta))
    return greedy_order(w, dag)
