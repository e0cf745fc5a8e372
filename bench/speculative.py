"""Speculative decoding throughput: `jaxlm.generate` with and without a draft model, and HF
`transformers` assisted generation (``assistant_model=``) on the same weights, CPU.

A target (8 layers, width 512) and a draft (2 layers, width 128) are trained on the same
synthetic Markov-chain text (`MarkovText`: made-up words; ``--fanout`` successors per word,
default 1, a deterministic chain), so greedy continuations are predictable and the draft
agrees often. Both are exported with
`jaxlm.save_hf` and loaded into transformers. Per cell the first call (compilation) is
excluded; then ``--repeats`` timed calls alternate between the runs and medians are
compared. Greedy, no early stop: every row produces exactly ``--new-tokens`` tokens, and
the speculative output is checked to equal plain greedy token for token.

    python bench/speculative.py                     # trains both models once (runs/speculative)
    python bench/speculative.py --batch 1 --k 2 4 8
    python bench/speculative.py --run runs/spec_long --words 40 40 --seq-len 256 --k 4 8 16   # long sentences
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def train_model(out: Path, model, steps: int, batch_size: int, task, seq_len: int):
    from jaxlm.data.pipeline import DataConfig
    from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig
    from trainers.loop import train

    if not (out / "model").exists():
        train(ExperimentConfig(
            model=model,
            data=DataConfig(source=task, seq_len=seq_len, batch_size=batch_size, pack=True, eval_examples=32),
            optimizer=OptimizerConfig(lr=2e-3, warmup_steps=30, min_lr_ratio=0.1),
            trainer=TrainerConfig(steps=steps, out_dir=str(out), progress=False, log_every=50, eval_every=0,
                                  save_every=100_000, eval_generate=0),
            algorithm=SFTConfig(), tokenizer="byte",
        ))
    return out / "model"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/speculative")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8], help="drafted tokens per verify round")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--target-steps", type=int, default=200)
    ap.add_argument("--draft-steps", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fanout", type=int, default=1, help="successors per word of the Markov chain")
    ap.add_argument("--words", type=int, nargs=2, default=[6, 12], metavar=("MIN", "MAX"),
                    help="words per sentence; sentence starts and ends are where a deterministic chain is "
                         "unpredictable, so long sentences make the draft agree more often")
    ap.add_argument("--seq-len", type=int, default=128, help="training sequence length (packed)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers assisted generation")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import jax
    import numpy as np

    import jaxlm
    from jaxlm.data.tasks import MarkovText

    run = Path(args.run)
    tcfg = jaxlm.ModelConfig.tiny(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536, max_seq_len=512)
    dcfg = jaxlm.ModelConfig.tiny(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=512)
    task = MarkovText(fanout=args.fanout, min_words=args.words[0], max_words=args.words[1])
    target = jaxlm.load_checkpoint(train_model(run / "target", tcfg, args.target_steps, 8, task, args.seq_len))
    draft = jaxlm.load_checkpoint(train_model(run / "draft", dcfg, args.draft_steps, 16, task, args.seq_len))
    tok = target.tokenizer
    texts = [" ".join(task.example(i, "eval")["completion"].split()[:2]) + " " for i in range(max(args.batch))]

    hf = None
    if not args.no_hf:
        import torch
        import transformers

        for name, m in (("target", target), ("draft", draft)):
            if not (run / f"hf_{name}").exists():
                jaxlm.save_hf(m, run / f"hf_{name}")
        hf = {name: transformers.AutoModelForCausalLM.from_pretrained(run / f"hf_{name}", dtype=torch.float32).eval()
              for name in ("target", "draft")}
        for m in hf.values():
            m.generation_config.eos_token_id = None
            m.generation_config.pad_token_id = 0

    versions = {"jax": jax.__version__}
    if hf:
        versions.update(torch=torch.__version__, transformers=transformers.__version__)
    print(json.dumps({"setting": vars(args), "versions": versions}))
    rows = []
    for batch in args.batch:
        prompts = [tok.encode(t, add_bos=True) for t in texts[:batch]]
        N = args.new_tokens

        def run_jaxlm(draft_model=None, k=4):
            out = jaxlm.generate(target, prompts, max_new_tokens=N, temperature=0, stop_tokens=(), bucket=1,
                                 draft=draft_model, num_draft_tokens=k)
            jax.block_until_ready(out.tokens)
            return out

        calls = {"plain": lambda: run_jaxlm()}
        for k in args.k:
            calls[f"spec k={k}"] = (lambda k=k: run_jaxlm(draft, k))
        if hf and batch == 1:  # transformers' assisted generation takes one sequence at a time
            ids = torch.tensor([prompts[0]])

            def hf_call(assistant):
                with torch.no_grad():
                    return hf["target"].generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                 max_new_tokens=N, min_new_tokens=N, do_sample=False,
                                                 assistant_model=assistant)

            calls["HF plain"] = lambda: hf_call(None)
            calls["HF assisted"] = lambda: hf_call(hf["draft"])
        results = {name: fn() for name, fn in calls.items()}  # first calls (compilation) excluded
        wall = {name: [] for name in calls}
        cpu = {name: [] for name in calls}
        for _ in range(args.repeats):
            for name, fn in calls.items():
                results[name], w, c = timed(fn)
                wall[name].append(w), cpu[name].append(c)
        plain = np.asarray(results["plain"].tokens)
        med = {name: float(np.median(v)) for name, v in wall.items()}
        print(f"\nbatch {batch}, {N} new tokens per row (greedy)")
        print(f"{'run':>14} | {'tok/s':>8} | {'vs plain jaxlm':>14} | {'tokens/round':>12} | output == plain greedy")
        for name in calls:
            r = results[name]
            tps = batch * N / med[name]
            if name.startswith("HF"):
                gen = r[0, len(prompts[0]):].numpy()
                same = bool(np.array_equal(gen, plain[0]))
                per_round = "-"
            else:
                same = bool(np.array_equal(np.asarray(r.tokens), plain))
                per_round = "-" if r.verify_rounds is None else f"{(N - 1) / float(np.mean(np.asarray(r.verify_rounds))):.2f}"
            ratio = med["plain"] / med[name]
            print(f"{name:>14} | {tps:>8,.0f} | {ratio:>13.2f}x | {per_round:>12} | {same}")
            rows.append({"batch": batch, "run": name, "tokens_per_s": round(tps, 1), "vs_plain_jaxlm": round(ratio, 2),
                         "tokens_per_round": per_round, "equal_plain_greedy": same,
                         "wall_s": [round(t, 4) for t in wall[name]], "cpu_s": [round(t, 4) for t in cpu[name]]})
        if "HF assisted" in med:
            for k in args.k:
                print(f"spec k={k} vs HF assisted: {med['HF assisted'] / med[f'spec k={k}']:.2f}x "
                      f"(CPU time {np.median(cpu['HF assisted']) / np.median(cpu[f'spec k={k}']):.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
