"""Affine-Scaled Attention's stability claim, looked for at CPU scale: a learning-rate sweep
over several seeds of small-LM pretraining (`configs/attn_pretrain.py`, the synthetic Markov
corpus) with softmax, affine-scaled (free and coupled bias) and sink attention.

Per run: loss spikes (a step whose training loss exceeds 1.2x the median of the 20 before),
gradient-norm spikes (over 3x the running median of 20), the largest gradient norm (before
clipping), the final training loss (mean of the last 10 steps), the held-out loss, the
first-token attention mass, and the massive-activation ratio of the trained model (largest
|hidden| over the median |hidden|, across every layer's output on held-out rows; Sun et al.,
"Massive Activations in LLMs", 2024). A run whose loss goes non-finite is reported as
diverged (the harness stops it and keeps its last good checkpoint).

    python bench/asa_stability.py --out runs/asa --lrs 3e-3,1e-2,3e-2 --seeds 0,1
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxlm
from jaxlm.data.pipeline import eval_batches
from trainers.loop import train
from trainers.recipes import load_config

ARMS = {
    "softmax": ["model.attention=softmax"],
    "affine_free": ["model.attention=affine_scaled", "model.affine_bias=free"],
    "affine_coupled": ["model.attention=affine_scaled", "model.affine_bias=coupled"],
    "sink": ["model.attention=sink"],
}


def spikes(values: list[float], factor: float, window: int = 20) -> int:
    return sum(1 for i in range(window, len(values)) if values[i] > factor * statistics.median(values[i - window:i]))


@functools.partial(jax.jit, static_argnums=0)
def _hidden_abs(graphdef, state, tokens, valid):
    """|hidden| of every layer's output, ``[L, B, T, D]``."""
    model = nnx.merge(graphdef, state)
    return jnp.abs(model.backbone(tokens, mask=valid, collect=("hidden",)).collected["hidden"])


def massive_ratio(model, data_cfg, batches: int = 2) -> float:
    """max |h| / median |h| over every layer's output at the real tokens of held-out rows."""
    graphdef, state = nnx.split(model)
    values = []
    for batch in eval_batches(data_cfg, jaxlm.ByteTokenizer())[:batches]:
        valid = batch["segment_ids"] > 0
        h = np.asarray(_hidden_abs(graphdef, state, jnp.asarray(batch["tokens"]), jnp.asarray(valid)))
        values.append(h[:, valid].reshape(-1))  # [L, n_real, D] flattened
    a = np.concatenate(values)
    return float(a.max() / np.median(a))


def one_run(out: Path, arm: str, lr: float, seed: int, steps: int, warmup: int) -> dict:
    d = out / f"{arm}_lr{lr}_s{seed}"
    over = ARMS[arm] + [f"optimizer.lr={lr}", f"optimizer.warmup_steps={warmup}", f"trainer.seed={seed}",
                        f"data.shuffle_seed={seed}", f"trainer.steps={steps}", f"trainer.out_dir={d}",
                        "trainer.progress=false", "trainer.log_every=1", f"trainer.eval_every={steps}",
                        f"trainer.save_every={steps}"]
    cfg = load_config("attn_pretrain", over)
    if not (d / "model").exists():
        train(cfg)
    recs = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tr = [r for r in recs if r["kind"] == "train"]
    ev = [r for r in recs if r["kind"] == "eval"]
    loss, gn = [r["loss"] for r in tr], [r["grad_norm"] for r in tr]
    diverged = len(tr) < steps or not np.isfinite(loss).all()
    model = jaxlm.load_checkpoint(d / "model")
    return {"arm": arm, "lr": lr, "seed": seed, "diverged": bool(diverged), "steps": len(tr),
            "loss_spikes": spikes(loss, 1.2), "grad_spikes": spikes(gn, 3.0), "max_grad_norm": float(np.max(gn)),
            "final_loss": float(np.mean(loss[-10:])), "eval_loss": float(ev[-1]["loss"]) if ev else float("nan"),
            "first_token_mass": float(ev[-1].get("first_token_mass", float("nan"))) if ev else float("nan"),
            "massive_ratio": massive_ratio(model, cfg.data)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/asa"))
    ap.add_argument("--lrs", default="3e-3,1e-2,3e-2")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--overrides", default="", help="extra comma-separated config overrides (e.g. model.d_model=64)")
    args = ap.parse_args(argv)
    extra = [o for o in args.overrides.split(",") if o]
    for arm in ARMS:
        ARMS[arm] = ARMS[arm] + extra
    rows = []
    print("| attention | lr | seed | loss spikes | grad spikes | max grad norm | final loss | held-out loss "
          "| first-token mass | massive ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for lr in (float(x) for x in args.lrs.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            for arm in args.arms.split(","):
                r = one_run(args.out, arm, lr, seed, args.steps, args.warmup)
                rows.append(r)
                flag = " (diverged)" if r["diverged"] else ""
                print(f"| {arm}{flag} | {lr:g} | {seed} | {r['loss_spikes']} | {r['grad_spikes']} | {r['max_grad_norm']:.2f} "
                      f"| {r['final_loss']:.3f} | {r['eval_loss']:.3f} | {r['first_token_mass']:.3f} "
                      f"| {r['massive_ratio']:.1f} |", flush=True)
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
