"""Tail-aware vs forward-KL distillation in miniature ("Don't Ignore the Tail", Dasgupta et al.
2026): a small student distilled from a larger teacher on a stochastic corpus (MarkovText:
each word has several likely successors, so next-token distributions have real tails), equal
steps and data for every student; held-out NLL of the data tokens, top-1 ECE and full
(classwise) ECE of the next-token distributions, and the student-teacher KL.

    python bench/distill_claim.py                      # teacher, then SFT / forward-KL / tail-aware students
    python bench/distill_claim.py --steps 150 --k 5 --beta 2.0
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxlm
from jaxlm.data.pipeline import DataConfig, eval_batches
from jaxlm.data.tasks import MarkovText
from jaxlm.eval import expected_calibration_error, full_calibration_error
from jaxlm.models.masks import segment_mask
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig
from trainers.distill.config import DistillConfig
from trainers.loop import train

SOURCE = MarkovText(n_words=32, fanout=6)
TEACHER = jaxlm.ModelConfig.tiny(d_model=96, n_heads=4, n_kv_heads=2, ffn_dim=256, n_layers=3, max_seq_len=96)
STUDENT = jaxlm.ModelConfig.tiny(d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64, n_layers=1, max_seq_len=96)
DATA = DataConfig(source=SOURCE, seq_len=96, batch_size=16, pack=True, eval_examples=128)


def run(out: Path, model, algorithm, steps: int, lr: float, seed: int = 0) -> Path:
    train(ExperimentConfig(
        model=model, data=DATA, optimizer=OptimizerConfig(lr=lr, warmup_steps=10, min_lr_ratio=0.1),
        trainer=TrainerConfig.quiet(steps, str(out), seed=seed),
        algorithm=algorithm, tokenizer="byte"))
    return out / "model"


def heldout(model, teacher=None) -> dict[str, float]:
    """NLL, top-1 ECE, full ECE (and KL to the teacher) over the held-out trained tokens."""
    probs, labels, kls = [], [], []
    for b in eval_batches(DATA, jaxlm.ByteTokenizer()):
        b = {k: jnp.asarray(v) for k, v in b.items()}
        mask = segment_mask(b["segment_ids"])
        logp = jax.nn.log_softmax(model(b["tokens"], b["positions"], mask=mask).logits.astype(jnp.float32), -1)
        seg, lm = np.asarray(b["segment_ids"]), np.asarray(b["loss_mask"])
        valid = np.zeros(seg.shape, bool)
        valid[:, :-1] = lm[:, 1:] & (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)
        tgt = np.zeros_like(seg)
        tgt[:, :-1] = np.asarray(b["tokens"])[:, 1:]
        lp = np.asarray(logp, np.float64)[valid]
        probs.append(np.exp(lp))
        labels.append(tgt[valid])
        if teacher is not None:
            tl = np.asarray(jax.nn.log_softmax(teacher(b["tokens"], b["positions"], mask=mask).logits, -1),
                            np.float64)[valid]
            kls.append(np.sum(np.exp(tl) * (tl - lp), -1))
    p, y = np.concatenate(probs), np.concatenate(labels)
    out = {"nll": float(-np.log(p[np.arange(len(y)), y]).mean()),
           "ece": expected_calibration_error(p.max(-1), p.argmax(-1) == y),
           "full_ece": full_calibration_error(p, y)}
    if kls:
        out["kl_to_teacher"] = float(np.concatenate(kls).mean())
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher-steps", type=int, default=400)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tail", default="5:1.0", help="tail-aware students as K:beta[,K:beta...]")
    ap.add_argument("--seed", type=int, default=0, help="the students' initialisation")
    ap.add_argument("--no-sft", action="store_true", help="skip the student trained without a teacher")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    root = args.out or Path(tempfile.mkdtemp(prefix="distill_claim_"))
    teacher_dir = root / "teacher" / "model"
    if not teacher_dir.exists():  # a teacher from an earlier run in --out is reused
        run(root / "teacher", TEACHER, SFTConfig(), args.teacher_steps, 3e-3)
    teacher = jaxlm.load_model(teacher_dir)
    students = {
        "sft (no teacher)": SFTConfig(),
        "forward KL": SFTConfig(distill=DistillConfig(teacher=str(teacher_dir), divergence="forward_kl")),
    }
    for spec in args.tail.split(","):
        k, beta = spec.split(":")
        students[f"tail-aware K={k} beta={beta}"] = SFTConfig(distill=DistillConfig(
            teacher=str(teacher_dir), divergence="tail_aware", top_k=int(k), tail_beta=float(beta)))
    results = {"teacher": heldout(teacher)}
    for name, algo in students.items():
        if args.no_sft and algo.distill is None:
            continue
        d = root / f"seed{args.seed}" / name.replace(" ", "_").replace("(", "").replace(")", "").replace("=", "")
        results[name] = heldout(jaxlm.load_model(run(d, STUDENT, algo, args.steps, 3e-3, args.seed)), teacher)
    print(f"student {STUDENT.n_layers} x {STUDENT.d_model} from teacher {TEACHER.n_layers} x {TEACHER.d_model}, "
          f"{args.steps} steps of {DATA.batch_size} x {DATA.seq_len} tokens, MarkovText(n_words=32, fanout=6)")
    print(f"{'model':<28} {'NLL':>7} {'ECE':>7} {'full ECE':>9} {'KL(T||S)':>9}")
    for name, r in results.items():
        print(f"{name:<28} {r['nll']:>7.4f} {r['ece']:>7.4f} {r['full_ece']:>9.4f} {r.get('kl_to_teacher', float('nan')):>9.4f}")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
