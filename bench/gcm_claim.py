"""Generalized Correctness Models in miniature (Xiao et al., method card §7.4): a correctness
model trained on *other* models' correctness histories predicts a held-out model's
correctness better than that model's own confidence.

Answering models: small byte-level models trained on 2-digit addition for different budgets,
some from a teacher that drops the ones carry (``carry_slip``), so their mistakes differ in
kind and rate. Each answers held-out problems greedily; `correctness_history` records its
answer, whether it is right, and its own confidence (the geometric mean probability of its
answer tokens). The GCM starts from the strongest answering model's weights (as the paper
fine-tunes a pretrained LLM), deepened by ``--expand-blocks`` identity blocks on top
(`jaxlm.expand_blocks`, LLaMA Pro), and is fine-tuned on the verdict rows
(``57+68=125\\nCorrect? `` -> ``Y``/``N``) of the training models' histories, each ``N`` row
repeated ``--negative-repeat`` times; the held-out model and the test questions are never in
them. Its confidence is P(Y) over {Y, N}.

Why the two knobs: the strongest model's own likelihood of an answer separates right from
wrong almost perfectly, but its last layer is where the sum comes out; telling whether the
written answer matches needs computation after that, which a fine-tune of the same depth
can only find by overwriting the sum. The rows are ~13% ``N``. ``--expand-blocks 0
--negative-repeat 1`` is the plain fine-tune.

Reported on the held-out model's answers to the test questions: AUROC for "the answer is
right" of the GCM, of the model's own confidence, and of another model's likelihood of the
same answer (the strongest training model's ``exp(mean log p(answer))``), and the ECE (30
bins) of each, raw and after Platt scaling fit on half of the held-out model's answers
(scored on the other half).

    python bench/gcm_claim.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
from flax import nnx

import jaxlm
from jaxlm.data.correctness import GCM_TEMPLATE, correctness_history, gcm_rows
from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Arithmetic
from jaxlm.eval.calibration import expected_calibration_error
from jaxlm.eval.judge import JudgeTemplate, judge_points
from jaxlm.eval.recalibration import fit_platt
from jaxlm.eval.selective import auroc
from sft_rows import sft_on_rows
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig
from trainers.loop import train
from trainers.rl.counterfactual import answer_scores

MODEL = jaxlm.ModelConfig.tiny(d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=64)
# name: (SFT steps, carry_slip of the teacher); the last one is held out
ANSWERERS = {"alpha": (400, 0.0), "beta": (600, 0.5), "epsilon": (800, 0.2), "gamma": (1200, 0.0),
             "delta": (450, 0.3)}
HELD_OUT = "delta"
TEMPLATES = {"qa": GCM_TEMPLATE,  # "Q: 57+68=\nA: 125\nCorrect? "
             "inline": JudgeTemplate(pointwise="{question}{response}\nCorrect? ")}  # "57+68=125\nCorrect? "
STRONGEST = "gamma"
EXPAND_BLOCKS = 2
NEGATIVE_REPEAT = 4


def task(carry_slip: float = 0.0) -> Arithmetic:
    # half the problems held out, so the histories are on problems no answering model trained on
    return Arithmetic(digits=2, ops=("+",), carry_slip=carry_slip, eval_fraction=0.5)


def train_answerer(out: Path, steps: int, carry_slip: float, seed: int):
    train(ExperimentConfig(
        model=MODEL,
        data=DataConfig(source=task(carry_slip), seq_len=32, batch_size=64, pack=True),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=50, min_lr_ratio=0.05, weight_decay=0.01),
        trainer=TrainerConfig.quiet(steps=steps, out_dir=str(out), seed=seed),
        algorithm=SFTConfig(), tokenizer="byte",
    ))
    return jaxlm.load_checkpoint(out / "model")


def distinct_eval_indices(n: int, start: int, exclude: set[str]) -> tuple[list[int], set[str]]:
    """``n`` eval-split indices from ``start`` whose problems are distinct and not in ``exclude``."""
    t, out, seen, i = task(), [], set(exclude), start
    while len(out) < n:
        prompt = t.example(i, "eval")["prompt"]
        if prompt not in seen:
            seen.add(prompt)
            out.append(i)
        i += 1
    return out, seen


def _platt_ece(score: np.ndarray, correct: np.ndarray, seed: int) -> float:
    """Post-hoc calibration: Platt scaling fit on a random half of the held-out model's
    answers, ECE (30 bins) on the other half."""
    idx = np.random.default_rng(seed).permutation(len(score))
    fit, ev = idx[: len(idx) // 2], idx[len(idx) // 2:]
    platt = fit_platt(score[fit], correct[fit])
    return expected_calibration_error(platt(score[ev]), correct[ev], n_bins=30)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-questions", type=int, default=3500)
    ap.add_argument("--test-questions", type=int, default=800)
    ap.add_argument("--gcm-steps", type=int, default=4000)
    ap.add_argument("--gcm-lr", type=float, default=3e-4)
    ap.add_argument("--template", choices=sorted(TEMPLATES), default="inline")
    ap.add_argument("--expand-blocks", type=int, default=EXPAND_BLOCKS,
                    help="identity blocks (LLaMA Pro) added on top of the strongest model before fine-tuning")
    ap.add_argument("--negative-repeat", type=int, default=NEGATIVE_REPEAT,
                    help="each 'N' (wrong-answer) row appears this many times in the GCM's training rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.negative_repeat < 1 or args.expand_blocks < 0:
        ap.error(f"--negative-repeat={args.negative_repeat} must be >= 1 and --expand-blocks={args.expand_blocks} >= 0")
    train_idx, seen = distinct_eval_indices(args.train_questions, 0, set())
    test_idx, _ = distinct_eval_indices(args.test_questions, 10**6, seen)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        models, histories, accuracy = {}, [], {}
        for k, (name, (steps, slip)) in enumerate(ANSWERERS.items()):
            path = out / name
            models[name] = (jaxlm.load_checkpoint(path / "model") if (path / "model").exists()
                            else train_answerer(path, steps, slip, args.seed * 10 + k))
            if name != HELD_OUT:
                hist = correctness_history(models[name], task(), train_idx, name=name, max_new_tokens=6)
                histories += hist
                accuracy[name] = float(np.mean([r.correct for r in hist]))
        test = correctness_history(models[HELD_OUT], task(), test_idx, name=HELD_OUT, max_new_tokens=6)
        accuracy[HELD_OUT] = float(np.mean([r.correct for r in test]))
        template = TEMPLATES[args.template]
        rows = gcm_rows(histories, variant="standard", seed=args.seed, template=template)
        rows = rows + [r for r in rows if r["completion"] == "N"] * (args.negative_repeat - 1)
        rows = [rows[i] for i in np.random.default_rng(args.seed).permutation(len(rows))]
        backbone = models[STRONGEST]
        if args.expand_blocks:
            backbone = jaxlm.expand_blocks(backbone, [backbone.config.n_layers - 1] * args.expand_blocks)
        shutil.rmtree(out / "gcm", ignore_errors=True)  # never resume a GCM of other settings
        jaxlm.save_checkpoint(backbone, out / "gcm_backbone", overwrite=True)
        gcm = sft_on_rows(out / "gcm", rows, backbone.config, steps=args.gcm_steps, seq_len=32, lr=args.gcm_lr,
                          init_from=str(out / "gcm_backbone"))
        questions, answers = [r.question for r in test], [r.answer for r in test]
        correct = np.array([r.correct for r in test])
        strongest = models[STRONGEST]
        graphdef, params = nnx.split(strongest)
        scores = {
            "gcm": judge_points(gcm, questions, answers, template=template).p_yes,
            "own_confidence": np.array([r.confidence for r in test]),
            f"{STRONGEST}_likelihood": answer_scores(graphdef, params, strongest.tokenizer, questions, answers),
        }
    result = {
        "answerer_accuracy": accuracy,
        "gcm_training_rows": len(rows),
        "gcm_layers": backbone.config.n_layers,
        "gcm_training_fraction_correct": float(np.mean([r.correct for r in histories])),
        "test_answers": len(test),
        "auroc": {k: auroc(v, correct) for k, v in scores.items()},
        "ece_30": {k: expected_calibration_error(np.asarray(v, np.float64), correct, n_bins=30)
                   for k, v in scores.items()},
        "ece_30_platt": {k: _platt_ece(np.asarray(v, np.float64), correct, args.seed) for k, v in scores.items()},
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
