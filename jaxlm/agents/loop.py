"""The tool-use agent loop: a policy replies, its tool calls run, their results come back,
until it answers or a budget runs out. Batched over episodes.

An `Episode` is an opening conversation (system and user messages), the `Toolbox` it may
use and a ``score`` of the final answer. A `Policy` turns conversations into replies: a jaxlm
model (`ModelPolicy`), the GRPO sampler (`trainers.rl.agent`), or a script in tests. Each
turn, every unfinished episode gets one reply; `jaxlm.agents.parsing.parse_reply` splits it:

- no tool call: the reply is the final answer, scored by the episode;
- tool calls: each runs (`Toolbox.call`) and its result is a ``tool`` message;
- a malformed call, an unknown tool, wrong arguments, a tool that raises or hangs: the error
  is the ``tool`` message, so the model is told and the episode goes on.

Budgets (`AgentConfig`): turns, tool calls, tokens per reply and tokens per episode (the whole
conversation as the policy counts it). An episode that runs out ends without an answer and
gets ``Episode.no_answer_reward``.

A `Trajectory` records the conversation in the agentic-data format (assistant messages with
structured ``tool_calls``, ``tool`` messages with the observations), which
`jaxlm.data.encoding.encode` trains with the loss on the assistant's tokens only, so
trajectories are SFT data as they are; its ``reward`` is an outcome reward for multi-turn GRPO
and its fields are the evaluation record.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from jaxlm.agents.parsing import parse_reply
from jaxlm.agents.tools import Toolbox, check_timeout
from jaxlm.fileio import jsonl_lines
from jaxlm.inference.sampler import default_stop_tokens, generate


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Budgets of one episode."""

    max_turns: int = 8
    """Policy replies per episode."""
    max_tool_calls: int = 16
    """Tool calls per episode (calls past it are answered with an error and end the episode)."""
    max_new_tokens: int = 64
    """Tokens per reply."""
    max_episode_tokens: int = 2048
    """Tokens of the whole conversation, the next reply included."""
    tool_timeout_s: float = 2.0
    """Seconds a tool call may run (a tool's own ``timeout_s`` wins)."""
    max_observation_chars: int = 2000
    """Characters of a tool result shown to the model (longer ones are cut, saying so)."""

    def __post_init__(self):
        for name in ("max_turns", "max_tool_calls", "max_new_tokens", "max_episode_tokens", "max_observation_chars"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"AgentConfig.{name}={v!r} must be an int > 0")
        check_timeout(self.tool_timeout_s, "AgentConfig.tool_timeout_s")
        if self.max_new_tokens >= self.max_episode_tokens:
            raise ValueError(f"AgentConfig.max_new_tokens={self.max_new_tokens} must be below "
                             f"max_episode_tokens={self.max_episode_tokens}")


@dataclasses.dataclass
class Episode:
    """One task instance: the opening ``messages``, the ``toolbox``, ``score(answer) -> reward``
    and free-form ``info`` (the gold answer, ids) copied into the trajectory."""

    messages: list[dict[str, Any]]
    toolbox: Toolbox
    score: Callable[[str], float]
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    no_answer_reward: float = 0.0


def question_episode(system: str, question: str, toolbox: Toolbox, score: Callable[[str], float],
                     info: dict[str, Any]) -> Episode:
    """The common episode shape: a system prompt, one user question."""
    return Episode([{"role": "system", "content": system}, {"role": "user", "content": question}], toolbox, score,
                   info)


def read_rows(path: str | Path, fields: dict[str, type | tuple[type, ...]]) -> list[dict[str, Any]]:
    """The JSON objects of a jsonl file (blank lines skipped), each checked to hold ``fields``
    of the given types (a field that may be a str or a list, like a gold ``answer``, must be a
    string or a non-empty list of strings); errors name the file, the line and what is wrong."""
    rows = []
    for n, line in jsonl_lines(path):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        except (ValueError, RecursionError) as e:  # an integer past Python's digit limit, deep nesting
            raise ValueError(f"{path}:{n}: not JSON that can be read ({type(e).__name__})") from None
        bad = [k for k, kind in fields.items() if not isinstance(row, dict) or not isinstance(row.get(k), kind)]
        if bad:
            need = ", ".join(f"{k!r} ({'/'.join(t.__name__ for t in (kind if isinstance(kind, tuple) else (kind,)))})"
                             for k, kind in fields.items())
            raise ValueError(f"{path}:{n}: a row needs {need}; {bad} missing or of the wrong type")
        for k, kind in fields.items():
            value = row[k]
            if isinstance(value, list) and kind == (str, list) and (not value or not all(isinstance(v, str) for v in value)):
                raise ValueError(f"{path}:{n}: {k!r} must be a string or a non-empty list of strings, got {value!r:.80}")
        rows.append(row)
    return rows


@dataclasses.dataclass
class Trajectory:
    """One finished episode. ``stop``: answer | max_turns | max_tool_calls | token_budget.
    ``errors``: every error shown to the model, in order. ``tokens``: the policy's count of
    the conversation through its last reply (the observations after it were never read)."""

    messages: list[dict[str, Any]]
    answer: str | None
    reward: float
    stop: str
    turns: int
    tool_calls: int
    errors: list[str]
    tokens: int
    info: dict[str, Any]

    def example(self) -> dict[str, Any]:
        """The trajectory as an SFT example (``{"messages": ...}``, the agentic-data format)."""
        return {"messages": [dict(m) for m in self.messages]}


