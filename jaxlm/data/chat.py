"""Chat formatting: a model's own chat template, or the built-in format.

A tokenizer with a ``chat_template`` (Jinja2, from ``chat_template.jinja`` or
``tokenizer_config.json``) renders conversations with it, in the environment transformers
uses (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson``,
``strftime_now``, ``namespace``, loop controls and ``{% generation %}``), with the variables
``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the special tokens
(``bos_token``, ``eos_token``, ...) and any keyword arguments. The rendered text is tokenized
as a whole, without added specials: the template decides BOS and the end-of-turn tokens.

Without a template (`ByteTokenizer`, or a ``tokenizer.json`` without one) the built-in format
is used: BOS, then ``<|role|>\\n`` + content + ``\\n`` per message, then EOS.

Assistant masks (`encode_chat`), the tokens trained in SFT:

- templates with ``{% generation %}``: the tokens overlapping its blocks, exactly
  transformers' ``return_assistant_tokens_mask``;
- other templates: per assistant message ``i``, the text that ``messages[:i + 1]`` adds after
  ``messages[:i]`` rendered with the generation prompt (what the model writes after that
  prompt), up to and including the last special token in it (the end-of-turn token, e.g.
  ``<|im_end|>``, ``<|eot_id|>``); text after it (a newline between turns) is not trained, and
  with no special token in it all of it is. This needs a template whose rendering of
  ``messages[:i + 1]`` starts every longer conversation's rendering, up to special tokens it
  writes only at the conversation's end (Phi-3's closing ``eos_token``); one that rewrites
  earlier turns when later ones follow raises `ChatTemplateError` (use ``{% generation %}``);
- the built-in format: each assistant content + ``\\n``, and the final EOS when the conversation
  ends with an assistant turn (after a final user turn the EOS is context, as a template leaves it).
A token is trained when it overlaps a trained character span (its offsets in the text).
"""

from __future__ import annotations

import contextvars
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The template variables a tokenizer's special tokens are passed as (when it has them)."""

TEMPLATE_FILE = "chat_template.jinja"
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat template cannot be read, compiled or rendered, or its output cannot be masked."""


# ----------------------------------------------------------------------------------------
# The built-in format


def render_tool_call(call: dict) -> str:
    """A tool call in the built-in format: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
    (``</`` inside the JSON written ``<\\/``, valid JSON for the same string, so an argument
    holding ``</tool_call>`` cannot end the call early)."""
    fn = call.get("function", call)
    body = json.dumps({"name": fn["name"], "arguments": fn.get("arguments", {})}).replace("</", "<\\/")
    return "<tool_call>" + body + "</tool_call>"


def builtin_segments(messages: Sequence[dict], *, add_generation_prompt: bool = False) -> list[tuple[str, bool]]:
    """``[(text, trainable), ...]``: ``<|role|>\\n`` (not trained) and content + ``\\n``
    (trained for the assistant, whose tool calls follow its content on the same line, one
    `render_tool_call` each: a turn is one line, as `jaxlm.agents.ModelPolicy` stops a reply at
    its newline); tool results are a ``<|tool|>`` turn, not trained. The generation prompt is
    ``<|assistant|>\\n``."""
    out = []
    for m in messages:
        out.append((f"<|{m['role']}|>\n", False))
        calls = "".join(render_tool_call(c) for c in m.get("tool_calls") or ())
        out.append((m["content"] + calls + "\n", m["role"] == "assistant"))
    if add_generation_prompt:
        out.append(("<|assistant|>\n", False))
    return out


# ----------------------------------------------------------------------------------------
# The Jinja2 environment

_spans_tracker: contextvars.ContextVar = contextvars.ContextVar("generation_spans", default=None)


class _GenerationSpans(jinja2.ext.Extension):
    """``{% generation %} ... {% endgeneration %}``: renders its body and, while a tracker is
    active, records the body's character span in the output rendered so far."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_record", []), [], [], body).set_lineno(lineno)

    def _record(self, caller):
        text = caller()
        tracker = _spans_tracker.get()
        if tracker is not None:
            chunks, spans = tracker
            start = sum(map(len, chunks))
            spans.append((start, start + len(text)))
        return text


