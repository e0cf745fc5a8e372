"""Sandboxed tools, the tool-use environment and agentic trajectories: tool outputs, the
environment's protocol, and loss masks that cover exactly the agent's actions."""

import json

import pytest

import jaxlm
from jaxlm.data.chat import render_tool_call
from jaxlm.data.encoding import encode
from jaxlm.data.files import DataError, read_rows
from trainers.rl.environments import Environment
from trainers.rl.tools import (
    ToolEnvironment,
    ToolProblems,
    ToolState,
    context_trajectory,
    environment_trajectory,
    parse_tool_call,
    run_tool,
)

TOK = jaxlm.ByteTokenizer()


def test_tools_compute_store_and_search():
    state = ToolState(files={"a.txt": "apple 3\nPear 4", "b.txt": "pear 9"})
    assert run_tool(state, {"name": "calculator", "arguments": {"expression": "(2+3)*7-1"}}) == "34"
    assert run_tool(state, {"name": "calculator", "arguments": {"expression": "__import__('os')"}}).startswith("error")
    assert run_tool(state, {"name": "kv_get", "arguments": {"key": "x"}}) == "error: no key 'x'"
    assert run_tool(state, {"name": "kv_set", "arguments": {"key": "x", "value": 5}}) == "ok"
    assert run_tool(state, {"name": "kv_get", "arguments": {"key": "x"}}) == "5"
    assert run_tool(state, {"name": "file_search", "arguments": {"query": "pear"}}) == "a.txt:2: Pear 4\nb.txt:1: pear 9"
    assert run_tool(state, {"name": "file_search", "arguments": {"query": "kiwi"}}) == "no match"
    assert "unknown tool 'shell'" in run_tool(state, {"name": "shell", "arguments": {}})
    assert run_tool(state, {"name": "kv_get", "arguments": {"nope": 1}}).startswith("error:")


def test_tool_calls_parse_from_the_agents_text():
    assert parse_tool_call('ok <tool_call>{"name": "kv_get", "arguments": {"key": "k"}}</tool_call> x') == {
        "name": "kv_get", "arguments": {"key": "k"}}
    assert parse_tool_call("42") is None
    assert "not JSON" in parse_tool_call("<tool_call>{oops</tool_call>")["error"]
    assert "error" in parse_tool_call('<tool_call>["kv_get"]</tool_call>')
    # what a policy may write: an integer over Python's digit limit, nesting past the recursion limit
    assert "not JSON" in parse_tool_call('<tool_call>{"name": "calculator", "arguments": {"expression": %s}}'
                                         '</tool_call>' % ("7" * 5000))["error"]
    assert "not JSON" in parse_tool_call("<tool_call>" + "[" * 100000 + "]" * 100000 + "</tool_call>")["error"]
    # read as the agent loop reads replies: a call cut off by the token budget is an error, not a
    # final answer; an abandoned call does not swallow the whole one after it
    assert "not closed" in parse_tool_call('<tool_call>{"name": "kv_get", "arguments": {"ke')["error"]
    assert parse_tool_call('<tool_call>{"name": "kv<tool_call>{"name": "kv_get", "arguments": {"key": "k"}}'
                           '</tool_call>')["error"].startswith("error: tool call 0")
    assert parse_tool_call('<tool_call>{"name": "kv_get", "arguments": {"key": "</tool_call>"}}</tool_call>') == {
        "name": "kv_get", "arguments": {"key": "</tool_call>"}}


def test_a_result_too_long_to_write_is_an_error_text_not_a_crash():
    env = ToolEnvironment(ToolProblems())
    env.reset(0)
    product = "*".join(["9" * 100] * 50)  # about 5000 digits: past str()'s limit for ints
    obs, reward, done = env.step(render_tool_call({"name": "calculator", "arguments": {"expression": product}}))
    assert obs.startswith("error: the result has about 5000 digits") and (reward, done) == (0.0, False)


