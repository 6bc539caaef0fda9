"""One config object per service, from flags, ``WALBUS_*`` env vars and a TOML file.

A service declares a keyword-only dataclass whose fields carry :func:`option`
metadata. :func:`load_config` builds the argparse parser from it and merges the
three sources, flags beating env vars beating the file::

    --pg-dsn  ==  WALBUS_PG_DSN  ==  pg-dsn (or pg_dsn) in the --config TOML file

Every option also has a per-command env var, ``WALBUS_<COMMAND>_<OPTION>``
(``WALBUS_DEMUX_GROUP_ID``), which beats the shared one. An option whose meaning differs
between commands (a consumer group, a metrics port, a state directory) is declared with
``env="command"`` (only the per-command name is read) or ``env="legacy"`` (the shared name
still works, with a deprecation log line): one shell env can then serve every command.

Lists are comma-separated in flags and env vars (or the flag repeated), arrays in TOML;
``key=value`` lists split only at a comma that starts a new ``key=``, so values may hold commas.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import re
import tomllib
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, NoReturn, TypeVar

ENV_PREFIX = "WALBUS_"
ENV_SCOPES = ("shared", "command", "legacy")
# In a key=value list, a comma starts a new item only when a key and '=' follow it.
_KV_SPLIT = re.compile(r",(?=\s*[A-Za-z_][\w.\-]*=)")

log = logging.getLogger("walbus.config")

T = TypeVar("T")


PORT_MAX: Final = 65535
INT32_MAX: Final = 2**31 - 1  # Kafka's int settings (timeouts in ms, partitions)
INT64_MAX: Final = 2**63 - 1  # any other count


# The tables of a config file the commands read, and every option name any command takes:
# set by the application layer (walbus.app.commands: the core imports no service), to judge
# a top-level key this command does not take (one no command takes is a typo). Unset (a
# service started without the CLI), such keys are not judged.
_catalog: tuple[frozenset[str], Callable[[], set[str]]] | None = None


def set_command_catalog(tables: Iterable[str], option_names: Callable[[], set[str]]) -> None:
    """Tell :func:`load_config` the commands' tables and (lazily) their option names."""
    global _catalog
    _catalog = (frozenset(tables), option_names)


class ConfigError(Exception):
    """A configuration problem the user must fix; the message says what."""


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    choices: Sequence[str] | None = None,
    secret: bool = False,
    short: str | None = None,
    env: str = "shared",
    key_values: bool = False,
    minimum: float | None = None,
    maximum: float | None = None,
    topic: bool = False,
) -> Any:
    """Declare a config field. Fields without a default are required.

    ``env``: shared (``WALBUS_<OPTION>`` is read by every command), command (only
    ``WALBUS_<COMMAND>_<OPTION>``) or legacy (the shared name still read, deprecated).
    ``key_values``: a list of key=value items whose values may hold commas.
    ``minimum``, ``maximum``: the range a number must be in (a ConfigError outside it).
    ``topic``: a Kafka topic name (or a list of them, or a topic prefix): one Kafka could never
    create is a ConfigError (a consumer of it waits forever for it to exist)."""
    if env not in ENV_SCOPES:
        raise ValueError(f"env must be one of {ENV_SCOPES}")
    meta = {
        "help": help, "choices": tuple(choices) if choices else None, "secret": secret, "short": short,
        "env": env, "key_values": key_values, "minimum": minimum,
        "maximum": maximum, "topic": topic,
    }
    if isinstance(default, list):
        items = list(default)
        return dataclasses.field(default_factory=lambda: list(items), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str, command: str | None = None) -> str:
    """``WALBUS_<OPTION>``, or with ``command`` the per-command ``WALBUS_<COMMAND>_<OPTION>``."""
    middle = command.upper().replace("-", "_") + "_" if command else ""
    return ENV_PREFIX + middle + field_name.upper()


def split_list(text: str, *, key_values: bool = False) -> list[str]:
    """A flag's or env var's list: comma-separated, blanks dropped. A comma inside double
    quotes is part of the entry (a table named ``"a,b"``: ``public."a,b"``)."""
    pieces = _KV_SPLIT.split(text) if key_values else split_unquoted(text, ",")
    return [p.strip() for p in pieces if p.strip()]


