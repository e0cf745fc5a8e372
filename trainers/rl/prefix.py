"""PrefixRL: RL on hard problems conditioned on prefixes of correct, very off-policy traces
(Setlur et al. 2026, "Reuse your FLOPs", arXiv 2601.18795; method card B.1).

On a problem whose on-policy pass@k is ~0 every GRPO group has equal (zero) rewards and no
gradient. PrefixRL:

1. builds a pool of correct traces ``y_x`` per problem ``x``: rejection-sampled from the base
   policy with a large budget (`rejection_sample_pool`), or taken from another source, here
   the task's reference solution (``PrefixConfig.trace_source``; the paper allows traces from
   other models or earlier runs);
2. cuts a trace at fractions ``f`` of its tokens (`cut_points`), estimates the base pass rate
   ``p(x, y[:h])`` of each prefixed prompt (`pass_rates`) and keeps per problem the cut whose
   rate lies in ``[band_lo, band_hi]``, the one closest to the band's centre, ties to the
   shorter prefix (`choose_cut`; card [INFERRED]: the paper asks only for a "reasonable"
   accuracy; cuts are not snapped to step boundaries);
3. trains standard GRPO on the prefixed problems only (`PrefixRLCollector`): the prompt is
   ``x`` followed by the prefix tokens, an open assistant turn (no EOS after the prefix). The
   prefix is in the prompt block, so its tokens have ``loss_mask = 0``: no loss and no
   importance ratio. The verifier scores prefix + completion (`rewards.example_completion`).

Evaluation (`train_grpo`'s held-out accuracy) is on unprefixed problems; the paper's
"back-generalisation" is that it rises although training never sees them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxlm.inference.sampler import default_stop_tokens
from trainers.rl.collectors import SingleTurnCollector
from trainers.rl.rollout import sample_rollouts


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the base policy is sampled: the same settings (prompt block, completion budget,
    temperature, top-p) as the GRPO rollouts, so a pass rate is the rate training will see."""

    tokenizer: Any
    prompt_block: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float | None = None
    rows_per_call: int = 256


def sample_completions(policy, prompts: Sequence[Sequence[int]], n: int, spec: Sampling,
                       rng) -> list[list[list[int]]]:
    """``n`` sampled completions (token ids, stop token removed) per prompt, batched with
    jaxlm's KV-cache sampler ``rows_per_call`` sequences at a time (the last call is padded
    with repeats, so every call has one shape and compiles once)."""
    graphdef, params = policy
    tok = spec.tokenizer
    stops = default_stop_tokens(tok)
    flat = [list(p) for p in prompts for _ in range(n)]
    if not flat:
        return [[] for _ in prompts]
    width = spec.rows_per_call
    out: list[list[int]] = []
    for c, start in enumerate(range(0, len(flat), width)):
        chunk = flat[start : start + width]
        padded = chunk + [chunk[0]] * (width - len(chunk))
        rows = sample_rollouts(
            graphdef, params, padded, num_generations=1, prompt_block=spec.prompt_block,
            max_new_tokens=spec.max_new_tokens, temperature=spec.temperature, top_p=spec.top_p,
            rng=jax.random.fold_in(rng, c), pad_id=tok.pad_id,
            stop_tokens=stops,
        )
        for ids, length in zip(rows["completion"][: len(chunk)], rows["lengths"][: len(chunk)]):
            ids = ids[:length].tolist()
            if ids and ids[-1] in stops:
                ids = ids[:-1]
            out.append(ids)
    return [out[i * n : (i + 1) * n] for i in range(len(prompts))]


def _prompt_ids(example: dict, tokenizer, prefix_ids: Sequence[int] = ()) -> list[int]:
    return tokenizer.encode(example["prompt"], add_bos=True) + list(prefix_ids)


