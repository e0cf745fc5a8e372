"""Graph linearisation: the Weaver mask equals a brute-force construction from its rules,
nodes come local-first, positions carry (in-node position, hop distance)."""

import numpy as np
import pytest

import jaxlm
from jaxlm.data.graphs import GraphLabels, bfs_hops, graph_attention_mask, linearize_graph, local_first_order

TOK = jaxlm.ByteTokenizer()
EDGES = [(0, 1), (1, 2), (2, 3), (0, 4)]
TEXTS = ["a0", "b11", "c", "d33", "e4"]


def brute_force_mask(node, edges):
    adjacent = {(a, b) for a, b in edges} | {(b, a) for a, b in edges}
    T = len(node)
    mask = np.zeros((T, T), bool)
    for t in range(T):
        for s in range(T):
            u, v = node[t], node[s]
            if v == -1:  # global prefix
                mask[t, s] = True
            elif u == -2:  # question / answer: every node, and earlier question tokens
                mask[t, s] = v >= 0 or (v == -2 and s <= t)
            elif u == v:
                mask[t, s] = s <= t
            elif u >= 0 and v >= 0 and (u, v) in adjacent:
                mask[t, s] = True
    return mask


def test_weaver_mask_matches_brute_force():
    g = linearize_graph(TEXTS, EDGES, 2, "Q=", "x", TOK, structure="weaver")
    np.testing.assert_array_equal(g.attn_mask, brute_force_mask(g.node.tolist(), EDGES))
    np.testing.assert_array_equal(graph_attention_mask(g.node, 5, EDGES), g.attn_mask)
    assert g.attn_mask.diagonal().all()  # no empty rows
    for seed in range(5):  # random task graphs too
        task = GraphLabels(seed=seed, n_nodes=8, extra_edges=4)
        ex = task.example(seed)
        arr = task.encode_arrays(ex, TOK)
        g = linearize_graph(ex["texts"], ex["edges"], ex["query"], "Q=", ex["answer"], TOK)
        np.testing.assert_array_equal(arr["attn_mask"], brute_force_mask(g.node.tolist(), ex["edges"]))


def test_local_first_order_and_positions():
    assert bfs_hops(5, EDGES, 2).tolist() == [2, 1, 0, 1, 3]
    # hop 0: node 2; hop 1: nodes 1 (degree 2) then 3 (degree 1); hop 2: node 0; hop 3: node 4
    assert local_first_order(5, EDGES, 2) == [2, 1, 3, 0, 4]
    g = linearize_graph(TEXTS, EDGES, 2, "Q=", "x", TOK)
    for u in range(5):
        idx = np.flatnonzero(g.node == u)
        np.testing.assert_array_equal(g.positions[idx, 0], np.arange(len(idx)))  # in-node position
        assert set(g.positions[idx, 1]) == {bfs_hops(5, EDGES, 2)[u]}  # hop distance
    assert TOK.decode(g.tokens[g.loss_mask]) == "x"


def test_plain_layout_is_causal_with_an_edge_list():
    g = linearize_graph(TEXTS, EDGES, 2, "Q=", "x", TOK, structure="plain")
    np.testing.assert_array_equal(g.attn_mask, np.tril(np.ones((len(g.tokens),) * 2, bool)))
    assert "edges 0-1 1-2 2-3 0-4" in TOK.decode(g.tokens)
    assert g.positions.ndim == 1
    with pytest.raises(ValueError, match="structure='tree' is invalid"):
        linearize_graph(TEXTS, EDGES, 2, "Q=", "x", TOK, structure="tree")


def test_graph_task_answers_follow_the_rule():
    task = GraphLabels(rule="minority", n_labels=3)
    for i in range(50):
        ex = task.example(i)
        q = ex["query"]
        nbrs = [b if a == q else a for a, b in ex["edges"] if q in (a, b)]
        labels = [ex["texts"][v].split(":")[1] for v in nbrs]
        counts = {lab: labels.count(lab) for lab in set(labels)}
        assert counts[ex["answer"]] == min(counts.values())


def test_extra_edges_must_fit_the_graph():
    """A 3-node graph has 1 edge beyond its spanning tree: more drew edges forever."""
    ex = GraphLabels(n_nodes=3, extra_edges=1).example(0)
    assert sorted(ex["edges"]) == [(0, 1), (0, 2), (1, 2)]
    for bad in (3, -1, 1.5):  # the default 3 on 3 nodes, negative, not an int
        with pytest.raises(ValueError, match=r"graph_labels.extra_edges=.* must be an int in \[0, 1\]"):
            GraphLabels(n_nodes=3, extra_edges=bad)
