"""D^3 scheduling: the order on hand-made influence matrices, cycle breaking, SCCs against
networkx, the lookahead influence against a closed form, and the scheduler hook (resume
serves the same batches in the same order; a run trains with it)."""

import json

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
import pytest

import jaxlm
from jaxlm.data.pipeline import DataConfig, train_dataset
from jaxlm.data.tasks import Arithmetic
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig
from trainers.loop import train
from trainers.schedule.config import ScheduleConfig
from trainers.schedule.d3 import (
    break_cycles,
    d3_order,
    directed_edges,
    greedy_order,
    influence_matrix,
    strongly_connected_components,
)
from trainers.schedule.scheduler import UnitScheduler, adam_preconditioner


def test_prerequisite_chain_comes_first_and_the_cycle_breaks_at_its_lightest_edge():
    # 0 -> 1 -> 2 -> 0 is a cycle whose lightest edge (2 -> 0, margin 0.5) goes; 3 -> 0 makes 3 a root
    w = np.zeros((4, 4))
    w[0, 1], w[1, 2], w[2, 0], w[3, 0] = 2.0, 2.0, 0.5, 0.1
    edges = directed_edges(w, 0.0)
    assert edges == {(0, 1): 2.0, (1, 2): 2.0, (2, 0): 0.5, (3, 0): 0.1}
    assert break_cycles(4, edges) == {(0, 1): 2.0, (1, 2): 2.0, (3, 0): 0.1}
    assert d3_order(w) == [3, 0, 1, 2]


def test_margins_below_delta_are_not_edges_and_ties_take_the_lower_index():
    w = np.array([[0.0, 1.0, 0.3], [0.9, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert directed_edges(w, 0.2) == {(0, 2): 0.3}  # 0 -> 1 has margin 0.1 only
    # no edges at all: greedy by outgoing influence onto the remaining units
    assert greedy_order(w, {}) == [0, 1, 2]
    assert greedy_order(np.zeros((3, 3)), {}) == [0, 1, 2]
    # the greedy score counts only units not yet placed: after 1, unit 0's 1.0 onto 1 is gone
    w2 = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]])
    assert greedy_order(w2, {}) == [1, 0, 2]


def test_a_nan_influence_is_taken_last():
    """A unit whose lookahead diverged (NaN row) was scheduled first: no number beats NaN in
    Python's max, so the NaN score won whenever it came first."""
    w = np.array([[0.0, np.nan, np.nan], [0.2, 0.0, 0.1], [0.3, 0.4, 0.0]])
    assert greedy_order(w, {}) == [2, 1, 0]
    assert d3_order(w) == [2, 1, 0]
    # a NaN column (unit 2's loss): scores counting unit 2 rank last until 2 is placed, and a
    # NaN margin is no edge; 0 -> 1 (margin 0.3) stays
    w = np.array([[0.0, 0.5, np.nan], [0.2, 0.0, np.nan], [0.3, 0.4, 0.0]])
    assert directed_edges(w, 0.0) == {(0, 1): pytest.approx(0.3)}
    assert d3_order(w) == [2, 0, 1]


@pytest.mark.parametrize("seed", range(4))
def test_components_match_networkx_and_the_result_is_acyclic(seed):
    rng = np.random.default_rng(seed)
    n = 12
    w = rng.normal(size=(n, n)) * (rng.random((n, n)) < 0.4)
    edges = directed_edges(w, 0.1)
    g = nx.DiGraph(list(edges))
    g.add_nodes_from(range(n))
    assert sorted(map(sorted, nx.strongly_connected_components(g))) == sorted(strongly_connected_components(n, edges))
    dag = break_cycles(n, edges)
    assert set(dag) <= set(edges) and nx.is_directed_acyclic_graph(nx.DiGraph(list(dag)))
    order = d3_order(w, delta=0.1)
    pos = {u: i for i, u in enumerate(order)}
    assert sorted(order) == list(range(n)) and all(pos[i] < pos[j] for i, j in dag)


