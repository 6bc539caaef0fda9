"""One config object per service, from flags, ``WALBUS_*`` env vars and a TOML file.

A service declares a keyword-only dataclass whose fields carry :func:`option`
metadata. :func:`load_config` builds the argparse parser from it and merges the
three sources, flags beating env vars beating the file::

    --pg-dsn  ==  WALBUS_PG_DSN  ==  pg-dsn (or pg_dsn) in the --config TOML file

Lists are comma-separated in flags and env vars, arrays in TOML.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

ENV_PREFIX = "WALBUS_"

T = TypeVar("T")


class ConfigError(Exception):
    """A configuration problem the user must fix; the message says what."""


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    choices: Sequence[str] | None = None,
    secret: bool = False,
    short: str | None = None,
) -> Any:
    """Declare a config field. Fields without a default are required."""
    meta = {"help": help, "choices": tuple(choices) if choices else None, "secret": secret, "short": short}
    if isinstance(default, list):
        items = list(default)
        return dataclasses.field(default_factory=lambda: list(items), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(underlying type, optional?) of a field annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _convert(name: str, tp: Any, raw: Any, source: str) -> Any:
    base, optional = _base_type(tp)
    if raw is None:
        if optional:
            return None
        raise ConfigError(f"{name}: a value is required ({source})")
    try:
        if typing.get_origin(base) is list:
            if isinstance(raw, str):
                return [p.strip() for p in raw.split(",") if p.strip()]
            if isinstance(raw, list):
                return [str(p) for p in raw]
            raise TypeError
        if base is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if base is int:
            if isinstance(raw, bool):
                raise TypeError
            return int(raw)
        if base is float:
            return float(raw)
        if base is Path:
            return Path(str(raw))
        if base is str:
            if not isinstance(raw, str | int | float):
                raise TypeError
            return str(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: {raw!r} is not a valid {getattr(base, '__name__', base)} ({source})") from None
    raise ConfigError(f"{name}: unsupported option type {tp!r}")


def build_parser(cls: type[Any], prog: str, description: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        argument_default=argparse.SUPPRESS,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file with option keys (env: WALBUS_CONFIG)")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        names = [flag_name(f.name)]
        if meta.get("short"):
            names.insert(0, meta["short"])
        base, _ = _base_type(hints[f.name])
        extra = f" (env: {env_name(f.name)})"
        if base is bool:
            parser.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, help=meta["help"] + extra)
        else:
            parser.add_argument(*names, dest=f.name, metavar=f.name.upper(), choices=meta.get("choices"), help=meta["help"] + extra)
    return parser


def load_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def load_config(
    cls: type[T],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str | None = None,
    env: Mapping[str, str] | None = None,
    section: str | None = None,
) -> T:
    """Parse ``argv`` (flags), env vars and the TOML file into ``cls``.

    ``section``: a TOML table whose keys apply to this service only (``[produce]``);
    top-level keys apply to every service.
    """
    env = os.environ if env is None else env
    parser = build_parser(cls, prog, description)
    ns = vars(parser.parse_args(argv))
    config_path = ns.pop("config", None) or env.get(ENV_PREFIX + "CONFIG")
    file_values: dict[str, Any] = {}
    if config_path:
        doc = load_toml(Path(config_path))
        flat = {k: v for k, v in doc.items() if not isinstance(v, dict)}
        if section and isinstance(doc.get(section), dict):
            flat.update(doc[section])
        file_values = {k.replace("-", "_"): v for k, v in flat.items()}
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for name in known:
        tp = hints[name]
        if name in ns:
            values[name] = _convert(flag_name(name), tp, ns[name], "flag")
        elif env_name(name) in env:
            values[name] = _convert(flag_name(name), tp, env[env_name(name)], f"env {env_name(name)}")
        elif name in file_values:
            values[name] = _convert(flag_name(name), tp, file_values[name], f"file {config_path}")
    missing = [
        f.name
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        hints_text = ", ".join(f"{flag_name(m)} / {env_name(m)}" for m in missing)
        raise ConfigError(f"missing required option(s): {hints_text}")
    for name, v in values.items():
        choices = next(f.metadata.get("choices") for f in dataclasses.fields(cls) if f.name == name)  # type: ignore[arg-type]
        if choices and v not in choices:
            raise ConfigError(f"{flag_name(name)}: {v!r} is not one of {', '.join(choices)}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None


# libpq quotes pieces of the connection string in its parse errors, and a piece may be
# (part of) the password: such errors are shown without any quoted piece.
_QUOTED = re.compile(r'"[^"]*"')


def parse_dsn(dsn: str, flag: str) -> dict[str, Any]:
    """libpq's parameters of a connection string; a :class:`ConfigError` that shows no part of it."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        params: dict[str, Any] = conninfo_to_dict(dsn)
    except Exception as e:
        reason = _QUOTED.sub('"…"', str(e).strip()) or type(e).__name__
        raise ConfigError(f"{flag} is not a valid connection string: {reason}") from None
    # libpq ends a URI's password at its first '@' and takes the rest for the host, which
    # then shows up in every connection error.
    if "@" in str(params.get("host", "")):
        raise ConfigError(f"{flag}: an '@' in a URI's user name or password must be written %40")
    return params


def describe(config: Any) -> dict[str, Any]:
    """The config as a dict for logging: secrets and DSN passwords hidden."""
    from walbus.logs import redact_dsn

    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        if f.metadata.get("secret") and v:
            v = "***"
        elif isinstance(v, str) and "dsn" in f.name:
            v = redact_dsn(v)
        elif isinstance(v, Path):
            v = str(v)
        out[f.name] = v
    return out
