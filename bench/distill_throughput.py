"""Distillation step vs the plain SFT step: tokens/s and XLA's peak memory, same run.

The student and batch are the same in every row; the distillation rows add a frozen teacher's
forward and the divergence (`trainers.distill.loss`); "autodiff" is the forward KL differentiated by JAX
instead of its hand-written backward pass. Peak memory is XLA's buffer assignment
of the compiled step (``memory_analysis()``: arguments, i.e. parameters, optimizer state,
teacher and batch, plus temporaries; a donated state is not counted twice). Timed calls
alternate between the variants so machine drift hits all of them; medians are compared.

    python bench/distill_throughput.py                  # vocab 32000, student 2 x 256, teachers 2 x 256 and 4 x 384
    python bench/distill_throughput.py --steps 5 --batch 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxlm
from trainers.distill.config import DistillConfig
from trainers.distill.loss import make_distill_loss_fn
from trainers.step import init_state, make_train_step


def model_config(layers, width, heads, ffn, vocab, seq_len):
    return jaxlm.ModelConfig(vocab_size=vocab, d_model=width, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                             ffn_dim=ffn, max_seq_len=seq_len, tie_embeddings=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--chunk-rows", type=int, default=256)
    args = ap.parse_args()
    B, T, V = args.batch, args.seq_len, args.vocab
    student_cfg = model_config(2, 256, 4, 768, V, T)
    teachers = {"same size": model_config(2, 256, 4, 768, V, T), "larger": model_config(4, 384, 6, 1152, V, T)}

    rng = np.random.default_rng(0)
    batch = {"tokens": jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32),
             "loss_mask": jnp.ones((B, T), bool), "segment_ids": jnp.ones((B, T), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))}
    student = jaxlm.build_model(student_cfg, seed=0)
    graphdef, state = nnx.split(student)
    params = nnx.to_pure_dict(state)
    tx = optax.adamw(1e-4)

    variants: dict[str, tuple] = {"sft": (make_train_step(graphdef, tx, lambda s: 1e-4), None)}
    for tname, tcfg in teachers.items():
        teacher = jaxlm.build_model(tcfg, seed=1)
        tg, ts = nnx.split(teacher)
        tp = nnx.to_pure_dict(ts)
        for mode, chunked, fused in (("full", False, True), ("full", True, True), ("topk", False, True),
                                     ("topk", True, True), ("topk", False, False)):
            if tname == "larger" and (mode == "full" or not fused):
                continue
            cfg = DistillConfig(teacher="bench", divergence="forward_kl", teacher_logprobs=mode, top_k=args.top_k,
                                chunk_rows=args.chunk_rows)
            fn = make_distill_loss_fn(graphdef, sliding_window=None, distill=cfg, pear=None, teacher_graphdef=tg,
                                      vocab_size=V, chunked=chunked, fused=fused)
            name = (f"distill {mode}{', chunked' if chunked else ''}{', autodiff' if not fused else ''}, "
                    f"{tname} teacher")
            variants[name] = (make_train_step(graphdef, tx, lambda s: 1e-4, loss_fn=fn), tp)

    states, memory, times = {}, {}, {k: [] for k in variants}
    for name, (step, side) in variants.items():
        st = init_state(jax.tree.map(jnp.copy, params), tx, 0)
        inputs = batch if side is None else (batch, side)
        mem = jax.jit(step.step, donate_argnums=(0,)).lower(st, inputs).compile().memory_analysis()
        memory[name] = (mem.argument_size_in_bytes + mem.temp_size_in_bytes, mem.temp_size_in_bytes)
        st, m = step(st, inputs)  # compile + first step
        jax.block_until_ready(m["loss"])
        states[name] = st
    for _ in range(args.steps):
        for name, (step, side) in variants.items():
            inputs = batch if side is None else (batch, side)
            start = time.perf_counter()
            states[name], m = step(states[name], inputs)
            jax.block_until_ready(m["loss"])
            times[name].append(time.perf_counter() - start)

    base_t = statistics.median(times["sft"])
    base_peak, base_temp = memory["sft"]
    print(f"student {student_cfg.n_layers} x {student_cfg.d_model}, vocab {V}, batch {B} x {T} tokens, "
          f"top-K {args.top_k}, {args.steps} timed steps each (median), {jax.devices()[0].platform}")
    print(f"{'step':<44} {'tokens/s':>9} {'time / SFT':>10} | {'peak MiB':>9} {'peak / SFT':>10} {'temp MiB':>9}")
    for name in variants:
        t = statistics.median(times[name])
        peak, temp = memory[name]
        print(f"{name:<44} {B * T / t:>9.0f} {t / base_t:>9.2f}x | {peak / 2**20:>9.0f} {peak / base_peak:>9.2f}x "
              f"{temp / 2**20:>9.0f}")


if __name__ == "__main__":
    main()
