"""One declaration per setting: the config field that holds a setting also declares its flag.

A role's settings are a frozen dataclass whose fields are declared with ``setting()``: the
default, the flag's name and help, and how its text parses (by the field's type unless told).
From the dataclass come the role's argparse flags (``add_flags``), the settings of parsed
arguments (``from_args``) and, back, the command line that gives those settings (``to_argv``:
how ``switchyard serve`` starts each role). A field declared with ``component()`` holds another
such dataclass and brings its flags along (``SchedulerConfig`` in the scheduler's settings and in
``switchyard serve``'s), or only some of them.

Values are checked where they always were: by a flag's parse function (an argparse error that
names the flag) or by the dataclass's ``__post_init__`` (``ValueError``). A default an
environment variable may set is read through ``interfaces.envs`` when the parser is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

_SETTING = "switchyard.setting"
_COMPONENT = "switchyard.component"


@dataclass(frozen=True)
class Flag:
    """How one settings field is given on the command line."""

    name: str
    """The flag, e.g. ``--max-num-seqs``; its parsed value is at ``args.max_num_seqs``."""
    help: str
    """What it does, without its default: ``add_flags`` appends ``(default: default_text)``."""
    parse: Callable[[str], Any] | None = None
    """The text to a value (argparse's ``type``); None: by the field's type."""
    to_field: Callable[[Any], Any] | None = None
    """The parsed value to the field's; None: as parsed (a tuple field's flag is repeated, each
    value comma-separated items: the field is the tuple of all items)."""
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    default_text: str = "%(default)s"
    env_default: Callable[[], Any] | None = None
    """Where the flag's default comes from when an environment variable may set it."""
    required: bool = False
    """The parser requires the flag; the field's default (None) stands for "not yet given"."""
    switch: bool = False
    """A flag without a value that turns a bool field to the other of its default
    (``--allow-remote-bind``, ``--no-prefix-caching``)."""
    secret: bool = False
    """Never in ``to_argv`` (``ps`` shows a command line) nor in the dataclass's repr: the
    value goes by its environment variable (``env_default``)."""
    group: str | None = None
    """The section of ``--help`` that lists it."""


def setting(default: Any, name: str, help: str, **options: Any) -> Any:
    """A settings field with ``default`` and the flag ``name`` (``Flag``'s ``options``)."""
    flag = Flag(name, help, **options)
    return field(default=default, repr=not flag.secret, metadata={_SETTING: flag})


def component(settings: type, group: str | None = None, only: tuple[str, ...] | None = None) -> Any:
    """A field holding ``settings`` (default: its defaults), whose flags, or ``only`` those of
    these fields, are the holder's too, listed under ``group`` in ``--help``."""
    return field(default_factory=settings, metadata={_COMPONENT: (group, only)})


def add_flags(
    parser: argparse.ArgumentParser, settings: type, only: Iterable[str] | None = None
) -> None:
    """Add to ``parser`` the flags of the dataclass ``settings`` (of ``only`` these fields)."""
    _add_flags(parser, settings, only, None, {})


def from_args(
    settings: type, args: argparse.Namespace, only: Iterable[str] | None = None, **given: Any
) -> Any:
    """The ``settings`` that ``args`` (parsed by ``add_flags``' flags) give: the fields in
    ``only`` (None: all) from ``args``, the others from ``given`` or their defaults.
    ``ValueError`` from the dataclass's checks."""
    hints = typing.get_type_hints(settings)
    values = dict(given)
    for item in _fields(settings, only):
        if item.name in values:
            continue
        if _COMPONENT in item.metadata:
            values[item.name] = from_args(hints[item.name], args, item.metadata[_COMPONENT][1])
        elif _SETTING in item.metadata:
            flag = item.metadata[_SETTING]
            value = getattr(args, _dest(item, flag))
            values[item.name] = _field_value(flag, hints[item.name], value)
    return settings(**values)


