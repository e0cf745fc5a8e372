"""Collectors (``COLLECTORS``): where rollouts come from.

A registered factory ``(cfg, graphdef, tokenizer, *, base_params) -> collector`` builds one
(``base_params``: the policy the run starts from). ``collector(params, iteration, rng) ->
Experience`` produces the rows of one iteration
(`trainers.rl.rollout` format) and their rewards: ``[B, G]`` per rollout (outcome
advantages) or ``[B, G, K]`` per turn (turn-level advantages; each token's ``turn``
picks its turn's advantage). `SingleTurnCollector` samples G completions per prompt of the
configured data source and scores them with the configured rewards (registered as
``single_turn`` in `trainers.rl.registries`, with PrefixRL's variant).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from jaxlm.data.pipeline import ExampleSource
from jaxlm.inference.sampler import default_stop_tokens
from jaxlm.registry import Registry
from trainers.rl.rewards import REWARDS, combine_rewards
from trainers.rl.rollout import sample_rollouts

COLLECTORS: Registry = Registry("rollout collector")


@dataclasses.dataclass
class Experience:
    rows: dict[str, np.ndarray]
    rewards: np.ndarray  # [B, G] or [B, G, K]
    valid: np.ndarray | None = None  # same shape: rollouts / turns that count
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    samples: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    prompt_block: int | None = None  # rows with one prompt_index share this many leading columns


class SingleTurnCollector:
    """``data.batch_size`` prompts of iteration k are the train examples ``k*B .. k*B+B-1``
    (so a resumed run sees the same prompts); each is sampled ``num_generations`` times."""

    def __init__(self, cfg, graphdef, tokenizer, *, examples: Callable[[int], dict] | None = None):
        self.cfg, self.graphdef, self.tokenizer = cfg, graphdef, tokenizer
        a = cfg.algorithm
        self.source = ExampleSource(cfg.data.source, "train")
        self.task = cfg.data.source
        self.examples = examples or self.source.__getitem__
        self.reward_fns = [REWARDS[n] for n in a.rewards]
        self.prompt_sharding = None  # GRPOTrainer: the prompts split over its mesh's data devices
        self.prompt_block = cfg.data.seq_len - a.max_new_tokens
        if self.prompt_block <= 0:
            raise ValueError(
                f"data.seq_len={cfg.data.seq_len} must exceed algorithm.max_new_tokens={a.max_new_tokens} "
                f"(rows hold the prompt block and the completion)"
            )

    def prompt_ids(self, example: dict) -> list[int]:
        """BOS + the prompt; a chat example's messages before its last assistant turn (all of
        them if it has none), rendered with the tokenizer's chat template and its generation
        prompt."""
        if "messages" in example:
            return list(self.tokenizer.apply_chat_template(_prompt_messages(example), add_generation_prompt=True))
        return self.tokenizer.encode(example["prompt"], add_bos=True)

    def prompt_text(self, example: dict) -> str:
        """The prompt as the rewards and the samples see it (a chat prompt rendered as text)."""
        if "messages" in example:
            return self.tokenizer.apply_chat_template(_prompt_messages(example), add_generation_prompt=True,
                                                      tokenize=False)
        return example["prompt"]

    def __call__(self, params, iteration: int, rng) -> Experience:
        a, B = self.cfg.algorithm, self.cfg.data.batch_size
        G = a.num_generations
        examples = [self.examples(iteration * B + i) for i in range(B)]
        prompt_ids = [self.prompt_ids(e) for e in examples]
        rows = sample_rollouts(
            self.graphdef, params, prompt_ids, num_generations=G,
            prompt_block=self.prompt_block, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
            top_p=a.top_p, rng=rng, pad_id=self.tokenizer.pad_id, stop_tokens=default_stop_tokens(self.tokenizer),
            prompt_sharding=self.prompt_sharding,
        )
        texts = [self.tokenizer.decode(c[:n]) for c, n in zip(rows["completion"], rows["lengths"])]
        flat_examples = [e for e in examples for _ in range(G)]
        prompts = [self.prompt_text(e) for e in examples]
        total, parts = combine_rewards(
            self.reward_fns, a.reward_weights, [p for p in prompts for _ in range(G)], texts,
            examples=flat_examples, prompt_ids=[p for p in prompt_ids for _ in range(G)],
            group=np.repeat(np.arange(B), G), num_generations=G, task=self.task,
            policy=(self.graphdef, params), tokenizer=self.tokenizer, config=a,
        )
        metrics = {"reward": float(np.nanmean(total)), "completion_len": float(rows["lengths"].mean())}
        for name, p in zip(a.rewards, parts):
            metrics[f"reward/{name}"] = float(np.nanmean(p))
        samples = [{"prompt": p, "completion": t, "reward": float(r)} for p, t, r in zip(prompts, texts[::G], total[::G])]
        rewards = total.reshape(B, G)
        return Experience(rows=rows, rewards=np.nan_to_num(rewards, nan=0.0), valid=~np.isnan(rewards),
                          metrics=metrics, samples=samples, prompt_block=self.prompt_block)


def _prompt_messages(example: dict) -> list[dict]:
    """A chat example's messages before its final assistant turn(s): what the policy answers."""
    messages = list(example["messages"])
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages:
        raise ValueError(f"a chat example has no message before its assistant turn: {example['messages']!r}")
    return messages
