"""ReQAT in miniature (docs/quantization.md): stage-1 SFT, then NVFP4 W4A4 + E1M2 KV4 by
post-training quantization (the stage-1 weights quantized as stored) vs quantization-aware
training on the identical SFT data (TAQ), with and without the SEM term and the Q-FIT key
transforms (scale folded into W_q / W_k, shift in the ``k_shift`` parameter, fitted on the
stage-1 model before QAT), over several data orders; every quantized model is evaluated as
exported to stored 4-bit weights (`jaxlm.quant.qat_export.export_qat`).

    python bench/reqat.py --out runs/reqat --seeds 0 1 2
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jaxlm  # noqa: E402
from jaxlm.data.pipeline import DataConfig  # noqa: E402
from jaxlm.data.tasks import Arithmetic  # noqa: E402
from jaxlm.models.params import flat_params, model_from_flat  # noqa: E402
from jaxlm.quant.apply import calibration_batches  # noqa: E402
from jaxlm.quant.qat_export import export_qat  # noqa: E402
from jaxlm.quant.qfit import fold_qfit, qfit_calibrate  # noqa: E402
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig  # noqa: E402
from jaxlm.eval import task_accuracy  # noqa: E402
from trainers.loop import train  # noqa: E402

TASK = Arithmetic(digits=2)
MODEL = jaxlm.ModelConfig.tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)
QUANT = dict(qat_format="nvfp4", kv_quant="e1m2")


def config(model, steps, lr, out, *, init=None, sem=0.0, seed=0, batch_size=64):
    return ExperimentConfig(
        model=model,
        data=DataConfig(source=TASK, seq_len=32, batch_size=batch_size, pack=True, eval_examples=16, shuffle_seed=seed),
        optimizer=OptimizerConfig(lr=lr, warmup_steps=20, min_lr_ratio=0.05),
        trainer=TrainerConfig(steps=steps, out_dir=str(out), progress=False, log_every=50, eval_every=0,
                              save_every=10_000, eval_generate=0),
        algorithm=SFTConfig(sem_lambda=sem), tokenizer="byte", init_from=init,
    )


def with_config(model, **changes):
    out = model_from_flat(model.config.replace(**changes), flat_params(model))
    out.tokenizer = model.tokenizer
    return out


def max_rel_logit_gap(a, b, tokens, valid):
    f = nnx.jit(lambda m, t, v: m(t, mask=v).logits)
    x, y = np.asarray(f(a, tokens, valid), np.float64), np.asarray(f(b, tokens, valid), np.float64)
    return float(np.linalg.norm(x - y) / np.linalg.norm(y - y.mean(-1, keepdims=True)))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/reqat")
    ap.add_argument("--stage1-steps", type=int, default=600)
    ap.add_argument("--qat-steps", type=int, default=200)
    ap.add_argument("--sem-lambda", type=float, default=0.01)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=["qat", "qat+sem", "qat+qfit", "qat+qfit+sem"])
    ap.add_argument("--eval-n", type=int, default=300)
    a = ap.parse_args()
    out = Path(a.out)
    t0 = time.time()
    if not (out / "s1" / "model").exists():
        train(config(MODEL, a.stage1_steps, 3e-3, out / "s1"))
    base = jaxlm.load_checkpoint(out / "s1" / "model")
    held = [TASK.example(i, "eval") for i in range(a.eval_n)]
    acc = lambda m: task_accuracy(m, held, TASK.verify, tokenizer=base.tokenizer, max_new_tokens=5).accuracy  # noqa: E731
    # Q-FIT on the stage-1 model (calibration: 128 training texts), saved for QAT to start from
    texts = [e["prompt"] + e["completion"] for e in (TASK.example(i, "train") for i in range(128))]
    if not (out / "s1_qfit").exists():
        res = qfit_calibrate(base, calibration_batches(base.tokenizer, texts, seq_len=16))
        print(f"Q-FIT alphas: a_s {np.asarray(res.alpha_s)}, a_m {np.asarray(res.alpha_m)}")
        jaxlm.save_checkpoint(fold_qfit(base, res), out / "s1_qfit")
    qfit_base = jaxlm.load_checkpoint(out / "s1_qfit")
    rows = [("stage 1 (fp32)", acc(base))]
    for name, m in (("PTQ W4A4KV4 (RTN, stored)", base), ("PTQ W4A4KV4 + Q-FIT (RTN, stored)", qfit_base)):
        fake = with_config(m, **QUANT)
        stored = export_qat(fake)
        rows.append((name, acc(stored)))
        print(f"| {name} | {rows[-1][1]:.3f} |", flush=True)
    probe = [e["prompt"] + e["completion"] for e in held[:64]]
    tokens, valid = map(np.asarray, calibration_batches(base.tokenizer, probe, seq_len=16)[0])
    results = {}
    for variant in a.variants:
        qfit, sem = "qfit" in variant, a.sem_lambda if "sem" in variant else 0.0
        cfg = MODEL.replace(**QUANT, k_shift=qfit)
        init = str(out / "s1_qfit") if qfit else str(out / "s1" / "model")
        for seed in a.seeds:
            run = out / f"{variant.replace('+', '_')}_seed{seed}"
            if not (run / "model").exists():
                train(config(cfg, a.qat_steps, 1e-3, run, init=init, sem=sem, seed=seed))
            qat = jaxlm.load_checkpoint(run / "model")
            stored = export_qat(qat)
            results.setdefault(variant, []).append(acc(stored))
            if seed == a.seeds[0]:  # the export computes the QAT model
                gap = max_rel_logit_gap(stored, qat, tokens, valid)
                same = acc(qat) == results[variant][-1]
                print(f"{variant} seed {seed}: exported vs QAT logits {gap:.1e} of the spread, "
                      f"same accuracy: {same}", flush=True)
            print(f"| {variant}, data order {seed} | {results[variant][-1]:.3f} |", flush=True)
    print(f"\n| model | held-out accuracy ({a.eval_n} problems) |\n|---|---|")
    for name, v in rows:
        print(f"| {name} | {v:.3f} |")
    for variant, v in results.items():
        orders = " / ".join(f"{x:.3f}" for x in v)
        print(f"| {variant.upper()} (data orders {' / '.join(map(str, a.seeds))}) | {orders} (mean {np.mean(v):.3f}) |")
    print(f"\n{time.time() - t0:.0f} s")

