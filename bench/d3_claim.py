"""D^3 scheduling in miniature: do units ordered by directed influence reach a target loss in
fewer steps than a random order, on data whose skills build on each other?

Units are single-skill batches of addition with 1, 2 and 3 digits (the 2- and 3-digit sums
reuse the 1-digit ones); the held-out loss is on all three (``--heldout-digits 3``: on the
3-digit skill only, the one that builds on the others). Each epoch, the scheduler reads
all units as one pool and orders them with the live model (`trainers.schedule.scheduler`:
``d3``, ``loss`` = lowest loss first, ``random``, ``fifo`` = skills in order 1, 2, 3
interleaved). Same model init, units and optimizer for every order; steps to reach the
target (the median final loss of the random orders) are compared.

    python bench/d3_claim.py                 # 3 random seeds, d3, loss
    python bench/d3_claim.py --epochs 3 --units-per-skill 8
    python bench/d3_claim.py --epochs 4 --random-seeds 5 --pool 6 --init-seed 1 --influence-lr 1e-3
    python bench/d3_claim.py --epochs 3 --random-seeds 5 --pool 6 --units-per-skill 16,4,4  # unequal skills
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxlm
from jaxlm.data.encoding import encode
from jaxlm.data.tasks import Arithmetic
from trainers.schedule.config import ScheduleConfig
from trainers.schedule.scheduler import UnitScheduler
from trainers.step import init_state, make_eval_loss, make_loss_fn, make_train_step

TOK = jaxlm.ByteTokenizer()
MODEL = jaxlm.ModelConfig.tiny(d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, n_layers=2, max_seq_len=32)
T = 24


def rows(task: Arithmetic, start: int, n: int, split: str = "train") -> dict[str, np.ndarray]:
    out = {k: np.zeros((n, T), bool if k == "loss_mask" else np.int32)
           for k in ("tokens", "loss_mask", "segment_ids", "positions")}
    for r in range(n):
        enc = encode(task.example(start + r, split), TOK)
        m = len(enc["tokens"])
        out["tokens"][r, :m], out["loss_mask"][r, :m] = enc["tokens"], enc["loss_mask"]
        out["segment_ids"][r, :m], out["positions"][r, :m] = 1, np.arange(m)
    return out


class ListIterator:
    """The units of one epoch in a fixed order, with grain's get_state / set_state."""

    def __init__(self, units):
        self.units, self.i = units, 0

    def __next__(self):
        unit = self.units[self.i % len(self.units)]
        self.i += 1
        return unit

    def get_state(self):
        return {"i": self.i}

    def set_state(self, s):
        self.i = s["i"]


def run(order_name: str, units, heldout, *, epochs: int, seed: int, lr: float, influence_lr: float, pool: int,
        init_seed: int = 0):
    model = jaxlm.build_model(MODEL, seed=init_seed)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    tx = optax.adam(lr)
    step = make_train_step(graphdef, tx, lambda s: lr)
    eval_loss = make_eval_loss(graphdef)
    cfg = ScheduleConfig(name=order_name, units=pool or len(units), rows=4, lr=influence_lr, seed=seed,
                         params=r"layers\.\d+\.(mlp|attn)\.")
    sched = UnitScheduler(ListIterator(units), cfg, make_loss_fn(graphdef, sliding_window=None), params,
                          adam=(0.999, 1e-8))
    st = init_state(params, tx, 0)
    curve, overhead, first_order = [], 0.0, None
    for _ in range(epochs * len(units)):
        batch, info = sched.next(st.params, st.opt_state)
        overhead += info.get("schedule_refresh_s", 0.0)
        if first_order is None:
            first_order = list(sched.order)
        st, _ = step(st, {k: jnp.asarray(v) for k, v in batch.items()})
        sums = jax.device_get(eval_loss(st.params, heldout))
        curve.append(float(sums["loss"] / sums["tokens"]))
    return curve, overhead / max(sched.refreshes, 1), first_order


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--units-per-skill", default="8",
                    help="units of each skill: one count, or three (1-, 2-, 3-digit) separated by commas")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--influence-lr", type=float, default=1e-2)
    ap.add_argument("--random-seeds", type=int, default=3)
    ap.add_argument("--pool", type=int, default=0, help="units ordered per refresh (0: a whole epoch)")
    ap.add_argument("--init-seed", type=int, default=0, help="the model's initialisation (same for every order)")
    ap.add_argument("--heldout-digits", default="1,2,3", help="the skills (digit counts) of the held-out loss")
    args = ap.parse_args(argv)
    skills = [Arithmetic(digits=d, ops=("+",)) for d in (1, 2, 3)]
    counts = [int(c) for c in args.units_per_skill.split(",")]
    counts = counts * 3 if len(counts) == 1 else counts
    if len(counts) != 3 or min(counts) < 0 or sum(counts) == 0:
        ap.error(f"--units-per-skill={args.units_per_skill!r}: one count or three, >= 0")
    # fifo interleaves the skills (1, 2, 3, 1, 2, 3, ... while each lasts)
    skill_of = [s for u in range(max(counts)) for s in range(3) if u < counts[s]]
    units = [rows(skills[s], skill_of[:i].count(s) * args.rows, args.rows) for i, s in enumerate(skill_of)]
    digits = args.heldout_digits.split(",")
    if not digits or any(d not in ("1", "2", "3") for d in digits):
        ap.error(f"--heldout-digits={args.heldout_digits!r}: a comma-separated subset of 1,2,3")
    held = [skills[int(d) - 1] for d in digits]
    heldout = {k: jnp.asarray(np.concatenate([rows(s, 0, 32, "eval")[k] for s in held])) for k in units[0]}
    results = {}
    for name, seed in [("random", s) for s in range(args.random_seeds)] + [("fifo", 0), ("loss", 0), ("d3", 0)]:
        start = time.perf_counter()
        curve, overhead, order = run(name, units, heldout, epochs=args.epochs, seed=seed, lr=args.lr,
                                     influence_lr=args.influence_lr, pool=args.pool, init_seed=args.init_seed)
        label = f"{name} {seed}" if name == "random" else name
        results[label] = {"curve": curve, "refresh_s": overhead, "wall_s": time.perf_counter() - start,
                          "first_epoch_skills": [skill_of[u] + 1 for u in order]}
    target = float(np.median([r["curve"][-1] for k, r in results.items() if k.startswith("random")]))
    print(f"{len(units)} units ({'/'.join(map(str, counts))} of 1/2/3 digits) of {args.rows} rows, {args.epochs} epochs, "
          f"{args.pool or len(units)} units per refresh, held-out loss target "
          f"{target:.4f} (median final loss of the random orders)")
    print(f"{'order':<10} {'steps to target':>15} {'final loss':>10} {'refresh s':>9}  first epoch's skills")
    for k, r in results.items():
        hit = next((i + 1 for i, v in enumerate(r["curve"]) if v <= target), None)
        r["steps_to_target"] = hit
        skills_str = "".join(map(str, r["first_epoch_skills"]))
        print(f"{k:<10} {str(hit):>15} {r['curve'][-1]:>10.4f} {r['refresh_s']:>9.2f}  {skills_str}")
    print(json.dumps({k: {kk: vv for kk, vv in r.items() if kk != "curve"} for k, r in results.items()}))
    return results


if __name__ == "__main__":
    main()
