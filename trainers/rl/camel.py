"""CAMEL's GRPO with counterfactual prefix augmentation (Zhu et al. 2026, arXiv 2602.20670;
method card B.7, training [SUMMARY], prefix format [INFERRED]).

Each iteration, for the ``B`` judging prompts of the data source (`SingleTurnCollector`'s
order), the policy's own verdict is its greedy choice between the two verdict letters (one
batched scoring call, as `jaxlm.eval.camel.gated_judge` takes it). With probability
``CamelConfig.flip_prob`` the other letter is forced instead. The prompt block then holds the
judging prompt, that verdict and the reflection marker (``loss_mask`` 0: no loss and no
importance ratio on the forced verdict), and the ``G`` rollouts write the reflection and the
final verdict. The verifier reads prefix + completion (`rewards.example_completion`), so the
reward is the final verdict's correctness: a rollout after a wrong forced verdict earns it only
by revising.

Registered as the ``camel`` collector: ``GRPOConfig(collector="camel", camel=CamelConfig(...))``.
Metrics: ``camel/own_correct`` (the policy's one-token verdict accuracy), ``camel/flipped``,
and the final-verdict accuracy after a right and after a wrong initial verdict
(``camel/final_after_right``, ``camel/final_after_wrong``: rubber-stamping shows as the latter
near 0).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from jaxlm.eval.camel import CamelTemplate
from jaxlm.eval.scoring import candidate_logprobs, single_token_id
from trainers.rl.collectors import COLLECTORS, SingleTurnCollector


@dataclasses.dataclass(frozen=True)
class CamelConfig:
    """CAMEL's counterfactual prefix augmentation (Zhu et al. 2026, method card B.7;
    `trainers.rl.camel`): each judging prompt's rollouts continue after an initial verdict
    placed in the prompt (no loss on it), the policy's own greedy verdict or, with probability
    ``flip_prob``, the other one, so the reflection and final verdict learn to revise rather than
    rubber-stamp. The data source is a pairwise judging task in CAMEL's format
    (`jaxlm.data.judging.SumJudging`) whose examples carry ``answer`` (0 = A, 1 = B)."""

    flip_prob: float = 0.5
    """Probability that the initial verdict is the other letter than the policy's own
    (card [INFERRED]: Bernoulli(0.5))."""

    def __post_init__(self):
        v = self.flip_prob
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise ValueError(f"CamelConfig.flip_prob={v!r} must be a number in [0, 1]")


def verdict_prefixes(policy, tokenizer, examples: list[dict], *, template: CamelTemplate, flip_prob: float,
                     rng: np.random.Generator) -> tuple[list[dict], np.ndarray, np.ndarray]:
    """The examples with their counterfactual ``prefix`` (verdict letter + reflection marker) after
    the bare judging prompt (``judge_prompt`` when the example has one), and per example the
    policy's own verdict and whether it was flipped."""
    for i, e in enumerate(examples):
        if "answer" not in e or e["answer"] not in (0, 1):
            raise ValueError(f"example {i} has no 'answer' of 0 (A) or 1 (B): the camel collector needs a pairwise "
                             "judging task (e.g. jaxlm.data.judging.SumJudging)")
    jt = template.judge
    ids = [single_token_id(tokenizer, jt.first), single_token_id(tokenizer, jt.second)]
    prompts = [e.get("judge_prompt", e["prompt"]) for e in examples]
    logp = candidate_logprobs(policy, prompts, ids)
    own = (logp[:, 1] > logp[:, 0]).astype(np.int32)  # ties: A, as gated_judge
    flipped = rng.random(len(examples)) < flip_prob
    initial = np.where(flipped, 1 - own, own)
    letters = (jt.first, jt.second)
    out = [{**e, "prompt": p, "prefix": letters[v] + template.reflect, "initial": int(v), "flipped": bool(f)}
           for e, p, v, f in zip(examples, prompts, initial, flipped)]
    return out, own, flipped


class CamelCollector(SingleTurnCollector):
    """Single-turn GRPO over counterfactually prefixed judging prompts (module docstring)."""

    def __init__(self, cfg, graphdef, tokenizer):
        super().__init__(cfg, graphdef, tokenizer, examples=self._prefixed)
        self.camel = cfg.algorithm.camel or CamelConfig()
        self.template = getattr(cfg.data.source, "template", CamelTemplate())
        if not isinstance(self.template, CamelTemplate):
            raise ValueError(f"data.source.template must be a CamelTemplate for the camel collector, got "
                             f"{type(self.template).__name__}")
        self._batch: dict[int, dict] = {}

    def _prefixed(self, index: int) -> dict:
        return self._batch[index]

    def prompt_ids(self, example: dict) -> list[int]:
        """BOS + the judging prompt with the initial verdict and the reflection marker."""
        return self.tokenizer.encode(example["prompt"] + example["prefix"], add_bos=True)

    def __call__(self, params, iteration: int, rng):
        B = self.cfg.data.batch_size
        indices = [iteration * B + i for i in range(B)]
        base = [self.source[i] for i in indices]
        draws = np.random.default_rng([self.cfg.trainer.seed, iteration, 0xCA3E1])  # resume: same flips
        policy = nnx.merge(self.graphdef, params)
        policy.tokenizer = self.tokenizer
        prefixed, own, flipped = verdict_prefixes(policy, self.tokenizer, base, template=self.template,
                                                  flip_prob=self.camel.flip_prob, rng=draws)
        self._batch = dict(zip(indices, prefixed))
        exp = super().__call__(params, iteration, rng)
        G = self.cfg.algorithm.num_generations
        answers = np.asarray([e["answer"] for e in base])
        initial_right = np.repeat(np.asarray([e["initial"] for e in prefixed]) == answers, G)
        final_right = exp.rewards.reshape(-1) > 0  # the verifier's part is 0/1; other rewards may shift it
        if len(self.cfg.algorithm.rewards) == 1 and self.cfg.algorithm.rewards[0] == "verifier":
            exp.metrics["camel/final_after_right"] = float(final_right[initial_right].mean()) \
                if initial_right.any() else float("nan")
            exp.metrics["camel/final_after_wrong"] = float(final_right[~initial_right].mean()) \
                if (~initial_right).any() else float("nan")
        exp.metrics["camel/own_correct"] = float(np.mean(own == answers))
        exp.metrics["camel/flipped"] = float(np.mean(flipped))
        return exp


@COLLECTORS.register("camel")
def camel(cfg, graphdef, tokenizer, *, base_params=None):
    """CAMEL's counterfactual verdict prefixes over a pairwise judging task (module docstring)."""
    return CamelCollector(cfg, graphdef, tokenizer)
