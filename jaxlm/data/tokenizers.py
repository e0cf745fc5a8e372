"""Tokenizers: `ByteTokenizer` (no files, the embedded default) and `HFTokenizer`
(a thin wrapper over the `tokenizers` library for a local ``tokenizer.json``).

Both expose ``encode(text, add_bos=...) -> list[int]``, ``decode(ids) -> str``,
``bos_id``, ``eos_id``, ``pad_id``, ``vocab_size`` and ``apply_chat_template(messages,
add_generation_prompt=..., tokenize=...)`` (`jaxlm.data.chat`: the tokenizer's own chat
template when it has one, else the built-in format).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Sequence

from jaxlm.data.chat import (
    NAMED_TEMPLATES_DIR,
    SPECIAL_TOKEN_NAMES,
    TEMPLATE_FILE,
    ChatTemplate,
    apply_chat_template,
    read_chat_template,
    read_named_chat_templates,
)


class ByteTokenizer:
    """UTF-8 bytes shifted past three specials: PAD=0, BOS=1, EOS=2, byte b -> b + 3.

    Vocabulary size 259 (`ModelConfig.tiny` uses it). Decoding drops the specials
    and replaces invalid UTF-8 with U+FFFD, so ``decode(encode(s)) == s`` for every str that is
    text (a lone surrogate has no UTF-8 encoding: `encode` raises ``UnicodeEncodeError``).
    """

    pad_id, bos_id, eos_id = 0, 1, 2
    offset = 3
    vocab_size = 256 + offset

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode expects str, got {type(text).__name__}")
        ids = [b + self.offset for b in text.encode("utf-8")]
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(int(i) - self.offset for i in ids if self.offset <= int(i) < self.vocab_size)
        return data.decode("utf-8", errors="replace")

    def batch_encode(self, texts: Sequence[str], **kw) -> list[list[int]]:
        return [self.encode(t, **kw) for t in texts]

    chat_template = None
    """No template: chats use the built-in format (`jaxlm.data.chat.builtin_segments`)."""

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = False,
                            tokenize: bool = True) -> list[int] | str:
        """BOS + ``<|role|>\\n`` content ``\\n`` per message + EOS (or ``<|assistant|>\\n`` instead
        of EOS with ``add_generation_prompt``); ``tokenize=False``: the text, without BOS/EOS."""
        return apply_chat_template(self, messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _token_string(special) -> str | None:
    if isinstance(special, dict):  # {"content": "<s>", ...}
        special = special.get("content")
    return special if isinstance(special, str) else None


def _json_object(file: Path) -> dict:
    """A JSON object file; a `ValueError` naming the file when it is damaged or not an object
    (a bare JSONDecodeError or AttributeError named nothing)."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{file} could not be read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} holds a JSON {type(data).__name__}, not an object")
    return data


def _token_ids(tok, special) -> list[int]:
    """The ids a special-token entry names: an id, a token string, ``{"content": ...}``, or
    a list of those (``config.json``'s ``eos_token_id`` in Llama 3); unknown strings and
    negative ids (``pad_token_id: -1``, "none" in some conversions) skipped; an id past the
    vocabulary is an error (`SpecialTokenIdError`)."""
    if special is None:
        return []
    if isinstance(special, (list, tuple)):
        return [i for s in special for i in _token_ids(tok, s)]
    if isinstance(special, dict):  # {"content": "<s>", ...}
        special = special.get("content")
    if isinstance(special, bool) or not isinstance(special, (int, str)):
        raise TypeError(f"special token {special!r} is neither a token id nor a token string")
    if isinstance(special, int):
        if special < 0:
            return []
        vocab = tok.get_vocab_size(with_added_tokens=True)
        if special >= vocab:  # it flowed into encoded rows and stop ids unchecked
            raise SpecialTokenIdError(special, vocab)
        return [special]
    token_id = tok.token_to_id(special)
    return [] if token_id is None else [token_id]


class SpecialTokenIdError(ValueError):
    """A special-token id outside the tokenizer's vocabulary."""

    def __init__(self, token_id: int, vocab: int):
        super().__init__(f"special token id {token_id} is outside the tokenizer's vocabulary [0, {vocab})")
        self.token_id = token_id


def _token_id(tok, special) -> int | None:
    ids = _token_ids(tok, special)
    return ids[0] if ids else None


