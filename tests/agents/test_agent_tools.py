"""Typed tools: schemas from annotations, argument checks, and every failure a tool call can
have coming back as an observation instead of an exception."""

import re
import threading
import time
from typing import Literal

import pytest

from jaxlm.agents.tools import Toolbox, tool


@tool
def lookup(key: str, limit: int = 3, scale: float = 1.0, exact: bool = False, tags: list[str] | None = None,
           mode: Literal["a", "b"] = "a") -> str:
    """Look a key up.

    The second paragraph is not part of the description."""
    return f"{key}|{limit}|{scale}|{exact}|{tags}|{mode}"


def test_schema_from_annotations():
    assert lookup.description == "Look a key up."
    assert lookup.parameters == {
        "type": "object", "required": ["key"],
        "properties": {"key": {"type": "string"}, "limit": {"type": "integer"}, "scale": {"type": "number"},
                       "exact": {"type": "boolean"},
                       "tags": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
                       "mode": {"enum": ["a", "b"]}}}
    assert lookup.spec()["function"]["name"] == "lookup"


@pytest.mark.parametrize("bad", [lambda x: x, lambda *a: a])
def test_untyped_or_variadic_functions_fail_at_definition(bad):
    with pytest.raises(TypeError, match="annotation|args"):
        tool(bad)


def test_unsupported_annotation_names_the_parameter():
    def f(x: set) -> str:
        return ""
    with pytest.raises(TypeError, match="parameter 'x'.*unsupported"):
        tool(f)


def test_good_call_converts_integral_floats_and_ints_to_floats():
    box = Toolbox([lookup])
    r = box.call("lookup", {"key": "k", "limit": 2.0, "scale": 3, "tags": ["x"], "mode": "b"})
    assert r.ok and r.content == "k|2|3.0|False|['x']|b"
    assert isinstance(r.seconds, float)


@pytest.mark.parametrize("name,args,expected", [
    ("nope", {}, "unknown tool 'nope'; the tools are \\['lookup'\\]"),
    (None, {}, "unknown tool None"),
    ("lookup", {}, "needs the argument\\(s\\) \\['key'\\]"),
    ("lookup", {"key": "k", "colour": 1}, "no argument\\(s\\) \\['colour'\\]"),
    ("lookup", {"key": 3}, "lookup.key must be a string, got int"),
    ("lookup", {"key": "k", "limit": 2.5}, "lookup.limit must be an integer"),
    ("lookup", {"key": "k", "limit": True}, "lookup.limit must be an integer, got bool"),
    ("lookup", {"key": "k", "exact": 1}, "lookup.exact must be a boolean"),
    ("lookup", {"key": "k", "tags": ["a", 2]}, "lookup.tags\\[1\\] must be a string"),
    ("lookup", {"key": "k", "mode": "c"}, "lookup.mode must be one of \\['a', 'b'\\]"),
    ("lookup", ["k"], "must be a JSON object"),
    ("lookup", {"key": "k", "scale": 10 ** 400}, "lookup.scale must be a number within float range, got an integer of 401"),
])
def test_bad_calls_are_errors_not_exceptions(name, args, expected):
    r = Toolbox([lookup]).call(name, args)
    assert not r.ok and r.content == f"error: {r.error}"
    assert re.search(expected, r.error), r.error