def split_unquoted(text: str, sep: str) -> list[str]:
    """``text`` split at each ``sep`` outside double quotes."""
    parts: list[str] = []
    start = 0
    quoted = False
    for i, ch in enumerate(text):
        if ch == '"':
            quoted = not quoted  # a doubled quote toggles twice
        elif ch == sep and not quoted:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(underlying type, optional?) of a field annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _convert(name: str, tp: Any, raw: Any, source: str, *, key_values: bool = False, secret: bool = False) -> Any:
    base, optional = _base_type(tp)
    if raw is None:
        if optional:
            return None
        raise ConfigError(f"{name}: a value is required ({source})")
    try:
        if typing.get_origin(base) is list:
            if isinstance(raw, str):
                return split_list(raw, key_values=key_values)
            # Text items only: str() made [["public.t"]] the pattern "['public.t']" without a word.
            if isinstance(raw, list) and all(isinstance(p, str) for p in raw):
                return list(raw)
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
            # A TOML 1.9 (or true) is no count: int() would make it 1 without a word (a fuzz).
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise TypeError
            return int(raw)
        if base is float:
            if isinstance(raw, bool):
                raise TypeError
            return float(raw)
        if base is Path:
            return Path(str(raw))
        if base is str:
            if isinstance(raw, bool) or not isinstance(raw, str | int | float):
                raise TypeError
            return str(raw)
    except (TypeError, ValueError):
        from walbus.logs import redact_dsn

        # A secret's value is never echoed, whatever its type (a TOML list holding a password).
        given = f"a {type(raw).__name__}" if secret else redact_dsn(repr(raw))
        kind = "list of str" if typing.get_origin(base) is list else getattr(base, "__name__", base)
        raise ConfigError(f"{name}: {given} is not a valid {kind} ({source})") from None
    raise ConfigError(f"{name}: unsupported option type {tp!r}")


class _QuietParser(argparse.ArgumentParser):
    """argparse, but its errors never echo an option's value: "unrecognized arguments: --pg-dns
    postgresql://u:PW@…" printed the password of a mistyped flag (a fuzz)."""

    def error(self, message: str) -> NoReturn:
        from walbus.logs import redact_dsn

        head, sep, rest = message.partition("unrecognized arguments: ")
        if sep:
            # Only what looks like a mistyped flag (close to one of ours): a value after it may
            # start with '-' or '--' (-Xs3cret, --hunter2) and hold spaces.
            known = [o for action in self._actions for o in action.option_strings]
            flags, others = [], 0
            for token in rest.split():
                name = token.split("=", 1)[0]
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.8) if name.startswith("--") else []
                if close:
                    flags.append(f"{name} (did you mean {close[0]}?)")
                else:
                    others += 1
            if flags:
                message = head + sep + ", ".join(flags) + (f" and {others} other argument(s)" if others else "")
            else:
                message = head + f"{others} argument(s) this command does not take (values not shown; see --help)"
        # "ambiguous option: --kafka-sasl=PW could match …" echoes the value after '=' (spaces too).
        message = re.sub(r"(--[A-Za-z0-9][-A-Za-z0-9_]*)=.*?( could match|$)", r"\1=…\2", message)
        super().error(redact_dsn(message))


def build_parser(
    cls: type[Any], prog: str, description: str | None = None, command: str | None = None
) -> argparse.ArgumentParser:
    parser = _QuietParser(
        prog=prog,
        description=description,
        argument_default=argparse.SUPPRESS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"Each option may also be set as {env_name('<option>', command)} in the environment." if command else None,
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file with option keys (env: WALBUS_CONFIG)")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        names = [flag_name(f.name)]
        if meta.get("short"):
            names.insert(0, meta["short"])
        base, _ = _base_type(hints[f.name])
        text = _help_text(f, command).replace("%", "%%")
        if base is bool:
            parser.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, help=text)
        elif typing.get_origin(base) is list:
            # Repeated flags add up (a plain store keeps only the last one).
            parser.add_argument(*names, dest=f.name, action="append", metavar=f.name.upper(), help=text)
        else:
            parser.add_argument(*names, dest=f.name, metavar=f.name.upper(), choices=meta.get("choices"), help=text)
    return parser