class HFTokenizer:
    """A local ``tokenizer.json`` (HF `tokenizers`), with specials from ``tokenizer_config.json``
    or ``config.json`` and the chat template (``chat_template.jinja`` or ``tokenizer_config.json``)
    when present.

    ``special_tokens``: the special token strings a chat template sees (``bos_token``, ...;
    default: those of the given ids); ``chat_template``: a Jinja2 template string, or None for
    the built-in chat format."""

    def __init__(self, tokenizer, *, bos_id=None, eos_id=None, pad_id=None, source: Path | None = None,
                 special_tokens: dict[str, str] | None = None, chat_template: str | None = None,
                 template_origin: str = "chat_template", extra_eos_ids: Sequence[int] = ()):
        self._tok = tokenizer
        self.bos_id, self.eos_id = bos_id, eos_id
        self.extra_eos_ids = tuple(dict.fromkeys(int(i) for i in extra_eos_ids if i != eos_id))
        if special_tokens is None:
            named = {"bos_token": bos_id, "eos_token": eos_id, "pad_token": pad_id}
            special_tokens = {k: tokenizer.id_to_token(i) for k, i in named.items() if i is not None}
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
        self._fallback_pad = None if pad_id is not None else self.pad_id
        self._source = source
        self._source_text: str | None = None  # the tokenizer.json it was read from, as read
        self._source_config: dict | None = None  # and its directory's tokenizer_config.json
        #: templates beside the default one (``tool_use``, ...), carried to a save as transformers 5 writes them
        self.named_chat_templates: dict[str, str] = {}
        self.set_chat_template(chat_template, origin=template_origin)

    def set_chat_template(self, template: str | None, *, origin: str = "chat_template") -> None:
        """Format chats with the Jinja2 ``template`` (None: the built-in format); ``origin``
        names it in errors. A template that does not compile raises `ChatTemplateError`."""
        if template is None:
            self.chat_template = None
            return
        specials = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]
        self.chat_template = ChatTemplate(template, origin=origin, variables=self.special_tokens, end_tokens=specials)

    @classmethod
    def from_file(cls, file: str | os.PathLike, *, bos=None, eos=None, pad=None) -> "HFTokenizer":
        """Load ``file``; ``bos``/``eos``/``pad`` are token strings or ids (optional)."""
        from tokenizers import Tokenizer

        file = Path(file)
        if not file.exists():
            raise FileNotFoundError(f"{file} does not exist")
        try:
            text = file.read_text(encoding="utf-8")
            tok = Tokenizer.from_str(text)
        except Exception as e:  # the library raises a bare Exception on bad JSON
            raise ValueError(f"{file} is not a valid tokenizer.json: {e}") from None
        eos_ids = _token_ids(tok, eos)
        out = cls(
            tok, bos_id=_token_id(tok, bos), eos_id=eos_ids[0] if eos_ids else None, pad_id=_token_id(tok, pad),
            source=file, extra_eos_ids=eos_ids[1:],
        )
        out._source_text = text  # saved as read, even once the file is gone or replaced
        return out

    @property
    def pad_named(self) -> bool:
        """Whether PAD was named (by the files or a later assignment), not EOS's fallback."""
        return self.pad_id != self._fallback_pad

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a sequence: EOS, then any other end-of-sequence ids the
        checkpoint lists (``eos_token_id: [128001, 128008, 128009]``)."""
        return (() if self.eos_id is None else (self.eos_id,)) + self.extra_eos_ids

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "HFTokenizer":
        """``path/tokenizer.json`` with specials from ``config.json``,
        ``special_tokens_map.json`` and ``tokenizer_config.json`` (later wins for BOS, PAD and
        the primary EOS; an explicit ``"bos_token": null`` in ``tokenizer_config.json`` means no
        BOS, as in Qwen2.5, and likewise for PAD). Every end-of-sequence id any of
        ``tokenizer_config.json``, ``config.json`` and ``generation_config.json`` names is a
        stop id (Llama 3.1: ``eos_token: "<|eot_id|>"`` beside ``eos_token_id: [128001, 128008,
        128009]``). A chat template sees the strings of the BOS and EOS ids in use, and those
        ``special_tokens_map.json`` and ``tokenizer_config.json`` name."""
        path = Path(path)
        specials: dict[str, object] = {}
        eos_lists: dict[str, list] = {}
        strings: dict[str, str | None] = {}
        own_config = None
        id_fields: list[tuple[str, str, list]] = []  # (file, field, ids) for error messages
        for name in ("config.json", "generation_config.json", "special_tokens_map.json", _CONFIG):
            if (path / name).exists():
                data = _json_object(path / name)
                for key in ("bos", "eos", "pad"):
                    if name == "generation_config.json" and key != "eos":
                        continue  # generation settings do not name the tokenizer's BOS / PAD
                    for field in (f"{key}_token_id", f"{key}_token"):
                        if data.get(field) is not None:
                            specials[key] = data[field]
                    if name == _CONFIG and key != "eos" and f"{key}_token" in data and data[f"{key}_token"] is None \
                            and data.get(f"{key}_token_id") is None:
                        specials[key] = None  # the tokenizer's own file says there is none
                eos_lists[name] = [data[f] for f in ("eos_token", "eos_token_id") if data.get(f) is not None]
                id_fields += [(name, f, data[f] if isinstance(data[f], list) else [data[f]])
                              for f in ("bos_token_id", "eos_token_id", "pad_token_id") if f in data]
                if name == _CONFIG:
                    own_config = dict(data)
                if name in ("special_tokens_map.json", _CONFIG):
                    strings.update({k: _token_string(data[k]) for k in SPECIAL_TOKEN_NAMES if k in data})
        if specials.get("eos") is not None:  # the primary EOS (the last file's) first, then every other id listed
            listed = [e for name in (_CONFIG, "generation_config.json", "config.json") for e in eos_lists.get(name, [])]
            specials["eos"] = [specials["eos"], *listed]
        try:
            tok = cls.from_file(path / "tokenizer.json", **specials)
        except SpecialTokenIdError as e:
            named = [f"{name} {field}" for name, field, value in id_fields if e.token_id in value]
            raise ValueError(f"{path}: {e} (named by {', '.join(named) or 'a special-token field'})") from None
        tok._source_config = own_config
        # the strings of the BOS / EOS ids in use, then those the files name (a null removes one)
        named = {**{k: v for k, v in tok.special_tokens.items() if k in ("bos_token", "eos_token")}, **strings}
        tok.special_tokens = {k: v for k, v in named.items() if v is not None}
        template = read_chat_template(path)
        if template is not None:
            tok.set_chat_template(template[0], origin=template[1])
        tok.named_chat_templates = read_named_chat_templates(path)
        return tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if add_eos and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """``encode(text)`` and each token's character span ``(start, end)`` in ``text``."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, [tuple(o) for o in enc.offsets]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = False,
                            tokenize: bool = True, tools=None, **kwargs) -> list[int] | str:
        """``messages`` rendered by the chat template (as transformers' ``apply_chat_template``;
        ``kwargs`` are template variables), or in the built-in format without one."""
        return apply_chat_template(self, messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize,
                                   tools=tools, **kwargs)

    def batch_encode(self, texts: Sequence[str], **kw) -> list[list[int]]:
        return [self.encode(t, **kw) for t in texts]

    def save(self, path: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` into directory ``path``."""
        target = Path(path) / "tokenizer.json"
        if self._source_text is not None:  # the file it was read from, as read
            target.write_text(self._source_text, encoding="utf-8")
        else:
            self._tok.save(str(target))

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id})"


_CONFIG = "tokenizer_config.json"


def save_tokenizer(tokenizer, path: str | os.PathLike) -> None:
    """Write ``tokenizer`` into directory ``path`` so `load_tokenizer` finds it again.

    HF: ``tokenizer.json``, the chat template as ``chat_template.jinja``, and
    ``tokenizer_config.json``: the one of the directory the tokenizer was read from (its
    other settings kept) with the tokenizer's own special tokens (ids and strings; a BOS or
    PAD it lacks written as null, so a ``config.json`` id beside it does not bring one back)
    and without a chat template of its own; byte-level: a ``tokenizer_config.json`` naming
    ``ByteTokenizer``.
    """
    path = Path(path)
    if isinstance(tokenizer, ByteTokenizer):
        (path / _CONFIG).write_text(json.dumps({"tokenizer_class": "ByteTokenizer"}))
    elif isinstance(tokenizer, HFTokenizer):
        # the tokenizer_config.json it was read with (as read: its directory may have changed since)
        config = dict(tokenizer._source_config or {})
        tokenizer.save(path)
        if tokenizer.chat_template is not None:
            (path / TEMPLATE_FILE).write_text(tokenizer.chat_template.source, encoding="utf-8")
        if tokenizer.named_chat_templates:  # transformers 5's layout; the config's list is dropped below
            (path / NAMED_TEMPLATES_DIR).mkdir(exist_ok=True)
            for name, text in tokenizer.named_chat_templates.items():
                (path / NAMED_TEMPLATES_DIR / f"{name}.jinja").write_text(text, encoding="utf-8")
        config.pop("chat_template", None)  # the template is chat_template.jinja or none
        for name in SPECIAL_TOKEN_NAMES:  # exactly the tokenizer's special token strings
            config.pop(name, None)
        config.update(tokenizer.special_tokens)
        for key in ("bos", "eos", "pad"):
            token_id = getattr(tokenizer, f"{key}_id")
            if key == "pad" and not tokenizer.pad_named:
                token_id = None  # PAD falls back to EOS again on reading, as before
            if token_id is None and key != "eos":  # an explicit "none" (a config.json id must not win)
                config[f"{key}_token"] = None
            config[f"{key}_token_id"] = token_id
            if key == "eos" and tokenizer.extra_eos_ids:  # every stop id, the primary first
                config["eos_token_id"] = list(tokenizer.stop_ids)
            if token_id is not None:  # a string names the id in use (transformers reads the strings)
                string = tokenizer._tok.id_to_token(token_id)
                if string is not None:
                    config[f"{key}_token"] = string
        (path / _CONFIG).write_text(json.dumps(config, indent=2))
    else:
        raise TypeError(f"cannot save a tokenizer of type {type(tokenizer).__name__}")


def load_tokenizer(path: str | os.PathLike) -> ByteTokenizer | HFTokenizer | None:
    """The tokenizer stored in directory ``path``, or None if it holds none."""
    path = Path(path)
    if (path / _CONFIG).exists():
        if _json_object(path / _CONFIG).get("tokenizer_class") == "ByteTokenizer":
            return ByteTokenizer()
    if (path / "tokenizer.json").exists():
        return HFTokenizer.from_dir(path)
    return None
