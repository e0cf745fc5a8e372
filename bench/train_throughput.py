"""SFT training throughput against each framework's own GEMM floor, jaxlm vs PyTorch + HF.

Same random Llama in both (built in transformers, loaded with `jaxlm.load_hf`), same batch of
token ids (every target trained), AdamW (weight decay on matrices only) with global-norm
clipping, fp32, CPU. Peer: a plain PyTorch loop over HF `transformers`
(``model(input_ids, labels=...)``, ``backward``, ``clip_grad_norm_``, ``AdamW.step``; SDPA).

The floor of a step is the time of its matrix products alone: every matmul of one training
step at its own shapes, as plain GEMM calls, timed in the same run. Forward: the q/k/v/o
projections, the attention scores ``q k^T`` and context ``p v`` (batched over batch x heads),
gate/up/down of the MLP and the LM head. Backward: the two gradient matmuls of each forward
matmul ``y = x w`` (``dx = dy w^T``, ``dw = x^T dy``), so the floor is three GEMMs per
forward matmul. jaxlm's floor is all of them in one jitted function (``jnp.dot`` /
``jnp.einsum``, output buffers donated); PyTorch's is the same list of ``torch.matmul(...,
out=)`` calls. Both write into preallocated memory, so a floor is the GEMMs' arithmetic and
not the first touch of freshly mapped pages (which costs a step here: see
``--hugepages``). ``step / floor`` is
then what each framework spends beyond its own GEMMs (embedding, norms, RoPE, softmax,
cross-entropy, the optimizer, framework overhead), and ``jaxlm / PyTorch`` compares steps.

Compilation and first steps are excluded; the four timed calls (jaxlm step, jaxlm floor,
PyTorch step, PyTorch floor) alternate so machine drift hits all of them, and medians are
compared (wall time, and process CPU time as a steadier second reading on a shared machine).
With no shape flags both grid shapes run:

    python bench/train_throughput.py                 # quickstart shape and the width-1024 shape
    python bench/train_throughput.py --shape B       # one of them (B or W1024)
    python bench/train_throughput.py --layers 4 --width 256 --heads 4 --ffn 1024 --vocab 32000 \\
        --batch 16 --seq-len 128                     # any other shape
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

SHAPES = {
    # the quickstart model's shape ("setting B" of the old table)
    "B": dict(layers=3, width=128, heads=4, ffn=384, vocab=259, batch=64, seq_len=32, steps=20),
    # a width-1024 Llama: 2 layers, 16 heads of 64, SwiGLU 2816, 32k vocabulary, 8 x 128 tokens
    "W1024": dict(layers=2, width=1024, heads=16, ffn=2816, vocab=32000, batch=8, seq_len=128, steps=7),
}


def matmuls(s: dict) -> list[tuple[int, int, int, int]]:
    """The forward matmuls of one step as ``(batch, m, k, n)``: ``[batch, m, k] x [batch, k, n]``."""
    N, D, H = s["batch"] * s["seq_len"], s["width"], s["width"] // s["heads"]
    BH, T = s["batch"] * s["heads"], s["seq_len"]
    per_layer = [
        (1, N, D, D), (1, N, D, D), (1, N, D, D),  # q, k, v
        (BH, T, H, T),  # scores q k^T
        (BH, T, T, H),  # context p v
        (1, N, D, D),  # o
        (1, N, D, s["ffn"]), (1, N, D, s["ffn"]), (1, N, s["ffn"], D),  # gate, up, down
    ]
    return per_layer * s["layers"] + [(1, N, D, s["vocab"])]  # + LM head


def gemm_flops(s: dict) -> float:
    return sum(3 * 2.0 * b * m * k * n for b, m, k, n in matmuls(s))


def jax_floor(s: dict):
    """A jitted ``f(operands, outputs) -> outputs`` running every GEMM of a step, its operands,
    and output buffers. The outputs are donated, so every call writes into the same
    (resident) memory: the floor times the arithmetic, not first touches of fresh pages."""
    import jax
    import jax.numpy as jnp

    def one(x, w, g):
        if x.shape[0] == 1:  # a projection: 2-D GEMMs, as `linear` runs them
            x, w, g = x[0], w[0], g[0]
            return jnp.dot(x, w), jnp.dot(g, w.T), jnp.dot(x.T, g)
        return (jnp.einsum("bmk,bkn->bmn", x, w), jnp.einsum("bmn,bkn->bmk", g, w),
                jnp.einsum("bmk,bmn->bkn", x, g))

    keys = iter(jax.random.split(jax.random.key(1), 3 * len(matmuls(s))))
    ops = [tuple(jax.random.normal(next(keys), shape, jnp.float32) for shape in ((b, m, k), (b, k, n), (b, m, n)))
           for b, m, k, n in matmuls(s)]
    f = jax.jit(lambda ops, outs: [one(*o) for o in ops], donate_argnums=(1,), keep_unused=True)
    outs = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(lambda o: [one(*x) for x in o], ops))
    return f, ops, outs


def torch_floor(s: dict):
    """``f()`` running every GEMM of a step with ``torch.matmul(..., out=)`` on preallocated
    operands and outputs."""
    import torch

    g = torch.Generator().manual_seed(1)
    ops = []
    for b, m, k, n in matmuls(s):
        x, w, gy = (torch.randn(shape, generator=g) for shape in ((b, m, k), (b, k, n), (b, m, n)))
        if b == 1:
            x, w, gy = x[0], w[0], gy[0]
        outs = (torch.empty(gy.shape), torch.empty(x.shape), torch.empty(w.shape))
        ops.append((x, w, gy, outs))

    def f():
        with torch.no_grad():
            for x, w, gy, (y, dx, dw) in ops:
                torch.matmul(x, w, out=y)
                torch.matmul(gy, w.transpose(-1, -2), out=dx)
                torch.matmul(x.transpose(-1, -2), gy, out=dw)

    return f


def run_shape(s: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers
    from flax import nnx

    import jaxlm
    from trainers.config import OptimizerConfig
    from trainers.optim import make_optimizer
    from trainers.step import init_state, make_train_step

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["width"], intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
        max_position_embeddings=s["seq_len"],
    )
    hf_model = transformers.LlamaForCausalLM(hf_config)
    hf_model.config._attn_implementation = "sdpa"
    with tempfile.TemporaryDirectory() as d:
        hf_model.save_pretrained(d)
        model = jaxlm.load_hf(d, dtype="float32")
    hf_model.train()

    rng = np.random.RandomState(0)
    tokens = rng.randint(0, s["vocab"], (s["batch"], s["seq_len"])).astype(np.int32)
    B, T = tokens.shape
    batch = {
        "tokens": jnp.asarray(tokens), "loss_mask": jnp.ones((B, T), bool),
        "segment_ids": jnp.ones((B, T), jnp.int32), "positions": jnp.tile(jnp.arange(T, dtype=jnp.int32), (B, 1)),
    }
    opt = OptimizerConfig(lr=1e-4, warmup_steps=0, schedule="constant", weight_decay=0.01, clip_norm=1.0)

    # --- jaxlm step and floor
    graphdef, state = nnx.split(model)
    tx, schedule = make_optimizer(opt, 1000)
    step = make_train_step(graphdef, tx, schedule)
    train_state = init_state(nnx.to_pure_dict(state), tx, 0)
    t0 = time.perf_counter()
    train_state, m = step(train_state, batch)
    jax.block_until_ready(m["loss"])
    compile_s = time.perf_counter() - t0
    floor_fn, floor_ops, floor_outs = jax_floor(s)
    floor_outs = jax.block_until_ready(floor_fn(floor_ops, floor_outs))

    # --- PyTorch + transformers step and floor
    decay = [p for p in hf_model.parameters() if p.ndim >= 2]
    no_decay = [p for p in hf_model.parameters() if p.ndim < 2]
    torch_opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=opt.lr, betas=(opt.b1, opt.b2), eps=opt.eps,
    )
    ids = torch.tensor(tokens, dtype=torch.long)

    def torch_step():
        loss = hf_model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf_model.parameters(), opt.clip_norm)
        torch_opt.step()
        torch_opt.zero_grad(set_to_none=True)
        return float(loss)

    torch_floor_fn = torch_floor(s)
    torch_step()
    torch_floor_fn()

    def jax_step():
        nonlocal train_state
        train_state, m = step(train_state, batch)
        jax.block_until_ready(m["loss"])

    def jax_floor_call():
        nonlocal floor_outs
        floor_outs = jax.block_until_ready(floor_fn(floor_ops, floor_outs))

    calls = {"jaxlm_step": jax_step, "jaxlm_floor": jax_floor_call,
             "torch_step": torch_step, "torch_floor": torch_floor_fn}
    times = {k: [] for k in calls}
    cpu = {k: [] for k in calls}
    faults = {k: [] for k in calls}
    load = os.getloadavg()[0]
    for _ in range(s["steps"]):
        for name, fn in calls.items():
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    cpu_med = {k: float(np.median(v)) for k, v in cpu.items()}
    return {
        "shape": {k: s[k] for k in ("layers", "width", "heads", "ffn", "vocab", "batch", "seq_len")},
        "timed_calls_each": s["steps"],
        "gemm_gflop_per_step": round(gemm_flops(s) / 1e9, 2),
        **{f"{k}_s": round(v, 4) for k, v in med.items()},
        "jaxlm_step_over_floor": round(med["jaxlm_step"] / med["jaxlm_floor"], 3),
        "torch_step_over_floor": round(med["torch_step"] / med["torch_floor"], 3),
        "jaxlm_over_torch_step_time": round(med["jaxlm_step"] / med["torch_step"], 3),
        "cpu_s": {k: round(v, 4) for k, v in cpu_med.items()},
        "cpu_jaxlm_step_over_floor": round(cpu_med["jaxlm_step"] / cpu_med["jaxlm_floor"], 3),
        "cpu_torch_step_over_floor": round(cpu_med["torch_step"] / cpu_med["torch_floor"], 3),
        "cpu_jaxlm_over_torch_step": round(cpu_med["jaxlm_step"] / cpu_med["torch_step"], 3),
        "page_faults_per_call": {k: int(np.median(v)) for k, v in faults.items()},
        "load_avg_1min": [round(load, 1), round(os.getloadavg()[0], 1)],
        "spread_s": {k: [round(float(np.min(v)), 4), round(float(np.max(v)), 4)] for k, v in times.items()},
        "jaxlm_first_step_s_incl_compile": round(compile_s, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), action="append", help="grid shape(s) to run (default: all)")
    for k in ("layers", "width", "heads", "ffn", "vocab", "batch", "seq-len"):
        ap.add_argument(f"--{k}", type=int)
    ap.add_argument("--steps", type=int, help="timed calls of each kind (default: per shape)")
    ap.add_argument("--hugepages", action="store_true",
                    help="re-run under GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (malloc asks for transparent huge "
                         "pages: far fewer page faults on the large buffers both frameworks allocate every step)")
    ap.add_argument("--host-allocator", choices=("system", "tuned"), default=None,
                    help="JAXLM_HOST_ALLOCATOR for this run (`jaxlm.host_allocator`; default: the environment's, "
                         "else system): tuned keeps XLA:CPU's per-call buffers mapped between steps")
    args = ap.parse_args()
    if args.host_allocator:
        os.environ["JAXLM_HOST_ALLOCATOR"] = args.host_allocator  # read by `import jaxlm`, below
    if args.hugepages and "glibc.malloc.hugetlb=1" not in os.environ.get("GLIBC_TUNABLES", ""):
        tunables = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), "glibc.malloc.hugetlb=1"]))
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "GLIBC_TUNABLES": tunables})
    custom = {k: getattr(args, k) for k in ("layers", "width", "heads", "ffn", "vocab", "batch", "seq_len")}
    if any(v is not None for v in custom.values()):
        shapes = {"custom": {**SHAPES["B"], **{k: v for k, v in custom.items() if v is not None}}}
    else:
        shapes = {name: SHAPES[name] for name in (args.shape or SHAPES)}

    import jax
    import torch
    import transformers

    rows = {}
    for name, s in shapes.items():
        s = {**s, "steps": args.steps or s["steps"]}
        rows[name] = run_shape(s)
        print(json.dumps({name: rows[name]}), flush=True)
    print(f"jax {jax.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"transformers {transformers.__version__}, GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}, "
          f"JAXLM_HOST_ALLOCATOR={os.environ.get('JAXLM_HOST_ALLOCATOR', 'system')}; "
          f"seconds are medians")
    print("| shape | jaxlm step | jaxlm floor | jaxlm step/floor | PyTorch step | PyTorch floor "
          "| PyTorch step/floor | jaxlm/PyTorch step time |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['jaxlm_step_s']:.4f} | {r['jaxlm_floor_s']:.4f} | {r['jaxlm_step_over_floor']:.2f}x "
              f"| {r['torch_step_s']:.4f} | {r['torch_floor_s']:.4f} | {r['torch_step_over_floor']:.2f}x "
              f"| {r['jaxlm_over_torch_step_time']:.2f}x |")
    print("process CPU seconds (both threads; steadier than wall time on a loaded machine): "
          + "; ".join(f"{name}: jaxlm step/floor {r['cpu_jaxlm_step_over_floor']:.2f}x, PyTorch step/floor "
                      f"{r['cpu_torch_step_over_floor']:.2f}x, jaxlm/PyTorch {r['cpu_jaxlm_over_torch_step']:.2f}x, "
                      f"load {r['load_avg_1min'][0]}-{r['load_avg_1min'][1]}" for name, r in rows.items()))


if __name__ == "__main__":
    main()