def test_environment_follows_the_protocol_and_scores_the_answer():
    env = ToolEnvironment(ToolProblems(), max_calls=2)
    assert isinstance(env, Environment)
    question = env.reset(5)
    p = env.problem
    assert p["target"] in question
    obs, reward, done = env.step(render_tool_call({"name": "kv_get", "arguments": {"key": f"price:{p['target']}"}}))
    assert (obs, reward, done) == (str(p["price"]), 0.0, False)
    assert env.step(p["answer"]) == ("", 1.0, True)
    env.reset(5)
    assert env.step(p["answer"] + "0")[1] == 0.0
    env.reset(5)
    env.step(render_tool_call({"name": "calculator", "arguments": {"expression": "1"}}))
    assert env.step(render_tool_call({"name": "calculator", "arguments": {"expression": "1"}}))[2]  # call budget
    # a finished episode (budget spent, or answered) is not stepped again: an answer scored twice
    # or a call past the budget would be silent
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step(render_tool_call({"name": "calculator", "arguments": {"expression": "1"}}))
    env.reset(5)
    env.step(p["answer"])
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step(p["answer"])
    with pytest.raises(RuntimeError, match="finished episode"):
        ToolEnvironment(ToolProblems()).step(p["answer"])  # before any reset


@pytest.mark.parametrize("native", ["environment", "context"])
def test_trajectory_masks_cover_exactly_the_actions(native):
    problems = ToolProblems(seed=1)
    msgs = environment_trajectory(ToolEnvironment(problems), 7) if native == "environment" else \
        context_trajectory(problems, 7)
    enc = encode({"messages": msgs}, TOK)
    trained = [t for t, m in zip(enc["tokens"], enc["loss_mask"]) if m]
    assert trained[-1] == TOK.eos_id
    calls = [c for m in msgs if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    actions = "".join(render_tool_call(c) + "\n" for c in calls) + problems.problem(7)["answer"] + "\n"
    assert TOK.decode(trained[:-1]) == actions  # and nothing of the system, user or tool turns


def test_environment_observations_are_the_tools_outputs_and_context_ones_are_prose():
    problems = ToolProblems(seed=2)
    env_msgs = environment_trajectory(ToolEnvironment(problems), 4)
    ctx_msgs = context_trajectory(problems, 4)
    p = problems.problem(4)
    env_obs = [m["content"] for m in env_msgs if m["role"] == "tool"]
    ctx_obs = [m["content"] for m in ctx_msgs if m["role"] == "tool"]
    state = ToolState(store=dict(p["store"]), files=dict(p["files"]))
    assert env_obs == [run_tool(state, {"name": n, "arguments": a}) for n, a in p["plan"]]
    assert env_obs != ctx_obs and all(str(v) in o for v, o in zip((p["price"], p["count"], p["answer"]), ctx_obs))
    # same actions in both: only the observations differ
    assert [m for m in env_msgs if m["role"] != "tool"] == [m for m in ctx_msgs if m["role"] != "tool"]


def test_trajectory_rows_load_from_files(tmp_path):
    path = tmp_path / "traj.jsonl"
    short = {"messages": [{"role": "user", "content": "2*3?"},
                          {"role": "assistant", "content": "", "tool_calls": [{"name": "calculator",
                                                                               "arguments": {"expression": "2*3"}}]},
                          {"role": "tool", "name": "calculator", "content": "6"},
                          {"role": "assistant", "content": "6"}]}
    path.write_text(json.dumps(short) + "\n")
    (row,) = read_rows(path)
    assert row["messages"][1]["tool_calls"] == [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}}]
    assert row["messages"][2] == {"role": "tool", "name": "calculator", "content": "6"}
    bad = json.loads(json.dumps(short))
    bad["messages"][0]["tool_calls"] = []
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(DataError, match=r"traj.jsonl:1: messages\[0\]: 'tool_calls' is a list on an assistant"):
        read_rows(path)
    bad = json.loads(json.dumps(short))
    bad["messages"][1]["tool_calls"] = [{"arguments": {}}]
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(DataError, match=r"messages\[1\].tool_calls\[0\]: a tool call must be"):
        read_rows(path)


@pytest.mark.slow  # an Extraction base and two 400-step mid-training runs at 16 x 768 tokens (about 25 minutes on 2 cores)
def test_environment_native_trajectories_beat_context_native_ones_at_equal_tokens(tmp_path):
    """The agentic mid-training claim in miniature, as `bench/agentic_claim.py` measures it (its
    own process, XLA's default optimisation): from the same base, mid-training on trajectories
    whose observations are the tools' real outputs solves held-out problems in the live
    environment far more often than the same plans with prose observations, at equal tokens."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "bench" / "agentic_claim.py"
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", "").strip()
    proc = subprocess.run([sys.executable, str(bench), "--out", str(tmp_path / "runs"), "--eval", "100", "--json",
                           str(tmp_path / "result.json")], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["environment"]["success"] >= 0.3
    assert result["environment"]["success"] > result["context"]["success"] + 0.2
