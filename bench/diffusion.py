"""Diffusion-LM decoding on one trained model and one set of held-out prompts, same run:
LLaDA low-confidence remasking (one token per step, the baseline), Fast-dLLM (threshold,
with and without its dual cache), dLLM-Cache and SPEED's Slow-Fast rule (both directions).
Prints accuracy, steps, tokens/s, the FLOPs reduction and the wall-time ratio against LLaDA.

    python bench/diffusion.py                      # trains configs/diffusion_sort.py first (~3 min)
    python bench/diffusion.py --model runs/diffusion_sort/model --n 200
    python bench/diffusion.py --model runs/diffusion_sort8/model --sort-length 8 --gen-length 16 \
        --block-length 16 --dllm-cache 16,8,0.1 16,16,0   # 6 layers, 8 digits (docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import numpy as np

import jaxlm
from configs.diffusion_sort import get_config
from jaxlm.inference.diffusion import DLLMCache, SlowFast, diffusion_generate
from trainers.loop import train


def trained_model(path: str | None):
    if path is not None:
        return jaxlm.load_model(path), get_config().data.source
    cfg = get_config()
    out = Path(tempfile.mkdtemp()) / "diffusion_sort"
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, out_dir=str(out), progress=False,
                                                               eval_every=0, eval_generate=0))
    train(cfg)
    return jaxlm.load_model(str(out / "model")), cfg.data.source


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a trained diffusion checkpoint (default: train configs/diffusion_sort.py)")
    ap.add_argument("--n", type=int, default=200, help="held-out prompts")
    ap.add_argument("--sort-length", type=int, default=None,
                    help="digits per list of the model's sorting task (default: configs/diffusion_sort.py's)")
    ap.add_argument("--gen-length", type=int, default=8)
    ap.add_argument("--block-length", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per method (after one warm-up)")
    ap.add_argument("--json", action="store_true", help="also print the rows as one JSON list (last line)")
    ap.add_argument("--dllm-cache", nargs="*", default=[], metavar="KP,KR,RHO",
                    help="more dLLM-Cache settings to compare, e.g. 16,8,0.1")
    args = ap.parse_args()
    model, task = trained_model(args.model)
    if args.sort_length is not None:
        task = dataclasses.replace(task, length=args.sort_length)
    examples = [task.example(i, "eval") for i in range(args.n)]
    prompts = [e["prompt"] for e in examples]
    G, L = args.gen_length, args.block_length
    methods = {
        "LLaDA (1 token/step)": dict(steps=G),
        "LLaDA (2 tokens/step)": dict(steps=G // 2),
        "Fast-dLLM threshold 0.9": dict(threshold=0.9),
        "Fast-dLLM threshold 0.9 + dual cache": dict(threshold=0.9, cache="dual"),
        "dLLM-Cache K_p=8 K_r=4 rho=0.25": dict(steps=G, cache=DLLMCache(8, 4, 0.25)),
        "dLLM-Cache K_p=8 K_r=8 rho=0": dict(steps=G, cache=DLLMCache(8, 8, 0.0)),
        **{f"dLLM-Cache K_p={kp} K_r={kr} rho={rho}": dict(steps=G, cache=DLLMCache(int(kp), int(kr), float(rho)))
           for kp, kr, rho in (c.split(",") for c in args.dllm_cache)},
        "SPEED slow-fast (low jointly)": dict(slow_fast=SlowFast(jsd_threshold=0.05, confidence=0.5, fast="low")),
        "SPEED slow-fast (high jointly)": dict(slow_fast=SlowFast(jsd_threshold=0.05, confidence=0.5, fast="high")),
    }
    rows = []
    for name, kw in methods.items():
        run = lambda: diffusion_generate(model, prompts, gen_length=G, block_length=L, **kw)  # noqa: E731
        out = run()  # compile
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = run()
            times.append(time.perf_counter() - t0)
        acc = float(np.mean([task.verify(e, t) for e, t in zip(examples, out.texts)]))
        rows.append((name, acc, out.steps, out.forwards, out.flops, float(np.median(times))))
    base = rows[0]
    print(f"{len(prompts)} prompts, gen_length {G}, block {L}; ratios against {base[0]}")
    print(f"{'method':40s} {'acc':>6s} {'steps':>5s} {'fwd':>4s} {'tok/s':>8s} {'FLOPs x':>8s} {'wall x':>7s}")
    for name, acc, steps, fwd, flops, t in rows:
        print(f"{name:40s} {acc:6.3f} {steps:5d} {fwd:4d} {len(prompts) * G / t:8.0f} {base[4] / flops:8.2f} "
              f"{base[5] / t:7.2f}")
    if args.json:
        print(json.dumps([{"method": name, "accuracy": acc, "steps": steps, "forwards": fwd,
                           "flops_reduction": base[4] / flops, "wall_ratio": base[5] / t}
                          for name, acc, steps, fwd, flops, t in rows]))


if __name__ == "__main__":
    main()
