"""Multi-turn GRPO on tool-use tasks: the ``agent`` collector.

Iteration ``k`` runs ``data.batch_size`` task episodes (`jaxlm.agents.tasks`, indices
``k*B .. k*B+B-1``), each ``num_generations`` times, through the shared agent loop
(`jaxlm.agents.loop.run_episodes`) with `StreamPolicy`: one token stream per rollout
(`trainers.rl.multiturn.ChatRows`), the system/user/tool messages as context and the policy's
replies sampled with the KV-cache sampler, so one forward over a row recomputes every
turn's log-probs. The reward is the episode's outcome (its score; ``no_answer_reward`` when a
budget ran out first), advantages per group as in single-turn GRPO. The loop's budgets come
from ``GRPOConfig.agent.loop``, with the reply length ``GRPOConfig.max_new_tokens`` and the
episode capped at ``data.seq_len`` tokens (the row width).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from jaxlm.agents.loop import run_episodes
from jaxlm.agents.tasks import AgentTaskConfig
from jaxlm.inference.sampler import default_stop_tokens
from trainers.rl.collectors import COLLECTORS, Experience
from trainers.rl.multiturn import ChatRows, sample_turn


class StreamPolicy:
    """The agent loop's `jaxlm.agents.loop.Policy` over ``n`` `ChatRows` streams, sampling
    with ``(graphdef, params)``. Built-in chat format: a reply ends at a newline or EOS."""

    def __init__(self, n: int, graphdef, params, tokenizer, *, width: int, temperature: float,
                 top_p: float | None, rng: jax.Array, prompt_sharding=None):
        templated = getattr(tokenizer, "chat_template", None) is not None
        eos = default_stop_tokens(tokenizer)
        newline = () if templated else tuple(tokenizer.encode("\n"))
        self.stop_tokens = newline + eos
        self.rows = ChatRows(n, tokenizer, stop_tokens=self.stop_tokens)
        self.graphdef, self.params, self.tokenizer = graphdef, params, tokenizer
        self.width, self.temperature, self.top_p = width, temperature, top_p
        self.rng, self.prompt_sharding = rng, prompt_sharding
        self.turns = [0] * n

    def _new(self, i: int, conversation, tools) -> list[dict]:
        self.rows.tools[i] = list(tools) if tools else None  # a chat template renders them, as at inference
        return [dict(m) for m in conversation[len(self.rows.messages[i]):]]

    def count_tokens(self, episode: int, conversation, tools) -> int:
        return self.rows.length_with(episode, self._new(episode, conversation, tools))

    def act(self, episodes: Sequence[int], conversations, tools, max_new_tokens: int) -> list[str]:
        for i, conv, t in zip(episodes, conversations, tools):
            self.rows.add_messages(i, self._new(i, conv, t), self.turns[i])
        self.rng, key = jax.random.split(self.rng)
        ids, logp = sample_turn(self.graphdef, self.params, [self.rows.tokens[i] for i in episodes], width=self.width,
                                max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                                rng=key, pad_id=self.tokenizer.pad_id, stop_tokens=self.stop_tokens,
                                prompt_sharding=self.prompt_sharding)
        out = []
        for i, t, lp in zip(episodes, ids, logp):
            out.append(self.rows.add_reply(i, t, lp, self.turns[i]))
            self.turns[i] += 1
        return out


class AgentCollector:
    """Rollouts of a tool-use task (see the module docstring); rewards ``[B, G]``."""

    def __init__(self, cfg, graphdef, tokenizer):
        a = cfg.algorithm
        agent = getattr(a, "agent", None)
        if not isinstance(agent, AgentTaskConfig):
            raise ValueError(f"GRPOConfig.agent={agent!r} is invalid for collector='agent': must be an AgentTaskConfig")
        self.cfg, self.graphdef, self.tokenizer = cfg, graphdef, tokenizer
        self.task = agent.build()
        self.width = cfg.data.seq_len
        self.loop = dataclasses.replace(agent.loop, max_new_tokens=a.max_new_tokens,
                                        max_episode_tokens=min(agent.loop.max_episode_tokens, self.width))
        self.prompt_sharding = None  # GRPOTrainer: the streams split over its mesh

    def __call__(self, params, iteration: int, rng) -> Experience:
        a, B = self.cfg.algorithm, self.cfg.data.batch_size
        G = a.num_generations
        episodes = [self.task.episode(iteration * B + b) for b in range(B) for _ in range(G)]
        policy = StreamPolicy(B * G, self.graphdef, params, self.tokenizer, width=self.width - a.max_new_tokens,
                              temperature=a.temperature, top_p=a.top_p, rng=rng, prompt_sharding=self.prompt_sharding)
        trajectories = run_episodes(policy, episodes, self.loop)
        rows = policy.rows.rows(self.width, self.tokenizer.pad_id)
        rewards = np.asarray([t.reward for t in trajectories], np.float32).reshape(B, G)
        metrics = {
            "reward": float(rewards.mean()),
            "answered": float(np.mean([t.answer is not None for t in trajectories])),
            "turns": float(np.mean([t.turns for t in trajectories])),
            "tool_calls": float(np.mean([t.tool_calls for t in trajectories])),
            "tool_errors": float(np.mean([len(t.errors) for t in trajectories])),
            "episode_tokens": float(np.mean([t.tokens for t in trajectories])),
        }
        samples = [{"episode": self.tokenizer.decode(policy.rows.tokens[b * G]), "reward": float(rewards[b, 0])}
                   for b in range(B)]
        return Experience(rows=rows, rewards=rewards, metrics=metrics, samples=samples)


@COLLECTORS.register("agent")
def agent(cfg, graphdef, tokenizer, *, base_params=None):
    return AgentCollector(cfg, graphdef, tokenizer)