def rejection_sample_pool(policy, task, problems: Sequence[dict], n_samples: int, spec: Sampling,
                          rng) -> dict[int, list[list[int]]]:
    """``{problem index: [correct completions as token ids, distinct, in order drawn]}``:
    ``n_samples`` draws per problem from ``policy`` = (graphdef, params), kept when
    ``task.verify`` accepts them. Problems with no correct draw are absent."""
    tok = spec.tokenizer
    samples = sample_completions(policy, [_prompt_ids(e, tok) for e in problems], n_samples, spec, rng)
    pool: dict[int, list[list[int]]] = {}
    for i, (e, draws) in enumerate(zip(problems, samples)):
        correct: list[list[int]] = []
        for ids in draws:
            if ids not in correct and task.verify(e, tok.decode(ids)) > 0:
                correct.append(ids)
        if correct:
            pool[i] = correct
    return pool


def reference_pool(problems: Sequence[dict], tokenizer) -> dict[int, list[list[int]]]:
    """Traces from another source: each problem's reference solution (``completion``)."""
    return {i: [tokenizer.encode(e["completion"])] for i, e in enumerate(problems) if e.get("completion")}


def pass_rates(policy, task, problems: Sequence[dict], prefixes: Sequence[Sequence[int]], n: int, spec: Sampling,
               rng) -> np.ndarray:
    """``[len(problems)]``: the fraction of ``n`` samples from ``problem + prefix`` (prefix
    token ids continuing the open assistant turn) whose prefix + completion verifies."""
    tok = spec.tokenizer
    prompts = [_prompt_ids(e, tok, p) for e, p in zip(problems, prefixes)]
    samples = sample_completions(policy, prompts, n, spec, rng)
    return np.asarray([
        np.mean([task.verify(e, tok.decode(list(p) + ids)) for ids in draws])
        for e, p, draws in zip(problems, prefixes, samples)
    ], np.float64)


def pass_rate(policy, problem: dict, prefix: Sequence[int], n: int, *, task, spec: Sampling, rng) -> float:
    """One problem's base pass rate from its prefixed prompt (see `pass_rates`)."""
    return float(pass_rates(policy, task, [problem], [prefix], n, spec, rng)[0])


def cut_points(length: int, fractions: Sequence[float]) -> list[int]:
    """Prefix lengths ``h = round(f * length)`` for each fraction, distinct, ascending, kept
    when ``0 < h < length`` (a prefix leaves at least one token to generate)."""
    return sorted({h for h in (round(f * length) for f in fractions) if 0 < h < length})


def clean_cut(tokenizer, trace: Sequence[int], h: int) -> bool:
    """Whether the text of ``trace[:h]`` followed by that of ``trace[h:]`` is the trace's text:
    a cut inside a multi-byte character (byte-level tokens) would leave U+FFFD on both sides,
    and the prefix text the rewards score with a completion would not be the trace's."""
    return tokenizer.decode(trace[:h]) + tokenizer.decode(trace[h:]) == tokenizer.decode(trace)


def choose_cut(cuts: Sequence[int], rates: Sequence[float], band_lo: float, band_hi: float) -> int | None:
    """The cut whose pass rate lies in ``[band_lo, band_hi]`` and is closest to the band's
    centre (ties: the shorter prefix); None if no rate is in the band. [INFERRED, card B.1]"""
    centre = 0.5 * (band_lo + band_hi)
    best = None
    for h, r in sorted(zip(cuts, rates)):
        # distances equal up to float error tie (rates 3/10 and 7/10 around 0.5)
        if band_lo <= r <= band_hi and (best is None or abs(r - centre) < abs(best[1] - centre) - 1e-9):
            best = (h, r)
    return None if best is None else best[0]


