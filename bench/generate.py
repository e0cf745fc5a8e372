"""Sampling throughput: `jaxlm.generate` vs HF `transformers` `generate` (PyTorch, CPU).

Same tiny random Llama in both (built in transformers, saved, loaded with
`jaxlm.load_hf`), same left-padded prompts, multinomial sampling at temperature 1
with no early stop, so both produce exactly batch x new_tokens tokens. Compilation
(jaxlm) and the first call (HF) are excluded; the best of ``--repeats`` timed runs
calls alternate between the two (so drifts in machine load hit both) and the
median of ``--repeats`` timed calls is reported for each, then the ratio.

    python bench/generate.py            # batch 16, 128 new tokens, 4 layers, width 256
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt-len", type=int, default=32, help="longest prompt; others are shorter")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import jax
    import numpy as np
    import torch
    import transformers

    import jaxlm

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.width, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.prompt_len + args.new_tokens,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    hf_model = transformers.LlamaForCausalLM(hf_config).eval()
    rng = np.random.RandomState(0)
    lengths = rng.randint(args.prompt_len // 2, args.prompt_len + 1, args.batch)
    lengths[0] = args.prompt_len
    prompts = [rng.randint(3, args.vocab, n).tolist() for n in lengths]

    with tempfile.TemporaryDirectory() as d:
        hf_model.save_pretrained(d)
        model = jaxlm.load_hf(d, dtype="float32")

    # --- jaxlm
    def run_jaxlm(seed):
        out = jaxlm.generate(
            model, prompts, max_new_tokens=args.new_tokens, temperature=1.0, rng=seed,
            stop_tokens=[], bucket=1,
        )
        jax.block_until_ready(out.tokens)
        return out

    t0 = time.perf_counter()
    run_jaxlm(0)
    compile_s = time.perf_counter() - t0

    P = args.prompt_len
    ids = torch.zeros((args.batch, P), dtype=torch.long)
    attn = torch.zeros((args.batch, P), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p)
        attn[b, P - len(p):] = 1

    def run_hf():
        with torch.no_grad():
            return hf_model.generate(
                input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0,
                max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0,
            )

    run_hf()
    jaxlm_times, hf_times = [], []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        out = run_jaxlm(r + 1)
        jaxlm_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        seqs = run_hf()
        hf_times.append(time.perf_counter() - t0)
    assert int(np.asarray(out.lengths).sum()) == args.batch * args.new_tokens
    assert seqs.shape == (args.batch, P + args.new_tokens)

    n_tokens = args.batch * args.new_tokens
    jaxlm_tps = n_tokens / float(np.median(jaxlm_times))
    hf_tps = n_tokens / float(np.median(hf_times))
    result = {
        "setting": vars(args),
        "jaxlm_tokens_per_s": round(jaxlm_tps, 1),
        "hf_tokens_per_s": round(hf_tps, 1),
        "ratio_jaxlm_over_hf": round(jaxlm_tps / hf_tps, 2),
        "jaxlm_first_call_s_incl_compile": round(compile_s, 2),
        "jaxlm_call_s": [round(t, 3) for t in jaxlm_times],
        "hf_call_s": [round(t, 3) for t in hf_times],
        "versions": {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
    }
    print(json.dumps(result, indent=2))
    print(
        f"jaxlm {jaxlm_tps:,.0f} tok/s | HF transformers {hf_tps:,.0f} tok/s | "
        f"ratio {jaxlm_tps / hf_tps:.2f}x"
    )


if __name__ == "__main__":
    main()
