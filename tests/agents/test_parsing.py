"""Tool calls in replies: well-formed calls, content around them, and each malformed shape
reported as an error (never raised)."""

import json

from jaxlm.agents.parsing import ToolCall, parse_reply
from jaxlm.data.chat import render_tool_call


def test_rendered_calls_parse_back():
    call = {"type": "function", "function": {"name": "search", "arguments": {"query": "Ada", "limit": 2}}}
    r = parse_reply("Let me look.\n" + render_tool_call(call) + "\n" + render_tool_call(call))
    assert r.content == "Let me look."
    assert r.calls == (ToolCall("search", {"query": "Ada", "limit": 2}),) * 2
    assert r.errors == () and not r.is_final
    assert r.calls[0].message_entry() == call


def test_a_reply_without_calls_is_final():
    r = parse_reply("  Oslo \n")
    assert r.is_final and r.content == "Oslo"


def test_arguments_may_be_a_json_string_or_absent():
    r = parse_reply('<tool_call>{"name": "t", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>{"name": "u"}</tool_call>')
    assert r.calls == (ToolCall("t", {"x": 1}), ToolCall("u", {}))


def test_malformed_calls_are_errors():
    cases = {
        "<tool_call>{not json}</tool_call>": "is not JSON",
        '<tool_call>["search"]</tool_call>': 'must be {"name"',
        '<tool_call>{"name": 3}</tool_call>': 'must be {"name"',
        '<tool_call>{"name": "s", "arguments": [1]}</tool_call>': "arguments must be a JSON object, got list",
        '<tool_call>{"name": "s", "args": {}}</tool_call>': "unexpected key",
        '<tool_call>{"name": "s", "arguments": {"q": "a"': "is not closed",
        'done</tool_call>': "has no <tool_call>",
        '<tool_call>{"name": "s", "arguments": {"x": ' + "9" * 5000 + '}}</tool_call>': "not JSON that can be read",
        '<tool_call>' + "[" * 100_000 + "]" * 100_000 + '</tool_call>': "not JSON that can be read",
    }
    for text, expected in cases.items():
        r = parse_reply(text)
        assert len(r.errors) == 1 and expected in r.errors[0], (text, r.errors)
        assert r.calls == () and not r.is_final


def test_good_and_bad_calls_together():
    good = "<tool_call>" + json.dumps({"name": "a", "arguments": {}}) + "</tool_call>"
    r = parse_reply(good + "<tool_call>oops</tool_call>")
    assert r.calls == (ToolCall("a", {}),) and len(r.errors) == 1 and "tool call 1" in r.errors[0]


def test_a_rendered_call_whose_argument_holds_the_closing_tag_parses_back():
    from jaxlm.data.chat import render_tool_call

    call = {"name": "run_python", "arguments": {"code": 'print("</tool_call>")', "n": 1}}
    reply = parse_reply("before " + render_tool_call(call) + " after")
    assert reply.errors == () and [(c.name, c.arguments) for c in reply.calls] == [(call["name"], call["arguments"])]
    # Hermes / Qwen2.5 templates write the call with `tojson`, which does not escape "</": the
    # JSON value is read whole, so the closing tag inside its string does not end the call
    raw = '<tool_call>\n{"name": "run_python", "arguments": {"code": "print(\\"</tool_call>\\")"}}\n</tool_call>'
    reply = parse_reply("Let me run it.\n" + raw + "\nok")
    assert reply.errors == () and reply.calls == (ToolCall("run_python", {"code": 'print("</tool_call>")'}),)
    assert reply.content == "Let me run it.\n\nok"


def test_an_abandoned_call_does_not_swallow_the_next_whole_one():
    # the model began a call, gave up on it and wrote a whole one: the whole one is kept and
    # the abandoned one is reported (it used to be read as one body up to the closing tag)
    text = 'Let me see. <tool_call>{"name": "a", "argum<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call> ok'
    r = parse_reply(text)
    assert r.calls == (ToolCall("b", {"x": 1}),)
    assert len(r.errors) == 1 and "tool call 0" in r.errors[0] and "not closed" in r.errors[0]
    assert r.content.startswith("Let me see.") and r.content.endswith("ok") and "argum" not in r.content


def test_json_that_rfc_8259_refuses_is_an_error():
    # Python's json reader takes NaN / Infinity and keeps the last of a repeated key silently;
    # a tool must never run on an argument the model wrote twice, or on a non-JSON number
    cases = {
        '<tool_call>{"name": "s", "arguments": {"x": NaN}}</tool_call>': "NaN is not a JSON value",
        '<tool_call>{"name": "s", "arguments": {"x": -Infinity}}</tool_call>': "-Infinity is not a JSON value",
        '<tool_call>{"name": "s", "arguments": {"x": 1, "x": 2}}</tool_call>': "duplicate key(s) ['x']",
        '<tool_call>{"name": "s", "name": "t", "arguments": {}}</tool_call>': "duplicate key(s) ['name']",
        '<tool_call>{"name": "s", "arguments": "{\\"x\\": Infinity}"}</tool_call>': "arguments are not strict JSON",
    }
    for text, expected in cases.items():
        r = parse_reply(text)
        assert r.calls == () and len(r.errors) == 1 and expected in r.errors[0], (text, r.errors)
    nested = parse_reply('<tool_call>{"name": "s", "arguments": {"a": [{"b": null}, 1.5e-3]}}</tool_call>')
    assert nested.errors == () and nested.calls == (ToolCall("s", {"a": [{"b": None}, 1.5e-3]}),)


def test_text_on_both_sides_of_a_call_keeps_a_word_break():
    """Content written around a call with no space ("see<call>below") read as "seebelow"."""
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert parse_reply(f"see{call}below").content == "see below"
    assert parse_reply(f"a{call}b{call}c").content == "a b c"
    assert parse_reply(f"a\n{call}\nb").content == "a\n\nb"  # whitespace already there is kept as written
    assert parse_reply(f"{call}x").content == "x" and parse_reply(f"x{call}").content == "x"
