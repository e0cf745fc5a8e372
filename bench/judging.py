"""Pairwise judging throughput: both response orders batched in one scoring call vs one
order, and vs two separate calls; and CAMEL's generated tokens per judgment (gated at the
median verdict margin) vs always reflecting.

A randomly initialised model of a fixed shape judges synthetic (question, A, B) triples
(byte tokenizer) in two prompt shapes: ``bare`` (the default template, ~250 bytes, of
which the two orders share ~120) and ``rubric`` (the same after ~450 bytes of judging
instructions, as judge prompts such as MT-Bench's carry). Both orders share the prefix up
to the first response (computed once). Each setting is timed after a warm-up call (the
compilation is not counted), median of ``--repeats``.

    python bench/judging.py --pairs 1 8 32
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import jaxlm
from jaxlm.data.tokenizers import ByteTokenizer
from jaxlm.eval.camel import gated_judge
from jaxlm.eval.judge import JudgeTemplate, judge_pairs

MODEL = jaxlm.ModelConfig.tiny(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=1024, max_seq_len=1024)


def triples(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    words = "the a of answer model judge question which better because first second value".split()
    text = lambda k: " ".join(rng.choice(words, size=k))
    return [text(18) + "?" for _ in range(n)], [text(10) for _ in range(n)], [text(10) for _ in range(n)]


RUBRIC = JudgeTemplate(pairwise=(
    "You are a careful judge. Read the user's question and the two answers below. Decide which answer "
    "is more helpful, correct and complete. Do not let the order of the answers, their length or their "
    "style influence you. Judge only what the answers say about the question. If both are equally good, "
    "prefer the one that is more precise. Reply with one letter: A if the first answer is better, B if "
    "the second answer is better.\n"
    "Question: {question}\nAnswer A: {first}\nAnswer B: {second}\nBetter: "))
TEMPLATES = {"bare": JudgeTemplate(), "rubric": RUBRIC}


def timed(fn, repeats: int) -> float:
    fn()  # compile
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def run(pairs=(1, 8, 32), repeats: int = 5, reflect_pairs: int = 16, max_reflection_tokens: int = 32) -> dict:
    model = jaxlm.build_model(MODEL, seed=0, tokenizer=ByteTokenizer())
    rows = []
    for shape, t in TEMPLATES.items():
        for n in pairs:
            q, a, b = triples(n)
            kw = dict(template=t, batch_size=2 * n)
            one = timed(lambda: judge_pairs(model, q, a, b, both_orders=False, **kw), repeats)
            both = timed(lambda: judge_pairs(model, q, a, b, both_orders=True, **kw), repeats)
            two = timed(lambda: (judge_pairs(model, q, a, b, both_orders=False, **kw),
                                 judge_pairs(model, q, b, a, both_orders=False, **kw)), repeats)
            rows.append({"prompt": shape, "pairs": n, "one_order_s": one, "both_one_call_s": both,
                         "two_calls_s": two, "both_over_one": both / one, "two_calls_over_both": two / both,
                         "pairs_per_s_both": n / both})
    q, a, b = triples(reflect_pairs, seed=1)
    always = gated_judge(model, q, a, b, tau=float("inf"), max_reflection_tokens=max_reflection_tokens)
    tau = float(np.median(always.margin))
    gated = gated_judge(model, q, a, b, tau=tau, max_reflection_tokens=max_reflection_tokens)
    camel = {"tau": tau, "tokens_gated": float(gated.tokens.mean()), "tokens_always": float(always.tokens.mean()),
             "tokens_never": 1.0, "reflect_rate": float(gated.reflected.mean()),
             "gated_over_always": float(gated.tokens.mean() / always.tokens.mean())}
    return {"throughput": rows, "camel": camel}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    out = run(tuple(args.pairs), args.repeats)
    for r in out["throughput"]:
        print(f"{r['prompt']:6s} pairs={r['pairs']:3d}  one order {r['one_order_s'] * 1e3:7.1f} ms  both (one call) "
              f"{r['both_one_call_s'] * 1e3:7.1f} ms  two calls {r['two_calls_s'] * 1e3:7.1f} ms  "
              f"both/one = {r['both_over_one']:.2f}x  two calls/both = {r['two_calls_over_both']:.2f}x")
    c = out["camel"]
    print(f"CAMEL tau={c['tau']:.3f}: {c['tokens_gated']:.1f} tokens/judgment gated vs {c['tokens_always']:.1f} "
          f"always-reflect ({c['gated_over_always']:.2f}x), reflect rate {c['reflect_rate']:.2f}")
    print(json.dumps(out))
