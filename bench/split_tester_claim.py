"""SplitTester-style selection in miniature: Best-of-N among sampled programs, chosen at
random, by the largest behaviour cluster (majority output), or by discriminative tests with
a tester's expected outputs (`jaxlm.eval.program_selection.split_tester`).

Tasks: `jaxlm.data.programs.SPECS` (six small functions, each with a reference and two
typical mistakes that agree with it on typical inputs). Each pool holds N candidates drawn
with P(correct) = 0.3 and the commonest mistake twice as likely as the other. Inputs for
clustering and testing come from the same type-directed fuzzer; the tester is simulated
(`OracleTester`: the reference's output with probability ``--accuracy``, else a mistake's
output). A selection counts when the chosen program passes every hidden test.

    python bench/split_tester_claim.py --pools 10
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from jaxlm.data.programs import SPECS, candidate_pool, fuzz_inputs, hidden_tests
from jaxlm.eval.program_selection import (OracleTester, behaviour_table, passes_hidden_tests, select_majority,
                                          split_tester)


def run(pools: int = 10, n: int = 8, accuracy: float = 0.85, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    picked = {"random": [], "majority": [], "split_tester": []}
    for spec in SPECS:
        hidden = hidden_tests(spec)
        ok = {p: passes_hidden_tests(p, spec.function, spec.reference, hidden) for p in (spec.reference, *spec.mistakes)}
        for pool in range(pools):
            cands, _ = candidate_pool(spec, n, rng)
            picked["random"].append(float(np.mean([ok[c] for c in cands])))  # the expectation of a random pick
            inputs = fuzz_inputs(spec.arg_type, 48, rng)
            picked["majority"].append(float(ok[cands[select_majority(behaviour_table(cands, spec.function, inputs))]]))
            tester = OracleTester(spec.reference, spec.function,
                                  lambda k, r, s=spec: fuzz_inputs(s.arg_type, k, r),
                                  accuracy=accuracy, wrong_programs=spec.mistakes, seed=pool)
            choice = split_tester(cands, spec.function, tester, rounds=3, proposals=16, seed=pool)
            picked["split_tester"].append(float(ok[cands[choice.index]]))
    return {"pools": len(picked["random"]), "candidates": n, "tester_accuracy": accuracy,
            **{k: float(np.mean(v)) for k, v in picked.items()}}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pools", type=int, default=10, help="candidate pools per task")
    ap.add_argument("--candidates", type=int, default=8)
    ap.add_argument("--accuracy", type=float, default=0.85, help="the simulated tester's expected-output accuracy")
    args = ap.parse_args()
    print(json.dumps(run(args.pools, args.candidates, args.accuracy), indent=1))