def choose_prefixes(policy, task, problems: Sequence[dict], pool: dict[int, list[list[int]]], *,
                    fractions: Sequence[float], band_lo: float, band_hi: float, n: int, spec: Sampling,
                    rng) -> tuple[list[dict], dict[str, float]]:
    """Prefixed training problems, one per problem with a cut in the band, from its first
    trace (cuts only between characters, `clean_cut`). Each is the problem's example with ``prompt`` = problem prompt + prefix text,
    ``prefix`` (text, scored with the completion), ``prefix_ids``, ``problem_prompt``,
    ``prefix_fraction`` and ``pass_rate``. Returns them and summary statistics. All the
    candidate (problem, cut) pass rates are estimated in one batched pass; a cut whose
    prefixed prompt does not fit ``spec.prompt_block`` is not a candidate (counted in the
    statistics as ``cuts_over_prompt_block``)."""
    tok = spec.tokenizer
    cands = [(i, h) for i in sorted(pool) for h in cut_points(len(pool[i][0]), fractions)
             if clean_cut(tok, pool[i][0], h)]
    # a prefixed prompt must fit the rollouts' prompt block: longer cuts are not candidates
    lengths = {i: len(_prompt_ids(problems[i], tok)) for i in {i for i, _ in cands}}
    too_long = sum(lengths[i] + h > spec.prompt_block for i, h in cands)
    cands = [(i, h) for i, h in cands if lengths[i] + h <= spec.prompt_block]
    prefixes = [pool[i][0][:h] for i, h in cands]
    rates = pass_rates(policy, task, [problems[i] for i, _ in cands], prefixes, n, spec, rng)
    chosen: list[dict] = []
    for i in sorted(pool):
        mine = [(h, r) for (j, h), r in zip(cands, rates) if j == i]
        h = choose_cut([c for c, _ in mine], [r for _, r in mine], band_lo, band_hi)
        if h is None:
            continue
        trace, e = pool[i][0], problems[i]
        prefix = tok.decode(trace[:h])
        chosen.append({
            **e, "problem_prompt": e["prompt"], "prompt": e["prompt"] + prefix, "prefix": prefix,
            "prefix_ids": list(trace[:h]), "prefix_fraction": h / len(trace), "pass_rate": dict(mine)[h],
            "problem_index": i,
        })
    stats = {
        "problems": float(len(problems)), "with_trace": float(len(pool)), "prefixed": float(len(chosen)),
        "cuts_over_prompt_block": float(too_long),
        "mean_pass_rate": float(np.mean([c["pass_rate"] for c in chosen])) if chosen else float("nan"),
        "mean_prefix_fraction": (float(np.mean([c["prefix_fraction"] for c in chosen])) if chosen
                                 else float("nan")),
    }
    return chosen, stats


def _key(cfg):
    return jax.random.fold_in(jax.random.key(cfg.trainer.seed), 0x5052)  # PrefixRL's own stream


def sampling_of(cfg, tokenizer) -> Sampling:
    """The GRPO rollout settings of an `ExperimentConfig` with ``algorithm.prefix`` set."""
    a = cfg.algorithm
    return Sampling(tokenizer, cfg.data.seq_len - a.max_new_tokens, a.max_new_tokens, a.temperature, a.top_p,
                    a.prefix.rows_per_call)


def build_pool(policy, cfg, tokenizer, problems: Sequence[dict], *, task=None) -> dict[int, list[list[int]]]:
    """Step 1 by ``prefix.trace_source``: the base policy's correct samples, the reference
    solutions, or both (policy traces first). Seeded by ``trainer.seed``."""
    p = cfg.algorithm.prefix
    task = cfg.data.source if task is None else task
    pool: dict[int, list[list[int]]] = {}
    if p.trace_source in ("policy", "both"):
        key = jax.random.fold_in(_key(cfg), 1)
        pool = rejection_sample_pool(policy, task, problems, p.pool_samples, sampling_of(cfg, tokenizer), key)
    if p.trace_source in ("reference", "both"):
        for i, traces in reference_pool(problems, tokenizer).items():
            pool[i] = pool.get(i, []) + [t for t in traces if t not in pool.get(i, [])]
    return pool


