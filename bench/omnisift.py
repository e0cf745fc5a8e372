"""Prefill and per-token decode time, and peak memory, of an omni model on a long
audio-visual clip with all tokens vs OmniSIFT at 25% and 35% retention, in the same run;
the compression's own time (pruning + audio selector) is reported separately.

Prefill is the language model's forward over the prompt into a fresh KV cache (the
sampler's first step, `jaxlm.inference.sampler.generate_tokens` with ``max_new_tokens=1``);
decode per token is ``(t(N) - t(1)) / (N - 1)`` for ``N`` greedy tokens. Peak memory is XLA's
memory analysis of the compiled prefill + decode program (arguments + outputs + temporaries;
CPU has no allocator high-water mark). Timings are medians of ``--repeats`` runs.

    python bench/omnisift.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxlm
from jaxlm.compress.omnisift import AudioSelector, ClipLayout, OmniSIFTConfig, compress
from jaxlm.data.tokenizers import ByteTokenizer
from jaxlm.inference.omni import omni_inputs_embeds
from jaxlm.inference.sampler import generate_tokens
from jaxlm.models.omni import AudioVisual, OmniConfig, batch_sequences, build_omni, build_sequence

TOK = ByteTokenizer()


def median_time(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--grid", type=int, default=8)
    ap.add_argument("--audio", type=int, default=64, help="audio frames in the clip")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    lm = jaxlm.ModelConfig.tiny(vocab_size=261, rope="mrope", d_model=args.d_model, n_layers=args.layers,
                                n_heads=8, n_kv_heads=4, ffn_dim=3 * args.d_model, max_seq_len=2048)
    config = OmniConfig(lm=lm, patch_dim=48, audio_dim=32, video_token_id=259, audio_token_id=260)
    model = build_omni(config, seed=0, tokenizer=TOK)
    rng = np.random.default_rng(0)
    seqs = [build_sequence([[TOK.bos_id], "Describe the clip.", AudioVisual(
        rng.normal(size=(args.frames, args.grid, args.grid, 48)), rng.normal(size=(args.audio, 32)),
        frames_per_chunk=2, frame_ticks=args.audio // args.frames), "Answer:"], TOK, config)
            for _ in range(args.batch)]
    batch = {k: jnp.asarray(v) for k, v in batch_sequences(seqs, TOK.pad_id).items()}
    layout = ClipLayout.of(seqs[0])
    E = omni_inputs_embeds(model, batch["tokens"], batch["video"], batch["audio"])
    graphdef, params = nnx.split(model.lm)

    def decode(tokens, positions, mask, embeds, n):
        return generate_tokens(graphdef, params, tokens, mask, jax.random.key(0), max_new_tokens=n, greedy=True,
                               prompt_embeds=embeds, prompt_positions=positions).tokens

    def measure(tokens, positions, mask, embeds) -> dict:
        prefill = median_time(lambda: decode(tokens, positions, mask, embeds, 1), args.repeats)
        n = args.new_tokens
        full = median_time(lambda: decode(tokens, positions, mask, embeds, n), args.repeats)
        lowered = jax.jit(decode, static_argnames="n").lower(tokens, positions, mask, embeds, n=n)
        mem = lowered.compile().memory_analysis()
        peak = None if mem is None else int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                                             + mem.temp_size_in_bytes)
        return {"tokens": int(tokens.shape[1]), "prefill_ms": 1e3 * prefill,
                "decode_ms_per_token": 1e3 * (full - prefill) / (n - 1), "peak_mb": None if peak is None else peak / 2**20}

    results = {"full": measure(batch["tokens"], batch["positions"], batch["mask"], E)}
    for rho in (0.25, 0.35):
        cfg = OmniSIFTConfig.retention(rho)
        sel = AudioSelector(lm.d_model, cfg, rngs=nnx.Rngs(0))
        sel_graph, sel_state = nnx.split(sel)
        run = jax.jit(lambda s, E, cfg=cfg: compress(nnx.merge(sel_graph, s), E, batch["positions"], batch["mask"],
                                                     batch["tokens"], layout, cfg).inputs())
        overhead = median_time(lambda: run(sel_state, E), args.repeats)
        toks, pos, mask, emb = run(sel_state, E)
        r = measure(toks, pos, mask, emb)
        r["compression_ms"] = 1e3 * overhead
        results[f"omnisift_{rho}"] = r
    full = results["full"]
    print(f"clip: {args.frames} frames of {args.grid}x{args.grid} patches + {args.audio} audio frames, batch "
          f"{args.batch}; LM d_model {args.d_model}, {args.layers} layers; medians of {args.repeats}")
    for name, r in results.items():
        extra = f"  compression {r['compression_ms']:.1f} ms" if "compression_ms" in r else ""
        print(f"  {name:<14} tokens {r['tokens']:4d}  prefill {r['prefill_ms']:7.1f} ms "
              f"({full['prefill_ms'] / r['prefill_ms']:.2f}x)  decode {r['decode_ms_per_token']:6.2f} ms/token "
              f"({full['decode_ms_per_token'] / r['decode_ms_per_token']:.2f}x)  peak {r['peak_mb']:.1f} MiB{extra}")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
