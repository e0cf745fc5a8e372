"""ReQAT's claim in miniature (docs/quantization.md, "ReQAT"): under NVFP4 W4A4 + an E1M2 KV4
cache, quantization-aware training on the stage-1 SFT data (TAQ) recovers much of the
accuracy that post-training quantization of the same model loses.

Stage 1: a 2-layer d_model-64 model, SFT on 2-digit addition (600 steps, batch 64). PTQ: its
weights stored in NVFP4 (RTN), activations NVFP4 per token, E1M2 KV cache. QAT: 150 steps at
lr 1e-3 on the same task data from the stage-1 weights, then exported to the same stored
format (`export_qat`). Greedy exact match on 200 held-out problems.

Measured (stage-1 data order 0, QAT data orders 0 / 1 / 2): fp32 0.920, PTQ 0.490, QAT
0.695 / 0.720 / 0.685; stage-1 data order 1, QAT orders 0 / 1: fp32 0.925, PTQ 0.440, QAT
0.705 / 0.695. QAT - PTQ: 0.195 to 0.265; the test asserts 0.1. (Q-FIT and SEM are measured
in `bench/reqat.py`: on this miniature neither improves on plain QAT.)
"""

import pytest

import jaxlm
from jaxlm.data.tasks import Arithmetic
from jaxlm.models.params import flat_params, model_from_flat
from jaxlm.quant.qat_export import ActQuantWeight, export_qat
from tiny_training import train_tiny
from jaxlm.eval import task_accuracy

TASK = Arithmetic(digits=2)
MODEL = jaxlm.ModelConfig.tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)
QUANT = dict(qat_format="nvfp4", kv_quant="e1m2")
STAGE1 = dict(steps=600, batch_size=64, min_lr_ratio=0.05, eval_examples=16)
QAT = dict(steps=150, lr=1e-3, batch_size=64, min_lr_ratio=0.05, eval_examples=16)


def reqat_miniature(out, *, stage1_seed: int = 0, qat_seed: int = 0, n_eval: int = 200) -> dict:
    """Accuracies of the stage-1 model, its PTQ and its QAT (both stored 4-bit)."""
    s1 = out / "s1" / "model"  # reused when present (measuring several QAT data orders)
    if not s1.exists():
        s1 = train_tiny(out / "s1", TASK, MODEL, shuffle_seed=stage1_seed, **STAGE1)
    base = jaxlm.load_checkpoint(s1)
    held = [TASK.example(i, "eval") for i in range(n_eval)]
    acc = lambda m: task_accuracy(m, held, TASK.verify, tokenizer=base.tokenizer, max_new_tokens=5).accuracy  # noqa: E731
    ptq = export_qat(model_from_flat(MODEL.replace(**QUANT), flat_params(base)))
    qat_dir = train_tiny(out / f"qat{qat_seed}", TASK, MODEL.replace(**QUANT), init_from=s1, shuffle_seed=qat_seed, **QAT)
    qat = jaxlm.load_checkpoint(qat_dir)
    stored = export_qat(qat)
    assert isinstance(stored.layers[0].mlp.up_proj.kernel.get_value(), ActQuantWeight)
    return {"fp32": acc(base), "ptq": acc(ptq), "qat": acc(stored)}


@pytest.mark.slow
def test_qat_beats_ptq_under_nvfp4_w4a4_kv4(tmp_path):
    r = reqat_miniature(tmp_path)
    print(r)
    assert r["fp32"] >= 0.8
    assert r["ptq"] <= r["fp32"] - 0.2  # the quantized setting is hard for PTQ (measured -0.43 to -0.49)
    assert r["qat"] >= r["ptq"] + 0.1
