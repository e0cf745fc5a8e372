"""Local training data: ``.jsonl`` or ``.parquet`` rows with ``prompt`` / ``completion``
columns, or chat ``messages`` (a list of ``{"role", "content"}``, rendered in the tokenizer's
chat format, its template when it has one; the assistant output is trained, `jaxlm.data.chat`).
Every row is validated on load; a malformed row raises `DataError` naming the
file and the line (jsonl, 1-based) or row (parquet, 0-based).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from jaxlm.data.chat import REASONING_FIELDS
from jaxlm.fileio import UTF8_BOM

ROLES = ("system", "user", "assistant", "tool")

#: Optional per-token columns a row may carry, one entry per token of the row's encoding
#: (`jaxlm.data.encoding.encode`; entry i scores token i given the tokens before it; ``jaxlm
#: logprobs`` writes them): log-probs of each token under the behaviour policy (PEAR), a fixed
#: target policy (PEAR) and a teacher, and a teacher's top-K ids and log-probs (offline
#: distillation, ``[n, K]``).
TOKEN_FIELDS = ("behavior_logprobs", "target_logprobs", "teacher_logprobs")
TOPK_FIELDS = ("teacher_topk_ids", "teacher_topk_logprobs")


class DataError(ValueError):
    """A data file or row is malformed."""


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


def _token_fields(row: dict[str, Any], where: str) -> dict[str, Any]:
    """The row's per-token columns, validated (lengths against the encoding are checked when
    the row is encoded)."""
    out: dict[str, Any] = {}
    for k in TOKEN_FIELDS:
        if k in row:
            v = row[k]
            if not isinstance(v, list) or not all(_is_number(x) for x in v):
                raise DataError(f"{where}: column {k!r} must be a list of finite numbers (one per token)")
            if any(x > 1e-6 for x in v):  # float32 rounding of a log-prob of 0 allowed
                raise DataError(f"{where}: column {k!r} must hold log-probabilities (<= 0); a positive value "
                                "(e.g. a negative log-likelihood stored with its sign) is not one")
            out[k] = v
    widths = set()
    for k in TOPK_FIELDS:
        if k in row:
            v = row[k]
            ok = isinstance(v, list) and all(isinstance(r, list) and all(_is_number(x) for x in r) for r in v)
            if not ok:
                raise DataError(f"{where}: column {k!r} must be a list (one per token) of lists of K numbers")
            widths |= {len(r) for r in v}
            out[k] = v
    if (TOPK_FIELDS[0] in out) != (TOPK_FIELDS[1] in out):
        raise DataError(f"{where}: {TOPK_FIELDS[0]!r} and {TOPK_FIELDS[1]!r} come together")
    if len(widths) > 1 or 0 in widths:
        raise DataError(f"{where}: the top-K columns need the same K >= 1 for every token, got {sorted(widths)}")
    if TOPK_FIELDS[0] in out:
        ids, lps = out[TOPK_FIELDS[0]], out[TOPK_FIELDS[1]]
        if len(ids) != len(lps) or any(len(a) != len(b) for a, b in zip(ids, lps)):
            raise DataError(f"{where}: {TOPK_FIELDS[0]!r} and {TOPK_FIELDS[1]!r} differ in shape")
        if any(not float(x).is_integer() or x < 0 for r in ids for x in r):
            raise DataError(f"{where}: {TOPK_FIELDS[0]!r} must hold non-negative token ids")
        if any(len(set(r)) != len(r) for r in ids):  # the bins would count a token twice
            raise DataError(f"{where}: {TOPK_FIELDS[0]!r} repeats a token id within a position's K")
        # log-probs: at most 0, and the K of a position hold at most probability 1 (float32 rounding allowed)
        if any(x > 1e-6 for r in lps for x in r) or any(sum(math.exp(x) for x in r) > 1 + 1e-4 for r in lps):
            raise DataError(f"{where}: {TOPK_FIELDS[1]!r} must be log-probabilities (<= 0, each position's K "
                            "summing to at most probability 1)")
    return out


def tool_call(call: Any, where: str) -> dict[str, Any]:
    """A tool call as chat templates take it, ``{"type": "function", "function": {"name",
    "arguments"}}``, from that form or the short ``{"name", "arguments"}``."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"] \
            or not isinstance(fn.get("arguments", {}), dict):
        raise DataError(f"{where}: a tool call must be {{'name': str, 'arguments': {{...}}}} (or HF's "
                        f"{{'type': 'function', 'function': {{...}}}}), got {call!r}")
    return {"type": "function", "function": {"name": fn["name"], "arguments": dict(fn.get("arguments", {}))}}


def check_message(m: Any, where: str) -> dict[str, Any]:
    """One chat message, validated: ``role`` (system | user | assistant | tool) and ``content``;
    an assistant message may carry ``tool_calls`` and its reasoning (``reasoning_content``,
    ``thinking`` or ``reasoning``: what templates with a thinking block render), a tool message the tool's ``name`` and ``tool_call_id``.
    Every string in it must be text (no lone surrogate)."""
    if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
        raise DataError(f"{where} must be {{'role': one of {ROLES}, 'content': str}}, got {m!r}")
    out = {"role": m["role"], "content": m["content"]}
    if m.get("tool_calls") is not None:  # null: absent (parquet gives every message the column's keys)
        if m["role"] != "assistant" or not isinstance(m["tool_calls"], list):
            raise DataError(f"{where}: 'tool_calls' is a list on an assistant message")
        out["tool_calls"] = [tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])]
    for key, role in (("name", "tool"), ("tool_call_id", "tool"), *((k, "assistant") for k in REASONING_FIELDS)):
        if m["role"] == role and m.get(key) is not None:
            if not isinstance(m[key], str):
                raise DataError(f"{where}: a {role} message's {key!r} must be a string")
            out[key] = m[key]
    _check_strings(out, where)
    return out