class PrefixRLCollector(SingleTurnCollector):
    """The single_turn collector over prefixed problems (step 3).

    At construction: the problems (train examples ``0 .. prefix.problems-1``), the trace pool
    and the cuts, from the base policy ``base_params`` (the weights the run starts from, as for
    the reference model). With ``recalibrate_every = R`` the cuts
    are re-chosen with the current policy at iterations R, 2R, ... (traces stay). The chosen
    cuts are part of the checkpoint (`state_dict`), so a run resumed between two calibrations
    continues with the cuts of the last one, bit-identically. Iteration k's prompts are
    prefixed problems ``k*B .. k*B+B-1`` of a fixed per-epoch shuffle."""

    def __init__(self, cfg, graphdef, tokenizer, *, base_params):
        super().__init__(cfg, graphdef, tokenizer, examples=self._prefixed)
        p = self.prefix = cfg.algorithm.prefix
        self.problems = [self.source[i] for i in range(p.problems)]
        self.pool = build_pool((graphdef, base_params), cfg, tokenizer, self.problems, task=self.task)
        self.prefixed: list[dict] = []
        self.calibrate((graphdef, base_params), 0)
        if not self.prefixed:
            raise ValueError(
                f"PrefixRL found no training problem: {len(self.pool)} of {p.problems} problems have a "
                f"correct trace and none has a cut whose base pass rate is in [band_lo={p.band_lo}, "
                f"band_hi={p.band_hi}]; widen the band, add fractions, raise pool_samples or use "
                f"trace_source='reference' or 'both'"
            )

    def calibrate(self, policy, iteration: int) -> dict[str, float]:
        """Step 2 with ``policy``: re-choose the cuts (kept as they were if none is in the band)."""
        p = self.prefix
        key = jax.random.fold_in(_key(self.cfg), 2 + iteration)
        chosen, stats = choose_prefixes(
            policy, self.task, self.problems, self.pool, fractions=p.fractions, band_lo=p.band_lo,
            band_hi=p.band_hi, n=p.pass_rate_samples, spec=sampling_of(self.cfg, self.tokenizer), rng=key,
        )
        if chosen or not self.prefixed:
            self.prefixed = chosen
        self.calibrated_at, self.calibration = iteration, stats
        return stats

    def state_dict(self) -> dict:
        """The current cuts and when they were chosen (JSON; saved with each checkpoint)."""
        def plain(o):
            return o.tolist() if hasattr(o, "tolist") else str(o)

        return json.loads(json.dumps(
            {"calibrated_at": self.calibrated_at, "prefixed": self.prefixed, "calibration": self.calibration},
            default=plain,
        ))

    def load_state_dict(self, state: dict) -> None:
        self.calibrated_at = int(state["calibrated_at"])
        self.prefixed = [dict(e) for e in state["prefixed"]]
        self.calibration = dict(state["calibration"])

    def _prefixed(self, index: int) -> dict:
        n = len(self.prefixed)
        order = np.random.default_rng([self.cfg.trainer.seed, index // n, 0x5052]).permutation(n)
        return self.prefixed[int(order[index % n])]

    def prompt_ids(self, example: dict) -> list[int]:
        """Problem tokens then the trace's own prefix tokens (no re-tokenisation, no EOS)."""
        return _prompt_ids({"prompt": example["problem_prompt"]}, self.tokenizer, example["prefix_ids"])

    def __call__(self, params, iteration: int, rng):
        R = self.prefix.recalibrate_every
        if R and iteration // R * R != self.calibrated_at:
            self.calibrate((self.graphdef, params), iteration // R * R)
        exp = super().__call__(params, iteration, rng)
        B = self.cfg.data.batch_size
        batch = [self._prefixed(iteration * B + i) for i in range(B)]
        exp.metrics.update({
            "prefix/fraction": float(np.mean([e["prefix_fraction"] for e in batch])),
            "prefix/problems": float(len(self.prefixed)),
            "prefix/calibrated_pass_rate": float(np.mean([e["pass_rate"] for e in self.prefixed])),
        })
        return exp
