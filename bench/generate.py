"""Decoding throughput: `jaxlm.generate` vs HF `transformers` `generate` (PyTorch, CPU), as a grid.

Cells: batch x vocabulary x mode (``greedy`` = argmax, ``sampling`` = multinomial at
temperature 1, no top-k / top-p). Per vocabulary one random Llama is built in transformers,
saved and loaded with `jaxlm.load_hf`, so both decode the same weights from the same
left-padded prompts, with no early stop: both produce exactly batch x new_tokens tokens.
Per cell, jaxlm's first call (compilation) and HF's first call are excluded; then
``--repeats`` timed calls alternate between the two (so drifts in machine load hit both) and
the medians are compared. Wall-clock and process CPU time are both reported (on a shared
machine the CPU-time ratio is the steadier one). Greedy cells also report how many rows
produced exactly HF's tokens.

    python bench/generate.py                                    # the grid: batch 1/16/64 x vocab 512/32000 x greedy/sampling
    python bench/generate.py --batch 16 --vocab 512 --mode greedy   # one cell
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def timed(fn):
    """``(result, wall seconds, process CPU seconds)`` of one call."""
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--vocab", type=int, nargs="+", default=[512, 32000])
    ap.add_argument("--mode", nargs="+", choices=("greedy", "sampling"), default=["greedy", "sampling"])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=32, help="longest prompt; the others are 1/2 to 1x as long")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--host-allocator", choices=("system", "tuned"), default=None,
                    help="JAXLM_HOST_ALLOCATOR for this run (`jaxlm.host_allocator`; default: the environment's, "
                         "else system)")
    args = ap.parse_args()
    if args.host_allocator:
        os.environ["JAXLM_HOST_ALLOCATOR"] = args.host_allocator  # read by `import jaxlm`, below

    import jax
    import numpy as np
    import torch
    import transformers

    import jaxlm

    versions = {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                "torch_threads": torch.get_num_threads(),
                "host_allocator": os.environ.get("JAXLM_HOST_ALLOCATOR", "system")}
    print(json.dumps({"setting": vars(args), "versions": versions}))
    header = (f"{'batch':>5} {'vocab':>6} {'mode':>8} | {'jaxlm tok/s':>11} {'HF tok/s':>9} {'ratio':>6} | "
              f"{'CPU ratio':>9} | greedy rows = HF")
    print(header)
    print("-" * len(header))
    rows = []
    for vocab in args.vocab:
        torch.manual_seed(0)
        hf_config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=args.width, intermediate_size=args.ffn,
            num_hidden_layers=args.layers, num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads, max_position_embeddings=args.prompt_len + args.new_tokens,
            pad_token_id=0, bos_token_id=1, eos_token_id=None,
        )
        hf_model = transformers.LlamaForCausalLM(hf_config).eval()
        hf_model.generation_config.eos_token_id = None  # no early stop: exactly new_tokens per row
        with tempfile.TemporaryDirectory() as d:
            hf_model.save_pretrained(d)
            model = jaxlm.load_hf(d, dtype="float32")

        for batch in args.batch:
            rng = np.random.RandomState(batch)
            lengths = rng.randint(max(1, args.prompt_len // 2), args.prompt_len + 1, batch)
            lengths[0] = args.prompt_len
            prompts = [rng.randint(3, vocab, n).tolist() for n in lengths]
            P = args.prompt_len
            ids = torch.zeros((batch, P), dtype=torch.long)
            attn = torch.zeros((batch, P), dtype=torch.long)
            for b, p in enumerate(prompts):
                ids[b, P - len(p):] = torch.tensor(p)
                attn[b, P - len(p):] = 1

            for mode in args.mode:
                greedy = mode == "greedy"

                def run_jaxlm(seed):
                    out = jaxlm.generate(
                        model, prompts, max_new_tokens=args.new_tokens, temperature=0.0 if greedy else 1.0,
                        rng=seed, stop_tokens=[], bucket=1,
                    )
                    jax.block_until_ready(out.tokens)
                    return out

                def run_hf():
                    with torch.no_grad():
                        kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0)
                        return hf_model.generate(
                            input_ids=ids, attention_mask=attn, max_new_tokens=args.new_tokens, pad_token_id=0,
                            **kw,
                        )

                _, compile_s, _ = timed(lambda: run_jaxlm(0))
                run_hf()
                jw, jc, hw, hc = [], [], [], []
                for r in range(args.repeats):
                    out, w, c = timed(lambda: run_jaxlm(r + 1))
                    jw.append(w), jc.append(c)
                    seqs, w, c = timed(run_hf)
                    hw.append(w), hc.append(c)
                n_tokens = batch * args.new_tokens
                assert int(np.asarray(out.lengths).sum()) == n_tokens
                assert tuple(seqs.shape) == (batch, P + args.new_tokens)
                same = None
                if greedy:
                    same = int(np.sum(np.all(np.asarray(out.tokens) == seqs[:, P:].numpy(), axis=1)))
                j_tps, h_tps = n_tokens / float(np.median(jw)), n_tokens / float(np.median(hw))
                cpu_ratio = float(np.median(hc)) / float(np.median(jc))
                row = {
                    "batch": batch, "vocab": vocab, "mode": mode,
                    "jaxlm_tokens_per_s": round(j_tps, 1), "hf_tokens_per_s": round(h_tps, 1),
                    "ratio": round(j_tps / h_tps, 2), "cpu_ratio": round(cpu_ratio, 2),
                    "jaxlm_call_s": [round(t, 4) for t in jw], "hf_call_s": [round(t, 4) for t in hw],
                    "jaxlm_cpu_s": [round(t, 4) for t in jc], "hf_cpu_s": [round(t, 4) for t in hc],
                    "jaxlm_first_call_s": round(compile_s, 2), "greedy_rows_equal_hf": same,
                }
                rows.append(row)
                same_txt = f"{same}/{batch}" if greedy else "-"
                print(f"{batch:>5} {vocab:>6} {mode:>8} | {j_tps:>11,.0f} {h_tps:>9,.0f} {j_tps / h_tps:>5.2f}x | "
                      f"{cpu_ratio:>8.2f}x | {same_txt}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setting": vars(args), "versions": versions, "cells": rows}, f, indent=2)
    worst = min(rows, key=lambda r: r["ratio"])
    print(f"lowest ratio: {worst['ratio']:.2f}x (batch {worst['batch']}, vocab {worst['vocab']}, {worst['mode']})")


if __name__ == "__main__":
    main()
