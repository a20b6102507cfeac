"""Command-line flags and `LORAFLEET_*` environment variables generated from a config dataclass.

Every field of a process's config dataclass becomes one flag (`max_num_seqs` -> `--max-num-seqs`)
and one environment variable (`LORAFLEET_MAX_NUM_SEQS`); the help text is the field's
`metadata["help"]`. A field whose type is itself a dataclass (the worker's `engine: EngineConfig`)
is flattened: its fields become top-level flags and the nested object is built from them.
Precedence: flag > environment > field default. The stager and the operator reuse this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar

ENV_PREFIX = "LORAFLEET_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

T = TypeVar("T")


@dataclasses.dataclass(slots=True)
class _Option:
    """One generated flag: where its value goes and how to parse it."""

    path: tuple[str, ...]  # ("engine", "max_num_seqs"): attribute path from the top config
    owner: type  # the dataclass that declares the field
    field: dataclasses.Field
    kind: Any  # the type with Optional stripped
    optional: bool
    help_override: str | None = None  # from the composing config (see _options)

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def env_var(self, prefix: str) -> str:
        return prefix + self.name.upper()


_COMMENTED_FIELD = re.compile(r"^\s+(\w+)\s*:[^#]*#\s*(.+?)\s*$")


def _source_comments(cls: type) -> dict[str, str]:
    """`name: type = default  # comment` -> {name: comment}: help for fields without metadata."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    return {m[1]: m[2] for m in map(_COMMENTED_FIELD.match, lines) if m}


def _help(opt: _Option) -> str:
    return (
        opt.help_override
        or opt.field.metadata.get("help")
        or _source_comments(opt.owner).get(opt.name)
        or opt.name.replace("_", " ")
    )


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(args) < len(typing.get_args(tp)):
            return args[0], True
    return tp, False


def _options(cls: type, prefix: tuple[str, ...] = (), overrides: dict[str, str] | None = None) -> list[_Option]:
    """A nested config field may carry `metadata={"help": {field: text}}`: the composing config's
    wording for fields whose meaning it widens (the worker's `--adapters` also takes s3:// URIs)."""
    hints = typing.get_type_hints(cls)
    found: list[_Option] = []
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("cli") is False:
            continue
        kind, optional = _strip_optional(hints[f.name])
        if dataclasses.is_dataclass(kind):
            found.extend(_options(kind, prefix + (f.name,), dict(f.metadata.get("help") or {})))
        else:
            found.append(_Option(prefix + (f.name,), cls, f, kind, optional, (overrides or {}).get(f.name)))
    names = [o.name for o in found]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise TypeError(f"{cls.__name__}: nested config fields clash as flags: {clashes}")
    return found


def _is_sequence(kind: Any) -> bool:
    return typing.get_origin(kind) in (list, tuple)


def _item_type(kind: Any) -> Any:
    args = [a for a in typing.get_args(kind) if a is not Ellipsis]
    return args[0] if args else str


def _convert(kind: Any, text: str) -> Any:
    """Parse one value from its text form; raises ValueError with a readable message."""
    if kind is bool:
        low = text.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}, got {text!r}")
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        if text not in choices:
            raise ValueError(f"expected one of {list(choices)}, got {text!r}")
        return text
    if _is_sequence(kind):
        item = _item_type(kind)
        values = [_convert(item, part.strip()) for part in text.split(",") if part.strip()]
        return tuple(values) if typing.get_origin(kind) is tuple else values
    if kind in (int, float, str):
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"expected {kind.__name__}, got {text!r}") from None
        if kind is float and not math.isfinite(value):  # nan passes every range check (a grace of nan: none)
            raise ValueError(f"expected a finite number, got {text!r}")
        return value
    raise TypeError(f"cli cannot parse fields of type {kind!r}")


