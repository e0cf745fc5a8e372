"""W4A4 under RTN / shared Hadamard / WUSH / QuaRot / TwinQuant on a trained model (docs/quantization.md).

    jaxlm quickstart && python bench/quant_methods.py --model runs/quickstart/model
    python bench/quant_methods.py --methods rtn twinquant --formats nvfp4
    python bench/quant_methods.py --methods rtn wush --inner rtn gptq --formats mxfp4 nvfp4 int4:group=32,scale=rms

Calibrates on training-split prompts, quantizes every attention/MLP projection (weights and
activations) with each method and format, and reports held-out exact match (answer + EOS
under teacher forcing = greedy decoding) and answer NLL against the bf16/fp32 model.
``--inner gptq``: the rtn / hadamard / wush transforms with GPTQ-style inner rounding
(WUSH's GPTQ mode, `jaxlm.quant.gptq`). Formats take options: ``int4:group=32,scale=rms``.
"""

import argparse
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxlm  # noqa: E402
from jaxlm.data.tasks import Arithmetic  # noqa: E402
from jaxlm.editing.kfac import token_batches  # noqa: E402
from jaxlm.editing.metrics import score  # noqa: E402
from jaxlm.editing.requests import encode_pairs  # noqa: E402
from jaxlm.quant.formats import get_format  # noqa: E402
from jaxlm.quant.gptq import INNER  # noqa: E402
from jaxlm.quant.quarot import quarot_quantize  # noqa: E402
from jaxlm.quant.twinquant import twinquant_quantize_model  # noqa: E402
from jaxlm.quant.w4a4 import METHODS, transform_quantize_model  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/quickstart/model")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--calibration", type=int, default=256)
    ap.add_argument("--methods", nargs="+", default=[*METHODS, "quarot"],
                    choices=[*METHODS, "quarot", "twinquant"])
    ap.add_argument("--formats", nargs="+", default=["mxfp4", "nvfp4"],
                    help="mxfp4 | nvfp4 | int4, options after a colon (int4:group=32,scale=rms)")
    ap.add_argument("--inner", nargs="+", default=["rtn"], choices=list(INNER),
                    help="inner rounding of the rtn / hadamard / wush transforms")
    a = ap.parse_args()
    for fmt in a.formats:
        get_format(fmt)  # fail on a bad format before loading anything
    model = jaxlm.load_model(a.model)
    tok = model.tokenizer
    task = Arithmetic(digits=2)
    held = [task.example(i, "eval") for i in range(a.n)]
    pairs = encode_pairs(tok, [e["prompt"] for e in held], [e["completion"] for e in held], append_eos=True)
    calib_texts = [e["prompt"] + e["completion"] for e in (task.example(i, "train") for i in range(a.calibration))]
    calib = list(token_batches(tok, calib_texts, batch_size=64, seq_len=32))

    def evaluate(m):
        s = score(m, pairs)
        return float(s["exact"].mean()), float(-s["logprob"].mean())

    acc0, nll0 = evaluate(model)
    print("| method | inner | format | exact match | answer NLL | time (s) |\n|---|---|---|---|---|---|")
    print(f"| none (fp32) | - | - | {acc0:.3f} | {nll0:.3f} | - |")
    for fmt in a.formats:
        for method in a.methods:
            for inner in a.inner if method in METHODS else ["-"]:
                t0 = time.perf_counter()
                if method == "quarot":  # norms fused, residual + V/O rotated, RTN (needs no calibration)
                    q = quarot_quantize(model, fmt)
                elif method == "twinquant":  # rank 16, model-level default steps (time includes compiling)
                    q = twinquant_quantize_model(model, fmt, calib)
                else:
                    q = transform_quantize_model(model, method, fmt, calib, inner=inner)
                acc, nll = evaluate(q)
                print(f"| {method} | {inner} | {fmt} | {acc:.3f} | {nll:.3f} | {time.perf_counter() - t0:.1f} |",
                      flush=True)
