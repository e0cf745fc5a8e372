"""Grammar-constrained decoding: on-device token tables vs XGrammar's host masks (CPU).

Overhead grid: a random model (4 layers, width 256, byte vocabulary, or ``--vocab N``
with random multi-byte tokens added) decodes
``--new-tokens`` tokens per row at batch 1 / 16 / 64 (sampling at temperature 1):

* unconstrained `jaxlm.generate` (the peer for the overhead);
* constrained `jaxlm.generate(..., grammar=)`: mask and state update inside the loop;
* the host path: the same model stepped by a jitted one-token function, XGrammar's
  `BatchGrammarMatcher` filling the ``[B, ceil(V/32)]`` bitmask on the host each step, the
  mask applied on the device, the sampled tokens sent back to the matchers; and that loop
  with an all-ones mask and no matcher, so each path's masking cost is its time over its
  own unconstrained loop.

Per decode step times are compared (rows of a constrained batch may finish early: the time
is divided by the loop's steps). Also the compile time of both and the table sizes.

Miniature (``--miniature``): a tiny model trained on `Extraction` (text in, JSON out);
held-out schema-valid rate and accuracy unconstrained vs constrained, greedy and sampled.

    python bench/grammar.py                      # the grid
    python bench/grammar.py --vocab 32000        # the grid with a BPE-sized vocabulary
    python bench/grammar.py --miniature          # + the trained miniature (runs/grammar)
    python bench/grammar.py --compile-only --vocab 32000 --repeats 5   # compile times only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"]}},
    "required": ["name", "tags"]}


def host_mask_decoder(model, compiled, batch: int, new_tokens: int, seed: int):
    """Sampling stepped from the host with XGrammar filling the masks each step (``compiled``
    None: the same loop with an all-ones mask and no matcher, the host loop's own cost);
    returns ``run() -> (tokens [B, N], steps)``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import xgrammar as xgr
    from flax import nnx

    from jaxlm.inference.cache import KVCache
    from jaxlm.inference.sampling import sample_categorical

    graphdef, params = nnx.split(model)
    cfg = model.config
    V = cfg.vocab_size
    ids = jnp.arange(V, dtype=jnp.int32)
    prompt = jnp.asarray([model.tokenizer.encode("JSON: ", add_bos=True)] * batch, jnp.int32)
    P = prompt.shape[1]

    @jax.jit
    def prefill(params, tokens):
        m = nnx.merge(graphdef, params)
        cache = KVCache.init(cfg, tokens.shape[0], P + new_tokens, per_layer=True)
        out = m.backbone(tokens, cache=cache, mask=jnp.ones(tokens.shape, bool))
        return m.unembed(out.hidden[:, -1]), out.cache

    @jax.jit
    def step(params, cache, logits, bitmask, key):
        m = nnx.merge(graphdef, params)
        allowed = ((jnp.take(bitmask, ids >> 5, axis=1) >> (ids & 31)) & 1).astype(bool)
        token = sample_categorical(key, jnp.where(allowed, logits, -jnp.inf)).astype(jnp.int32)
        out = m.backbone(token[:, None], cache=cache)
        return token, m.unembed(out.hidden[:, 0]), out.cache

    batch_matcher = xgr.BatchGrammarMatcher()

    def run():
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)] if compiled is not None else None
        bitmask = xgr.allocate_token_bitmask(batch, V)
        logits, cache = prefill(params, prompt)
        key = jax.random.key(seed)
        out = np.zeros((batch, new_tokens), np.int32)
        done = np.zeros(batch, bool)
        steps = 0
        for t in range(new_tokens):
            if matchers is not None:
                active = [b for b in range(batch) if not done[b]]  # a finished matcher has no next mask
                batch_matcher.batch_fill_next_token_bitmask([matchers[b] for b in active], bitmask, indices=active)
            key, sub = jax.random.split(key)
            token, logits, cache = step(params, cache, logits, jnp.asarray(bitmask.numpy()), sub)
            token = np.asarray(token)
            out[:, t] = token
            steps += 1
            for b in range(batch if matchers is not None else 0):
                if not done[b]:
                    matchers[b].accept_token(int(token[b]))
                    done[b] = matchers[b].is_terminated()
            if done.all():
                break
        return out, steps

    return run


