"""W4A16 and fused low-rank kernels on a GPU: time, achieved HBM bandwidth, ratios.

One prepared script for one H200 (finishes in a few minutes):
- W4A16 (MXFP4, INT4-g128) vs a bf16 ``jnp.dot`` at M in {1, 8, 16, 64}, K = N in {4096, 8192};
- the fused low-rank + residual kernel (r in {32, 64}) vs the plain W4A16 kernel;
- model level: a WUSH-transformed W4A4 layer (`jaxlm.quant.w4a4.TransformedWeight`, NVFP4 and
  MXFP4, K = N = 4096) through ``linear`` under the ``kernel`` backend (fused per-block
  transform + activation quantization, then the W4A4 kernel) vs the bf16 ``jnp.dot``, and
  the same layer's jnp path (``reference`` backend: fake-quantized activations, W4A16);
- the grammar mask (`kernels_pallas.grammar_mask`: bits unpacked in-kernel) vs its jnp path
  at batch 1 / 16 / 64 over 32,000 and 151,936 logits (K = the vocabulary, M = the batch).
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


def model_level(smoke: bool, rng, ms, repeats) -> list[dict]:
    """A WUSH W4A4 layer through `linear` (kernels) vs the bf16 dense matmul: per-block
    transforms from a synthetic second moment (diagonal with outlier channels plus a rank-64
    term) and a random weight."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxlm.quant as Q
    from jaxlm.models.layers.linear import linear
    from jaxlm.quant.transforms import transform_weights, wush_transform
    from jaxlm.quant.w4a4 import TransformedWeight

    K = N = 256 if smoke else 4096
    kernel_mode = "interpret" if smoke else "kernel"
    d = np.ones(K)
    d[rng.choice(K, K // 64, replace=False)] = 10.0
    V = rng.randn(K, 64) * d[:, None] / 8
    H = np.diag(d**2) + V @ V.T
    W = rng.randn(K, N) * 0.02
    w_bf16 = jnp.asarray(W, jnp.bfloat16)
    dense = jax.jit(lambda x, w: jnp.dot(x, w))
    layer = jax.jit(lambda x, w: linear(x, w))

    def under(mode):
        def run(x, w):
            with Q.backend(mode):  # part of the jit cache key: one trace per backend
                return layer(x, w)
        return run

    weights = {}
    for fmt in (Q.nvfp4(), Q.mxfp4()):
        T = wush_transform(H, W, fmt.block)
        q = Q.quantize(transform_weights(jnp.asarray(W, jnp.float32), T), fmt, axis=-2)
        weights[fmt.name] = TransformedWeight(T, q, fmt)
    rows = []
    for M in ms:
        x = jnp.asarray(rng.randn(M, K) * d, jnp.bfloat16)
        t_dense = timeit(dense, x, w_bf16, repeats=repeats)
        rows.append(dict(kernel="layer bf16 jnp.dot", K=K, M=M, ms=t_dense * 1e3,
                         gbs=(w_bf16.nbytes + x.nbytes + M * N * 2) / t_dense / 1e9))
        for name, w in weights.items():
            nbytes = w.weight.nbytes + w.T.nbytes + x.nbytes + M * N * 2
            for label, mode in (("kernels", kernel_mode), ("jnp path", "reference")):
                if smoke and mode == "reference" and name == "mxfp4":
                    continue
                t = timeit(under(mode), x, w, repeats=repeats)
                rows.append(dict(kernel=f"layer W4A4 WUSH {name} {label}", K=K, M=M, ms=t * 1e3,
                                 gbs=nbytes / t / 1e9, speedup_vs_bf16=t_dense / t))
    return rows


def grammar_mask_rows(smoke: bool, rng, repeats) -> list[dict]:
    """The masked logits ``[B, V]`` from each row's packed words ``[B, V/32]``: the kernel
    against the jnp path the sampler runs by default (bytes: logits read and written, words)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas import grammar_mask

    rows = []
    for V in ((1000,) if smoke else (32000, 151936)):
        for B in ((1, 8) if smoke else (1, 16, 64)):
            logits = jnp.asarray(rng.randn(B, V), jnp.float32)
            words = jnp.asarray(rng.randint(-(2**31), 2**31 - 1, size=(B, -(-V // 32))), jnp.int32)
            nbytes = 2 * logits.nbytes + words.nbytes
            ref = jax.jit(grammar_mask.reference)
            kernel = jax.jit(lambda x, w: grammar_mask.masked_logits(x, w, interpret=smoke))
            np.testing.assert_array_equal(np.asarray(kernel(logits, words)), np.asarray(ref(logits, words)))
            t_ref = timeit(ref, logits, words, repeats=repeats)
            t = timeit(kernel, logits, words, repeats=repeats)
            rows.append({"kernel": "grammar mask jnp path", "K": V, "M": B, "ms": t_ref * 1e3,
                         "gbs": nbytes / t_ref / 1e9})
            rows.append({"kernel": "grammar mask kernel", "K": V, "M": B, "ms": t * 1e3, "gbs": nbytes / t / 1e9,
                         "speedup_vs_jnp": t_ref / t})
    return rows


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
    try:  # the fused transform + quantize kernel's GPU lowering has never run: keep the rows above
        rows += model_level(args.smoke, rng, ms, repeats)
    except Exception as e:  # noqa: BLE001
        print(f"model-level W4A4 entry failed: {type(e).__name__}: {e}")
        rows.append(dict(kernel="layer W4A4 WUSH (failed)", error=f"{type(e).__name__}: {e}"))
    try:  # nor has the grammar mask kernel's
        rows += grammar_mask_rows(args.smoke, rng, repeats)
    except Exception as e:  # noqa: BLE001
        print(f"grammar mask entry failed: {type(e).__name__}: {e}")
        rows.append({"kernel": "grammar mask (failed)", "error": f"{type(e).__name__}: {e}"})
    for r in rows:
        if "error" in r:
            continue
        extra = ""
        if "speedup_vs_bf16" in r:
            extra = f"  speedup vs bf16 {r['speedup_vs_bf16']:.2f}x"
        if "speedup_vs_jnp" in r:
            extra = f"  speedup vs jnp path {r['speedup_vs_jnp']:.2f}x"
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
