"""Typed tools for agents: Python functions whose type hints are their JSON-argument schema.

    @tool
    def search(query: str, limit: int = 5) -> str:
        "Lines of the data lake that contain every word of ``query``."
        ...

    box = Toolbox([search, read])
    box.specs()                                  # OpenAI-style function specs for the chat template
    box.call("search", {"query": "Ada"})         # ToolResult(content=..., error=None)

The parameter annotations supported are ``str``, ``int``, ``float``, ``bool``, ``list[T]``,
``dict``/``dict[str, T]``, ``Literal[...]`` and ``T | None``; a parameter without a default is
required. Anything else fails when the tool is defined, naming the parameter.

`Toolbox.call` never raises for anything the model wrote: an unknown tool, a missing, unknown
or wrongly-typed argument, a tool that raises and a tool that runs past its timeout all come
back as a `ToolResult` whose ``error`` says what went wrong (and whose ``content`` is that text,
the observation the model is shown). Timeouts interrupt the tool with ``SIGALRM`` when called
from the main thread (pure-Python loops and ``time.sleep`` stop); elsewhere the call runs in a
daemon thread that is abandoned at the timeout. Code that must not be trusted with the
process (the model's own programs) runs in `jaxlm.sandbox` instead.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import signal
import threading
import time
import types
import typing
from typing import Any, Callable, Literal, Sequence

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _schema(annotation: Any, where: str) -> dict[str, Any]:
    """The JSON schema of one parameter annotation."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(args) != 2:
            raise TypeError(f"{where}: a union must be `T | None`, got {annotation!r}")
        return {"anyOf": [_schema(rest[0], where), {"type": "null"}]}
    if annotation is list or origin is list:
        return {"type": "array", **({"items": _schema(args[0], where)} if args else {})}
    if annotation is dict or origin is dict:
        if args and args[0] is not str:
            raise TypeError(f"{where}: JSON object keys are strings, got {annotation!r}")
        return {"type": "object", **({"additionalProperties": _schema(args[1], where)} if args else {})}
    raise TypeError(f"{where}: unsupported annotation {annotation!r} (str, int, float, bool, list[T], dict, "
                    f"Literal[...], T | None)")


def _check(value: Any, schema: dict[str, Any], where: str) -> Any:
    """``value`` checked against ``schema`` (and an integral float made an int); raises
    ValueError naming ``where`` and what was expected."""
    if "enum" in schema:
        if value not in schema["enum"] or isinstance(value, bool) != any(isinstance(e, bool) for e in schema["enum"]):
            raise ValueError(f"{where} must be one of {schema['enum']}, got {value!r}")
        return value
    if "anyOf" in schema:
        return None if value is None else _check(value, schema["anyOf"][0], where)
    kind = schema["type"]
    if kind == "string" and isinstance(value, str):
        return value
    if kind == "boolean" and isinstance(value, bool):
        return value
    if kind == "integer" and not isinstance(value, bool):
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    if kind == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # a JSON integer of hundreds of digits
            raise ValueError(f"{where} must be a number within float range, got an integer of "
                             f"{len(str(abs(value)))} digits") from None
    if kind == "array" and isinstance(value, list):
        items = schema.get("items")
        return [_check(v, items, f"{where}[{i}]") for i, v in enumerate(value)] if items else value
    if kind == "object" and isinstance(value, dict):
        inner = schema.get("additionalProperties")
        return {k: _check(v, inner, f"{where}[{k!r}]") for k, v in value.items()} if inner else value
    raise ValueError(f"{where} must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}, got "
                     f"{type(value).__name__} {value!r:.60}")


@dataclasses.dataclass(frozen=True)
class Tool:
    """A function the agent may call: ``name``, ``description``, the JSON schema of its
    ``parameters``, and ``timeout_s`` (None: the toolbox's)."""

    name: str
    fn: Callable[..., Any]
    description: str
    parameters: dict[str, Any]
    timeout_s: float | None = None

    def __post_init__(self):
        if self.timeout_s is not None:
            check_timeout(self.timeout_s, f"tool {self.name}: timeout_s")

    def spec(self) -> dict[str, Any]:
        """The OpenAI-style function spec chat templates take as ``tools``."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def arguments(self, arguments: Any) -> dict[str, Any]:
        """``arguments`` validated against the parameters; ValueError says what is wrong."""
        if not isinstance(arguments, dict):
            raise ValueError(f"the arguments of {self.name} must be a JSON object, got {type(arguments).__name__}")
        props, required = self.parameters["properties"], self.parameters["required"]
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            raise ValueError(f"{self.name} has no argument(s) {unknown}; its arguments: {sorted(props)}")
        missing = [k for k in required if k not in arguments]
        if missing:
            raise ValueError(f"{self.name} needs the argument(s) {missing}")
        return {k: _check(v, props[k], f"{self.name}.{k}") for k, v in arguments.items()}

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None,
         timeout_s: float | None = None):
    """Make a `Tool` of a typed function (usable as ``@tool`` or ``@tool(timeout_s=1)``); the
    description defaults to the docstring's first paragraph."""
    def make(f: Callable[..., Any]) -> Tool:
        hints = typing.get_type_hints(f)
        props: dict[str, Any] = {}
        required: list[str] = []
        for p in inspect.signature(f).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"tool {f.__name__}: *args/**kwargs cannot be described as JSON arguments")
            if p.kind is p.POSITIONAL_ONLY:  # calls pass arguments by name: it could never be called
                raise TypeError(f"tool {f.__name__}: parameter {p.name!r} is positional-only; tools are called "
                                "with named arguments")
            if p.name not in hints:
                raise TypeError(f"tool {f.__name__}: parameter {p.name!r} has no type annotation")
            props[p.name] = _schema(hints[p.name], f"tool {f.__name__}, parameter {p.name!r}")
            if p.default is inspect.Parameter.empty:
                required.append(p.name)
        doc = (description if description is not None else (inspect.getdoc(f) or "").split("\n\n")[0]).strip()
        return Tool(name or f.__name__, f, " ".join(doc.split()),
                    {"type": "object", "properties": props, "required": required}, timeout_s)
    return make(fn) if fn is not None else make


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """One call's observation ``content``; ``error`` (also the content) when it failed."""

    name: str
    content: str
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