def synthetic_vocabulary(size: int, seed: int = 0) -> list[bytes]:
    """The byte tokenizer's 259 ids (3 specials, 256 bytes), then random 2-8-byte strings over
    a JSON-ish alphabet up to ``size`` tokens: a stand-in for a BPE vocabulary's size and
    multi-byte tokens."""
    import numpy as np

    vocab = [b"", b"", b""] + [bytes([b]) for b in range(256)]
    seen = set(vocab)
    alphabet = np.frombuffer(b'abcdefghijklmnopqrstuvwxyzABCDEZ0123456789 {}[]:,"-.eE_', np.uint8)
    rng = np.random.default_rng(seed)
    while len(vocab) < size:
        t = rng.choice(alphabet, int(rng.integers(2, 9))).tobytes()
        if t not in seen:
            seen.add(t)
            vocab.append(t)
    return vocab


def compile_times(vocab_size: int, repeats: int) -> dict:
    """Schema -> tables with no cache, jaxlm vs XGrammar, best of ``repeats`` (after one warm-up)."""
    import xgrammar as xgr

    import jaxlm
    from jaxlm.inference.grammar import compile_json_schema

    tok = jaxlm.ByteTokenizer()
    vocab = synthetic_vocabulary(vocab_size)
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[tok.eos_id])
    ours, theirs = [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        compile_json_schema(SCHEMA, token_bytes=vocab, stop_tokens=[tok.eos_id], any_whitespace=False, cache_dir=None)
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        theirs.append(time.perf_counter() - start)
    best = {"jaxlm": min(ours[1:]), "xgrammar": min(theirs[1:])}
    print(f"compile, vocab {vocab_size}: jaxlm {best['jaxlm'] * 1e3:.1f} ms, XGrammar {best['xgrammar'] * 1e3:.1f} ms "
          f"({best['jaxlm'] / best['xgrammar']:.1f}x)")
    return best


def overhead_grid(args) -> list[dict]:
    import jax
    import numpy as np
    import xgrammar as xgr

    import jaxlm
    from jaxlm.inference.grammar import compile_json_schema

    tok = jaxlm.ByteTokenizer()  # prompts are bytes; a larger vocabulary adds multi-byte tokens after them
    vocab = synthetic_vocabulary(args.vocab)
    V = len(vocab)
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(vocab_size=V, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2,
                                                     ffn_dim=1024, max_seq_len=512, init_std=0.05), tokenizer=tok,
                              seed=0)
    start = time.perf_counter()
    ours = compile_json_schema(SCHEMA, token_bytes=vocab, stop_tokens=[tok.eos_id], any_whitespace=False,
                               cache_dir=None)
    ours_compile = time.perf_counter() - start
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=V, stop_token_ids=[tok.eos_id])
    start = time.perf_counter()
    theirs = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA),
                                                                                 any_whitespace=False)
    theirs_compile = time.perf_counter() - start
    summary = ours.summary()
    print(f"tables: {summary['states']} states, {summary['categories']} categories, {summary['bytes']:,} bytes "
          f"(bitmask {'materialised' if summary['bitmask'] else 'not materialised'})")
    print(f"compile: jaxlm {ours_compile * 1e3:.1f} ms, XGrammar {theirs_compile * 1e3:.1f} ms "
          f"({ours_compile / theirs_compile:.2f}x)")
    rows = [{"compile_s": {"jaxlm": ours_compile, "xgrammar": theirs_compile}, "tables": summary}]
    N = args.new_tokens
    print(f"\n{'batch':>5} | {'free ms/step':>12} | {'tables ms/step':>14} | overhead | {'host ms/step':>12} | "
          f"host / tables | {'host loop, no mask':>18} | mask cost host / tables")
    for batch in args.batch:
        prompts = ["JSON: "] * batch

        def free():
            r = jaxlm.generate(model, prompts, max_new_tokens=N, temperature=1.0, stop_tokens=(), rng=1)
            jax.block_until_ready(r.tokens)
            return r, N

        def tables():
            r = jaxlm.generate(model, prompts, max_new_tokens=N, temperature=1.0, rng=1, grammar=ours)
            jax.block_until_ready(r.tokens)
            return r, int(np.max(np.asarray(r.lengths)))

        runs = {"free": free, "tables": tables, "host": host_mask_decoder(model, theirs, batch, N, seed=1),
                "host free": host_mask_decoder(model, None, batch, N, seed=1)}
        for fn in runs.values():  # compile
            fn()
        per_step = {k: [] for k in runs}
        for _ in range(args.repeats):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                _, steps = fn()
                per_step[name].append((time.perf_counter() - t0) / steps)
        med = {k: float(np.median(v)) * 1e3 for k, v in per_step.items()}
        r, _ = tables()
        for ids in r.completions():  # a finished row is a valid document
            text = b"".join(vocab[i] for i in ids)
            if ours.matches(text):
                json.loads(text)
        # what masking adds to each path's own unconstrained loop
        cost = {"tables": med["tables"] - med["free"], "host": med["host"] - med["host free"]}
        ratio = f"{cost['host'] / cost['tables']:.1f}x" if cost["tables"] > 0.02 * med["free"] else "(tables: noise)"
        print(f"{batch:>5} | {med['free']:>12.3f} | {med['tables']:>14.3f} | {med['tables'] / med['free']:>7.2f}x | "
              f"{med['host']:>12.3f} | {med['host'] / med['tables']:>12.2f}x | {med['host free']:>18.3f} | "
              f"{cost['host']:.3f} / {cost['tables']:.3f} ms {ratio}")
        rows.append({"batch": batch, "ms_per_step": med, "overhead": med["tables"] / med["free"],
                     "host_vs_tables": med["host"] / med["tables"], "mask_cost_ms": cost})
    return rows


