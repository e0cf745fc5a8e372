"""ARS in miniature (answer-agreement representation shaping, method card §7.3): shaping the
embeddings of a model's answers by whether counterfactual answers agree improves a linear
probe that detects wrong answers.

Task (``--task sum_trace``, the default): ``SumTrace`` adds three 2-digit numbers and shows
the running sums in any order (``sum 23 45 67:`` -> ``45+23=68,68+67=135;135``), so different
traces reach the same answer. A 3-layer byte-level model trained for 2000 steps answers
held-out problems greedily (trace and answer). For each problem, `counterfactual_answers`
adds Gaussian noise ``sigma N(0, I)`` to the last block's output at the last prompt position
and samples again at temperature 0.7, top-p 0.95 (the authors' settings; ``variants`` times).
A variant agrees when its final answer equals the original's (the task's latent is the
number), and agreeing variants mostly take other traces. Every (problem, output) sample is
embedded as a hidden state at its last token, at every block's output and at the final
hidden state (the authors' scripts embed and probe every layer). `fit_shaping` trains the
linear map ``W`` per layer on the samples (same problem and same agreement label are the
positives; it uses no correctness labels, and by default every problem's samples, as the
authors' code does). Logistic-regression probes (label: the original answer is right) are
fit on ``--probe-labels`` training problems, on the raw and on the shaped embeddings
``normalize(W x)`` of the same problems, and scored on the held-out problems.

``--task addition`` is the earlier miniature: 2-digit addition, whose answer is the number
alone, so an agreeing variant is the same text as the original and its embedding the same
vector (use it with ``--steps 350 --temperature 0 --noise 10``).

Reported: held-out AUROC for "the answer is right" of the probes on raw and on shaped
embeddings per layer and number of labels (averaged over ``--probe-draws`` labelled subsets);
the same for HaloScope's unsupervised membership score (`jaxlm.eval.membership`; its ``k``
and orientation chosen on the labelled problems), a baseline detector the authors also feed
shaped embeddings; and two baselines that need no embedding: the model's own confidence
(geometric mean token probability) and the fraction of variants that agree.

    python bench/ars_claim.py --out runs/ars            # --seed 1 for a second model
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxlm
from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Arithmetic, SumTrace
from jaxlm.eval.ars import ShapingConfig, counterfactual_answers, fit_shaping, shape_embeddings
from jaxlm.eval.membership import membership_scores, select_membership
from jaxlm.eval.scoring import encode_prompts
from jaxlm.eval.selective import auroc
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig
from trainers.loop import train

MODEL = jaxlm.ModelConfig.tiny(d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=64)
# task name -> (task, training sequence length, answer tokens to decode, the answer's latent)
TASKS = {
    "addition": (Arithmetic(digits=2, ops=("+",), eval_fraction=0.5), 32, 6, str.strip),
    "sum_trace": (SumTrace(count=3, digits=2, eval_fraction=0.5), 48, 28, SumTrace.final_answer),
}


def train_model(out: Path, steps: int, seed: int, task, seq_len: int):
    if (out / "model").exists():
        return jaxlm.load_checkpoint(out / "model")
    train(ExperimentConfig(
        model=MODEL, data=DataConfig(source=task, seq_len=seq_len, batch_size=64, pack=True),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=50, min_lr_ratio=0.05, weight_decay=0.01),
        trainer=TrainerConfig.quiet(steps=steps, out_dir=str(out), seed=seed),
        algorithm=SFTConfig(), tokenizer="byte",
    ))
    return jaxlm.load_checkpoint(out / "model")


@functools.partial(jax.jit, static_argnames=("graphdef", "layer", "pool"))
def _last_hidden(graphdef, state, tokens, mask, pooled, layer, pool):
    model = nnx.merge(graphdef, state)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    out = model.backbone(tokens, positions, mask=mask, collect=() if layer is None else ("hidden",))
    h = (out.hidden if layer is None else out.collected["hidden"][layer]).astype(jnp.float32)
    if pool == "last":
        return h[:, -1]
    return (h * pooled[..., None]).sum(1) / jnp.maximum(pooled.sum(1), 1)[:, None]


def embed(model, texts: list[str], batch_size: int = 256, layer: int | None = None, pool: str = "last",
          skip: list[int] | None = None) -> np.ndarray:
    """The hidden state ``[N, D]`` at each text's last token (left-padded batches), or its mean
    over the tokens after the first ``skip[i]`` (``pool="mean"``): the final one (after the
    last norm) or block ``layer``'s output."""
    ids = encode_prompts(model.tokenizer, texts)
    width = -(-max(map(len, ids)) // 8) * 8
    tokens = np.zeros((len(ids), width), np.int32)
    mask = np.zeros((len(ids), width), bool)
    pooled = np.zeros((len(ids), width), bool)
    for r, row in enumerate(ids):
        tokens[r, width - len(row):] = row
        mask[r, width - len(row):] = True
        pooled[r, width - len(row) + (skip[r] if skip else 0):] = True
    graphdef, state = nnx.split(model)
    out = [np.asarray(_last_hidden(graphdef, state, jnp.asarray(tokens[s:s + batch_size]),
                                   jnp.asarray(mask[s:s + batch_size]), jnp.asarray(pooled[s:s + batch_size]),
                                   layer, pool))
           for s in range(0, len(ids), batch_size)]
    return np.concatenate(out)


def probe_auroc(x_train, y_train, x_test, y_test, seed: int) -> float:
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    scale = StandardScaler().fit(x_train)
    clf = LogisticRegression(C=1.0, max_iter=5000, random_state=seed).fit(scale.transform(x_train), y_train)
    return auroc(clf.decision_function(scale.transform(x_test)), y_test)


def labelled_subset(correct, n: int, seed: int, draw: int) -> np.ndarray:
    """Indices of ``n`` labelled training problems holding both classes: draw 0 the first
    ``n`` problems, the others random; a one-class draw is redrawn at random."""
    rng = np.random.default_rng([seed, draw])
    rows = np.arange(n) if draw == 0 else np.sort(rng.choice(len(correct), n, replace=False))
    for _ in range(1000):
        if 0 < correct[rows].sum() < n:
            return rows
        rows = np.sort(rng.choice(len(correct), n, replace=False))
    raise ValueError(f"no {n} labelled problems hold both right and wrong answers")


def halo_auroc(x, labelled, correct, test, weighting) -> float:
    """HaloScope's membership score on every original answer (the unlabeled set), with ``k``
    and orientation chosen on the labelled rows; the test rows' AUROC."""
    k, sign, _ = select_membership(x, labelled, correct[labelled], weighting=weighting)
    return auroc(sign * membership_scores(x, k, weighting=weighting)[test], correct[test])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=sorted(TASKS), default="sum_trace")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--problems", type=int, default=900)
    ap.add_argument("--train-fraction", type=float, default=0.6)
    ap.add_argument("--probe-labels", default="60,150,all",
                    help="comma-separated counts of labelled training problems a probe sees ('all': every "
                         "training problem)")
    ap.add_argument("--probe-draws", type=int, default=5,
                    help="labelled subsets the probes are fit on (the first: the first problems; the rest "
                         "random; a subset with one class only is redrawn); the AUROCs are averaged")
    ap.add_argument("--shape-on", choices=("train", "all"), default="all",
                    help="problems whose samples fit the shaping map (it uses agreement labels only; "
                         "the authors' code fits it on every problem)")
    ap.add_argument("--variants", type=int, default=6)
    ap.add_argument("--noise", type=float, default=1.0)
    ap.add_argument("--temperature", type=float, default=0.7, help="variant sampling (0: greedy)")
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--epochs", type=int, default=ShapingConfig.epochs)
    ap.add_argument("--pool", choices=("last", "mean"), default="last",
                    help="embed the last token (the authors' choice) or the mean over the output tokens")
    ap.add_argument("--layers", default="all",
                    help="comma-separated block indices and/or 'final' (the final hidden state) to embed "
                         "and probe; 'all': every block's output and the final one, as the authors' "
                         "scripts do")
    ap.add_argument("--halo-weighting", choices=("paper", "whitened"), default="whitened",
                    help="HaloScope's score: the paper's sigma-weighted mean or the ARS authors' whitened sum")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    task, seq_len, max_new, latent = TASKS[args.task]
    prompts, seen, i = [], set(), 0
    while len(prompts) < args.problems:  # distinct held-out problems
        ex = task.example(i, "eval")
        if ex["prompt"] not in seen:
            seen.add(ex["prompt"])
            prompts.append(ex)
        i += 1
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        model = train_model(out, args.steps, args.seed, task, seq_len)
        texts = [e["prompt"] for e in prompts]
        cache = out / (f"samples_p{args.problems}_v{args.variants}_n{args.noise}_t{args.temperature}"
                       f"_p{args.top_p}_s{args.seed}.json")
        if cache.exists():  # the decoded outputs of an earlier run with the same settings
            saved = json.loads(cache.read_text())
            outputs, variants, confidence = saved["outputs"], saved["variants"], np.asarray(saved["confidence"])
        else:
            greedy = jaxlm.generate(model, texts, max_new_tokens=max_new, temperature=0)
            outputs = [t.strip() for t in greedy.texts]
            logp, lengths = np.asarray(greedy.logprobs), np.asarray(greedy.lengths)
            confidence = np.array([np.exp(logp[r, :n].mean()) if n else 0.0 for r, n in enumerate(lengths)])
            variants = counterfactual_answers(model, texts, num_variants=args.variants, noise_scale=args.noise,
                                              seed=args.seed, max_new_tokens=max_new,
                                              temperature=args.temperature, top_p=args.top_p)
            variants = [[v.strip() for v in vs] for vs in variants]
            if args.out:
                cache.write_text(json.dumps({"outputs": outputs, "variants": variants,
                                             "confidence": confidence.tolist()}))
        correct = np.array([task.verify(e, a) >= 1 for e, a in zip(prompts, outputs)])
        agree = np.array([[latent(v) == latent(a) for v in vs] for vs, a in zip(variants, outputs)])
        distinct_agreeing = float(np.mean([len({v for v, ok in zip(vs, ag) if ok} | {a})
                                           for vs, ag, a in zip(variants, agree, outputs)]))
        # samples: the original and its variants, per problem, each embedded with its whole output
        sample_text = [t + o for t, a, vs in zip(texts, outputs, variants) for o in [a, *vs]]
        ids = np.repeat(np.arange(len(texts)), 1 + args.variants)
        labels = np.concatenate([np.ones((len(texts), 1), bool), agree], axis=1).ravel()
        prompt_len = [len(encode_prompts(model.tokenizer, [t])[0]) for t in texts]
        layers = (list(range(model.config.n_layers)) + ["final"] if args.layers == "all"
                  else [v if v == "final" else int(v) for v in args.layers.split(",")])
        xs = {layer: embed(model, sample_text, layer=None if layer == "final" else layer, pool=args.pool,
                           skip=[n for n in prompt_len for _ in range(1 + args.variants)])
              for layer in layers}
    n_train = int(args.train_fraction * len(texts))
    counts = [n_train if v == "all" else min(int(v), n_train) for v in args.probe_labels.split(",")]
    shape_rows = ids < n_train if args.shape_on == "train" else np.ones_like(ids, bool)
    originals = np.arange(len(texts)) * (1 + args.variants)
    te = slice(n_train, None)
    probes = []
    for layer, x in xs.items():
        W, history = fit_shaping(x[shape_rows], ids[shape_rows], labels[shape_rows],
                                 ShapingConfig(seed=args.seed, epochs=args.epochs))
        x_orig, shaped = x[originals], shape_embeddings(W, x[originals])
        for n_probe in counts:
            draws = [labelled_subset(correct[:n_train], n_probe, args.seed, k) for k in range(args.probe_draws)]
            raw = [probe_auroc(x_orig[d], correct[d], x_orig[te], correct[te], args.seed) for d in draws]
            shp = [probe_auroc(shaped[d], correct[d], shaped[te], correct[te], args.seed) for d in draws]
            halo = {name: float(np.mean([halo_auroc(e, d, correct, te, args.halo_weighting) for d in draws]))
                    for name, e in (("raw", x_orig), ("shaped", shaped))}
            probes.append({"layer": layer, "labels": n_probe, "raw": float(np.mean(raw)),
                           "shaped": float(np.mean(shp)), "shaped_wins": int(np.sum(np.array(shp) > np.array(raw))),
                           "draws": len(draws), "haloscope_raw": halo["raw"], "haloscope_shaped": halo["shaped"],
                           "shaping_loss_first_last": [history[0], history[-1]]})
            print(f"layer {layer!s:>5} labels {n_probe:4d}: probe AUROC raw {probes[-1]['raw']:.3f} "
                  f"shaped {probes[-1]['shaped']:.3f} (shaped better on {probes[-1]['shaped_wins']}/{len(draws)} "
                  f"labelled subsets); HaloScope raw {halo['raw']:.3f} shaped {halo['shaped']:.3f}", flush=True)
    result = {
        "task": args.task, "problems": len(texts), "train_problems": n_train, "shape_on": args.shape_on,
        "pool": args.pool, "accuracy": float(correct.mean()),
        "variant_agreement": float(agree.mean()), "distinct_agreeing_texts": distinct_agreeing,
        "auroc_correct": {"own_confidence": auroc(confidence[te], correct[te]),
                          "variant_agreement": auroc(agree[te].mean(axis=1), correct[te])},
        "probes": probes,
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
