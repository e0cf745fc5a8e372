"""ReQAT in miniature (docs/quantization.md): stage-1 SFT, then NVFP4 W4A4 + E1M2 KV4 by
post-training quantization (fake quant of the stage-1 weights) vs quantization-aware training
on the identical SFT data (TAQ), with and without the SEM term, over several data orders.

    python bench/reqat.py --out runs/reqat --seeds 0 1 2
"""

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxlm  # noqa: E402
from jaxlm.data.pipeline import DataConfig  # noqa: E402
from jaxlm.data.tasks import Arithmetic  # noqa: E402
from jaxlm.models.params import flat_params, model_from_flat  # noqa: E402
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig  # noqa: E402
from trainers.evaluate import task_accuracy  # noqa: E402
from trainers.loop import train  # noqa: E402

TASK = Arithmetic(digits=2)
MODEL = jaxlm.ModelConfig.tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)


def config(model, steps, lr, out, *, init=None, sem=0.0, seed=0):
    return ExperimentConfig(
        model=model,
        data=DataConfig(source=TASK, seq_len=32, batch_size=64, pack=True, eval_examples=16, shuffle_seed=seed),
        optimizer=OptimizerConfig(lr=lr, warmup_steps=20, min_lr_ratio=0.05),
        trainer=TrainerConfig(steps=steps, out_dir=str(out), progress=False, log_every=50, eval_every=0,
                              save_every=10_000, eval_generate=0),
        algorithm=SFTConfig(sem_lambda=sem), tokenizer="byte", init_from=init,
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/reqat")
    ap.add_argument("--stage1-steps", type=int, default=600)
    ap.add_argument("--qat-steps", type=int, default=200)
    ap.add_argument("--sem-lambda", type=float, default=0.01)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    a = ap.parse_args()
    out = Path(a.out)
    if not (out / "s1" / "model").exists():
        train(config(MODEL, a.stage1_steps, 3e-3, out / "s1"))
    base = jaxlm.load_checkpoint(out / "s1" / "model")
    held = [TASK.example(i, "eval") for i in range(300)]
    acc = lambda m: task_accuracy(m, held, TASK.verify, tokenizer=base.tokenizer, max_new_tokens=5).accuracy  # noqa: E731
    quantized = dataclasses.replace(MODEL, qat_format="nvfp4", kv_quant="e1m2")
    ptq = model_from_flat(quantized, flat_params(base))
    print(f"| model | held-out accuracy |\n|---|---|\n| stage 1 (fp32) | {acc(base):.3f} |\n"
          f"| PTQ W4A4KV4 | {acc(ptq):.3f} |")
    for seed in a.seeds:
        for sem in (0.0, a.sem_lambda):
            run = out / f"qat_sem{sem}_seed{seed}"
            if not (run / "model").exists():
                train(config(quantized, a.qat_steps, 1e-3, run, init=str(out / "s1" / "model"), sem=sem, seed=seed))
            print(f"| QAT W4A4KV4, SEM lambda {sem}, data order {seed} | {acc(jaxlm.load_checkpoint(run / 'model')):.3f} |",
                  flush=True)
