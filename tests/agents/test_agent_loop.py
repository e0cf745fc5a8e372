"""The agent loop with scripted policies: tool results reach the model, every kind of bad
call is recorded and answered without stopping the run, budgets end episodes, and the
trajectory is SFT data whose loss covers the assistant's tokens only."""

import json
import time

import numpy as np
import pytest

from jaxlm.agents import AgentConfig, Episode, Toolbox, run_episodes, tool
from jaxlm.data.encoding import encode
from jaxlm.data.tokenizers import ByteTokenizer


def call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@tool
def add(a: int, b: int) -> str:
    """a + b."""
    return str(a + b)


@tool
def fail(x: int) -> str:
    """Raises."""
    raise RuntimeError("broken")


@tool(timeout_s=0.2)
def hang() -> str:
    """Sleeps forever."""
    time.sleep(60)
    return ""


class Scripted:
    """Replies from per-episode scripts; counts tokens as bytes of the rendered conversation."""

    def __init__(self, scripts):
        self.scripts = [list(s) for s in scripts]
        self.seen = []
        self.tok = ByteTokenizer()

    def count_tokens(self, episode, conversation, tools):
        return len(self.tok.apply_chat_template(conversation, add_generation_prompt=True))

    def act(self, episodes, conversations, tools, max_new_tokens):
        self.seen.append([list(c) for c in conversations])
        return [self.scripts[i].pop(0) for i in episodes]


def episode(answer="5"):
    return Episode([{"role": "system", "content": "Tools: add, fail, hang."}, {"role": "user", "content": "2+3?"}],
                   Toolbox([add, fail, hang]), lambda a: float(a == answer), {"answer": answer})


def test_tool_results_reach_the_policy_and_the_answer_is_scored():
    policy = Scripted([[call("add", a=2, b=3), "5"], ["7"]])
    got = run_episodes(policy, [episode(), episode()])
    assert [t.reward for t in got] == [1.0, 0.0] and [t.stop for t in got] == ["answer", "answer"]
    assert got[0].turns == 2 and got[0].tool_calls == 1 and got[0].errors == []
    assert policy.seen[1][0][-1] == {"role": "tool", "name": "add", "content": "5"}
    assert len(policy.seen[1]) == 1  # the finished episode is not asked again
    assert got[0].messages[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}


def test_bad_calls_are_recorded_told_and_the_episode_goes_on():
    replies = ['<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', call("mul", a=1, b=2),
               call("add", a="two", b=3), call("fail", x=1), call("hang"), "not a call</tool_call>",
               call("add", a=2, b=3), "5"]
    policy = Scripted([replies])
    t0 = time.perf_counter()
    (traj,) = run_episodes(policy, [episode()], AgentConfig(max_turns=10))
    assert time.perf_counter() - t0 < 10
    assert traj.reward == 1.0 and traj.stop == "answer" and traj.turns == 8
    assert len(traj.errors) == 6
    for needle, err in zip(["not JSON", "unknown tool 'mul'", "add.a must be an integer", "fail raised RuntimeError",
                            "did not finish within 0.2 s", "has no <tool_call>"], traj.errors):
        assert needle in err, (needle, err)
    tool_msgs = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert all(c.startswith("error: ") for c in tool_msgs[:6]) and tool_msgs[6] == "5"
    # the malformed reply is kept as written in the record, so SFT on it shows the mistake
    assert traj.messages[2] == {"role": "assistant", "content": replies[0]}


@pytest.mark.parametrize("config,stop,turns", [
    (AgentConfig(max_turns=2), "max_turns", 2),
    (AgentConfig(max_tool_calls=1), "max_tool_calls", 2),
    (AgentConfig(max_new_tokens=8, max_episode_tokens=120), "token_budget", 1),
])
def test_budgets_end_episodes_without_an_answer(config, stop, turns):
    ep = episode()
    ep.no_answer_reward = -1.0
    (traj,) = run_episodes(Scripted([[call("add", a=1, b=1)] * 5]), [ep], config)
    assert traj.stop == stop and traj.turns == turns and traj.answer is None and traj.reward == -1.0
    # the token count covers the conversation through the last reply, not the observations
    # after it, which the policy never read (1619 tokens were reported for a 256 budget)
    policy = Scripted([[]])
    last = max(k for k, m in enumerate(traj.messages) if m["role"] == "assistant")
    assert traj.tokens == policy.count_tokens(0, traj.messages[: last + 1], None)


def test_two_calls_in_one_reply_over_the_call_budget():
    (traj,) = run_episodes(Scripted([[call("add", a=1, b=1) + call("add", a=2, b=2)]]), [episode()],
                           AgentConfig(max_tool_calls=1))
    assert traj.tool_calls == 1 and traj.stop == "max_tool_calls"
    assert traj.errors == ["the tool-call budget (1) is spent"]


def test_policy_must_answer_every_conversation():
    class Short(Scripted):
        def act(self, episodes, conversations, tools, max_new_tokens):
            return []
    with pytest.raises(ValueError, match="0 replies for 1"):
        run_episodes(Short([["x"]]), [episode()])


def test_trajectory_is_sft_data_with_loss_on_the_assistant_only():
    (traj,) = run_episodes(Scripted([[call("add", a=2, b=3), "5"]]), [episode()])
    tok = ByteTokenizer()
    enc = encode(traj.example(), tok)
    trained = tok.decode([t for t, m in zip(enc["tokens"], enc["loss_mask"]) if m and t != tok.eos_id])
    assert trained == call("add", a=2, b=3) + "\n5\n"
    text = tok.decode(enc["tokens"][1:-1])
    assert "<|tool|>\n5\n" in text and "2+3?" in text
    assert enc["loss_mask"][-1] and not enc["loss_mask"][0]
    assert np.asarray(enc["loss_mask"]).sum() == len(trained) + 1


@pytest.mark.parametrize("field,value", [("max_turns", 0), ("max_new_tokens", 4096), ("tool_timeout_s", 0),
                                         ("max_tool_calls", True)])
def test_bad_budgets_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"AgentConfig.{field}|max_new_tokens"):
        AgentConfig(**{field: value})