class ToolTimeout(BaseException):
    """A tool ran past its timeout (a BaseException: a tool's own ``except Exception`` does
    not swallow it)."""


MAX_TIMEOUT_S = 1e6
"""The longest tool timeout, in seconds (about 11.6 days; the interval timer's range)."""


def check_timeout(value: Any, where: str) -> None:
    """A timeout must be a finite number of seconds in ``(0, MAX_TIMEOUT_S]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"{where}={value!r} is invalid: must be a number of seconds in (0, {MAX_TIMEOUT_S:g}]")


def _raise_timeout(signum, frame):
    raise ToolTimeout()


def _with_timeout(fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()``, interrupted after ``timeout_s`` (see the module docstring)."""
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        previous_handler = signal.signal(signal.SIGALRM, _raise_timeout)
        previous_timer = (0.0, 0.0)
        start = time.monotonic()
        try:
            # the alarm repeats until the call ends, so a tool that catches one is stopped by the next
            previous_timer = signal.setitimer(signal.ITIMER_REAL, timeout_s, 0.05)
            value = fn()
            if time.monotonic() - start > timeout_s:  # it caught every alarm and still returned late
                raise ToolTimeout()
            return value
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous_handler)
            if previous_timer[0] > 0:  # an outer timer keeps (about) the time it had left
                left = previous_timer[0] - (time.monotonic() - start)
                signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), previous_timer[1])
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise ToolTimeout()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _shown(e: BaseException) -> str:
    """An exception's message, or its type's name when ``str(e)`` itself fails."""
    try:
        return str(e)
    except Exception:
        return f"<{type(e).__name__} whose message cannot be shown>"


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


class Toolbox:
    """Named tools and the rules for calling them: ``timeout_s`` per call (a tool's own wins)
    and ``max_chars`` of observation kept (longer ones are cut, saying so)."""

    def __init__(self, tools: Sequence[Tool | Callable[..., Any]], *, timeout_s: float = 2.0, max_chars: int = 2000):
        check_timeout(timeout_s, "Toolbox timeout_s")
        if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars <= 0:
            raise ValueError(f"Toolbox max_chars={max_chars!r} must be an int > 0")
        made = [t if isinstance(t, Tool) else tool(t) for t in tools]
        names = [t.name for t in made]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"Toolbox: tool name(s) {dupes} are given more than once")
        self.tools = {t.name: t for t in made}
        self.timeout_s, self.max_chars = timeout_s, max_chars

    def __contains__(self, name: str) -> bool:
        return name in self.tools

    def names(self) -> list[str]:
        return sorted(self.tools)

    def specs(self) -> list[dict[str, Any]]:
        return [t.spec() for t in self.tools.values()]

    def describe(self) -> str:
        """One line per tool, ``name(arg: type, ...): description``, for prompts of chat
        formats that take no ``tools`` (the built-in one)."""
        lines = []
        for t in self.tools.values():
            props = t.parameters["properties"]
            args = ", ".join(f"{k}: {v.get('type', 'enum' if 'enum' in v else 'any')}"
                             + ("" if k in t.parameters["required"] else "?") for k, v in props.items())
            lines.append(f"{t.name}({args}): {t.description}".rstrip(": "))
        return "\n".join(lines)

    def call(self, name: Any, arguments: Any) -> ToolResult:
        """Run tool ``name`` with ``arguments``; every failure is a `ToolResult` with an error."""
        t0 = time.perf_counter()

        def failed(msg: str) -> ToolResult:
            msg = self._cut(msg)  # an error is an observation too: the same limit
            return ToolResult(str(name), f"error: {msg}", msg, time.perf_counter() - t0)

        t = self.tools.get(name) if isinstance(name, str) else None
        if t is None:
            return failed(f"unknown tool {name!r}; the tools are {self.names()}")
        try:
            kwargs = t.arguments(arguments)
        except ValueError as e:
            return failed(str(e))
        except RecursionError:
            return failed(f"{t.name}: the arguments are nested too deeply")
        timeout = t.timeout_s or self.timeout_s
        try:
            value = _with_timeout(lambda: t.fn(**kwargs), timeout)
        except ToolTimeout:
            return failed(f"{t.name} did not finish within {timeout:g} s")
        except (Exception, SystemExit) as e:  # the tool's own failure (argparse's exit too) is the observation
            return failed(f"{t.name} raised {type(e).__name__}: {_shown(e)}")
        try:
            text = _as_text(value)
        except (Exception, RecursionError) as e:  # a value json and repr cannot show (nested too deep, a bad __repr__)
            return failed(f"{t.name} returned a {type(value).__name__} that cannot be shown as text ({type(e).__name__})")
        return ToolResult(t.name, self._cut(text), None, time.perf_counter() - t0)

    def _cut(self, text: str) -> str:
        if len(text) > self.max_chars:
            text = text[: self.max_chars] + f"\n[cut: {len(text) - self.max_chars} more characters]"
        return text
