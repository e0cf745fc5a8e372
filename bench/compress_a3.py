"""A^3 vs per-matrix truncated SVD at equal parameter budgets on a trained model (docs/compression.md).

    jaxlm quickstart && python bench/compress_a3.py --model runs/quickstart/model
    jaxlm train quickstart model.rope=none trainer.out_dir=runs/quickstart_nope
    python bench/compress_a3.py --model runs/quickstart_nope/model

Calibrates A^3 on training-split problems, compresses the chosen components at each budget
(kept fraction of their parameters), builds the SVD baseline with the same parameter count
per projection (dense reconstruction), and reports on held-out problems: each component's
relative output error (on the original model's layer inputs), exact match (answer + EOS
under teacher forcing = greedy decoding) and answer NLL, plus the compressed model's
parameter count and KV-cache size. The ratio printed last is SVD's answer NLL increase over
A^3's at the first budget (all components). With ``--allocation global`` each budget also gets
an "A^3 global" row: mixed per-layer ranks at the same parameter count (widths printed per layer).
On a RoPE model, the "A^3" rows with qk are the pair selection alone (``qk_rope_refit=False``)
and "A^3 + refit" rows add ``A3Config.qk_rope_refit`` (the kept pairs' query columns refit by
least squares on the scores; ``--refit-als`` extra key/query rounds, ``--refit-weight``,
``--refit-rank``), with its calibration score error per layer (selection -> refit) printed.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxlm  # noqa: E402
from jaxlm.compress import (  # noqa: E402
    A3Config, a3_compress, a3_statistics, component_errors, kv_cache_bytes, qk_rope_refit, svd_model,
)
from jaxlm.data.tasks import Arithmetic  # noqa: E402
from jaxlm.editing.kfac import token_batches  # noqa: E402
from jaxlm.editing.metrics import score  # noqa: E402
from jaxlm.editing.requests import encode_pairs  # noqa: E402
from jaxlm.models.params import flat_params, model_from_flat  # noqa: E402

COMPONENT_SETS = (("qk", "ov", "mlp"), ("ov", "mlp"))

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/quickstart/model")
    ap.add_argument("--budgets", default="0.75,0.5")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--calibration", type=int, default=256)
    ap.add_argument("--allocation", choices=("uniform", "global"), default="uniform",
                    help="global: also report A^3 with mixed per-layer ranks at the same budget")
    ap.add_argument("--refit-als", type=int, default=0, help="A3Config.qk_refit_als of the refit rows")
    ap.add_argument("--refit-weight", default="uniform", help="A3Config.qk_refit_weight of the refit rows")
    ap.add_argument("--refit-ridge", type=float, default=A3Config.qk_refit_ridge)
    ap.add_argument("--refit-rank", type=int, default=None, help="A3Config.qk_refit_rank of the refit rows")
    ap.add_argument("--no-refit", action="store_true", help="skip the RoPE refit rows")
    a = ap.parse_args()
    model = jaxlm.load_model(a.model)
    tok, c0 = model.tokenizer, model.config
    task = Arithmetic(digits=2)
    held = [task.example(i, "eval") for i in range(a.n)]
    pairs = encode_pairs(tok, [e["prompt"] for e in held], [e["completion"] for e in held], append_eos=True)
    texts = lambda split, n: [e["prompt"] + e["completion"] for e in (task.example(i, split) for i in range(n))]  # noqa: E731
    calib = list(token_batches(tok, texts("train", a.calibration), batch_size=64, seq_len=32))
    held_batches = list(token_batches(tok, texts("eval", 256), batch_size=128, seq_len=32))

    def evaluate(m):
        s = score(m, pairs)
        return float(s["exact"].mean()), float(-s["logprob"].mean())

    t0 = time.perf_counter()
    stats = a3_statistics(model, calib)  # one pass serves every budget and component set
    print(f"model {a.model}: d_model {c0.d_model}, {c0.n_layers} layers, {c0.n_heads} heads / {c0.n_kv_heads} KV, "
          f"head_dim {c0.head_dim}, ffn {c0.ffn_dim}, rope={c0.rope}; calibration {a.calibration} texts "
          f"({time.perf_counter() - t0:.1f}s)")
    acc0, nll0 = evaluate(model)
    print("\n| components | budget | method | widths qk/v/ffn | params | KV cache | err qk | err ov | err mlp "
          "| exact match | answer NLL |\n|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| - | 1.0 | none | {c0.qk_head_dim}/{c0.v_head_dim}/{c0.ffn_dim} | {c0.num_params():,} | 1.000 | - | - | - "
          f"| {acc0:.3f} | {nll0:.4f} |")
    first = None
    for budget in (float(b) for b in a.budgets.split(",")):
        for comps in COMPONENT_SETS:
            flat, c1 = a3_compress(flat_params(model), c0, stats,  # under RoPE: pair selection only
                                   A3Config(components=comps, budget=budget, qk_rope_refit=False))
            a3 = model_from_flat(c1, flat)
            a3.tokenizer = tok
            svd = svd_model(model, c1, comps)
            row = {}
            methods = [("A^3", a3, c1), ("SVD", svd, c1)]
            if a.allocation == "global":
                flat_g, c_g = a3_compress(flat_params(model), c0, stats,
                                          A3Config(components=comps, budget=budget, allocation="global",
                                                   qk_rope_refit=False))
                mixed = model_from_flat(c_g, flat_g)
                mixed.tokenizer = tok
                methods.insert(1, ("A^3 global", mixed, c_g))
            if "qk" in comps and c0.rope != "none" and not a.no_refit:
                cfg = A3Config(components=comps, budget=budget, qk_rope_refit=True, qk_refit_als=a.refit_als,
                               qk_refit_weight=a.refit_weight, qk_refit_ridge=a.refit_ridge,
                               qk_refit_rank=a.refit_rank)
                t1 = time.perf_counter()
                refit = qk_rope_refit(model, calib, stats, cfg)
                print(f"refit (budget {budget}, als {a.refit_als}, {a.refit_weight}, {time.perf_counter() - t1:.0f}s): "
                      "calibration score error per layer " + "; ".join(
                          " -> ".join(f"{e:.2e}" for e in errs) for errs in refit.errors.values()), flush=True)
                flat_r, c_r = a3_compress(flat_params(model), c0, stats, cfg, qk_refit=refit)
                refit_model = model_from_flat(c_r, flat_r)
                refit_model.tokenizer = tok
                methods.insert(1, ("A^3 + refit", refit_model, c_r))
            for name, m, c in methods:
                w = {n: "(" + ",".join(str(getattr(c.layer_config(i), n)) for i in range(c.n_layers)) + ")"
                     if getattr(c, f"layer_{n}s") else str(getattr(c, n)) for n in ("qk_head_dim", "v_head_dim", "ffn_dim")}
                err = component_errors(model, m, held_batches, comps)
                acc, nll = evaluate(m)
                row[name] = nll
                errs = " | ".join(f"{err[k]:.2e}" if k in err else "-" for k in ("qk", "ov", "mlp"))
                size = f"{c.num_params():,}" if name != "SVD" else f"~{c.num_params():,} (dense)"
                cache = f"{kv_cache_bytes(c, 1, 1) / kv_cache_bytes(c0, 1, 1):.3f}" if name != "SVD" else "1.000"
                print(f"| {','.join(comps)} | {budget} | {name} | {w['qk_head_dim']}/{w['v_head_dim']}/{w['ffn_dim']} "
                      f"| {size} | {cache} | {errs} | {acc:.3f} | {nll:.4f} |", flush=True)
            if first is None:
                first = row
    inc = {k: v - nll0 for k, v in first.items()}
    for name in [n for n in ("A^3", "A^3 + refit") if n in inc]:
        ratio = f"{inc['SVD'] / inc[name]:.2f}" if inc[name] > 0 else f"n/a ({name} no worse than uncompressed)"
        print(f"\nanswer-NLL increase at budget {a.budgets.split(',')[0]} (all components): {name} {inc[name]:+.4f}, "
              f"SVD {inc['SVD']:+.4f}; SVD / {name} = {ratio}")
    print(f"total {time.perf_counter() - t0:.0f}s")