def test_a_tool_that_raises_is_reported():
    @tool
    def boom(x: int) -> str:
        """Fails."""
        raise KeyError("missing thing")
    r = Toolbox([boom]).call("boom", {"x": 1})
    assert r.error == "boom raised KeyError: 'missing thing'"

    @tool
    def cli(argv: str) -> str:
        """Wraps an argument parser, which exits on a bad argument."""
        raise SystemExit(2)
    assert Toolbox([cli]).call("cli", {"argv": "--n three"}).error == "cli raised SystemExit: 2"  # it escaped

    # a value or message that cannot be shown is an error too (these escaped and ended the batch)
    class Unshowable:
        def __repr__(self):
            raise RuntimeError("no repr")

        def __str__(self):
            raise RuntimeError("no str")

    class QuietError(Exception):
        def __str__(self):
            raise RuntimeError("no message")

    deep: list = []
    for _ in range(100_000):
        deep = [deep]

    @tool
    def odd(kind: str) -> str:
        """Returns what cannot be shown."""
        if kind == "quiet":
            raise QuietError()
        return Unshowable() if kind == "object" else deep

    box = Toolbox([odd])
    assert box.call("odd", {"kind": "object"}).error == "odd returned a Unshowable that cannot be shown as text (RuntimeError)"
    assert box.call("odd", {"kind": "deep"}).error == "odd returned a list that cannot be shown as text (RecursionError)"
    assert box.call("odd", {"kind": "quiet"}).error == "odd raised QuietError: <QuietError whose message cannot be shown>"


def test_positional_only_parameters_fail_at_definition():
    def positional(x: int, /) -> str:
        return str(x)

    with pytest.raises(TypeError, match="parameter 'x' is positional-only"):  # no call could ever reach it
        tool(positional)


@pytest.mark.parametrize("body", ["sleep", "spin", "retry"])
def test_a_tool_that_hangs_is_stopped_at_its_timeout(body):
    @tool(timeout_s=0.3)
    def hang() -> str:
        """Never returns."""
        if body == "sleep":
            time.sleep(60)
        if body == "retry":  # a retry loop whose ``except Exception`` would swallow a timeout
            for _ in range(600):
                try:
                    time.sleep(0.1)
                except Exception:
                    continue
            return "finished"
        while True:
            pass
    t0 = time.perf_counter()
    r = Toolbox([hang]).call("hang", {})
    assert time.perf_counter() - t0 < 5
    assert r.error == "hang did not finish within 0.3 s"


def test_timeout_off_the_main_thread_abandons_the_call():
    @tool(timeout_s=0.2)
    def slow() -> str:
        """Sleeps."""
        time.sleep(3)
        return "late"
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("r", Toolbox([slow]).call("slow", {})))
    worker.start()
    worker.join(5)
    assert out["r"].error == "slow did not finish within 0.2 s"


def test_long_results_are_cut_and_non_strings_serialised():
    @tool
    def big() -> str:
        """Long."""
        return "x" * 50

    @tool
    def data() -> dict:
        """A dict."""
        return {"a": [1, 2]}
    box = Toolbox([big, data], max_chars=20)
    assert box.call("big", {}).content == "x" * 20 + "\n[cut: 30 more characters]"
    assert box.call("data", {}).content == '{"a": [1, 2]}'

    @tool
    def loud() -> str:
        """Fails at length."""
        raise ValueError("y" * 100)
    # an error is an observation too: the same cut
    for r in (box.call("loud", {}), box.call("z" * 200, {})):
        assert not r.ok and len(r.error) <= 20 + len("\n[cut: 1000 more characters]") and "[cut: " in r.error


def test_duplicate_names_and_bad_limits_fail():
    with pytest.raises(ValueError, match="more than once"):
        Toolbox([lookup, lookup])
    with pytest.raises(ValueError, match="timeout_s"):
        Toolbox([lookup], timeout_s=0)
    for bad in (float("inf"), float("nan"), 1e12):
        with pytest.raises(ValueError, match=r"Toolbox timeout_s=.* must be a number of seconds in \(0, 1e\+06\]"):
            Toolbox([lookup], timeout_s=bad)
        with pytest.raises(ValueError, match=r"tool lookup: timeout_s="):
            tool(lambda: None, name="lookup", description="", timeout_s=bad)
    from jaxlm.agents.loop import AgentConfig

    with pytest.raises(ValueError, match=r"AgentConfig.tool_timeout_s=inf is invalid"):
        AgentConfig(tool_timeout_s=float("inf"))


def test_describe_lists_arguments_and_optionality():
    assert Toolbox([lookup]).describe().startswith("lookup(key: string, limit: integer?, scale: number?")
