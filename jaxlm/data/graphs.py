"""Graphs as token sequences: the Weaver layout (Graph-over-Tokens RoPE + graph masks) and a
plain linearisation, from the same graph.

Weaver (ICML 2026 poster; abstract only, the method card's reading 3.3 [INF]):
- nodes are ordered local-first: by hop distance from the query node, then by degree
  (descending), then by id, so the nearest nodes get the smallest offsets;
- every token carries two coordinates: its position inside its node's text and its node's
  hop distance from the query node (fed to ``rope="graph"``);
- mask: a token sees earlier tokens of its own node (causal), every token of the nodes
  adjacent to its node, and the global prefix (BOS); question and answer tokens see every
  node and, causally, each other.
The plain layout writes the same node texts followed by the edge list as text, with ordinary
causal attention and 1-D positions: structure must be read from the text.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np


def bfs_hops(n: int, edges: list[tuple[int, int]], source: int) -> np.ndarray:
    """Hop distance from ``source`` (n = unreachable)."""
    adj = [[] for _ in range(n)]
    for a, b in edges:
        adj[a].append(b)
        adj[b].append(a)
    hops = np.full(n, n, np.int32)
    hops[source] = 0
    queue = deque([source])
    while queue:
        u = queue.popleft()
        for v in adj[u]:
            if hops[v] == n:
                hops[v] = hops[u] + 1
                queue.append(v)
    return hops


def local_first_order(n: int, edges: list[tuple[int, int]], query: int) -> list[int]:
    hops = bfs_hops(n, edges, query)
    degree = np.zeros(n, np.int32)
    for a, b in edges:
        degree[a] += 1
        degree[b] += 1
    return sorted(range(n), key=lambda u: (hops[u], -degree[u], u))


@dataclasses.dataclass
class LinearGraph:
    tokens: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] bool: the answer (and EOS)
    positions: np.ndarray  # [T, 2] int32 (weaver) or [T] (plain)
    attn_mask: np.ndarray  # [T, T] bool
    node: np.ndarray  # [T] int32: node id, -1 for the global prefix, -2 for question/answer


def linearize_graph(
    node_texts: list[str],
    edges: list[tuple[int, int]],
    query: int,
    question: str,
    answer: str,
    tokenizer,
    *,
    structure: str = "weaver",
    names: list[str] | None = None,
) -> LinearGraph:
    """Tokens, positions and attention mask for one graph question.

    ``structure="weaver"``: node texts in local-first order, 2-D positions and the graph
    mask; ``"plain"``: node texts, then ``"edges a-b c-d ..."`` text, causal mask, 1-D positions.
    ``names`` label nodes in the edge list (default: the node index).
    """
    if structure not in ("weaver", "plain"):
        raise ValueError(f"structure={structure!r} is invalid: must be 'weaver' or 'plain'")
    n = len(node_texts)
    order = local_first_order(n, edges, query)
    hops = bfs_hops(n, edges, query)
    names = names or [str(i) for i in range(n)]
    tokens: list[int] = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    node = [-1] * len(tokens)
    seq = [0] * len(tokens)
    graph = [0] * len(tokens)
    for u in order:
        ids = tokenizer.encode(node_texts[u] + " ")
        tokens += ids
        node += [u] * len(ids)
        seq += list(range(len(ids)))
        graph += [int(hops[u])] * len(ids)
    if structure == "plain":
        ids = tokenizer.encode("edges " + " ".join(f"{names[a]}-{names[b]}" for a, b in edges) + " ")
        tokens += ids
        node += [-2] * len(ids)
        seq += [0] * len(ids)
        graph += [0] * len(ids)
    q_ids, a_ids = tokenizer.encode(question), tokenizer.encode(answer)
    tail = q_ids + a_ids + ([] if tokenizer.eos_id is None else [tokenizer.eos_id])
    start = len(tokens)
    tokens += tail
    node += [-2] * len(tail)
    seq += list(range(len(tail)))
    graph += [0] * len(tail)
    T = len(tokens)
    loss_mask = np.zeros(T, bool)
    loss_mask[start + len(q_ids):] = True
    node_arr = np.asarray(node, np.int32)
    if structure == "plain":
        return LinearGraph(np.asarray(tokens, np.int32), loss_mask, np.arange(T, dtype=np.int32),
                           np.tril(np.ones((T, T), bool)), node_arr)
    return LinearGraph(
        np.asarray(tokens, np.int32), loss_mask, np.stack([np.asarray(seq), np.asarray(graph)], -1).astype(np.int32),
        graph_attention_mask(node_arr, n, edges), node_arr,
    )


def graph_attention_mask(node: np.ndarray, n: int, edges: list[tuple[int, int]]) -> np.ndarray:
    """The Weaver mask from each token's node id (-1 global prefix, -2 question/answer)."""
    T = len(node)
    adj = np.zeros((n + 2, n + 2), bool)  # indices shifted by 2: -2 -> 0, -1 -> 1, u -> u + 2
    for a, b in edges:
        adj[a + 2, b + 2] = adj[b + 2, a + 2] = True
    idx = node + 2
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    same = idx[:, None] == idx[None, :]
    causal = j <= i
    mask = (same & causal) | adj[idx[:, None], idx[None, :]]
    mask |= (node[None, :] == -1)  # everyone sees the global prefix
    qa = node == -2
    mask[qa] = (node[None, :] >= -1).repeat(qa.sum(), 0) | (qa[None, :] & causal[qa])
    return mask