def _check_strings(value: Any, where: str) -> None:
    """`_check_text` on every string inside ``value`` (dicts, lists)."""
    if isinstance(value, str):
        _check_text(value, where)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, where)
            _check_strings(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for j, v in enumerate(value):
            _check_strings(v, f"{where}[{j}]")


def _check_text(text: str, where: str) -> None:
    """Text must be encodable: JSON's ``\\ud83d`` escape alone decodes to a lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where} holds a lone surrogate {text[e.start]!r} at character {e.start}, which is "
                        "not text (a \\uD800-\\uDFFF escape without its pair)") from None


def _check_row(row: Any, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object, got {type(row).__name__}")
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: 'messages' must be a non-empty list")
        checked = [check_message(m, f"{where}: messages[{i}]") for i, m in enumerate(msgs)]
        if not any(m["role"] == "assistant" for m in checked):
            raise DataError(f"{where}: 'messages' has no assistant turn (nothing to train on)")
        return {"messages": checked, **_token_fields(row, where)}
    missing = [k for k in ("prompt", "completion") if k not in row]
    if missing:
        raise DataError(
            f"{where}: missing column(s) {missing}; rows need 'prompt' and 'completion', or 'messages'"
        )
    for k in ("prompt", "completion"):
        if not isinstance(row[k], str):
            raise DataError(f"{where}: column {k!r} must be a string, got {type(row[k]).__name__}")
        _check_text(row[k], f"{where}: column {k!r}")
    return {"prompt": row["prompt"], "completion": row["completion"], **_token_fields(row, where)}


def _jsonl_rows(path: Path):
    """``(line number, parsed value)`` of each non-blank line; a line that is not UTF-8 or not
    JSON raises `DataError` naming the file, line (and byte offset). A UTF-8 byte-order mark at
    the start is skipped."""
    data = path.read_bytes()
    offset = len(UTF8_BOM) if data.startswith(UTF8_BOM) else 0
    for lineno, raw in enumerate(data[offset:].split(b"\n"), 1):
        start, offset = offset, offset + len(raw) + 1
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{lineno}: not UTF-8 text (byte {start + e.start} of the file, "
                            f"{raw[e.start:e.start + 4]!r}); save the file as UTF-8") from None
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        except (ValueError, RecursionError) as e:  # an integer of over 4300 digits, very deep nesting
            raise DataError(f"{path}:{lineno}: cannot be read as JSON ({e})") from None


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a ``.jsonl`` or ``.parquet`` file, validated."""
    return read_rows_located(path)[0]


def read_rows_located(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """`read_rows` and where each row is (``path:line`` or ``path row i``), for errors found
    later (encoding a row with the tokenizer and its chat template)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path} does not exist")
    if path.is_dir():
        raise DataError(f"{path} is a directory, not a .jsonl or .parquet file")
    rows: list[dict[str, Any]] = []
    where: list[str] = []
    if path.suffix == ".jsonl":
        for lineno, row in _jsonl_rows(path):
            where.append(f"{path}:{lineno}")
            rows.append(_check_row(row, where[-1]))
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise DataError(f"{path}: not a readable parquet file ({e})") from None
        for i, row in enumerate(table.to_pylist()):
            where.append(f"{path} row {i}")
            rows.append(_check_row(row, where[-1]))
    else:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl or .parquet")
    if not rows:
        raise DataError(f"{path} holds no rows")
    for k in TOKEN_FIELDS + TOPK_FIELDS[:1]:
        have = [k in r for r in rows]
        if any(have) and not all(have):
            raise DataError(f"{where[have.index(False)]} has no {k!r} column but {where[have.index(True)]} does; "
                            "every row or none must carry it")
    return rows, where


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """Prompt rows of a ``.jsonl`` file: each line an object with a ``prompt`` string; its
    other keys (an ``id``, a reference answer) are kept as they are. A malformed row raises
    `DataError` naming the file and the 1-based line."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path} does not exist")
    if path.is_dir() or path.suffix != ".jsonl":
        raise DataError(f"{path}: prompts are read from a .jsonl file (one {{\"prompt\": ...}} object per line)")
    rows: list[dict[str, Any]] = []
    for lineno, row in _jsonl_rows(path):
        where = f"{path}:{lineno}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected an object with a 'prompt' string, got {type(row).__name__}")
        if not isinstance(row.get("prompt"), str) or not row["prompt"]:
            got = "no 'prompt'" if "prompt" not in row else f"'prompt' = {row['prompt']!r}"
            raise DataError(f"{where}: each row needs a non-empty 'prompt' string, got {got}")
        rows.append(row)
    if not rows:
        raise DataError(f"{path} holds no prompts")
    return rows


@dataclasses.dataclass(frozen=True)
class Files:
    """A data source from local files. ``eval_path`` (optional) is held out for
    evaluation; without it, ``eval_fraction`` of ``path``'s rows are (by index hash)."""

    path: str = "data.jsonl"
    """Training rows: a .jsonl or .parquet file."""
    eval_path: str | None = None
    """Held-out rows (None: eval_fraction of path's rows, chosen by index hash)."""
    eval_fraction: float = 0.05
    """Fraction of path's rows held out when eval_path is None."""
