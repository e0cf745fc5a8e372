"""Tail-aware vs forward-KL distillation in miniature ("Don't Ignore the Tail", Dasgupta et al.
2026): a small student distilled from a larger teacher on a stochastic corpus (MarkovText:
each word has several likely successors, so next-token distributions have real tails), equal
steps and data for every student; held-out NLL of the data tokens, top-1 ECE (and its signed
form: positive is over-confident) and full (classwise) ECE of the next-token distributions,
and the student-teacher KL.

With ``--tokenizer byte`` most positions sit inside a word, where the next byte is certain and
the teacher's tail is noise; ``--tokenizer word`` (a word-level ``tokenizers`` vocabulary built
from the chain's words) makes every position a choice among successors, so the tail the
divergence weights is the data's own.

    python bench/distill_claim.py                      # teacher, then SFT / forward-KL / tail-aware students
    python bench/distill_claim.py --steps 150 --tail 5:2.0
    python bench/distill_claim.py --tokenizer word --n-words 256 --fanout 16 --zipf 1.5 --tail 2:1.0
    python bench/distill_claim.py --tokenizer word --n-words 256 --fanout 16 --zipf 1.5 --tail 5:1.0 --pool 256

``--pool N`` trains the teacher and the students on N fixed sentences, repeated, so that they
memorise them (over-confident on held-out text); held-out scoring is on fresh sentences.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxlm
from jaxlm.data.files import Files
from jaxlm.data.pipeline import DataConfig, eval_batches
from jaxlm.data.tasks import MarkovText
from jaxlm.eval import expected_calibration_error, full_calibration_error, signed_calibration_error
from jaxlm.models.masks import segment_mask
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig
from trainers.distill.config import DistillConfig
from trainers.loop import train
from trainers.setup import make_tokenizer

TEACHER = {"d_model": 96, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 256, "n_layers": 3, "max_seq_len": 96}
STUDENT = {"d_model": 32, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64, "n_layers": 1, "max_seq_len": 96}
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


def word_tokenizer(source: MarkovText, out: Path) -> str:
    """A word-level ``tokenizer.json`` (specials, ``.``, then the chain's words) written to
    ``out``; returns the directory, which `ExperimentConfig.tokenizer` accepts."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate((*SPECIALS, ".", *source.vocabulary()))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"}))
    return str(out)


def pool_files(source: MarkovText, n: int, root: Path) -> Files:
    """``n`` fixed training sentences (and 128 held-out ones for the trainer's eval) as jsonl."""
    root.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, count in (("train", n), ("eval", 128)):
        paths[split] = root / f"pool{n}_{split}.jsonl"
        rows = (source.example(i, split) for i in range(count))
        paths[split].write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["completion"]}) + "\n"
                                        for r in rows))
    return Files(path=str(paths["train"]), eval_path=str(paths["eval"]))


def run(out: Path, model, data: DataConfig, tokenizer: str, algorithm, steps: int, lr: float, seed: int = 0) -> Path:
    train(ExperimentConfig(
        model=model, data=data, optimizer=OptimizerConfig(lr=lr, warmup_steps=10, min_lr_ratio=0.1),
        trainer=TrainerConfig.quiet(steps, str(out), seed=seed),
        algorithm=algorithm, tokenizer=tokenizer))
    return out / "model"


def heldout(model, data: DataConfig, tokenizer, teacher=None) -> dict[str, float]:
    """NLL, top-1 ECE, full ECE (and KL to the teacher) over the held-out trained tokens."""
    probs, labels, kls = [], [], []
    for b in eval_batches(data, tokenizer):
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
           "signed_ece": signed_calibration_error(p.max(-1), p.argmax(-1) == y),
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
    ap.add_argument("--tokenizer", choices=("byte", "word"), default="byte")
    ap.add_argument("--n-words", type=int, default=32)
    ap.add_argument("--fanout", type=int, default=6)
    ap.add_argument("--zipf", type=float, default=1.0, help="MarkovText's successor-weight exponent")
    ap.add_argument("--student-width", type=int, default=STUDENT["d_model"])
    ap.add_argument("--lr", type=float, default=3e-3, help="the students' learning rate")
    ap.add_argument("--eval-examples", type=int, default=128, help="held-out sentences scored")
    ap.add_argument("--pool", type=int, default=0,
                    help="train teacher and students on this many fixed sentences, repeated (0: fresh ones every step)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    root = args.out or Path(tempfile.mkdtemp(prefix="distill_claim_"))
    source = MarkovText(n_words=args.n_words, fanout=args.fanout, zipf=args.zipf)
    data = DataConfig(source=source, seq_len=96, batch_size=16, pack=True, eval_examples=128)
    scored = dataclasses.replace(data, eval_examples=args.eval_examples)  # held-out rows scored here
    if args.pool:
        data = dataclasses.replace(data, source=pool_files(source, args.pool, root))
    tok_spec = "byte" if args.tokenizer == "byte" else word_tokenizer(source, root / "tokenizer")
    tokenizer = make_tokenizer(tok_spec)
    teacher_cfg = jaxlm.ModelConfig.tiny(vocab_size=tokenizer.vocab_size, **TEACHER)
    student_cfg = jaxlm.ModelConfig.tiny(
        vocab_size=tokenizer.vocab_size, **{**STUDENT, "d_model": args.student_width})
    # a finished run in --out is reused (the harness refuses one with another config)
    teacher_dir = run(root / "teacher", teacher_cfg, data, tok_spec, SFTConfig(), args.teacher_steps, 3e-3)
    teacher = jaxlm.load_model(teacher_dir)
    students = {
        "sft (no teacher)": SFTConfig(),
        "forward KL": SFTConfig(distill=DistillConfig(teacher=str(teacher_dir), divergence="forward_kl")),
    }
    for spec in args.tail.split(","):
        k, beta = spec.split(":")
        students[f"tail-aware K={k} beta={beta}"] = SFTConfig(distill=DistillConfig(
            teacher=str(teacher_dir), divergence="tail_aware", top_k=int(k), tail_beta=float(beta)))
    results = {"teacher": heldout(teacher, scored, tokenizer)}
    for name, algo in students.items():
        if args.no_sft and algo.distill is None:
            continue
        d = root / f"seed{args.seed}" / name.replace(" ", "_").replace("(", "").replace(")", "").replace("=", "")
        model = jaxlm.load_model(run(d, student_cfg, data, tok_spec, algo, args.steps, args.lr, args.seed))
        results[name] = heldout(model, scored, tokenizer, teacher)
    print(f"student {student_cfg.n_layers} x {student_cfg.d_model} from teacher {teacher_cfg.n_layers} x "
          f"{teacher_cfg.d_model}, {args.steps} steps of {data.batch_size} x {data.seq_len} tokens, "
          f"{source}, {args.tokenizer} tokens (vocab {tokenizer.vocab_size})")
    print(f"{'model':<28} {'NLL':>7} {'ECE':>7} {'signed':>7} {'full ECE':>9} {'KL(T||S)':>9}")
    for name, r in results.items():
        print(f"{name:<28} {r['nll']:>7.4f} {r['ece']:>7.4f} {r['signed_ece']:>+7.4f} {r['full_ece']:>9.4f} "
              f"{r.get('kl_to_teacher', float('nan')):>9.4f}")
    print(json.dumps(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