def miniature(run: Path, steps: int = 1000, n_eval: int = 200, sample_temperature: float = 2.0) -> dict:
    """Train a tiny model on `Extraction` for ``steps``; held-out schema-valid rate and
    accuracy without and with the schema, greedy and sampled at ``sample_temperature``."""
    import jsonschema

    import jaxlm
    from jaxlm.data.pipeline import DataConfig
    from jaxlm.data.tasks import Extraction
    from jaxlm.inference.grammar import compile_json_schema
    from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig
    from trainers.loop import train

    task = Extraction()
    if not (run / "model").exists():
        train(ExperimentConfig(
            model=jaxlm.ModelConfig.tiny(d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=384,
                                         max_seq_len=128),
            data=DataConfig(source=task, seq_len=96, batch_size=32, pack=True, eval_examples=32),
            optimizer=OptimizerConfig(lr=3e-3, warmup_steps=30, min_lr_ratio=0.05),
            trainer=TrainerConfig(steps=steps, out_dir=str(run), progress=False, log_every=50, eval_every=0,
                                  save_every=100_000, eval_generate=0),
            algorithm=SFTConfig(), tokenizer="byte",
        ))
    model = jaxlm.load_checkpoint(run / "model")
    tok = model.tokenizer
    schema = task.schema()
    grammar = compile_json_schema(schema, tok, any_whitespace=False, cache_dir=None)
    held = [task.example(i, "eval") for i in range(n_eval)]

    def valid(text):
        try:
            jsonschema.validate(json.loads(text), schema)
            return True
        except (ValueError, jsonschema.ValidationError):
            return False

    out = {}
    for decoding, temperature in (("greedy", 0.0), ("sampled", sample_temperature)):
        for name, kw in (("unconstrained", {}), ("constrained", {"grammar": grammar})):
            texts = []
            for i in range(0, n_eval, 50):
                chunk = held[i: i + 50]
                r = jaxlm.generate(model, [e["prompt"] for e in chunk], max_new_tokens=64, temperature=temperature,
                                   rng=i, **kw)
                texts += r.texts
            out[f"{decoding} {name}"] = {
                "valid": sum(map(valid, texts)) / n_eval,
                "accuracy": sum(task.verify(e, t) for e, t in zip(held, texts)) / n_eval,
                "invalid_examples": [t for t in texts if not valid(t)][:3]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=259,
                    help="vocabulary size: 259 is the byte tokenizer; more adds random multi-byte tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--miniature", action="store_true")
    ap.add_argument("--no-grid", action="store_true")
    ap.add_argument("--compile-only", action="store_true",
                    help="only the compile times (best of --repeats) at the byte vocabulary and at --vocab")
    ap.add_argument("--run", default="runs/grammar")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--sample-temperature", type=float, default=2.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--mask-backend", default="auto", choices=("auto", "kernel", "interpret", "reference"),
                    help="the on-device mask: the Pallas kernel (kernel, or interpret on CPU) or the jnp path")
    args = ap.parse_args()
    result = {}
    if args.compile_only:
        result["compile_s"] = {v: compile_times(v, args.repeats) for v in sorted({259, args.vocab})}
    elif not args.no_grid:
        from jaxlm.inference.grammar import mask_backend

        with mask_backend(args.mask_backend):
            result["grid"] = overhead_grid(args)
    if args.miniature:
        result["miniature"] = miniature(Path(args.run), args.steps, sample_temperature=args.sample_temperature)
        for name, r in result["miniature"].items():
            print(f"{name:>21}: schema-valid {r['valid']:.1%}, accuracy {r['accuracy']:.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