def _help_text(f: dataclasses.Field[Any], command: str | None) -> str:
    """The option's help with its choices, default and env var(s)."""
    meta = f.metadata
    parts = [meta["help"]]
    if meta.get("choices"):
        parts.append(f"choices: {', '.join(meta['choices'])}")
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if default is dataclasses.MISSING:
        parts.append("required")
    elif not meta.get("secret") and default not in (None, [], ""):
        shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
        if isinstance(default, bool):
            shown = "on" if default else "off"
        parts.append(f"default: {shown}")
    scope = meta.get("env", "shared") if command else "shared"
    if scope == "shared":
        parts.append(f"env: {env_name(f.name)}")
    else:
        parts.append(f"env: {env_name(f.name, command)}")
        if scope == "legacy":
            parts.append(f"{env_name(f.name)} deprecated")
    return f"{parts[0]} ({'; '.join(parts[1:])})"


def load_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text (TOML is)") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None


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
    top-level keys apply to every service. It also names the per-command env vars
    (``WALBUS_<SECTION>_<OPTION>``).
    """
    env = os.environ if env is None else env
    parser = build_parser(cls, prog, description, section)
    ns = vars(parser.parse_args(argv))
    config_path = ns.pop("config", None) or env.get(ENV_PREFIX + "CONFIG")
    file_values: dict[str, Any] = {}
    if config_path:
        doc = load_toml(Path(config_path))
        scopes = {f.name: f.metadata.get("env", "shared") for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        strangers: list[str] = []  # top-level keys and tables this command does not take
        for key, value in doc.items():
            name = key.replace("-", "_")
            if isinstance(value, dict):
                if _catalog is not None and key not in _catalog[0]:
                    strangers.append(f"[{key}]")
                continue
            if name not in scopes:
                strangers.append(key)
                continue
            if scopes.get(name) == "command":
                # As its shared env var: its meaning differs between commands (tail's group_id
                # is no demux's), so only the command's own [section] sets it (a fuzz).
                log.warning(f"{key} at the top of {config_path} is ignored by this command: set it under [{section}]",
                            extra={"ignored_key": key})
                continue
            file_values[name] = value
        if strangers and _catalog is not None:
            _warn_of_typos(strangers, config_path, *_catalog)
        if section and isinstance(doc.get(section), dict):
            # Several commands may share a section ([warehouse]: load, stream, sql), so a key
            # another one takes is no error here; but a typo must not pass without a word.
            unknown = sorted(k for k in doc[section] if k.replace("-", "_") not in scopes)
            if unknown:
                log.warning(f"{config_path}: [{section}] keys this command does not take: {', '.join(unknown)}",
                            extra={"ignored_keys": unknown})
            file_values.update({k.replace("-", "_"): v for k, v in doc[section].items()})
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        name, tp, kv = f.name, hints[f.name], bool(f.metadata.get("key_values"))
        env_key = _env_key(f, env, section)
        secret = bool(f.metadata.get("secret")) or name.endswith("dsn")
        if name in ns:
            raw = ns[name]
            if isinstance(raw, list):  # repeated list flags
                raw = [item for text in raw for item in split_list(text, key_values=kv)]
            values[name] = _convert(flag_name(name), tp, raw, "flag", key_values=kv, secret=secret)
        elif env_key is not None:
            values[name] = _convert(flag_name(name), tp, env[env_key], f"env {env_key}", key_values=kv, secret=secret)
        elif name in file_values:
            values[name] = _convert(flag_name(name), tp, file_values[name], f"file {config_path}", key_values=kv, secret=secret)
    missing = [
        f.name
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        hints_text = ", ".join(f"{flag_name(m)} / {env_name(m)}" for m in missing)
        raise ConfigError(f"missing required option(s): {hints_text}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for name, v in values.items():
        if isinstance(v, str) and not v.strip():
            # Never the default in disguise: a blank TOML key or env var (--warehouse "" loaded
            # into the working directory, demux --group-id "" took the default group; a re-fuzz).
            raise ConfigError(f"{flag_name(name)} is empty: leave it out for the default")
        choices = fields[name].metadata.get("choices")
        if choices and v not in choices:
            raise ConfigError(f"{flag_name(name)}: {v!r} is not one of {', '.join(choices)}")
        _check_number(name, v, fields[name].metadata.get("minimum"), fields[name].metadata.get("maximum"))
        if fields[name].metadata.get("topic"):
            _check_topics(name, v)
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None


def _warn_of_typos(
    strangers: list[str], config_path: str, commands: frozenset[str], option_names: Callable[[], set[str]],
) -> None:
    """Top-level keys no command takes and tables no command reads: typos (`kafka-boostrap`
    was ignored without a word, and so the default used). Another command's key is no typo."""
    tables = [f"[{t}]" for t in sorted(commands)]
    options = {n.replace("_", "-") for n in option_names()}
    typos: dict[str, str] = {}  # key -> how it is named in the warning
    for key in strangers:
        if key.startswith("["):
            close = difflib.get_close_matches(key, tables, n=1, cutoff=0.6)
        elif key.replace("_", "-") in options:
            continue
        else:
            close = difflib.get_close_matches(key.replace("_", "-"), sorted(options), n=1, cutoff=0.8)
        typos[key] = f"{key} (did you mean {close[0]}?)" if close else key
    if typos:
        log.warning(f"{config_path}: no walbus command takes {', '.join(typos.values())}: ignored",
                    extra={"ignored_keys": list(typos)})


