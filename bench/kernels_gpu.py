"""W4A16 and fused low-rank kernels on a GPU: time, achieved HBM bandwidth, ratios.

One prepared script for one H200 (finishes in a few minutes):
- W4A16 (MXFP4, INT4-g128) vs a bf16 ``jnp.dot`` at M in {1, 8, 16, 64}, K = N in {4096, 8192};
- the fused low-rank + residual kernel (r in {32, 64}) vs the plain W4A16 kernel.
Each line prints the median time, the achieved bandwidth (bytes the kernel must move /
time) against a measured device-to-device copy, and the speedup. Goals on H200: >= 3x
over bf16 for M <= 16 at K = N = 8192 (byte-ratio ceiling ~3.76x), >= 70% of copy
bandwidth, low-rank overhead <= 15%. Results also go to ``$OUT/kernels_gpu.json`` when
``$OUT`` is set.

    python bench/kernels_gpu.py                # on a GPU
    python bench/kernels_gpu.py --smoke        # CPU, interpret mode, tiny shapes: checks the
                                               # script runs; its timings mean nothing
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def timeit(fn, *args, repeats=20):
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode on CPU")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxlm.quant as Q
    from kernels_pallas import lowrank_w4a16, w4a16

    interpret = args.smoke
    sizes = (256,) if args.smoke else (4096, 8192)
    ms = (1, 8) if args.smoke else (1, 8, 16, 64)
    ranks = (32,) if args.smoke else (32, 64)
    repeats = 2 if args.smoke else 20
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}"
          + ("  [SMOKE: interpret mode, timings meaningless]" if args.smoke else ""))

    # device-to-device copy bandwidth (read + write)
    n_copy = (1 << 20) if args.smoke else (1 << 29)  # 1 GiB of bf16 on a GPU
    buf = jnp.ones((n_copy,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + jnp.bfloat16(0))  # a fused elementwise pass: one read, one write
    t_copy = timeit(copy, buf, repeats=repeats)
    copy_gbs = 2 * buf.nbytes / t_copy / 1e9
    print(f"copy bandwidth: {copy_gbs:,.0f} GB/s")

    rows = []
    rng = np.random.RandomState(0)
    for K in sizes:
        N = K
        w = jnp.asarray(rng.randn(K, N) * 0.02, jnp.float32)
        w_bf16 = w.astype(jnp.bfloat16)
        dense = jax.jit(lambda x, w: jnp.dot(x, w))
        quants = {"mxfp4": Q.quantize(w, Q.mxfp4()), "int4_g128": Q.quantize(w, Q.int4(128))}
        for M in ms:
            x = jnp.asarray(rng.randn(M, K), jnp.bfloat16)
            t_dense = timeit(dense, x, w_bf16, repeats=repeats)
            dense_bytes = w_bf16.nbytes + x.nbytes + M * N * 2
            rows.append(dict(kernel="bf16 jnp.dot", K=K, M=M, ms=t_dense * 1e3,
                             gbs=dense_bytes / t_dense / 1e9))
            for name, q in quants.items():
                kw = dict(element=q.fmt.element, block=q.fmt.block, scale_kind=q.fmt.scale_kind, alpha=q.fmt.alpha)
                fn = jax.jit(lambda x, c, s, g, kw=kw: w4a16.w4a16_matmul(x, c, s, g, interpret=interpret, **kw))
                t = timeit(fn, x, q.codes, q.scales, q.global_scale.reshape(()), repeats=repeats)
                nbytes = q.nbytes + x.nbytes + M * N * 2
                rows.append(dict(kernel=f"w4a16 {name}", K=K, M=M, ms=t * 1e3, gbs=nbytes / t / 1e9,
                                 speedup_vs_bf16=t_dense / t))
                if name == "mxfp4":
                    for r in ranks:
                        P = jnp.asarray(rng.randn(K, r) * 0.02, jnp.bfloat16)
                        Lt = jnp.asarray(rng.randn(r, N) * 0.02, jnp.bfloat16)
                        lr = jax.jit(lambda x, c, s, g, P, Lt, kw=kw: lowrank_w4a16.lowrank_w4a16_matmul(
                            x, c, s, g, P, Lt, interpret=interpret, **kw))
                        t_lr = timeit(lr, x, q.codes, q.scales, q.global_scale.reshape(()), P, Lt, repeats=repeats)
                        rows.append(dict(kernel=f"lowrank r={r} + w4a16 mxfp4", K=K, M=M, ms=t_lr * 1e3,
                                         gbs=(nbytes + P.nbytes + Lt.nbytes) / t_lr / 1e9,
                                         overhead_vs_w4a16=t_lr / t - 1))
    for r in rows:
        extra = ""
        if "speedup_vs_bf16" in r:
            extra = f"  speedup vs bf16 {r['speedup_vs_bf16']:.2f}x"
        if "overhead_vs_w4a16" in r:
            extra = f"  low-rank overhead {100 * r['overhead_vs_w4a16']:+.1f}%"
        print(f"{r['kernel']:32s} K=N={r['K']:5d} M={r['M']:3d}  {r['ms']:8.3f} ms  "
              f"{r['gbs']:8,.0f} GB/s ({100 * r['gbs'] / copy_gbs:5.1f}% of copy){extra}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "kernels_gpu.json"), "w") as f:
            json.dump({"copy_gbs": copy_gbs, "rows": rows, "device": jax.devices()[0].device_kind}, f, indent=2)


if __name__ == "__main__":
    main()
