"""Structured (JSON lines) logging that never prints a password."""

from __future__ import annotations

import json
import logging
import re
import sys
from typing import Any

import orjson

# key=value (and a URI's query string): a quoted value (backslash escapes) with what follows
# it up to whitespace (libpq quotes with ' only: "x"rest is one value), or up to whitespace.
# Unquoted, libpq reads a backslash-escaped space as part of the value: password=a\ b is "a b"
# (a fuzz); more than one backslash: the same DSN in a repr().
_UNQUOTED = r"(?:\\+.|\S)"
_PASSWORD_KV = re.compile(
    rf"""(password\s*=\s*)('(?:[^'\\]|\\.)*'?{_UNQUOTED}*|"(?:[^"\\]|\\.)*"?{_UNQUOTED}*|{_UNQUOTED}+)""",
    re.IGNORECASE,
)
# URI: the userinfo's password runs to the *last* '@' of the line (an '@', ':', tab or space
# inside a password need not be encoded for libpq to be asked, and stopping at the first one
# would print the rest).
_PASSWORD_URI = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^\s:/?#@]*:)([^\n]*)(@)")
# URI without an '@': libpq reads "postgresql://user:password/db" as host "user", port
# "password" (a fuzz), so a port that is no port hides the rest of the URI. The host list
# ends at '/' or '?' for libpq ('#' is no delimiter to it); an IPv6 host is in brackets.
_URI_HOSTS = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)([^\s/?]*)(\S*)")
_HOST_PORT = re.compile(r"(\[[^\]]*\]|[^:\[\]]*)(?::(.*))?", re.DOTALL)
_SECRET_KEYS = ("password", "passwd", "secret", "sasl_plain_password", "token")
# aiokafka's DEBUG dump of a SaslAuthenticate request or response: a PLAIN login's bytes are
# user NUL user NUL password. The bytes literal (either quote) to its end, else the rest of the line.
_SASL_BYTES = re.compile(r"""(auth_bytes=)(b'(?:[^'\\]|\\.)*'|b"(?:[^"\\]|\\.)*"|[^\n]*)""")


def redact_dsn(text: str) -> str:
    """Hide passwords in libpq key=value DSNs, in URIs (``user:pw@host``), however many, and
    SASL login bytes (aiokafka's request dumps)."""
    # The query string's password first: "host:port/db?password=a@b" read as a userinfo
    # "host:" would end at that '@' and print the rest (a fuzz).
    text = _PASSWORD_KV.sub(r"\1***", text)
    text = _SASL_BYTES.sub(r"\1***", text)
    text = _PASSWORD_URI.sub(r"\1***\3", text)
    return _URI_HOSTS.sub(_hide_bad_port, text)


def _hide_bad_port(m: re.Match[str]) -> str:
    hosts = m[2]
    if "@" in hosts:  # a userinfo: its password is hidden above
        return m[0]
    for host in hosts.split(","):
        parsed = _HOST_PORT.fullmatch(host)
        port = parsed[2] if parsed else "?"
        if port is not None and port != "" and not (len(port) <= 5 and port.isascii() and port.isdigit() and int(port) <= 65535):
            first = _HOST_PORT.match(hosts)
            return f"{m[1]}{first[1] if first else ''}:***"
    return m[0]


def _clean(key: str, value: Any) -> Any:
    if any(s in key.lower() for s in _SECRET_KEYS):
        return "***"
    if isinstance(value, str):
        return redact_dsn(value)
    return value


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, then the record's ``extra`` fields."""

    _STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys()) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact_dsn(record.getMessage()),
        }
        for key, value in vars(record).items():
            if key not in self._STANDARD and not key.startswith("_"):
                out[key] = _clean(key, value)
        if record.exc_info:
            out["exc"] = redact_dsn(self.formatException(record.exc_info))
        try:
            return orjson.dumps(out, default=str).decode()
        except TypeError:  # an int past 64 bits: the line is kept, the number as text
            return json.dumps(out, default=str, ensure_ascii=False)


JsonFormatter.converter = __import__("time").gmtime


def setup_logging(level: str = "info", *, stream: Any = None) -> None:
    """Route the root logger to stderr as JSON lines (idempotent)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiokafka logs every reconnect attempt at ERROR; our own retry loop reports those.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL if level.lower() != "debug" else logging.DEBUG)
    # Its connections dump each request at DEBUG, a SASL login's password too: redacted above,
    # and kept at INFO in case another handler (a library user's) formats the records.
    logging.getLogger("aiokafka.conn").setLevel(logging.INFO if level.lower() == "debug" else logging.NOTSET)
