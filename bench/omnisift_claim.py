"""OmniSIFT in miniature: a tiny omni model learns the synthetic audio-visual task
(`jaxlm.data.audiovisual`), then keeps its accuracy with 25% and 35% of the media tokens
when OmniSIFT compresses its inputs, against random token dropping at the same retention.

1. The omni model (`jaxlm.models.omni`, rope="mrope") is trained on full-token clips
   (answer cross-entropy, every parameter).
2. Frozen, it is evaluated on held-out clips with all tokens; with OmniSIFT at retention
   rho (spatial + temporal video pruning, and the vision-guided audio selector, trained alone
   with the model frozen, by each estimator named: ``ste`` through the straight-through mask
   as in the paper, ``score_function`` by REINFORCE over sampled keep sets); and with the
   same numbers of tokens dropped uniformly at random.

Accuracy is the argmax over the question's four answers. Also reported: tokens per clip
and the per-question-type accuracy (``look`` needs the moving square's patches, ``tone`` the
tone's audio frames).

    python bench/omnisift_claim.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxlm
from jaxlm.compress.omnisift import ESTIMATORS, AudioSelector, ClipLayout, OmniSIFTConfig, compress, random_keep, \
    selector_loss
from jaxlm.data.audiovisual import AVTaskConfig, av_example
from jaxlm.data.tokenizers import ByteTokenizer
from jaxlm.models.omni import AudioVisual, OmniConfig, batch_sequences, build_omni, build_sequence

TOK = ByteTokenizer()
TASK = AVTaskConfig()
HELD_OUT = 1_000_000
CANDIDATES = {"move:": [TOK.encode(c)[0] for c in "LRUD"], "look:": [TOK.encode(c)[0] for c in "WXYZ"[:TASK.n_shapes]],
              "tone:": [TOK.encode(chr(65 + k))[0] for k in range(TASK.n_labels)]}


def omni_config() -> OmniConfig:
    lm = jaxlm.ModelConfig.tiny(vocab_size=261, rope="mrope", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                ffn_dim=192, max_seq_len=128)
    return OmniConfig(lm=lm, patch_dim=TASK.patch_dim, audio_dim=TASK.audio_dim, video_token_id=259,
                      audio_token_id=260, encoder_hidden=64)


def make_batch(config: OmniConfig, indices, seed: int):
    exs = [av_example(TASK, int(i), seed) for i in indices]
    seqs = [build_sequence([[TOK.bos_id], AudioVisual(e["video"], e["audio"], frames_per_chunk=2, frame_ticks=2),
                            e["question"]], TOK, config) for e in exs]
    b = batch_sequences(seqs, TOK.pad_id)
    b["answer"] = np.asarray([TOK.encode(e["answer"])[0] for e in exs], np.int32)
    b["question"] = np.asarray([e["question"] for e in exs])
    return b, seqs[0]


def dev_batch(b: dict) -> dict:
    """The arrays of a batch on the device (the question strings stay behind)."""
    return {k: jnp.asarray(v) for k, v in b.items() if k != "question"}


def candidate_accuracy(logits, batch) -> np.ndarray:
    logits = np.asarray(logits)
    right = []
    for row, ans, q in zip(logits, batch["answer"], batch["question"]):
        cands = CANDIDATES[q]
        right.append(cands[int(np.argmax(row[cands]))] == ans)
    return np.asarray(right)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--selector-steps", type=int, default=600)
    ap.add_argument("--selector-lr", type=float, default=1e-3)
    ap.add_argument("--estimator", nargs="+", choices=ESTIMATORS, default=list(ESTIMATORS))
    ap.add_argument("--samples", type=int, default=4, help="keep sets per clip (score_function)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--eval", type=int, default=512)
    ap.add_argument("--retention", type=float, nargs="+", default=[0.25, 0.35])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    config = omni_config()
    model = build_omni(config, seed=args.seed, tokenizer=TOK)
    graphdef, state = nnx.split(model)
    opt = optax.adamw(optax.warmup_cosine_decay_schedule(0, 3e-3, min(30, args.steps - 1), args.steps, 3e-4), weight_decay=0.0)
    opt_state = opt.init(state)

    def answer_loss(logits, answer):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), answer[:, None], axis=1))

    @jax.jit
    def train_step(state, opt_state, batch):
        def loss_fn(state):
            m = nnx.merge(graphdef, state)
            out = m(batch["tokens"], batch["positions"], video=batch["video"], audio=batch["audio"],
                    mask=batch["mask"])
            return answer_loss(out.logits[:, -1], batch["answer"])
        loss, grads = jax.value_and_grad(loss_fn)(state)
        upd, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, upd), opt_state, loss

    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    dev = dev_batch
    for step in range(args.steps):
        batch, _ = make_batch(config, rng.integers(0, HELD_OUT, args.batch), args.seed)
        state, opt_state, loss = train_step(state, opt_state, dev(batch))
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step} loss {float(loss):.3f}", flush=True)
    train_s = time.perf_counter() - t0
    model = nnx.merge(graphdef, state)
    lm_graph, lm_state = nnx.split(model.lm)

    @jax.jit
    def embed(state, batch):
        m = nnx.merge(graphdef, state)
        v, a = m.encode_media(batch["video"], batch["audio"])
        return m.embed(batch["tokens"], v, a)

    @jax.jit
    def lm_last(tokens, positions, mask, embeds):
        return nnx.merge(lm_graph, lm_state)(tokens, positions, mask=mask, embeds=embeds).logits[:, -1]

    evals = [make_batch(config, range(HELD_OUT + i, HELD_OUT + i + 64), args.seed) for i in range(0, args.eval, 64)]
    layout = ClipLayout.of(evals[0][1])

    def evaluate(select) -> dict:
        right, asked, tokens = [], [], []
        for b, _ in evals:
            d = {k: v for k, v in dev_batch(b).items()}
            E = embed(state, d)
            toks, pos, mask, emb = select(d, E)
            right.append(candidate_accuracy(lm_last(toks, pos, mask, emb), b))
            asked.append(b["question"])
            tokens.append(toks.shape[1])
        right, asked = np.concatenate(right), np.concatenate(asked)
        out = {"accuracy": float(right.mean()), "tokens": int(tokens[0])}
        for q in TASK.questions:
            out[q.rstrip(":")] = float(right[asked == q].mean())
        return out

    results = {"full": evaluate(lambda d, E: (d["tokens"], d["positions"], d["mask"], E))}
    print("full", results["full"], flush=True)
    for rho in args.retention:
        key = jax.random.key(args.seed + 7)
        base = OmniSIFTConfig.retention(rho, selector_dim=32, selector_heads=4, samples=args.samples)
        rand = jax.jit(lambda d, E, cfg=base: random_keep(key, E, d["positions"], d["mask"], d["tokens"], layout,
                                                          cfg).inputs())
        results[f"random_{rho}"] = evaluate(rand)
        print(f"random_{rho}", results[f"random_{rho}"], flush=True)
        sel_graph, untrained = nnx.split(AudioSelector(config.lm.d_model, base, rngs=nnx.Rngs(args.seed)))
        run = jax.jit(lambda s, d, E, cfg=base: compress(nnx.merge(sel_graph, s), E, d["positions"], d["mask"],
                                                          d["tokens"], layout, cfg).inputs())
        results[f"omnisift_untrained_selector_{rho}"] = evaluate(lambda d, E: run(untrained, d, E))
        print(f"omnisift_untrained_selector_{rho}", results[f"omnisift_untrained_selector_{rho}"], flush=True)
        for estimator in args.estimator:
            cfg = dataclasses.replace(base, estimator=estimator)
            sel_state = untrained
            sopt = optax.adam(args.selector_lr)
            sopt_state = sopt.init(sel_state)

            @jax.jit
            def selector_step(sel_state, sopt_state, d, rng, cfg=cfg):
                def row_loss(c):  # the frozen model's answer loss per clip
                    logits = lm_last(c.tokens, c.positions, c.mask, c.embeds)
                    return -jnp.take_along_axis(jax.nn.log_softmax(logits), d["answer"][:, None], axis=1)[:, 0]

                def loss_fn(s):
                    return selector_loss(nnx.merge(sel_graph, s), row_loss, embed(state, d), d["positions"],
                                         d["mask"], d["tokens"], layout, cfg, rng)
                (_, loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(sel_state)
                upd, sopt_state = sopt.update(grads, sopt_state, sel_state)
                return optax.apply_updates(sel_state, upd), sopt_state, loss

            srng = jax.random.key(args.seed + 11)
            for step in range(args.selector_steps):
                batch, _ = make_batch(config, rng.integers(0, HELD_OUT, args.batch), args.seed)
                srng, sub = jax.random.split(srng)
                sel_state, sopt_state, loss = selector_step(sel_state, sopt_state, dev(batch), sub)
                if step % 100 == 0 or step == args.selector_steps - 1:
                    print(f"  selector {estimator} rho={rho} step {step} loss {float(loss):.3f}", flush=True)
            name = f"omnisift_{estimator}_{rho}"
            results[name] = evaluate(lambda d, E, s=sel_state: run(s, d, E))
            print(name, results[name], flush=True)
    print(f"omni model trained {args.steps} steps x {args.batch} clips ({train_s:.0f} s); selector {args.selector_steps} "
          f"steps; {args.eval} held-out clips")
    full = results["full"]["accuracy"]
    for k, r in results.items():
        per = ", ".join(f"{q.rstrip(':')} {r[q.rstrip(':')]:6.1%}" for q in TASK.questions)
        print(f"  {k:<34} accuracy {r['accuracy']:6.1%} ({per})  tokens {r['tokens']:3d}  vs full "
              f"{r['accuracy'] - full:+.1%}")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
