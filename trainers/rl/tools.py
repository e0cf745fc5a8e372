"""Sandboxed tools, a tool-use environment and agentic trajectories (agentic mid-training).

Tools are pure Python on in-memory state, no I/O: a calculator (integer arithmetic, parsed,
never `eval`), a key-value store and a file search over an in-memory corpus. The agent calls
one by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the built-in
chat format's rendering, `jaxlm.data.chat.render_tool_call`); `ToolEnvironment` follows the
multi-turn `Environment` protocol (`reset(seed) -> observation`, `step(text) -> (observation,
reward, done)`), executing each call and answering with its result; a reply without a call is
the final answer, scored by the problem's verifier.

Trajectories are chat ``messages`` (system, user, assistant with ``tool_calls``, tool), so the
SFT loss trains on the agent's actions only (`jaxlm.data.encoding.encode`):

* `environment_trajectory`: an expert plan executed in the environment, every observation
  the tool's real output ("environmentally native");
* `context_trajectory`: the same plan with observations written from the problem's own
  context, as a trajectory synthesised from a document would have them ("contextually
  native"): the facts are right but not in the tool's output format.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import numpy as np

from jaxlm.agents.parsing import first_call
from jaxlm.data.tasks import safe_arithmetic


@dataclasses.dataclass
class ToolState:
    """What the tools of one episode act on."""

    store: dict[str, str] = dataclasses.field(default_factory=dict)
    files: dict[str, str] = dataclasses.field(default_factory=dict)


def calculator(state: ToolState, expression: str = "") -> str:
    value = safe_arithmetic(str(expression))
    if value is None:
        return "error: only integers, + - * and parentheses"
    try:
        return str(value)
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
        return f"error: the result has about {int(abs(value).bit_length() * 0.30103)} digits, too many to write"


def kv_get(state: ToolState, key: str = "") -> str:
    return state.store.get(str(key), f"error: no key {key!r}")


def kv_set(state: ToolState, key: str = "", value: str = "") -> str:
    state.store[str(key)] = str(value)
    return "ok"


def file_search(state: ToolState, query: str = "") -> str:
    """``path:line: text`` of every line containing ``query`` (case-insensitive), or no match."""
    q = str(query).lower()
    hits = [f"{path}:{i}: {line}" for path, text in sorted(state.files.items())
            for i, line in enumerate(text.splitlines(), 1) if q and q in line.lower()]
    return "\n".join(hits) if hits else "no match"


TOOLS: dict[str, Callable[..., str]] = {"calculator": calculator, "kv_get": kv_get, "kv_set": kv_set,
                                        "file_search": file_search}


def parse_tool_call(text: str) -> dict[str, Any] | None:
    """The first tool call in ``text`` (read as `jaxlm.agents.parsing` reads replies) as
    ``{"name", "arguments"}``; None without one; ``{"error": ...}`` for a malformed one (one
    that is not JSON, or never closed)."""
    call = first_call(text)
    if call is None:
        return None
    if isinstance(call, str):
        return {"error": f"error: {call}"}
    return {"name": call.name, "arguments": call.arguments}


def run_tool(state: ToolState, call: dict[str, Any]) -> str:
    """Execute a parsed call; unknown tools and bad arguments answer with an error text."""
    if "error" in call:
        return call["error"]
    fn = TOOLS.get(call["name"])
    if fn is None:
        return f"error: unknown tool {call['name']!r}; tools: {sorted(TOOLS)}"
    try:
        return fn(state, **{str(k): v for k, v in call["arguments"].items()})
    except (TypeError, ValueError, RecursionError) as e:  # the policy's arguments, never a crash of the episode
        return f"error: {e}"


@dataclasses.dataclass(frozen=True)
class ToolProblems:
    """Synthetic tool-use problems: look a price up (key-value store) or a quantity up (file
    search) and compute a total with the calculator. Problem ``i`` is ``problem(i)``."""

    seed: int = 0
    n_items: int = 6

    def problem(self, index: int) -> dict[str, Any]:
        rng = np.random.default_rng([self.seed, index])
        items = [f"item{j}" for j in rng.choice(50, self.n_items, replace=False)]
        prices = {it: int(rng.integers(2, 30)) for it in items}
        counts = {it: int(rng.integers(2, 12)) for it in items}
        target = items[int(rng.integers(self.n_items))]
        files = {"inventory.txt": "\n".join(f"{it} count {counts[it]}" for it in items)}
        answer = prices[target] * counts[target]
        plan = [("kv_get", {"key": f"price:{target}"}), ("file_search", {"query": f"{target} count"}),
                ("calculator", {"expression": f"{prices[target]}*{counts[target]}"})]
        return {"question": f"What do all the {target} in stock cost?", "store": {f"price:{k}": str(v) for k, v in
                prices.items()}, "files": files, "answer": str(answer), "plan": plan, "target": target,
                "price": prices[target], "count": counts[target]}

    def verify(self, problem: dict[str, Any], completion: str) -> float:
        return float(completion.strip() == problem["answer"])


SYSTEM = "You can call tools: calculator(expression), kv_get(key), kv_set(key, value), file_search(query)."


class ToolEnvironment:
    """One problem per episode (`ToolProblems`); at most ``max_calls`` tool calls."""

    def __init__(self, problems: ToolProblems, max_calls: int = 6):
        self.problems, self.max_calls = problems, max_calls
        self.problem: dict[str, Any] | None = None
        self.done = True  # no episode until reset

    def reset(self, seed: int) -> str:
        self.problem = self.problems.problem(seed)
        self.state = ToolState(store=dict(self.problem["store"]), files=dict(self.problem["files"]))
        self.calls = 0
        self.done = False
        return self.problem["question"]

    def step(self, text: str) -> tuple[str, float, bool]:
        """``(observation, reward, done)``; stepping a finished episode is an error (its answer
        was scored, or its tool budget is spent)."""
        if self.done:
            raise RuntimeError("step() on a finished episode: call reset(seed) first")
        call = parse_tool_call(text)
        if call is None:  # the final answer
            self.done = True
            return "", self.problems.verify(self.problem, text), True
        self.calls += 1
        result = run_tool(self.state, call)
        self.done = self.calls >= self.max_calls
        return result, 0.0, self.done


def _messages(question: str, plan, observations, answer: str) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for (name, args), obs in zip(plan, observations):
        msgs.append({"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]})
        msgs.append({"role": "tool", "name": name, "content": obs})
    msgs.append({"role": "assistant", "content": answer})
    return msgs


def environment_trajectory(env: ToolEnvironment, index: int) -> list[dict[str, Any]]:
    """Problem ``index``'s expert plan executed in ``env``: observations are the tools' outputs."""
    question = env.reset(index)
    observations = []
    for name, args in env.problem["plan"]:
        call = '<tool_call>' + json.dumps({"name": name, "arguments": args}) + '</tool_call>'
        obs, _, _ = env.step(call)
        observations.append(obs)
    return _messages(question, env.problem["plan"], observations, env.problem["answer"])


def context_trajectory(problems: ToolProblems, index: int) -> list[dict[str, Any]]:
    """The same plan with observations written from the problem's context (right facts, prose
    instead of each tool's output format)."""
    p = problems.problem(index)
    observations = [f"The price of {p['target']} is {p['price']}.", f"There are {p['count']} {p['target']} in stock.",
                    f"{p['price']} times {p['count']} is {p['answer']}."]
    return _messages(p["question"], p["plan"], observations, p["answer"])
