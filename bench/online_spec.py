"""OnlineSPEC in miniature: a draft that adapts while serving, against the static draft.

The stream: sequences from *tagged chains* over a small vocabulary. Tag ``1`` or ``2`` opens a
sequence, and every later token is the previous one's successor under that tag's random
permutation. The target (2 layers, width 64) is trained on both tags; the draft (1 layer,
width 32) only on tag 1, offline. The stream serves tag-1 prompts for the first chunks and
tag-2 prompts after that (the task mix shifts), greedy, through
`jaxlm.inference.online_spec.serve_stream`. Per method it prints tokens per verify round and
tokens/s after the shift, and their ratio against the static draft measured in the same run;
every method's outputs are checked to be the target's plain greedy outputs.

    python bench/online_spec.py                      # the table in docs/benchmarks.md
    python bench/online_spec.py --before 2 --after 4 --chunk 8   # smaller
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jaxlm  # noqa: E402
from jaxlm.inference.online_spec import OnlineSpecConfig, serve_stream  # noqa: E402

VOCAB, FIRST = 40, 3  # ids 1, 2 are the tags; 3..39 the chain tokens
TARGET = jaxlm.ModelConfig.tiny(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                                max_seq_len=64)
DRAFT = jaxlm.ModelConfig.tiny(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                               max_seq_len=64)


def successors(tag: int) -> np.ndarray:
    """``succ[token]``: the next token under ``tag``'s chain (a random permutation)."""
    succ = np.zeros(VOCAB, np.int32)
    succ[FIRST:] = np.random.default_rng([tag, 17]).permutation(np.arange(FIRST, VOCAB))
    return succ


def sequence(tag: int, start: int, length: int) -> list[int]:
    succ, out = successors(tag), [tag, start]
    while len(out) < length:
        out.append(int(succ[out[-1]]))
    return out


def train_lm(cfg, tags, *, steps: int, seed: int, lr: float = 3e-3, batch: int = 32, length: int = 32):
    """Next-token cross-entropy with Adam on random chain sequences of ``tags``."""
    model = jaxlm.build_model(cfg, seed=seed)
    graphdef, params = nnx.split(model)
    opt = optax.adam(lr)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, x):
        def loss(p):
            logits = nnx.merge(graphdef, p)(x).logits[:, :-1]
            return optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        x = [sequence(int(rng.choice(tags)), int(rng.integers(FIRST, VOCAB)), length) for _ in range(batch)]
        params, opt_state, _ = step(params, opt_state, jnp.asarray(x, jnp.int32))
    return nnx.merge(graphdef, params)


def make_pair(*, target_steps: int = 400, draft_steps: int = 300):
    """The target (both tags) and the offline draft (tag 1 only)."""
    return train_lm(TARGET, (1, 2), steps=target_steps, seed=0), train_lm(DRAFT, (1,), steps=draft_steps, seed=1)


def shifted_stream(*, before: int, after: int, chunk: int, seed: int = 5, prompt_length: int = 3):
    """``before`` chunks of tag-1 prompts, then ``after`` chunks of tag-2 prompts."""
    rng = np.random.default_rng(seed)
    return [[sequence(tag, int(rng.integers(FIRST, VOCAB)), prompt_length) for _ in range(chunk)]
            for tag in [1] * before + [2] * after]


METHODS = {
    "static": OnlineSpecConfig(method="static"),
    "opt_hydra": OnlineSpecConfig(method="opt_hydra"),
    "opt_hydra, momentum reset": OnlineSpecConfig(method="opt_hydra", persist_optimizer_state=False),
    "osd": OnlineSpecConfig(method="osd"),
    "ensemble": OnlineSpecConfig(method="ensemble"),
    **{f"ensemble of one, lr {lr:g}": OnlineSpecConfig(method="ensemble", ensemble_learning_rates=(lr,))
       for lr in OnlineSpecConfig().ensemble_learning_rates},
}


def run(target, draft, stream, *, before: int, max_new_tokens: int, batch: int, methods=METHODS, plain=None):
    """``{method: (report, after-shift tokens/round, after-shift tokens/s)}``; checks outputs."""
    out = {}
    for name, cfg in methods.items():
        cfg = dataclasses.replace(cfg, chunk_size=len(stream[0]), batch_size=batch, max_new_tokens=max_new_tokens)
        rep = serve_stream(target, draft, stream, cfg, stop_tokens=(), keep_completions=True)
        if plain is not None:
            got = [c for ch in rep.chunks for c in ch.completions]
            if got != plain:
                raise AssertionError(f"{name}: outputs differ from the target's plain greedy outputs")
        after = slice(before, None)
        out[name] = (rep, rep.mean("tokens_per_round", after), rep.mean("tokens_per_second", after))
    return out


def plain_greedy(target, stream, max_new_tokens: int) -> list[list[int]]:
    prompts = [p for chunk in stream for p in chunk]
    return jaxlm.generate(target, prompts, max_new_tokens=max_new_tokens, temperature=0, stop_tokens=()).completions()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=int, default=3, help="chunks before the shift")
    ap.add_argument("--after", type=int, default=6, help="chunks after the shift")
    ap.add_argument("--chunk", type=int, default=16, help="prompts per chunk")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes over the stream (median tokens/s)")
    args = ap.parse_args()
    start = time.perf_counter()
    target, draft = make_pair()
    print(f"trained the pair in {time.perf_counter() - start:.1f} s")
    stream = shifted_stream(before=args.before, after=args.after, chunk=args.chunk)
    plain = plain_greedy(target, stream, args.max_new_tokens)
    results = [run(target, draft, stream, before=args.before, max_new_tokens=args.max_new_tokens, batch=args.batch,
                   plain=plain) for _ in range(args.repeats)]
    base_tpr = results[0]["static"][1]
    base_tps = np.median([r["static"][2] for r in results])
    print(f"jax {jax.__version__}; {args.before} chunks of tag 1 then {args.after} of tag 2, {args.chunk} prompts per "
          f"chunk, k = {OnlineSpecConfig().num_draft_tokens}, {args.max_new_tokens} new tokens, greedy; outputs == "
          "plain greedy for every method")
    print("| method | tokens / round per chunk (shift after chunk %d) | after the shift | vs static | tok/s after "
          "| vs static |" % args.before)
    print("|---|---|---|---|---|---|")
    for name in METHODS:
        rep, tpr, _ = results[0][name]
        tps = np.median([r[name][2] for r in results])
        per_chunk = " ".join(f"{c.tokens_per_round:.2f}" for c in rep.chunks)
        print(f"| {name} | {per_chunk} | {tpr:.2f} | {tpr / base_tpr:.2f}x | {tps:,.0f} | {tps / base_tps:.2f}x |")


if __name__ == "__main__":
    main()
