"""Tool calls in a model's reply: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The format is the built-in chat format's (`jaxlm.data.chat.render_tool_call`) and the one
Hermes/Qwen-style templates render, so a trajectory's structured ``tool_calls`` and the text a
model writes for them agree. A reply may hold several calls; the text outside them is its
content. A reply with no call (and nothing malformed) is a final answer.

Malformed calls are reported, not raised: a ``<tool_call>`` that is never closed (the model
ran out of tokens), a body that is not JSON, or JSON that is not ``{"name": str, "arguments":
object}`` each give one error string, which the agent loop shows the model as the observation.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def message_entry(self) -> dict[str, Any]:
        """The call as a chat message's ``tool_calls`` entry."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class Reply:
    """A parsed reply: ``content`` (the text outside the calls, stripped), the well-formed
    ``calls`` in order and one ``errors`` entry per malformed call."""

    content: str
    calls: tuple[ToolCall, ...]
    errors: tuple[str, ...]

    @property
    def is_final(self) -> bool:
        return not self.calls and not self.errors


class _NotStrictJSON(ValueError):
    pass


def _no_constant(name: str):
    raise _NotStrictJSON(f"{name} is not a JSON value")


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise _NotStrictJSON(f"duplicate key(s) {dup}")
    return dict(pairs)


def _strict_loads(body: str):
    """``json.loads`` as RFC 8259 reads it: no NaN/Infinity, no repeated key (Python's reader
    accepts both and keeps the last value of a repeated key, silently)."""
    return json.loads(body, parse_constant=_no_constant, object_pairs_hook=_no_duplicates)


def _one(body: str, k: int) -> ToolCall | str:
    try:
        call = _strict_loads(body)
    except _NotStrictJSON as e:
        return f"tool call {k} is not strict JSON ({e})"
    except json.JSONDecodeError as e:
        return f"tool call {k} is not JSON ({e.msg} at character {e.pos})"
    except (ValueError, RecursionError) as e:  # an integer past Python's digit limit, deep nesting
        return f"tool call {k} is not JSON that can be read ({type(e).__name__}: {str(e)[:80]})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return f'tool call {k} must be {{"name": "<tool>", "arguments": {{...}}}}, got {body.strip()[:80]!r}'
    extra = sorted(set(call) - {"name", "arguments"})
    if extra:
        return f"tool call {k} has unexpected key(s) {extra} (only name and arguments)"
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some formats write the arguments as a JSON string
        try:
            arguments = _strict_loads(arguments)
        except _NotStrictJSON as e:
            return f"tool call {k}: arguments are not strict JSON ({e})"
        except (ValueError, RecursionError):  # not JSON: reported below as not an object
            pass
    if not isinstance(arguments, dict):
        return f"tool call {k}: arguments must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(call["name"], arguments)


_DECODER = json.JSONDecoder()


def _calls(text: str):
    """``(start, body, end)`` of each call. A body that is one JSON value followed by
    the closing tag is read whole, so a ``</tool_call>`` inside a string argument (which
    templates' ``tojson`` does not escape) does not end the call; otherwise the body runs to
    the next closing tag. A call that another ``<tool_call>`` opens before it is closed
    (the model gave up on it and began again) has ``body=None`` and ends there."""
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        body_start = start + len(OPEN)
        end = None
        value_at = len(text) - len(text[body_start:].lstrip())
        try:
            _, value_end = _DECODER.raw_decode(text, value_at)
            after = len(text) - len(text[value_end:].lstrip())
            if text.startswith(CLOSE, after):
                body, end = text[body_start:after], after + len(CLOSE)
        except (ValueError, RecursionError):
            pass
        if end is None:
            close = text.find(CLOSE, body_start)
            if close < 0:  # never closed: left in the content, reported by the caller
                return
            reopen = text.find(OPEN, body_start)
            if 0 <= reopen < close:  # this call is never closed; the next one may be whole
                body, end = None, reopen
            else:
                body, end = text[body_start:close], close + len(CLOSE)
        yield start, body, end
        pos = end


def _split(text: str) -> tuple[list[ToolCall | str], str]:
    """The calls of ``text`` in order (a `ToolCall`, or an error string for a malformed one)
    and the text outside them."""
    out: list[ToolCall | str] = []
    pieces, pos = [], 0
    for k, (start, body, end) in enumerate(_calls(text)):
        out.append(f"tool call {k}: a {OPEN} is not closed before the next one" if body is None else _one(body, k))
        pieces.append(text[pos:start])
        pos = end
    rest = ""
    for piece in pieces + [text[pos:]]:  # "see<tool_call>..</tool_call>below" is "see below", not "seebelow"
        if rest and piece and not rest[-1].isspace() and not piece[0].isspace():
            rest += " "
        rest += piece
    if OPEN in rest:
        out.append(f"a {OPEN} is not closed by {CLOSE}")
        rest = rest[: rest.index(OPEN)]
    elif CLOSE in rest:
        out.append(f"a {CLOSE} has no {OPEN} before it")
        rest = rest.replace(CLOSE, "")
    return out, rest


def parse_reply(text: str) -> Reply:
    """Split ``text`` into content, calls and errors (see the module docstring)."""
    items, rest = _split(text)
    calls = tuple(c for c in items if isinstance(c, ToolCall))
    errors = tuple(c for c in items if isinstance(c, str))
    return Reply(rest.strip(), calls, errors)


def first_call(text: str) -> ToolCall | str | None:
    """The first call of ``text``: a `ToolCall`, an error string when it (or a stray tag) is
    malformed, or None when ``text`` holds no call (a final answer)."""
    items, _ = _split(text)
    return items[0] if items else None