class _Raised(jinja2.TemplateError):
    """The template called ``raise_exception``."""


def _raise_exception(message):
    raise _Raised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _Dict:
    """``dict(...)`` for templates, without access to the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` refusing underscore-prefixed attributes."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot store the attribute {name!r}")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationSpans, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env


_ENV = _environment()
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _template_line(error: BaseException) -> int | None:
    """The template line an exception was raised on (Jinja puts template frames in the traceback)."""
    line, tb = None, error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (what a template may see)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _plain(value.item())
    raise TypeError(f"chat messages must hold JSON values (str, numbers, lists, dicts), got {type(value).__name__}")


def _messages(messages: Sequence[dict]) -> list[dict]:
    """Messages as a template sees them: plain data, keys with None dropped, reasoning under
    both ``reasoning_content`` and ``thinking``."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        m = {k: v for k, v in _plain(m).items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    """A compiled chat template. ``origin`` names where it came from (in every error);
    ``variables``: the special tokens (`SPECIAL_TOKEN_NAMES`) the template sees;
    ``end_tokens``: the special token strings of the tokenizer (the end of an assistant span)."""

    def __init__(self, source: str, *, origin: str = "chat_template", variables: dict[str, str] | None = None,
                 end_tokens: Sequence[str] = ()):
        if not isinstance(source, str):
            raise ChatTemplateError(f"{origin}: a chat template must be a string, got {type(source).__name__}")
        self.source, self.origin = source, origin
        self.variables = dict(variables or {})
        self.end_tokens = tuple(t for t in end_tokens if t)
        self.has_generation_tags = bool(_GENERATION_TAG.search(source))
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{origin}: chat template syntax error at line {e.lineno}: {e.message}") from None

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r})"

    def _context(self, messages, add_generation_prompt, tools, documents, kwargs) -> dict:
        return {**self.variables, **_plain(kwargs), "messages": _messages(messages), "tools": _plain(tools),
                "documents": _plain(documents), "add_generation_prompt": bool(add_generation_prompt)}

    def _run(self, context: dict, spans: list | None) -> str:
        chunks: list[str] = []
        token = _spans_tracker.set((chunks, spans)) if spans is not None else None
        try:
            for chunk in self._template.generate(**context):
                chunks.append(chunk)
        except _Raised as e:
            line = _template_line(e)
            raise ChatTemplateError(
                f"{self.origin}: the chat template raised an error{f' (line {line})' if line else ''}: {e.message}"
            ) from None
        except Exception as e:  # undefined variables, type errors and the like inside the template
            line = _template_line(e)
            raise ChatTemplateError(
                f"{self.origin}: rendering the chat template failed{f' at line {line}' if line else ''}: "
                f"{type(e).__name__}: {e}"
            ) from None
        finally:
            if token is not None:
                _spans_tracker.reset(token)
        return "".join(chunks)

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = False, tools=None, documents=None,
               **kwargs) -> str:
        """The conversation as text (``add_generation_prompt``: then the assistant's turn opens)."""
        return self._run(self._context(messages, add_generation_prompt, tools, documents, kwargs), None)

    def render_with_assistant_spans(self, messages: Sequence[dict], *, tools=None, documents=None,
                                    **kwargs) -> tuple[str, list[tuple[int, int]]]:
        """The conversation as text and the character spans of assistant output in it (the
        module docstring says which)."""
        if self.has_generation_tags:
            spans: list[tuple[int, int]] = []
            text = self._run(self._context(messages, False, tools, documents, kwargs), spans)
            return text, spans
        kw = dict(tools=tools, documents=documents, **kwargs)
        text = self.render(messages, **kw)
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            upto = self.render(messages[: i + 1], **kw)
            try:
                prompt = self.render(messages[:i], add_generation_prompt=True, **kw)
            except ChatTemplateError:
                prompt = None  # e.g. a template that reads messages[0] renders no empty conversation
            if prompt is None or not upto.startswith(prompt) or prompt == self._render_or_none(messages[:i], kw):
                # an opening assistant turn: the template writes its header (BOS, a default system
                # prompt) only once a first message exists; or a generation prompt that adds
                # nothing (Zephyr-style templates write it only inside the message loop, so an
                # empty conversation renders "" and the span took the role header): find the
                # content's start instead
                found = self._before_content(messages, i, kw, upto)
                prompt = found if found is not None else prompt
            if prompt is None:
                raise ChatTemplateError(
                    f"{self.origin}: the template renders no generation prompt before assistant message {i}, and "
                    f"its start could not be found; mark the assistant output with {{% generation %}} ... "
                    f"{{% endgeneration %}} in the template")
            if not text.startswith(upto):
                # a template that ends a conversation with an end-of-text token (Phi-3's
                # `{% else %}{{ eos_token }}`): that token is not there once later turns follow
                cut = self._closing_tokens_cut(upto, text)
                upto = upto[:cut] if cut is not None and cut > len(prompt) else upto
            if not text.startswith(upto):
                at = _first_difference(upto, text)
                raise ChatTemplateError(
                    f"{self.origin}: the template renders messages[:{i + 1}] differently when later messages "
                    f"follow (from character {at}: {upto[at:][:40]!r} alone, {text[at:][:40]!r} in the whole "
                    f"conversation), e.g. it drops earlier assistant turns' reasoning, so assistant message {i} "
                    f"cannot be located; mark the assistant output with {{% generation %}} ... "
                    f"{{% endgeneration %}} in the template, or give one conversation per assistant turn"
                )
            if not upto.startswith(prompt):
                at = _first_difference(prompt, upto)
                raise ChatTemplateError(
                    f"{self.origin}: the generation prompt after messages[:{i}] is not how the template starts "
                    f"assistant message {i} (from character {at}: {prompt[at:][:40]!r} vs {upto[at:][:40]!r}); mark "
                    f"the assistant output with {{% generation %}} ... {{% endgeneration %}} in the template"
                )
            end_token = self.end_of_turn(upto, len(prompt))
            spans.append((len(prompt), len(upto) if end_token is None else end_token[1]))
        return text, spans

    def _closing_tokens_cut(self, upto: str, text: str) -> int | None:
        """The longest ``k`` with ``text.startswith(upto[:k])`` where ``upto[k:]`` is only special
        tokens and whitespace (what a template writes after the last message), or None."""
        k = len(upto)
        while not text.startswith(upto[:k]):
            if k and upto[k - 1].isspace():
                k -= 1
                continue
            token = next((t for t in self.end_tokens if upto.endswith(t, 0, k)), None)
            if token is None:
                return None
            k -= len(token)
        return k

    def _render_or_none(self, messages, kw: dict) -> str | None:
        try:
            return self.render(messages, **kw)
        except ChatTemplateError:
            return None

    def _before_content(self, messages, i: int, kw: dict, upto: str) -> str | None:
        """What the template writes before assistant message ``i``'s content, found by rendering
        the conversation with that content replaced by a marker; None if that text is not how
        ``upto`` (messages ``[:i + 1]``) starts."""
        marker = "\ue000jaxlm-assistant-content\ue000"
        probe = [*messages[:i], {**messages[i], "content": marker}]
        try:
            rendered = self.render(probe, **kw)
        except ChatTemplateError:
            return None
        at = rendered.find(marker)
        return rendered[:at] if at >= 0 and upto.startswith(rendered[:at]) else None

    def end_of_turn(self, text: str, start: int = 0) -> tuple[int, int] | None:
        """``(start, end)`` of the last special token in ``text[start:]`` (an assistant turn's
        end-of-turn token), or None without one."""
        found = [(text.rfind(t, start), t) for t in self.end_tokens]
        found = [(at, at + len(t)) for at, t in found if at >= 0]
        return max(found) if found else None


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def read_chat_template(path: str | Path) -> tuple[str, str] | None:
    """``(template, origin)`` stored in directory ``path``: ``chat_template.jinja`` (as
    transformers 5 saves it), else ``tokenizer_config.json``'s ``chat_template`` (a string, or
    named templates of which ``default`` is used); None without one."""
    path = Path(path)
    if (path / TEMPLATE_FILE).exists():
        return (path / TEMPLATE_FILE).read_text(encoding="utf-8"), str(path / TEMPLATE_FILE)
    config = path / "tokenizer_config.json"
    if not config.exists():
        return None
    template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    origin = f"{config} (chat_template)"
    if template is None or isinstance(template, str):
        return None if template is None else (template, origin)
    if isinstance(template, list) and all(isinstance(t, dict) and "name" in t and "template" in t for t in template):
        template = {t["name"]: t["template"] for t in template}
    if isinstance(template, dict) and isinstance(template.get("default"), str):
        return template["default"], f"{config} (chat_template 'default')"
    names = sorted(template) if isinstance(template, dict) else None
    raise ChatTemplateError(
        f"{origin}: expected a string or named templates including 'default', got "
        f"{f'templates {names}' if names is not None else type(template).__name__}"
    )


#: transformers 5's folder of the named templates beside the default one
NAMED_TEMPLATES_DIR = "additional_chat_templates"


def read_named_chat_templates(path: str | Path) -> dict[str, str]:
    """The named templates beside the default one in directory ``path`` (``tool_use``, ...):
    ``additional_chat_templates/<name>.jinja`` (transformers 5), else the non-default entries
    of ``tokenizer_config.json``'s list of named templates."""
    path = Path(path)
    folder = path / NAMED_TEMPLATES_DIR
    if folder.is_dir():
        return {f.stem: f.read_text(encoding="utf-8") for f in sorted(folder.glob("*.jinja"))}
    config = path / "tokenizer_config.json"
    if not config.exists():
        return {}
    template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if not isinstance(template, dict):
        return {}
    return {k: v for k, v in template.items() if k != "default" and isinstance(k, str) and isinstance(v, str)}


# ----------------------------------------------------------------------------------------
# Tokenizer-level functions (`ByteTokenizer` / `HFTokenizer` call these)


def _check_conversation(messages) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")


def _check_builtin_arguments(tools, kwargs) -> None:
    if tools is not None or kwargs:
        raise ValueError(f"the built-in chat format (no chat_template) takes no tools or template variables, got "
                         f"{sorted(kwargs) + (['tools'] if tools is not None else [])}")


def apply_chat_template(tokenizer, messages: Sequence[dict], *, add_generation_prompt: bool = False,
                        tokenize: bool = True, tools=None, **kwargs) -> list[int] | str:
    """``messages`` in ``tokenizer``'s chat format: token ids, or the text (``tokenize=False``;
    the built-in format's BOS/EOS are ids only, so its text has none)."""
    _check_conversation(messages)
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        _check_builtin_arguments(tools, kwargs)
        segments = builtin_segments(messages, add_generation_prompt=add_generation_prompt)
        if not tokenize:
            return "".join(text for text, _ in segments)
        return _builtin_ids(tokenizer, segments, add_generation_prompt)[0]
    text = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
    return tokenizer.encode(text) if tokenize else text


def _builtin_ids(tokenizer, segments, add_generation_prompt: bool) -> tuple[list[int], list[bool]]:
    ids: list[int] = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    mask = [False] * len(ids)
    for text, trainable in segments:
        piece = tokenizer.encode(text)
        ids += piece
        mask += [trainable] * len(piece)
    if not add_generation_prompt and tokenizer.eos_id is not None:
        ids.append(tokenizer.eos_id)
        mask.append(bool(segments) and segments[-1][1])  # trained after an assistant turn only
    return ids, mask


def encode_chat(tokenizer, messages: Sequence[dict], *, tools=None, **kwargs) -> tuple[list[int], list[bool]]:
    """``(ids, assistant_mask)`` of a conversation: the token ids of ``messages`` in
    ``tokenizer``'s chat format and, per token, whether it is assistant output (trained)."""
    _check_conversation(messages)
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        _check_builtin_arguments(tools, kwargs)
        return _builtin_ids(tokenizer, builtin_segments(messages), False)
    text, spans = template.render_with_assistant_spans(messages, tools=tools, **kwargs)
    ids, offsets = tokenizer.encode_with_offsets(text)
    return ids, token_mask(offsets, spans)


def token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """Per token (character ``offsets``), whether it overlaps one of the character ``spans``."""
    return [any(end > s and start < e for s, e in spans) for start, end in offsets]