def test_influence_is_the_lookahead_loss_change():
    """Quadratic unit losses L_j(x) = a_j |x - c_j|^2: w[i, j] = L_j(x) - L_j(x - eta P mask grad L_i)."""
    rng = np.random.default_rng(0)
    N, D = 5, 3
    c, a = rng.normal(size=(N, D)), rng.uniform(0.5, 2.0, N)
    x = rng.normal(size=D)
    mask, precond, eta = np.array([1.0, 0.0, 1.0]), np.array([0.7, 1.3, 2.0]), 0.1

    def loss(params, unit):
        return unit["a"] * jnp.sum((params["x"] - unit["c"]) ** 2)

    w = influence_matrix(loss, {"x": jnp.asarray(x)}, {"c": jnp.asarray(c), "a": jnp.asarray(a)}, lr=eta,
                         mask={"x": jnp.asarray(mask)}, precond={"x": jnp.asarray(precond)})
    want = np.zeros((N, N))
    for i in range(N):
        moved = x - eta * precond * mask * 2 * a[i] * (x - c[i])
        for j in range(N):
            want[i, j] = a[j] * np.sum((x - c[j]) ** 2) - a[j] * np.sum((moved - c[j]) ** 2)
    np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(want, want.T)  # directed


MODEL = jaxlm.ModelConfig.tiny(d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64, n_layers=1, max_seq_len=64)
DATA = DataConfig(source=Arithmetic(digits=1), seq_len=24, batch_size=4, pack=True, eval_examples=8)


def test_a_resumed_scheduler_serves_the_same_batches():
    from flax import nnx

    from trainers.step import make_loss_fn

    model = jaxlm.build_model(MODEL, seed=0)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    loss_fn = make_loss_fn(graphdef, sliding_window=None)
    cfg = ScheduleConfig(name="loss", units=3, rows=2)

    def make():
        return UnitScheduler(iter(train_dataset(DATA, jaxlm.ByteTokenizer())), cfg, loss_fn, params, adam=(0.95, 1e-8))

    straight = make()
    seen = [straight.next(params, None)[0]["tokens"] for _ in range(7)]
    first = make()
    for _ in range(4):
        first.next(params, None)
    saved = json.loads(json.dumps(first.get_state()))
    resumed = make()
    resumed.set_state(saved)
    for k in range(4, 7):
        np.testing.assert_array_equal(resumed.next(params, None)[0]["tokens"], seen[k])
    # a loss curriculum serves each pool's lowest-loss unit first
    fresh = make()
    fresh.next(params, None)
    losses = np.asarray(fresh._unit_loss(params, fresh._measured()))
    assert list(np.argsort(losses, kind="stable")) == fresh.order


def test_units_are_measured_with_every_field_the_loss_reads():
    """A loss that reads a batch field beyond tokens/masks/positions (a condition, an attention
    mask) ranks the units by that loss: the field was dropped from the measured units."""
    params = {"w": jnp.ones(())}

    def loss_fn(p, batch):  # the unit's loss is its condition's mean: only the condition orders units
        return p["w"] * jnp.sum(batch["condition"]), jnp.asarray(batch["condition"].size, jnp.float32)

    conditions = [5.0, 1.0, 3.0]
    class Batches:  # a resumable iterator, as the data pipeline's
        def __init__(self, items):
            self.items, self.i = items, 0

        def __next__(self):
            self.i += 1
            return self.items[self.i - 1]

        def get_state(self):
            return self.i

    batches = Batches([{"tokens": np.zeros((4, 3), np.int32), "loss_mask": np.ones((4, 3), bool),
                     "segment_ids": np.ones((4, 3), np.int32), "positions": np.zeros((4, 3), np.int32),
                     "condition": np.full((4, 2), c, np.float32)} for c in conditions])
    sched = UnitScheduler(batches, ScheduleConfig(name="loss", units=3, rows=2), loss_fn, params, adam=(0.95, 1e-8))
    served = [float(sched.next(params, None)[0]["condition"][0, 0]) for _ in range(3)]
    assert served == [1.0, 3.0, 5.0]
    assert sched._measured()["condition"].shape == (3, 2, 2)