# ------------------------------------------------------------------ a synthetic task

from jaxlm.data.tasks import TASKS, Task  # noqa: E402

_NAMES = "ABCDEFGHIJKLMNOP"
_LABELS = "rgbcmykw"


@TASKS.register("graph_labels")
@dataclasses.dataclass(frozen=True)
class GraphLabels(Task):
    """Node classification by neighbourhood: a random connected graph whose nodes show their
    label (``"C:g"``) except the query node (``"A:?"``); the answer is the label held by the
    most neighbours of the query node (``rule="majority"``, ties -> first in alphabet order)
    or by the fewest present ones (``"minority"``, a heterophilic rule).

    ``structure`` chooses how the model reads the graph: ``"weaver"`` (graph mask + 2-D
    positions, node texts only) or ``"plain"`` (node texts + edge list, causal).
    """

    n_nodes: int = 7
    n_labels: int = 3
    extra_edges: int = 3
    rule: str = "majority"
    structure: str = "weaver"
    generative_eval = False  # the Weaver layout is read through masks, not generate()

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.n_nodes, bool) or not isinstance(self.n_nodes, int) or not 3 <= self.n_nodes <= len(_NAMES):
            raise ValueError(f"graph_labels.n_nodes={self.n_nodes!r} must be an int in [3, {len(_NAMES)}]")
        if isinstance(self.n_labels, bool) or not isinstance(self.n_labels, int) or not 2 <= self.n_labels <= len(_LABELS):
            raise ValueError(f"graph_labels.n_labels={self.n_labels!r} must be an int in [2, {len(_LABELS)}]")
        if self.rule not in ("majority", "minority"):
            raise ValueError(f"graph_labels.rule={self.rule!r} must be 'majority' or 'minority'")
        if self.structure not in ("weaver", "plain"):
            raise ValueError(f"graph_labels.structure={self.structure!r} must be 'weaver' or 'plain'")
        most = self.n_nodes * (self.n_nodes - 1) // 2 - (self.n_nodes - 1)  # a complete graph beyond its tree
        if isinstance(self.extra_edges, bool) or not isinstance(self.extra_edges, int) or not 0 <= self.extra_edges <= most:
            raise ValueError(f"graph_labels.extra_edges={self.extra_edges!r} must be an int in [0, {most}] "
                             f"(edges beyond a spanning tree of n_nodes={self.n_nodes})")

    def _draw(self, rng):
        n = self.n_nodes
        perm = rng.permutation(n)
        edges = {tuple(sorted((int(perm[i]), int(perm[rng.integers(0, i)])))) for i in range(1, n)}  # a tree
        while len(edges) < n - 1 + self.extra_edges:
            a, b = sorted(int(x) for x in rng.choice(n, 2, replace=False))
            edges.add((a, b))
        edges = sorted(edges)
        labels = [_LABELS[int(x)] for x in rng.integers(0, self.n_labels, n)]
        query = int(rng.integers(0, n))
        neighbours = [b if a == query else a for a, b in edges if query in (a, b)]
        counts = {lab: sum(labels[v] == lab for v in neighbours) for lab in _LABELS[: self.n_labels]}
        present = {lab: c for lab, c in counts.items() if c > 0}
        if self.rule == "majority":
            answer = min(present, key=lambda lab: (-present[lab], lab))
        else:
            answer = min(present, key=lambda lab: (present[lab], lab))
        texts = [f"{_NAMES[u]}:{'?' if u == query else labels[u]}" for u in range(n)]
        prompt = " ".join(texts) + " edges " + " ".join(f"{_NAMES[a]}-{_NAMES[b]}" for a, b in edges) + f" {_NAMES[query]}="
        return {"prompt": prompt, "completion": answer, "answer": answer, "texts": texts, "edges": edges, "query": query}

    def encode_arrays(self, example, tokenizer) -> dict[str, np.ndarray]:
        g = linearize_graph(example["texts"], example["edges"], example["query"], f"{_NAMES[example['query']]}=",
                            example["answer"], tokenizer, structure=self.structure, names=list(_NAMES))
        out = {"tokens": g.tokens, "loss_mask": g.loss_mask}
        if self.structure == "weaver":
            out.update(positions=g.positions, attn_mask=g.attn_mask)
        return out

    def verify(self, example, completion):
        return float(completion.strip() == example["answer"])

    def chance_accuracy(self):
        return 1.0 / self.n_labels