class Policy(Protocol):
    """Replies for a batch of conversations. ``episodes`` are stable ids (a stateful policy,
    such as the GRPO sampler, keeps one token stream per id); a conversation holds the
    assistant's replies as it wrote them. ``count_tokens`` is the length of a conversation
    with the generation prompt, in the policy's tokens."""

    def act(self, episodes: Sequence[int], conversations: Sequence[list[dict[str, Any]]],
            tools: Sequence[list[dict[str, Any]]], max_new_tokens: int) -> list[str]: ...

    def count_tokens(self, episode: int, conversation: list[dict[str, Any]],
                     tools: list[dict[str, Any]]) -> int: ...


class _Run:
    """The state of one episode inside `run_episodes`."""

    def __init__(self, episode: Episode, config: AgentConfig):
        self.episode = episode
        self.toolbox = Toolbox(list(episode.toolbox.tools.values()), timeout_s=config.tool_timeout_s,
                               max_chars=config.max_observation_chars)
        self.seen = [dict(m) for m in episode.messages]  # what the policy reads
        self.record = [dict(m) for m in episode.messages]  # the agentic-data trajectory
        self.specs = self.toolbox.specs()
        self.turns = self.calls = 0
        self.errors: list[str] = []
        self.answer: str | None = None
        self.stop: str | None = None

    def observe(self, role_name: str | None, content: str) -> None:
        m = {"role": "tool", "content": content, **({"name": role_name} if role_name else {})}
        self.seen.append(m)
        self.record.append(dict(m))

    def take(self, text: str, config: AgentConfig) -> None:
        self.turns += 1
        reply = parse_reply(text)
        self.seen.append({"role": "assistant", "content": text})
        if reply.is_final:
            self.record.append({"role": "assistant", "content": reply.content})
            self.answer, self.stop = reply.content, "answer"
            return
        msg: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.calls:
            msg["tool_calls"] = [c.message_entry() for c in reply.calls]
        if reply.errors:  # keep the text as written: the structured form would hide the mistake
            msg = {"role": "assistant", "content": text.strip()}
        self.record.append(msg)
        for err in reply.errors:
            self.errors.append(err)
            self.observe(None, f"error: {err}")
        for call in reply.calls:
            if self.calls >= config.max_tool_calls:
                err = f"the tool-call budget ({config.max_tool_calls}) is spent"
                self.errors.append(err)
                self.observe(call.name, f"error: {err}")
                self.stop = "max_tool_calls"
                continue
            self.calls += 1
            result = self.toolbox.call(call.name, call.arguments)
            if result.error is not None:
                self.errors.append(result.error)
            self.observe(call.name, result.content)
        if self.stop is None and self.turns >= config.max_turns:
            self.stop = "max_turns"


def run_episodes(policy: Policy, episodes: Sequence[Episode], config: AgentConfig = AgentConfig()
                 ) -> list[Trajectory]:
    """Run every episode to its end, one batched policy call per turn; trajectories in order."""
    runs = [_Run(e, config) for e in episodes]
    while True:
        active = []
        for i, r in enumerate(runs):
            if r.stop is not None:
                continue
            if policy.count_tokens(i, r.seen, r.specs) + config.max_new_tokens > config.max_episode_tokens:
                r.stop = "token_budget"
            else:
                active.append(i)
        if not active:
            break
        replies = policy.act(active, [runs[i].seen for i in active], [runs[i].specs for i in active],
                             config.max_new_tokens)
        if len(replies) != len(active):
            raise ValueError(f"the policy returned {len(replies)} replies for {len(active)} conversations")
        for i, text in zip(active, replies):
            runs[i].take(str(text), config)
    out = []
    for i, r in enumerate(runs):
        reward = float(r.episode.score(r.answer)) if r.answer is not None else float(r.episode.no_answer_reward)
        # the tokens of the conversation through the last reply (what the trajectory trains on;
        # the observations after it were never read, and counting them overstated the budget)
        last = max((k for k, m in enumerate(r.seen) if m.get("role") == "assistant"), default=len(r.seen) - 1)
        out.append(Trajectory(r.record, r.answer, reward, r.stop, r.turns, r.calls, r.errors,
                              policy.count_tokens(i, r.seen[: last + 1], r.specs), dict(r.episode.info)))
    return out


class ModelPolicy:
    """A jaxlm model (`jaxlm.load_model`) acting through `jaxlm.generate`: each conversation is
    rendered with the tokenizer's chat template (passing the tools) or the built-in format,
    whose turns are one line each, so replies stop at a newline there."""

    def __init__(self, model, *, temperature: float = 0.0, top_p: float | None = None, seed: int = 0,
                 stop_tokens: Sequence[int] | None = None):
        self.model, self.temperature, self.top_p = model, temperature, top_p
        self.tokenizer = model.tokenizer
        self._templated = getattr(self.tokenizer, "chat_template", None) is not None
        if stop_tokens is None:
            eos = list(default_stop_tokens(self.tokenizer))
            stop_tokens = eos if self._templated else [*self.tokenizer.encode("\n"), *eos]
        self.stop_tokens = list(stop_tokens)
        self._seed = seed
        self._calls = 0

    def _ids(self, conversation, tools) -> list[int]:
        kw = {"tools": tools} if self._templated and tools else {}
        return list(self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, **kw))

    def count_tokens(self, episode: int, conversation, tools) -> int:
        return len(self._ids(conversation, tools))

    def act(self, episodes, conversations, tools, max_new_tokens: int) -> list[str]:
        prompts = [self._ids(c, t) for c, t in zip(conversations, tools)]
        self._calls += 1
        out = generate(self.model, prompts, max_new_tokens=max_new_tokens, temperature=self.temperature,
                       top_p=self.top_p, add_bos=False, stop_tokens=self.stop_tokens,
                       rng=self._seed * 1_000_003 + self._calls)
        return [t.strip() for t in out.texts]
