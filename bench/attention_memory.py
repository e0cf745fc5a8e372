"""Peak memory of attention at long sequence length: the reference path (which forms the
``[B, N, T, S]`` probabilities) vs the probability-free paths (`ModelConfig.attention_impl`).

For each implementation, a random Llama-style model (default: 2 layers, width 256, 4 heads,
vocab 512, fp32) runs a forward pass and a forward + backward pass (gradient of the mean
next-token loss with respect to every parameter) on one sequence of ``--seq-len`` tokens.
Reported per implementation, each measured in its own process:

- XLA's buffer assignment of the compiled executable (`compiled.memory_analysis()`):
  temporaries (``temp``), i.e. everything besides arguments and outputs;
- the process's peak resident memory (``ru_maxrss``) after running forward + backward once,
  and its resident memory just before (the runtime, the model and the compiled programs);
- the median time of ``--repeats`` forward + backward calls (CPU timings vary; compare the
  implementations of one run).

    python bench/attention_memory.py                      # T = 4096: reference, auto, xla
    python bench/attention_memory.py --seq-len 8192 --impls reference auto
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def rss_mib() -> float:
    """Current resident memory of this process (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import jaxlm
    from jaxlm.models.layers.attention import QUERY_CHUNK, resolve_attention_impl

    cfg = jaxlm.ModelConfig(
        vocab_size=args.vocab, d_model=args.width, n_layers=args.layers, n_heads=args.heads,
        n_kv_heads=args.kv_heads, ffn_dim=4 * args.width, max_seq_len=args.seq_len, attention_impl=args.child,
    )
    model = jaxlm.build_model(cfg, seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    T = args.seq_len
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, args.vocab, (1, T)), jnp.int32)

    def loss(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens).logits
        lp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1))

    fwd = jax.jit(loss).lower(params, tokens).compile()
    fwd_bwd = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
    mib = lambda b: round(b / 2**20, 1)  # noqa: E731
    mf, mb = fwd.memory_analysis(), fwd_bwd.memory_analysis()
    q = jax.ShapeDtypeStruct((1, T, args.heads, args.width // args.heads), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, args.kv_heads, T, args.width // args.heads), jnp.float32)
    resolved = resolve_attention_impl(args.child, q, kv, kv, need_probs=False)
    before = rss_mib()
    jax.block_until_ready(fwd_bwd(params, tokens))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fwd_bwd(params, tokens))
        times.append(time.perf_counter() - t0)
    return {
        "impl": args.child, "resolves_to": resolved, "query_chunk": QUERY_CHUNK if resolved == "chunked" else None,
        "fwd_temp_mib": mib(mf.temp_size_in_bytes), "fwd_bwd_temp_mib": mib(mb.temp_size_in_bytes),
        "args_mib": mib(mb.argument_size_in_bytes), "rss_before_mib": round(before, 1),
        "peak_rss_mib": round(peak, 1), "fwd_bwd_s": round(float(np.median(times)), 3),
        "probs_per_layer_mib": mib(4 * args.heads * T * T),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--impls", nargs="+", default=["reference", "auto", "xla"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args)))
        return

    import jax

    print(json.dumps({"setting": {k: v for k, v in vars(args).items() if k != "child"},
                      "jax": jax.__version__, "backend": jax.default_backend()}))
    header = (f"{'impl':>10} {'runs as':>10} | {'fwd temp':>9} {'fwd+bwd temp':>12} | {'RSS before':>10} "
              f"{'peak RSS':>9} | {'fwd+bwd s':>9}")
    print(header)
    print("-" * len(header))
    rows = []
    for impl in args.impls:
        cmd = [sys.executable, __file__, "--child", impl] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("child", "impls")
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        rows.append(r)
        print(f"{r['impl']:>10} {r['resolves_to']:>10} | {r['fwd_temp_mib']:>7} M {r['fwd_bwd_temp_mib']:>10} M | "
              f"{r['rss_before_mib']:>8} M {r['peak_rss_mib']:>7} M | {r['fwd_bwd_s']:>9}", flush=True)
    print(f"(one layer's [1, N, T, T] float32 probabilities: {rows[0]['probs_per_layer_mib']} MiB)")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
