"""ARS in miniature (answer-agreement representation shaping, method card §7.3): shaping the
embeddings of a model's answers by whether counterfactual answers agree improves a linear
probe that detects wrong answers.

A 3-layer byte-level model trained briefly on 2-digit addition (so that it is often wrong)
answers held-out problems greedily. For each problem, `counterfactual_answers` adds Gaussian
noise ``sigma N(0, I)`` to the last block's output at the last prompt position and decodes
again (``variants`` times; the paper's sigma = 0.05 is for 8B models, whose residual stream
is far larger: at this size sigma = 1 leaves 99% of the answers unchanged, 10 changes 8%); a variant agrees when its answer equals the original (the task's
latent is the number). Every (problem, answer) sample is embedded as the final hidden state at
its last token. `fit_shaping` trains the linear map ``W`` on the training problems' samples
(same problem and same agreement label are the positives); a logistic-regression probe is then
fit on the training problems' original answers (label: the answer is right) and scored on the
test problems, on the raw embeddings and on the shaped ones ``normalize(W x)``.

Reported: test AUROC for "the answer is right" of the probe on raw and on shaped embeddings,
and of two baselines that need no probe: the model's own confidence (geometric mean token
probability) and the fraction of variants that agree.

    python bench/ars_claim.py
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
from jaxlm.data.tasks import Arithmetic
from jaxlm.eval.ars import ShapingConfig, counterfactual_answers, fit_shaping, shape_embeddings
from jaxlm.eval.scoring import encode_prompts
from jaxlm.eval.selective import auroc
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig
from trainers.loop import train

MODEL = jaxlm.ModelConfig.tiny(d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=64)
TASK = Arithmetic(digits=2, ops=("+",), eval_fraction=0.5)


def train_model(out: Path, steps: int, seed: int):
    if (out / "model").exists():
        return jaxlm.load_checkpoint(out / "model")
    train(ExperimentConfig(
        model=MODEL, data=DataConfig(source=TASK, seq_len=32, batch_size=64, pack=True),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=50, min_lr_ratio=0.05, weight_decay=0.01),
        trainer=TrainerConfig.quiet(steps=steps, out_dir=str(out), seed=seed),
        algorithm=SFTConfig(), tokenizer="byte",
    ))
    return jaxlm.load_checkpoint(out / "model")


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _last_hidden(graphdef, state, tokens, mask):
    model = nnx.merge(graphdef, state)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    return model.backbone(tokens, positions, mask=mask).hidden[:, -1].astype(jnp.float32)


def embed(model, texts: list[str], batch_size: int = 256) -> np.ndarray:
    """The final hidden state ``[N, D]`` at each text's last token (left-padded batches)."""
    ids = encode_prompts(model.tokenizer, texts)
    width = -(-max(map(len, ids)) // 8) * 8
    tokens = np.zeros((len(ids), width), np.int32)
    mask = np.zeros((len(ids), width), bool)
    for r, row in enumerate(ids):
        tokens[r, width - len(row):] = row
        mask[r, width - len(row):] = True
    graphdef, state = nnx.split(model)
    out = [np.asarray(_last_hidden(graphdef, state, jnp.asarray(tokens[s:s + batch_size]),
                                   jnp.asarray(mask[s:s + batch_size])))
           for s in range(0, len(ids), batch_size)]
    return np.concatenate(out)


def probe_auroc(x_train, y_train, x_test, y_test, seed: int) -> float:
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    scale = StandardScaler().fit(x_train)
    clf = LogisticRegression(C=1.0, max_iter=5000, random_state=seed).fit(scale.transform(x_train), y_train)
    return auroc(clf.decision_function(scale.transform(x_test)), y_test)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=350)
    ap.add_argument("--problems", type=int, default=900)
    ap.add_argument("--train-fraction", type=float, default=0.6)
    ap.add_argument("--variants", type=int, default=6)
    ap.add_argument("--noise", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    prompts, seen, i = [], set(), 0
    while len(prompts) < args.problems:  # distinct held-out problems
        ex = TASK.example(i, "eval")
        if ex["prompt"] not in seen:
            seen.add(ex["prompt"])
            prompts.append(ex)
        i += 1
    with tempfile.TemporaryDirectory() as tmp:
        model = train_model(args.out or Path(tmp), args.steps, args.seed)
        texts = [e["prompt"] for e in prompts]
        greedy = jaxlm.generate(model, texts, max_new_tokens=6, temperature=0)
        answers = [t.strip() for t in greedy.texts]
        correct = np.array([TASK.verify(e, a) >= 1 for e, a in zip(prompts, answers)])
        logp, lengths = np.asarray(greedy.logprobs), np.asarray(greedy.lengths)
        confidence = np.array([np.exp(logp[r, :n].mean()) if n else 0.0 for r, n in enumerate(lengths)])
        variants = counterfactual_answers(model, texts, num_variants=args.variants, noise_scale=args.noise,
                                          seed=args.seed, max_new_tokens=6)
        agree = np.array([[v.strip() == a for v in vs] for vs, a in zip(variants, answers)])
        # samples: the original and its variants, per problem
        sample_text = [t + a for t, a, vs in zip(texts, answers, variants) for a in [a] + [v.strip() for v in vs]]
        ids = np.repeat(np.arange(len(texts)), 1 + args.variants)
        labels = np.concatenate([np.ones((len(texts), 1), bool), agree], axis=1).ravel()
        x = embed(model, sample_text)
    n_train = int(args.train_fraction * len(texts))
    train_rows = ids < n_train
    W, history = fit_shaping(x[train_rows], ids[train_rows], labels[train_rows], ShapingConfig(seed=args.seed))
    originals = np.arange(len(texts)) * (1 + args.variants)
    x_orig, shaped = x[originals], shape_embeddings(W, x[originals])
    tr, te = slice(0, n_train), slice(n_train, None)
    result = {
        "problems": len(texts), "train_problems": n_train, "accuracy": float(correct.mean()),
        "variant_agreement": float(agree.mean()),
        "shaping_loss_first_last": [history[0], history[-1]],
        "auroc_correct": {
            "probe_raw": probe_auroc(x_orig[tr], correct[tr], x_orig[te], correct[te], args.seed),
            "probe_shaped": probe_auroc(shaped[tr], correct[tr], shaped[te], correct[te], args.seed),
            "own_confidence": auroc(confidence[te], correct[te]),
            "variant_agreement": auroc(agree[te].mean(axis=1), correct[te]),
        },
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
