"""``jaxlm train CONFIG --help``: every key of a config with its type, its value in that
config and a one-line description read from the dataclass (the string literal after a
field, or the comment on its line), in plain text."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import types
import typing
from typing import Any


def plain(text: str) -> str:
    """reStructuredText / Markdown inline markup removed: ``x`` and `x` -> x."""
    text = re.sub(r"``([^`]+)``", r"\1", text)
    return re.sub(r"`([^`]+)`", r"\1", text)


def _first_paragraph(text: str) -> str:
    return plain(" ".join(text.strip().split("\n\n")[0].split()))


@functools.cache
def field_descriptions(cls: type) -> dict[str, str]:
    """``field -> description`` from the class body: a docstring after the field, else the
    comment at the end of its line (the classes in its MRO too)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        lines = source.splitlines()
        body = ast.parse(source).body[0].body
        for node, nxt in zip(body, body[1:] + [None]):
            if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
                continue
            doc = None
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                doc = nxt.value.value
            else:
                line = lines[node.end_lineno - 1]
                if "#" in line:
                    doc = line.split("#", 1)[1].strip()
            if doc:
                out[node.target.id] = _first_paragraph(doc)
    return out


def type_name(tp: Any) -> str:
    """A short readable spelling of a type annotation."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"tuple[{type_name(args[0])}, ...]"
        return "tuple[" + ", ".join(type_name(a) for a in args) + "]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def _value(v: Any) -> str:
    if dataclasses.is_dataclass(v):
        return type(v).__name__ + "(...)"
    return repr(v)


def config_keys(config: Any, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """``(key, type, value, description)`` for every leaf field of a (nested) dataclass
    value; a section set to a dataclass lists its own fields (its type names the choice)."""
    rows = []
    hints = typing.get_type_hints(type(config))
    docs = field_descriptions(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        key = prefix + f.name
        if dataclasses.is_dataclass(value):
            choices = [a for a in typing.get_args(hints[f.name]) if dataclasses.is_dataclass(a)]
            if len(choices) > 1:  # the kind is the config file's choice: not a KEY=VALUE override
                note = "(the kind is set in the config file, not by KEY=VALUE; its fields follow)"
                rows.append((key, type_name(hints[f.name]), type(value).__name__,
                             (docs.get(f.name, "") + " " + note).strip()))
            rows += config_keys(value, key + ".")
        else:
            rows.append((key, type_name(hints[f.name]), _value(value), docs.get(f.name, "")))
    return rows


def describe_config(config: Any, name: str) -> str:
    """The help text of ``jaxlm train NAME --help``."""
    out = [f"usage: jaxlm train {name} [KEY=VALUE ...] [--multihost]", "",
           f"Keys of {name}, set as KEY=VALUE (e.g. trainer.steps=200), each with its type and its",
           "value in this config. A section that can be of several kinds (algorithm, data.source)",
           "shows the kind this config uses (chosen in the config file, not settable as KEY=VALUE)",
           "and lists that kind's fields.", ""]
    width = 100
    for key, tp, value, doc in config_keys(config):
        out.append(f"  {key}: {tp} = {value}")
        if doc:
            out += textwrap.wrap(doc, width=width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(out)
