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

`ChatRows` builds such streams for chat environments in the tokenizer's chat format (its own
template, else the built-in one; `jaxlm.data.chat`): the environment's messages and the
generation prompt are context, the policy's replies are what it sampled.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from jaxlm.inference.sampler import default_stop_tokens
from jaxlm.sharding import to_host
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


class ChatRows(TurnRows):
    """`TurnRows` of chat episodes. ``add_messages`` appends environment messages (user, tool,
    system): the text the chat template adds after the stream so far, up to and including
    the generation prompt (context). ``add_reply`` appends the policy's sampled tokens as an
    assistant message; they stand for the reply's trained span (`jaxlm.data.chat`: content
    and end-of-turn token), so the next context starts after the template's end-of-turn token
    (before it when the reply hit ``max_new_tokens`` without a stop token: the context closes
    the turn; the built-in format has none, its next context starts after the reply's line). Where the template writes replies as sampled and the tokenizer splits text at
    turn boundaries, a row equals `jaxlm.data.chat.encode_chat` of the conversation and its
    ``loss_mask`` the assistant mask. ``template_kwargs``: template variables; ``tools[i]``:
    stream ``i``'s tool specs, passed to a chat template as ``tools`` (as
    `jaxlm.agents.loop.ModelPolicy` renders them)."""

    def __init__(self, n: int, tokenizer, *, stop_tokens: Sequence[int] | None = None, **template_kwargs):
        template = getattr(tokenizer, "chat_template", None)
        builtin_bos = template is None and tokenizer.bos_id is not None
        super().__init__(n, [tokenizer.bos_id] if builtin_bos else [])
        self.tokenizer, self.template_kwargs = tokenizer, template_kwargs
        self._template = template  # None: the built-in format, whose specials carry no text
        self.stop_tokens = tuple(stop_tokens) if stop_tokens is not None else default_stop_tokens(tokenizer)
        self.messages: list[list[dict]] = [[] for _ in range(n)]
        self.tools: list[list[dict] | None] = [None] * n
        self._held = [""] * n  # the rendered text the stream's tokens stand for

    def _render(self, i: int, messages, add_generation_prompt: bool) -> str:
        kw = dict(self.template_kwargs)
        if self._template is not None and self.tools[i]:
            kw["tools"] = self.tools[i]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False, **kw)

    def _check_prefix(self, i: int, rendered: str, what: str) -> None:
        held = self._held[i]
        if not rendered.startswith(held):
            at = next((k for k, (a, b) in enumerate(zip(held, rendered)) if a != b), min(len(held), len(rendered)))
            raise ValueError(
                f"stream {i}: the chat template renders the conversation so far differently once {what} "
                f"(from character {at}: {held[at:][:40]!r} before, {rendered[at:][:40]!r} now); a template that "
                f"rewrites earlier turns cannot extend one row per episode"
            )

    def add_messages(self, i: int, messages: Sequence[dict], turn: int) -> list[int]:
        """Append ``messages`` and the generation prompt to stream ``i``; returns the ids added."""
        self.messages[i] += [dict(m) for m in messages]
        target = self._render(i, self.messages[i], True)
        self._check_prefix(i, target, f"{[m.get('role') for m in messages]} follow")
        ids = self.tokenizer.encode(target[len(self._held[i]):])
        self.add_context(i, ids, turn)
        self._held[i] = target
        return ids

    def length_with(self, i: int, messages: Sequence[dict]) -> int:
        """The tokens stream ``i`` would hold after ``add_messages(i, messages, ...)``."""
        target = self._render(i, self.messages[i] + [dict(m) for m in messages], True)
        self._check_prefix(i, target, f"{[m.get('role') for m in messages]} follow")
        return len(self.tokens[i]) + len(self.tokenizer.encode(target[len(self._held[i]):]))

    def add_reply(self, i: int, ids: Sequence[int], logp: Sequence[float], turn: int) -> str:
        """Append the policy's sampled ``ids`` (with their log-probs) as an assistant message;
        returns its content (the text before the stop token)."""
        ids = [int(t) for t in ids]
        self.add_policy(i, ids, logp, turn)
        stopped = bool(ids) and ids[-1] in self.stop_tokens
        body = ids[:-1] if stopped else ids
        content = (self.tokenizer.decode(body) if self._template is None
                   else self.tokenizer.decode(body, skip_special_tokens=False))
        self.messages[i].append({"role": "assistant", "content": content})
        rendered = self._render(i, self.messages[i], False)
        self._check_prefix(i, rendered, "the reply is added (the generation prompt does not open it)")
        end_token = None if self._template is None else self._template.end_of_turn(rendered, len(self._held[i]))
        if end_token is None:  # the built-in format closes a message with "\n": held only if sampled
            closed = stopped and self.tokenizer.decode([ids[-1]]) == "\n"
            resume = len(rendered) - 1 if rendered.endswith("\n") and not closed else len(rendered)
        else:
            resume = end_token[1] if stopped else end_token[0]
        self._held[i] = rendered[:resume]
        return content


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
    tokens, logp, lengths = to_host((final.tokens, final.logprobs, final.lengths))
    return ([tokens[i, : lengths[i]].tolist() for i in range(len(prefixes))],
            [logp[i, : lengths[i]].tolist() for i in range(len(prefixes))])