def _check_number(name: str, value: Any, minimum: float | None, maximum: float | None) -> None:
    """A number option's value: never NaN (it compares false with everything: a limit that
    never holds), within its range (a 0 that stalled a service, a port past 65535)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if value != value:
        raise ConfigError(f"{flag_name(name)}: NaN is not a number of anything")
    if isinstance(value, int) and not -INT64_MAX <= value <= INT64_MAX:
        # Past what any client or log line takes (orjson refuses it: the start-up line was lost).
        raise ConfigError(f"{flag_name(name)}: {value} is out of range")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        low = "" if minimum is None else f"at least {minimum:g}"
        high = "" if maximum is None else f"at most {maximum:g}"
        raise ConfigError(f"{flag_name(name)}: {value!r} is out of range (it must be {' and '.join(x for x in (low, high) if x)})")


def _check_topics(name: str, value: Any) -> None:
    """A topic option's name(s): ones Kafka accepts (contract.topic_name_error, the one check)."""
    from walbus.contract import topic_name_error

    for item in value if isinstance(value, list) else [value]:
        problem = None if item is None else topic_name_error(item)
        if problem is not None:
            raise ConfigError(f"{flag_name(name)} {problem}")


def _env_key(f: dataclasses.Field[Any], env: Mapping[str, str], command: str | None) -> str | None:
    """The env var that sets this option, if any: the per-command one first."""
    shared = env_name(f.name)
    if command:
        own = env_name(f.name, command)
        if own in env:
            return own
        scope = f.metadata.get("env", "shared")
        if scope == "command":
            if shared in env:
                log.warning(
                    f"{shared} is ignored by `walbus {command}`: its meaning differs between commands; set {own}",
                    extra={"ignored_env": shared, "use_env": own},
                )
            return None
        if scope == "legacy" and shared in env:
            log.warning(
                f"{shared} is deprecated for `walbus {command}`: set {own} (the shared name means something "
                "else to other commands)",
                extra={"deprecated_env": shared, "use_env": own},
            )
    return shared if shared in env else None


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
    # "postgresql://user:password/db" (no '@host') is read as host "user", port "password":
    # libpq's error would name that port (a fuzz). A port is a number (one per host, or empty).
    if any(p and not (p.isascii() and p.isdigit()) for p in str(params.get("port") or "").split(",")):
        raise ConfigError(f"{flag}: a port that is not a number (a URI's password goes in user:password@host)")
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
