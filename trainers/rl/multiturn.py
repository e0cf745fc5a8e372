"""Multi-turn rollouts as training rows: one row per episode, turns interleaved.

An episode is a token stream that grows turn by turn: context tokens the environment (or
the game around the policy) contributes, then the tokens the policy samples for that turn,
then the next turn's context, and so on. `TurnRows` records each rollout's stream with,
per token, ``loss_mask`` (1 only on sampled tokens), the sampler's log-prob and the turn
index; `sample_turn` extends every stream by one policy turn with the KV-cache sampler,
conditioning on the whole stream so far.

Why one row per episode (not one row per turn): the row's prefix before turn t's tokens is
exactly what the sampler conditioned on at turn t, so a single forward pass over the row
recomputes every turn's log-probs exactly (the ``sampler_mismatch`` metric stays at float
round-off), and the rollout contract (row ``b*G + g``, per-turn rewards ``[B, G, K]``,
``rows["turn"]`` picking a token's turn advantage) holds with no change to the loop. The
cost is that the policy sees the whole episode so far (a chat-style context); a Markov
context per turn (MemoPilot's ``pi(m_{t-1}, transcript_t)``) would need one row per turn.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from trainers.rl.rollout import left_pad, positions_of, sample_block


class TurnRows:
    """The token streams of ``n`` rollouts, each starting with ``start`` (e.g. ``[bos]``)."""

    def __init__(self, n: int, start: Sequence[int] = ()):
        self.tokens = [list(start) for _ in range(n)]
        self.policy = [[False] * len(start) for _ in range(n)]
        self.logp = [[0.0] * len(start) for _ in range(n)]
        self.turn = [[0] * len(start) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.tokens)

    def add_context(self, i: int, ids: Sequence[int], turn: int) -> None:
        """Tokens the policy reads but did not produce (loss_mask 0)."""
        self.tokens[i] += list(ids)
        self.policy[i] += [False] * len(ids)
        self.logp[i] += [0.0] * len(ids)
        self.turn[i] += [turn] * len(ids)

    def add_policy(self, i: int, ids: Sequence[int], logp: Sequence[float], turn: int) -> None:
        """Tokens the policy sampled (loss_mask 1) with the sampler's log-probs."""
        if len(ids) != len(logp):
            raise ValueError(f"{len(ids)} tokens but {len(logp)} log-probs")
        self.tokens[i] += list(ids)
        self.policy[i] += [True] * len(ids)
        self.logp[i] += [float(x) for x in logp]
        self.turn[i] += [turn] * len(ids)

    def rows(self, width: int, pad_id: int) -> dict[str, np.ndarray]:
        """Right-padded ``[n, width]`` rows in the `trainers.rl.rollout` format."""
        n = len(self.tokens)
        longest = max(map(len, self.tokens))
        if longest > width:
            raise ValueError(f"an episode has {longest} tokens > the row width {width}; raise data.seq_len")
        out = {
            "tokens": np.full((n, width), pad_id, np.int32),
            "attend": np.zeros((n, width), bool),
            "loss_mask": np.zeros((n, width), bool),
            "sampler_logp": np.zeros((n, width), np.float32),
            "turn": np.zeros((n, width), np.int32),
        }
        for i in range(n):
            L = len(self.tokens[i])
            out["tokens"][i, :L] = self.tokens[i]
            out["attend"][i, :L] = True
            out["loss_mask"][i, :L] = self.policy[i]
            out["sampler_logp"][i, :L] = self.logp[i]
            out["turn"][i, :L] = self.turn[i]
        out["positions"] = positions_of(out["attend"])
        return out


def sample_turn(
    graphdef, params, prefixes: Sequence[Sequence[int]], *, width: int, max_new_tokens: int,
    temperature: float, top_p: float | None, rng: jax.Array, pad_id: int, stop_tokens: tuple[int, ...],
    prompt_sharding=None,
) -> tuple[list[list[int]], list[list[float]]]:
    """One policy turn for every stream: ``(tokens, model log-probs)`` per stream, the stop
    token included. Prefixes are left-padded to the fixed ``width`` so every turn reuses one
    compiled sampler. ``prompt_sharding``: the streams split over devices (`sample_block`)."""
    block, mask = left_pad(prefixes, width, pad_id)
    final = sample_block(graphdef, params, block, mask, rng, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_p=top_p, pad_id=pad_id, stop_tokens=stop_tokens,
                         prompt_sharding=prompt_sharding)
    tokens, logp, lengths = jax.device_get((final.tokens, final.logprobs, final.lengths))
    return ([tokens[i, : lengths[i]].tolist() for i in range(len(prefixes))],
            [logp[i, : lengths[i]].tolist() for i in range(len(prefixes))])