def _default_text(opt: _Option) -> str:
    f = opt.field
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, list | tuple):
        return ",".join(map(str, value)) or "empty"
    return str(value)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        """One line, not the usage of every flag before it (--help has that)."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(
    config_cls: type,
    *,
    prog: str | None = None,
    description: str | None = None,
    epilog: str | None = None,
    env: Mapping[str, str] | None = None,
    env_prefix: str = ENV_PREFIX,
) -> argparse.ArgumentParser:
    """An argparse parser with one flag per config field; defaults come from `env` when set there."""
    env = os.environ if env is None else env
    parser = _Parser(
        prog=prog,
        description=description,
        epilog=" ".join(filter(None, [
            f"Every flag can also be set by the environment variable shown with it ({env_prefix}*).", epilog])),
    )
    for opt in _options(config_cls):
        env_name = opt.env_var(env_prefix)
        help_text = _help(opt)
        help_text = f"{help_text} [env {env_name}; default: {_default_text(opt)}]".replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": "__".join(opt.path), "help": help_text, "metavar": opt.name.upper()}
        kind = opt.kind
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            del kwargs["metavar"]
        elif _is_sequence(kind):
            kwargs["type"] = _argparse_type(kind)
            kwargs["metavar"] = "A,B,..."
        else:
            kwargs["type"] = _argparse_type(kind)
            if typing.get_origin(kind) is Literal:
                kwargs["choices"] = list(typing.get_args(kind))
                kwargs["type"] = str
                kwargs["metavar"] = "{" + ",".join(kwargs["choices"]) + "}"
        if env_name in env:
            try:
                kwargs["default"] = _convert(kind, env[env_name])
            except ValueError as exc:
                parser.error(f"environment variable {env_name}: {exc}")
        elif (
            opt.field.default is dataclasses.MISSING
            and opt.field.default_factory is dataclasses.MISSING
            and not opt.optional
        ):
            kwargs["required"] = True
        else:
            kwargs["default"] = argparse.SUPPRESS  # absent -> the dataclass default applies
        parser.add_argument(opt.flag, **kwargs)
    return parser


def _argparse_type(kind: Any):
    def parse(text: str) -> Any:
        try:
            return _convert(kind, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def _build(config_cls: type, values: Mapping[tuple[str, ...], Any], prefix: tuple[str, ...] = ()) -> Any:
    hints = typing.get_type_hints(config_cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(config_cls):
        kind, _ = _strip_optional(hints[f.name])
        path = prefix + (f.name,)
        if dataclasses.is_dataclass(kind) and f.metadata.get("cli") is not False:
            kwargs[f.name] = _build(kind, values, path)
        elif path in values:
            kwargs[f.name] = values[path]
    return config_cls(**kwargs)


def flag_terms(message: str, config_cls: type) -> str:
    """``message`` (a config's validation error, in its field names) with each field named as its flag: the user
    set ``--max-body-bytes``, not ``max_body_bytes``. Only a name where a check names its fields, leading the
    message or a list of them (``a, b and c must be > 0``), and only names with an underscore: a value quoted in
    the message (a path, a host, a served name) may spell a field's name, and a one-word field is its flag's
    word, which may be plain English in the message."""
    flags = {o.name: o.flag for o in _options(config_cls) if "_" in o.name}
    if not flags:
        return message
    names = "|".join(map(re.escape, sorted(flags, key=len, reverse=True)))
    pattern = re.compile(rf"(?:^|(?<=, )|(?<= and )|(?<= or ))({names})(?=[\s,()]|$)")
    return pattern.sub(lambda m: flags[m.group(1)], message)


def config_from_args(
    config_cls: type[T],
    argv: Sequence[str] | None = None,
    *,
    prog: str | None = None,
    description: str | None = None,
    epilog: str | None = None,
    env: Mapping[str, str] | None = None,
    env_prefix: str = ENV_PREFIX,
) -> T:
    """Parse flags (and the environment) into a validated config; a bad value exits 2 with one line."""
    parser = build_parser(config_cls, prog=prog, description=description, epilog=epilog, env=env,
                          env_prefix=env_prefix)
    namespace = vars(parser.parse_args(argv))
    values = {tuple(dest.split("__")): value for dest, value in namespace.items()}
    try:
        return _build(config_cls, values)
    except (ValueError, TypeError) as exc:  # __post_init__ validation
        parser.error(flag_terms(str(exc), config_cls))
        raise  # unreachable: parser.error exits