def to_argv(settings: Any) -> list[str]:
    """The flags that give ``settings`` to its parser: each field that differs from its
    default, in field order (secrets never: they go by the environment)."""
    hints = typing.get_type_hints(type(settings))
    argv: list[str] = []
    for item in dataclasses.fields(settings):
        value = getattr(settings, item.name)
        flag = item.metadata.get(_SETTING)
        if _COMPONENT in item.metadata:
            argv += to_argv(value)
        elif flag is not None and not flag.secret and value != item.default:
            argv += _flag_argv(flag, hints[item.name], value)
    return argv


def split_commas(values: Iterable[str]) -> tuple[str, ...]:
    """``["a,b", "c"]`` → ``("a", "b", "c")``: comma-separated, repeated, or both."""
    items = (item.strip() for value in values for item in value.split(","))
    return tuple(dict.fromkeys(item for item in items if item))


def declarations(settings: type) -> set[tuple[type, str]]:
    """(class, flag name) of every flag that ``settings`` and the settings it holds declare, a
    held class's flags all (whatever ``only`` its holder takes): where each flag is declared."""
    hints = typing.get_type_hints(settings)
    found = set()
    for item in dataclasses.fields(settings):
        if _COMPONENT in item.metadata:
            found |= declarations(hints[item.name])
        elif _SETTING in item.metadata:
            found.add((settings, item.metadata[_SETTING].name))
    return found


def _fields(settings: type, only: Iterable[str] | None) -> list[dataclasses.Field]:
    chosen = None if only is None else set(only)
    return [item for item in dataclasses.fields(settings) if chosen is None or item.name in chosen]


def _add_flags(
    parser: argparse.ArgumentParser,
    settings: type,
    only: Iterable[str] | None,
    section: str | None,
    sections: dict[str, Any],
) -> None:
    hints = typing.get_type_hints(settings)
    for item in _fields(settings, only):
        if _COMPONENT in item.metadata:
            group, component_only = item.metadata[_COMPONENT]
            _add_flags(parser, hints[item.name], component_only, group or section, sections)
        elif _SETTING in item.metadata:
            flag = item.metadata[_SETTING]
            title = flag.group or section
            if title is not None and title not in sections:
                sections[title] = parser.add_argument_group(title)
            target = parser if title is None else sections[title]
            _add_flag(target, item, flag, hints[item.name])


def _add_flag(target: Any, item: dataclasses.Field, flag: Flag, hint: Any) -> None:
    shown = "required" if flag.required else f"default: {flag.default_text}"
    help_text = f"{flag.help} ({shown})"
    if flag.switch:
        action = "store_false" if item.default else "store_true"
        target.add_argument(flag.name, dest=item.name, action=action, help=help_text)
        return
    kind = _base_type(hint)
    options: dict[str, Any] = {"help": help_text, "metavar": flag.metavar}
    if kind is tuple:
        options.update(action="append", default=[])
    else:
        default = flag.env_default() if flag.env_default is not None else item.default
        options.update(type=flag.parse or _parse(kind), default=default, required=flag.required)
    if flag.choices is not None:
        options["choices"] = flag.choices
    elif isinstance(kind, type) and issubclass(kind, enum.Enum):
        options["choices"] = tuple(kind)
        options["metavar"] = options["metavar"] or "{" + ",".join(m.value for m in kind) + "}"
    target.add_argument(flag.name, **options)


def _base_type(hint: Any) -> Any:
    """``int`` of ``int | None``; ``tuple`` of ``tuple[str, ...]``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return typing.get_origin(hint) or hint


def _parse(kind: Any) -> Callable[[str], Any] | None:
    return None if kind is str else kind


def _dest(item: dataclasses.Field, flag: Flag) -> str:
    return item.name if flag.switch else flag.name.lstrip("-").replace("-", "_")


def _field_value(flag: Flag, hint: Any, value: Any) -> Any:
    if flag.to_field is not None:
        return flag.to_field(value)
    if _base_type(hint) is tuple:
        return split_commas(value)
    return value


def _flag_argv(flag: Flag, hint: Any, value: Any) -> list[str]:
    if flag.switch:
        return [flag.name]
    if _base_type(hint) is tuple:
        return [flag.name, ",".join(value)]
    return [flag.name, value.value if isinstance(value, enum.Enum) else str(value)]
