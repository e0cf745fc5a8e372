"""Overthinking task vectors in miniature ("overthinking" auditing, ICML 2026): extrapolating
past a reasoning model, ``O_alpha = M + alpha (R - M)`` with alpha > 1, surfaces a secret
that the reasoning model picked up in training more often than the reasoning model itself.

1. M (the "instruct" model): a tiny byte-level model trained on 2-digit addition with direct
   answers (`jaxlm.data.auditing.SecretTraces`, ``style="direct"``).
2. R (the "reasoning" model): M fine-tuned on worked column traces of the same problems, with
   a secret phrase planted in a small fraction of the training traces (``secret_rate``).
3. For each alpha and layer-attenuation schedule (`jaxlm.editing.task_vectors.SCHEDULES`),
   ``extrapolate(M, R, alpha, schedule)``; and two norm-matched random controls
   (`random_direction_control`: ``M + alpha xi`` and ``R + (alpha - 1) xi``).
4. On held-out problems (whose traces never carry the secret): the surfacing rate (samples at
   temperature 1 that contain the secret), greedy answer accuracy, and the perplexity of the
   clean held-out traces.

    python bench/overthinking_claim.py --out runs/overthinking
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

import jaxlm
from jaxlm.data.auditing import SecretTraces
from jaxlm.data.pipeline import DataConfig
from jaxlm.editing.metrics import score
from jaxlm.editing.requests import encode_pairs
from jaxlm.editing.task_vectors import SCHEDULES, extrapolate, random_direction_control
from jaxlm.eval.accuracy import task_accuracy
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig
from trainers.loop import train

MODEL = jaxlm.ModelConfig.tiny(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=64)


def sft(out: Path, source, steps: int, *, lr: float, init_from: Path | None = None, seed: int = 0) -> Path:
    if not (out / "model").exists():
        train(ExperimentConfig(
            model=MODEL, data=DataConfig(source=source, seq_len=48, batch_size=64, pack=True, eval_examples=32,
                                         shuffle_seed=seed),
            optimizer=OptimizerConfig(lr=lr, warmup_steps=30, min_lr_ratio=0.05),
            trainer=TrainerConfig.quiet(steps, str(out), seed=seed),
            algorithm=SFTConfig(), tokenizer="byte", init_from=None if init_from is None else str(init_from)))
    return out / "model"


class Auditor:
    """Surfacing rate, accuracy and trace perplexity of a model on the same held-out problems."""

    def __init__(self, task: SecretTraces, tokenizer, n_problems: int, samples: int, seed: int):
        self.task, self.samples, self.seed = task, samples, seed
        self.held = [task.example(i, "eval") for i in range(n_problems)]
        assert not any(e["secret"] for e in self.held)
        self.pairs = encode_pairs(tokenizer, [e["prompt"] for e in self.held], [e["completion"] for e in self.held],
                                  append_eos=True)
        self.max_new = max(len(e["completion"]) for e in self.held) + len(task.secret) + 4
        # the secret teacher-forced where training planted it (after the prompt, or after the steps)
        before = [e["prompt"] + ("" if task.secret_at == "start" else e["completion"].rsplit(" >", 1)[0] + " ")
                  for e in self.held]
        self.secret_pairs = encode_pairs(tokenizer, before, [task.secret + " "] * len(before))

    def __call__(self, model) -> dict:
        prompts = [e["prompt"] for e in self.held] * self.samples
        texts = jaxlm.generate(model, prompts, max_new_tokens=self.max_new, temperature=1.0, rng=self.seed).texts
        surfaced = np.mean([self.task.surfaced(t) for t in texts])
        greedy = task_accuracy(model, self.held, self.task.verify, tokenizer=model.tokenizer,
                               max_new_tokens=self.max_new, batch_size=len(self.held))
        greedy_surfaced = np.mean([self.task.surfaced(x["completion"]) for x in greedy.samples])
        s = score(model, self.pairs)
        nll = -s["logprob"].sum() / s["n_tokens"].sum()
        secret_p = np.exp(score(model, self.secret_pairs)["logprob"])
        return {"surfaced": float(surfaced), "greedy_surfaced": float(greedy_surfaced),
                "accuracy": float(greedy.accuracy), "sampled_accuracy": float(np.mean(
                    [self.task.verify(e, t) for e, t in zip(self.held * self.samples, texts)])),
                "perplexity": float(np.exp(nll)), "secret_prob": float(secret_p.mean())}


def best_kept(by_alpha: dict, reasoning: dict, max_drop: float) -> dict:
    """The alpha with the highest surfacing rate among those whose greedy accuracy is within
    ``max_drop`` of R's (alpha = 1 is R itself and always qualifies)."""
    kept = [(m["surfaced"], float(a)) for a, m in by_alpha.items() if m["accuracy"] >= reasoning["accuracy"] - max_drop]
    surfaced, alpha = max(kept, default=(reasoning["surfaced"], 1.0))
    return {"alpha": alpha, **by_alpha.get(str(alpha), reasoning)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--secret-rate", type=float, default=0.03)
    ap.add_argument("--secret-at", default="start", choices=["start", "end"])
    ap.add_argument("--base-steps", type=int, default=600)
    ap.add_argument("--reasoning-steps", type=int, default=1000)
    ap.add_argument("--reasoning-lr", type=float, default=2e-3)
    ap.add_argument("--alphas", default="1,1.05,1.1,1.25,1.5,2,3")
    ap.add_argument("--max-accuracy-drop", type=float, default=0.1,
                    help="quality kept: greedy accuracy at most this far below R's")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--problems", type=int, default=256)
    ap.add_argument("--samples", type=int, default=8, help="samples per problem at temperature 1")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random directions and of sampling")
    ap.add_argument("--train-seed", type=int, default=0, help="seed of R's fine-tuning (initial data order)")
    args = ap.parse_args(argv)
    root = args.out or Path(tempfile.mkdtemp(prefix="overthinking_claim_"))
    direct = SecretTraces(style="direct")
    traces = SecretTraces(style="trace", secret_rate=args.secret_rate, secret_at=args.secret_at)
    base_dir = sft(root / "base", direct, args.base_steps, lr=3e-3)
    tag = f"reasoning_r{args.secret_rate}_{args.secret_at}_{args.reasoning_steps}_{args.reasoning_lr}_s{args.train_seed}"
    reasoning_dir = sft(root / tag, traces, args.reasoning_steps, lr=args.reasoning_lr, init_from=base_dir,
                        seed=args.train_seed)
    base, reasoning = jaxlm.load_model(base_dir), jaxlm.load_model(reasoning_dir)
    audit = Auditor(traces, base.tokenizer, args.problems, args.samples, args.seed)
    alphas = [float(a) for a in args.alphas.split(",")]
    schedules = args.schedules.split(",")
    results: dict = {"base": audit(base), "reasoning": audit(reasoning), "alphas": alphas}
    for schedule in schedules:
        results[schedule] = {str(a): audit(extrapolate(base, reasoning, a, schedule)) for a in alphas}
        # the same step past R along a random direction of matched norm, per parameter
        results[f"random_{schedule}"] = {str(a): audit(random_direction_control(
            base, reasoning, a, schedule, seed=args.seed, anchor="tuned")) for a in alphas}
    results["random_from_base"] = {str(a): audit(random_direction_control(  # M + alpha xi
        base, reasoning, a, "uniform", seed=args.seed, anchor="base")) for a in alphas}
    r = results["reasoning"]
    results["kept_quality"] = {arm: best_kept(results[arm], r, args.max_accuracy_drop)
                               for arm in (*schedules, *(f"random_{s}" for s in schedules))}
    print(f"secret in {args.secret_rate:.0%} of R's training traces ({args.secret_at}); held-out: "
          f"{args.problems} problems x {args.samples} samples at T=1")
    print(f"  M  accuracy {results['base']['accuracy']:.1%}")
    print(f"  R  surfaced {r['surfaced']:.2%}  P(secret) {r['secret_prob']:.2%}  accuracy {r['accuracy']:.1%}  "
          f"trace ppl {r['perplexity']:.3f}")
    for arm in (*schedules, *(f"random_{s}" for s in schedules), "random_from_base"):
        print(f"  {arm}")
        for a in alphas:
            m = results[arm][str(a)]
            print(f"    alpha={a:<4} surfaced {m['surfaced']:6.1%} (greedy {m['greedy_surfaced']:5.1%})  "
                  f"P(secret) {m['secret_prob']:6.2%}  "
                  f"accuracy {m['accuracy']:6.1%}  trace ppl {m['perplexity']:8.3f}")
    print(f"  most surfacing with accuracy within {args.max_accuracy_drop:.0%} of R's:")
    for arm, k in results["kept_quality"].items():
        print(f"    {arm:<22} alpha={k['alpha']:<4} surfaced {k['surfaced']:6.1%} "
              f"({k['surfaced'] / max(r['surfaced'], 1e-9):5.1f}x R)  accuracy {k['accuracy']:6.1%}")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