def test_units_are_ranked_by_the_loss_the_run_trains_on(tmp_path):
    """With selective entropy minimisation on, the scheduler's unit losses are the SFT + SEM
    loss the step trains on (they were the plain cross-entropy)."""
    from trainers.algorithm import ALGORITHMS, RunSetup
    from trainers.setup import run_mesh
    from trainers.step import make_loss_fn

    cfg = ExperimentConfig(
        model=MODEL, data=DATA, optimizer=OptimizerConfig(lr=3e-3, warmup_steps=1),
        trainer=TrainerConfig(out_dir=str(tmp_path), steps=4, progress=False, eval_generate=0),
        algorithm=SFTConfig(sem_lambda=0.5, schedule=ScheduleConfig(name="loss", units=2, rows=2)),
    )
    tok = jaxlm.ByteTokenizer()
    sft = ALGORITHMS["sft"](RunSetup(cfg=cfg, model=jaxlm.build_model(MODEL, seed=0, tokenizer=tok), tokenizer=tok,
                                     mesh=run_mesh(cfg)))
    sched = sft.scheduler
    sched._fill()
    units = sched._measured()
    got = np.asarray(sched._unit_loss(sft._params, units))

    def means(loss_fn):  # per unit, computed as the scheduler computes (vmapped under jit)
        return np.asarray(jax.jit(jax.vmap(lambda p, u: (lambda t, c: t / c)(*loss_fn(p, u)), in_axes=(None, 0)))(
            sft._params, units))

    trained = make_loss_fn(sft.graphdef, sliding_window=None, sem_lambda=0.5, sem_threshold=0.25)
    plain = make_loss_fn(sft.graphdef, sliding_window=None)
    np.testing.assert_allclose(got, means(trained), rtol=1e-6)
    assert np.all(np.abs(got - means(plain)) > 1e-2)


def test_d3_schedules_a_training_run(tmp_path):
    cfg = ExperimentConfig(
        model=MODEL, data=DATA, optimizer=OptimizerConfig(lr=3e-3, warmup_steps=1),
        trainer=TrainerConfig(out_dir=str(tmp_path), steps=4, progress=False, log_every=1, eval_every=0,
                              save_every=100, eval_generate=0),
        algorithm=SFTConfig(schedule=ScheduleConfig(name="d3", units=2, rows=2)),
    )
    assert train(cfg).step == 4
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    refresh = [r for r in recs if r["kind"] == "train" and "schedule_refresh_s" in r]
    assert [r["step"] for r in refresh] == [1, 3]


def test_bad_schedule_config_names_the_field():
    with pytest.raises(ValueError, match="algorithm.schedule.name='topo'"):
        ScheduleConfig(name="topo")
    with pytest.raises(ValueError, match="algorithm.schedule.units=0"):
        ScheduleConfig(units=0)
    with pytest.raises(ValueError, match="algorithm.schedule.seed=-1 is invalid"):
        ScheduleConfig(name="random", seed=-1)  # numpy failed at the first refresh, naming no field
    with pytest.raises(ValueError, match="algorithm.schedule.precondition='no' is invalid"):
        ScheduleConfig(precondition="no")  # a truthy string turned preconditioning on
    with pytest.raises(ValueError, match="algorithm.schedule.lr=0 is invalid"):
        ScheduleConfig(lr=0.0)  # every influence 0: d3 silently became the data order



@pytest.mark.parametrize("trainable", ["", r"\.mlp\."])
def test_the_preconditioner_is_adams_and_frozen_parameters_get_zero(trainable):
    """After one step, nu_hat = g^2 (g the clipped gradient), so P = 1 / (|g| + eps); parameters
    outside ``optimizer.trainable`` do not move in the lookahead (P = 0)."""
    from trainers.optim import make_optimizer

    rng = np.random.default_rng(1)
    params = {"layers": {"0": {"mlp": {"w": jnp.ones((3, 2))}, "attn": {"w": jnp.ones((2, 2))}}}}
    grads = jax.tree.map(lambda x: jnp.asarray(rng.uniform(0.1, 0.3, x.shape), jnp.float32), params)
    cfg = OptimizerConfig(trainable=trainable, clip_norm=None)
    tx, _ = make_optimizer(cfg, 10)
    state = tx.init(params)
    assert adam_preconditioner(state, params, cfg.b2, cfg.eps) is None  # no step yet: identity
    _, state = tx.update(grads, state, params)
    got = adam_preconditioner(state, params, cfg.b2, cfg.eps)
    for path in (("mlp",), ("attn",)):
        g = np.asarray(grads["layers"]["0"][path[0]]["w"])
        frozen = bool(trainable) and path[0] == "attn"
        want = np.zeros_like(g) if frozen else 1.0 / (np.abs(g) + cfg.eps)
        np.testing.assert_allclose(np.asarray(got["layers"]["0"][path[0]]["w"]), want, rtol=1e-5)
