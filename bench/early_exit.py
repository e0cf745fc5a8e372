"""WAVE early exit: layers saved and wall time against full depth at equal accuracy (CPU).

Trains the quickstart recipe (`configs/quickstart.py`) with 6 layers on clean 2-digit
addition (once, under ``--run``), calibrates on 256 held-out problems that the evaluation
never sees (``--calibrate-on train``: training problems): the exit window from the
teacher-forced settled layers at the positions that predict answer tokens, the threshold
from decoding the problems' prompts with exits, the smallest whose answers equal full
depth's on ``--agreement`` of them (``--calibrate teacher-forced``: the teacher-forced
per-token agreement). Then it measures on 200 other held-out problems: exact-match
accuracy and mean layers
per generated token with and without exits (batch 64), and the wall time of greedy
decoding at batch 1 (exits save compute only when every row of a batch has left, so a
batch of one is where the time shows): whole calls of 6 new tokens, and their decode steps
alone (a call minus a one-token call). Also the threshold sweep of the calibration.

    python bench/early_exit.py                    # -> runs/early_exit
    python bench/early_exit.py --agreement 0.98 --quantiles 0.05 0.95
    python bench/early_exit.py --calibrate teacher-forced --calibrate-on train  # the first calibration
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def answer_positions(pairs):
    """Positions whose next token is an answer token (where decoding happens)."""
    import numpy as np

    m = np.zeros_like(pairs.target_mask)
    m[:, :-1] = pairs.target_mask[:, 1:]
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/early_exit")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0, help="the training run's seed")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--calibration", type=int, default=256, help="problems to calibrate on")
    ap.add_argument("--calibrate-on", choices=("train", "held-out"), default="held-out",
                    help="calibration problems: training ones, or held-out ones disjoint from the evaluated set")
    ap.add_argument("--eval", type=int, default=200, help="held-out problems")
    ap.add_argument("--timed", type=int, default=24, help="held-out problems decoded one at a time for wall time")
    ap.add_argument("--agreement", type=float, default=0.99)
    ap.add_argument("--quantiles", type=float, nargs=2, default=(0.1, 0.9))
    ap.add_argument("--proxy-vocab", type=int, default=16)
    ap.add_argument("--calibrate", choices=("teacher-forced", "decode"), default="decode",
                    help="how the threshold is chosen: teacher-forced agreement per answer token, or "
                         "decoded answers equal to full depth's (sequence level)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import jax
    import numpy as np

    import jaxlm
    from jaxlm.data.tasks import Arithmetic
    from jaxlm.editing.requests import encode_pairs
    from jaxlm.eval.accuracy import task_accuracy
    from jaxlm.inference.early_exit import calibrate_exit_window
    from jaxlm.inference.exit_threshold import calibrate_threshold_by_decoding
    from trainers.loop import train
    from trainers.recipes import load_config

    task = Arithmetic(digits=2, ops=("+",))
    run = Path(args.run)
    if not (run / "model").exists():
        train(load_config("quickstart", [f"model.n_layers={args.layers}", "data.source.carry_slip=0",
                                         f"trainer.steps={args.steps}", f"trainer.out_dir={run}",
                                         f"trainer.seed={args.seed}",
                                         "trainer.progress=false"]))
    model = jaxlm.load_checkpoint(run / "model")
    cfg = model.config
    tok = model.tokenizer
    held = [task.example(i, "eval") for i in range(args.eval)]
    if args.calibrate_on == "train":
        cal_ex = [task.example(i, "train") for i in range(args.calibration)]
    else:  # held-out problems the evaluation never sees
        evaluated, cal_ex, i = {e["prompt"] for e in held}, [], args.eval
        while len(cal_ex) < args.calibration:
            e = task.example(i, "eval")
            i += 1
            if e["prompt"] not in evaluated:
                evaluated.add(e["prompt"])
                cal_ex.append(e)
    pairs = encode_pairs(tok, [e["prompt"] for e in cal_ex], [e["completion"] for e in cal_ex], append_eos=True)
    cal = calibrate_exit_window(model, pairs.tokens, pairs.valid, score_mask=answer_positions(pairs),
                                quantiles=tuple(args.quantiles), agreement=args.agreement, proxy_vocab=args.proxy_vocab)
    w = cal.window
    print(f"calibration: window [{w.start}, {w.end}] of {cfg.n_layers}, threshold {w.threshold}, "
          f"proxy vocab {w.proxy_vocab}; simulated agreement {cal.agreement:.3f}, layers {cal.mean_layers:.2f}")
    print("settled-layer histogram:", np.bincount(cal.settled, minlength=cfg.n_layers + 1)[1:].tolist())
    if args.calibrate == "decode":
        teacher_forced = cal
        cal = calibrate_threshold_by_decoding(model, [e["prompt"] for e in cal_ex], w, max_new_tokens=6,
                                              agreement=args.agreement)
        w = cal.window
        print(f"threshold by decoding: {w.threshold} (teacher-forced: {teacher_forced.window.threshold}); decoded "
              f"answers equal to full depth {cal.agreement:.3f}, layers per decoded token {cal.mean_layers:.2f}")

    rows = {}
    for name, kw in (("full depth", {}), ("WAVE", {"early_exit": w})):
        acc = task_accuracy(model, held, task.verify, tokenizer=tok, max_new_tokens=6, generate_kwargs=kw)
        rows[name] = {"accuracy": acc.accuracy}
    # layers per generated token (decoded tokens only: the first comes from the full-depth prefill)
    out = jaxlm.generate(model, [e["prompt"] for e in held], max_new_tokens=6, temperature=0, early_exit=w)
    exits = np.asarray(out.exit_layers)
    lengths = np.asarray(out.lengths)
    decoded = np.concatenate([exits[b, 1:lengths[b]] for b in range(len(held))])
    all_tokens = np.concatenate([exits[b, :lengths[b]] for b in range(len(held))])
    rows["full depth"].update(layers_decoded=float(cfg.n_layers), layers_all=float(cfg.n_layers))
    rows["WAVE"].update(layers_decoded=float(decoded.mean()), layers_all=float(all_tokens.mean()))

    def timed_run(kw, new_tokens):
        t0 = time.perf_counter()
        for e in held[: args.timed]:
            r = jaxlm.generate(model, [e["prompt"]], max_new_tokens=new_tokens, temperature=0, stop_tokens=(), **kw)
            jax.block_until_ready(r.tokens)
        return time.perf_counter() - t0

    # A call's fixed cost (host work, prefill, the first token at full depth) is measured by a
    # one-token call and subtracted, which leaves the decode steps where exits act.
    configs = {"full depth": {}, "WAVE": {"early_exit": w}}
    for kw in configs.values():  # compile
        timed_run(kw, 6), timed_run(kw, 1)
    times = {name: {"call": [], "prefill": []} for name in configs}
    for _ in range(5):
        for name, kw in configs.items():
            times[name]["call"].append(timed_run(kw, 6))
            times[name]["prefill"].append(timed_run(kw, 1))
    med = {name: {k: float(np.median(v)) for k, v in t.items()} for name, t in times.items()}
    decode = {name: max(m["call"] - m["prefill"], 1e-9) for name, m in med.items()}
    print(f"\n{'run':>10} | {'accuracy':>8} | {'layers / decoded token':>22} | {'layers / token':>14} | "
          f"{'batch-1 call':>12} | vs full | {'decode steps':>12} | vs full")
    for name in configs:
        r = rows[name]
        call, steps = med[name]["call"], decode[name]
        r.update(wall_s=call, vs_full=med["full depth"]["call"] / call, decode_s=steps,
                 decode_vs_full=decode["full depth"] / steps)
        print(f"{name:>10} | {r['accuracy']:>8.3f} | {r['layers_decoded']:>22.2f} | {r['layers_all']:>14.2f} | "
              f"{call:>11.3f}s | {r['vs_full']:.2f}x | {steps:>11.3f}s | {r['decode_vs_full']:.2f}x")
    print(f"\nthreshold sweep ({'decoded' if args.calibrate == 'decode' else 'simulated'} on calibration):")
    for s in cal.sweep:
        print(f"  {s['threshold']:<6g}: agreement {s['agreement']:.3f}, layers {s['mean_layers']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"window": vars(w), "calibrate": args.calibrate,
                                               "calibrate_on": args.calibrate_on, "rows": rows,
                                               "sweep": cal.sweep}, indent=2))


if __name__ == "__main__":
    main()
