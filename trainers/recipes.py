"""Recipes: ``configs/<name>.py`` (or any ``.py`` file) exposing ``get_config() ->
ExperimentConfig``, and ``key=value`` overrides parsed and type-checked by `tyro` (an
unknown key fails with the closest valid keys, a badly typed value names the field and the
expected type)::

    cfg = load_config("quickstart", ["model.n_layers=4", "trainer.steps=200"])

Recipes are found by name at run time (``importlib``): trainers never import ``configs``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.resources
import importlib.util
import io
import os
import re
import shlex
import traceback
import types
import typing
from pathlib import Path
from typing import Any, Sequence

import tyro

from trainers.config import ConfigError, ExperimentConfig


def known_recipes() -> list[str]:
    """The recipe names in the ``configs`` package."""
    try:
        files = importlib.resources.files("configs")
    except ModuleNotFoundError:
        return []
    return sorted(p.name[:-3] for p in files.iterdir() if p.name.endswith(".py") and p.name != "__init__.py")


def _where(error: BaseException, path: Path) -> str:
    """``file:line`` of the innermost frame of ``error`` inside ``path``."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    return f"{path}:{frames[-1].lineno}" if frames else str(path)


def _load_module(name_or_path: str) -> tuple[types.ModuleType, Path]:
    path = Path(name_or_path)
    if path.suffix != ".py":
        if name_or_path not in known_recipes():
            raise ConfigError(f"no config named {name_or_path!r}; known: {known_recipes()} (or pass a .py path)")
        spec = importlib.util.find_spec(f"configs.{name_or_path}")
        path = Path(spec.origin)
    elif not path.is_file():
        raise ConfigError(f"config file {path} does not exist" if not path.exists() else f"{path} is not a file")
    spec = importlib.util.spec_from_file_location(f"jaxlm_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ConfigError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 (any error in user code: name its line)
        raise ConfigError(f"{_where(e, path)}: {type(e).__name__}: {e}") from None
    return module, path


def _optional_section(obj: Any, name: str) -> type | None:
    """The dataclass ``X`` when field ``name`` of dataclass ``obj`` is declared ``X | None``."""
    hint = typing.get_type_hints(type(obj)).get(name)
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if type(None) in typing.get_args(hint) and len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _replace_path(obj: Any, parts: list[str], value: Any) -> Any:
    if not parts:
        return value
    head = getattr(obj, parts[0])
    return dataclasses.replace(obj, **{parts[0]: _replace_path(head, parts[1:], value)})


def _unchecked(cls: type, **values: Any) -> Any:
    """An instance of dataclass ``cls`` with its defaults (and ``values``), its validation not
    yet run: a section switched on by an override of one of its fields is only valid once
    every override is in (tyro rebuilds it, and its parents, through their constructors)."""
    obj = object.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.name in values:
            value = values[f.name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            raise ConfigError(f"{cls.__name__}.{f.name} has no default: set the section in the recipe")
        object.__setattr__(obj, f.name, value)
    return obj


def _replace_path_unchecked(obj: Any, parts: list[str], value: Any) -> Any:
    """`_replace_path` without running the validation of the dataclasses on the way."""
    if not parts:
        return value
    head = getattr(obj, parts[0])
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    values[parts[0]] = _replace_path_unchecked(head, parts[1:], value)
    return _unchecked(type(obj), **values)


def _walk(obj: Any, parts: list[str]) -> Any:
    for name in parts:
        obj = getattr(obj, name)
    return obj


def _switch_optional_sections(config: ExperimentConfig, items: list[tuple[str, str]]):
    """Optional sections (``algorithm.prefix``, ``algorithm.environment``: ``X | None``) are
    switched here, before tyro sees the rest: ``algorithm.prefix=None`` turns one off, and an
    override of a field inside a section that is None (``algorithm.prefix.problems=32``) turns it
    on with its defaults first (validated once every override is in: a section whose defaults
    alone are incomplete, ``algorithm.distill.teacher=PATH``, is switched on by its fields).
    Returns the config and the overrides still to apply."""
    rest = []
    for key, value in items:
        parts = key.split(".")
        obj, consumed = config, False
        for i, name in enumerate(parts):
            if not dataclasses.is_dataclass(obj) or not hasattr(obj, name):
                break
            section = _optional_section(obj, name)
            if section is not None and i == len(parts) - 1 and value in ("None", "none", "null"):
                config, consumed = _replace_path(config, parts, None), True
                break
            if section is not None and i < len(parts) - 1 and getattr(obj, name) is None:
                config = _replace_path_unchecked(config, parts[: i + 1], _unchecked(section))
            obj = _walk(config, parts[: i + 1])
        if not consumed:
            rest.append((key, value))
    for key, _ in rest:  # a field of a section that a later (or earlier) override switched off
        parts = key.split(".")
        obj = config
        for i, name in enumerate(parts[:-1]):
            if not dataclasses.is_dataclass(obj) or not hasattr(obj, name):
                break
            if _optional_section(obj, name) is not None and getattr(obj, name) is None:
                section = ".".join(parts[: i + 1])
                if any(k == section for k, _ in items):
                    raise ConfigError(f"override {key} sets a field of {section}, which {section}=None "
                                      f"switches off: drop one of the two")
                break
            obj = getattr(obj, name)
    return config, rest


def _unbox(text: str) -> str:
    """tyro's error message (boxed on a terminal, ruled with dashes otherwise) in at most two
    lines, in override terms: ``unknown key trainer.stepz`` and the closest keys, or the
    parse error and the key's type and description."""
    rule = set("─-━═ ")
    raw = [line.strip().strip("│").strip() for line in text.splitlines()]
    lines = []
    for i, line in enumerate(raw):
        if not line or line[0] in "╭╰" or set(line) <= rule or line.startswith("For full helptext"):
            continue
        title = i + 1 < len(raw) and raw[i + 1] and set(raw[i + 1]) <= rule and not any(raw[:i])
        if title:  # without a box, the title is the first line, above a rule
            continue
        lines.append(line)
    if not lines:
        return ""
    first, rest = lines[0], lines[1:]
    if first.startswith("Unrecognized options:"):
        keys = [t.strip(",")[2:].partition("=")[0] for t in first.split()[2:] if t.startswith("--")]
        first = "unknown key " + ", ".join(keys) if keys else first
    hint = ""
    if rest and rest[0].startswith("Perhaps you meant"):
        close = [line.split()[0][2:] for line in rest[1:] if line.startswith("--")]
        hint = "closest keys: " + ", ".join(close)
    elif rest and rest[0].startswith("Argument helptext"):
        flag = next((line for line in rest[1:] if line.startswith("--")), "")
        about = rest[rest.index(flag) + 1] if flag and rest.index(flag) + 1 < len(rest) else ""
        hint = f"{flag[2:]}: {about}".strip(": ") if flag else ""
    if first.startswith("Error parsing --"):
        first = "invalid value for " + first[len("Error parsing --"):]
    else:  # a section's own validation names its field already
        first = re.sub(r"^Error parsing [\w.]+: ", "", first)
    return first + (f"\n{hint}" if hint else "")


def _field_hint(config: Any, parts: list[str]) -> Any:
    """The declared type of field ``parts`` of ``config`` (None if there is no such field)."""
    obj = config
    for i, name in enumerate(parts):
        if not dataclasses.is_dataclass(obj) or name not in {f.name for f in dataclasses.fields(obj)}:
            return None
        if i == len(parts) - 1:
            return typing.get_type_hints(type(obj)).get(name)
        obj = getattr(obj, name)
    return None


def _is_sequence_field(config: Any, parts: list[str]) -> bool:
    """Field ``parts`` of ``config`` is declared a tuple or list: ``key=a,b`` or ``key='a b'``
    gives its items (shell-quoted items keep their spaces and commas: ``key="'a b' c"``,
    ``key="'x, y'"`` is the one item ``x, y``)."""
    hint = _field_hint(config, parts)
    origins = {typing.get_origin(h) for h in (hint, *typing.get_args(hint))}
    return bool(origins & {tuple, list})


def _is_bool_field(config: Any, parts: list[str]) -> bool:
    hint = _field_hint(config, parts)
    return hint is bool or bool in typing.get_args(hint)


def apply_overrides(config: ExperimentConfig, overrides: Sequence[str]) -> ExperimentConfig:
    """``["model.n_layers=4", ...]`` -> a new config, parsed and type-checked by tyro."""
    items: list[tuple[str, str]] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is invalid: expected key=value (e.g. trainer.steps=100)")
        items.append((key.strip(), value))
    try:
        config, items = _switch_optional_sections(config, items)
    except ValueError as e:  # a section's own validation
        raise ConfigError(str(e)) from None
    args: list[str] = []
    for key, value in items:
        if value.lower() in ("true", "false") and _is_bool_field(config, key.split(".")):
            value = value.capitalize()
        if _is_sequence_field(config, key.split(".")):  # a tuple takes its items as separate arguments
            try:
                parts = shlex.split(value)
            except ValueError as e:
                raise ConfigError(f"override {key}={value!r}: {e} (quote items that hold spaces or quotes)") from None
            if len(parts) == 1 and "," in parts[0] and not set(value) & {"'", '"'}:  # a quoted item is one item
                parts = parts[0].split(",")
            args += [f"--{key}", *parts]
        else:
            args.append(f"--{key}={value}")  # one argument: a value may start with '-'
    if not args:
        return config
    err = io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "400"  # keep tyro's messages on one line each
    try:
        with contextlib.redirect_stderr(err):
            return tyro.cli(
                type(config), default=config, args=args, use_underscores=True,
                config=(tyro.conf.AvoidSubcommands, tyro.conf.FlagConversionOff),
            )
    except SystemExit:
        raise ConfigError(_unbox(err.getvalue()) or f"invalid overrides {list(overrides)}") from None
    except ValueError as e:  # a config's own validation (e.g. n_heads not divisible)
        raise ConfigError(str(e)) from None
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns


def load_config(name_or_path: str, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """``configs/<name>.py`` (or any ``.py`` path) -> ``get_config()`` -> overrides applied.
    Errors in the file (syntax, an invalid section, a bad value) name the file and line."""
    module, path = _load_module(name_or_path)
    if not callable(getattr(module, "get_config", None)):
        raise ConfigError(f"{path} has no get_config() function")
    try:
        config = module.get_config()
    except Exception as e:  # noqa: BLE001 (the recipe's own validation or a typo: name its line)
        raise ConfigError(f"{_where(e, path)}: {e}" if isinstance(e, ValueError)
                          else f"{_where(e, path)}: {type(e).__name__}: {e}") from None
    if not isinstance(config, ExperimentConfig):
        raise ConfigError(f"{path}: get_config() returned {type(config).__name__}, not ExperimentConfig")
    return apply_overrides(config, overrides)
