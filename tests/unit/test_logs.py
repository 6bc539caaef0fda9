"""Passwords never reach a log line or an error message: DSN redaction and DSN parse errors."""

from __future__ import annotations

import io
import logging

import pytest

from producer.config import ProducerConfig
from walbus.config import ConfigError, describe
from walbus.logs import JsonFormatter, redact_dsn


@pytest.mark.parametrize(
    ("text", "secrets"),
    [
        ("postgresql://u:p@ss@h/db", ["p@ss", "ss@"]),  # the reproduction
        ("postgresql://u:pa:ss@h:5432/db", ["pa:ss", "ss@"]),
        ("postgres://u:p%40ss%3Aw@h/db?sslmode=require", ["p%40ss", "ss%3Aw"]),
        ("postgresql://:only@h/db", ["only"]),
        ("a postgresql://u:one@h1/db and postgresql://v:t@w@o@h2/db end", ["one", "t@w", "w@o"]),
        ("host=h password=s3cret dbname=x", ["s3cret"]),
        ("host=h password = 's3 cr\\'et' dbname=x", ["s3", "cr", "et'"]),
        ("host=h PASSWORD='unterminated secret", ["unterminated", "secret"]),
        ("postgresql://h/db?password=s3cret&sslmode=require", ["s3cret"]),
        ("dsn1=host=a password=x1y dsn2=postgresql://u:x2y@b/db", ["x1y", "x2y"]),
    ],
)
def test_every_password_is_redacted(text: str, secrets: list[str]) -> None:
    out = redact_dsn(text)
    for secret in secrets:
        assert secret not in out, out
    assert "***" in out
    assert redact_dsn(out) == out


def test_redaction_keeps_what_is_not_a_password() -> None:
    assert redact_dsn("postgresql://u:p@ss@h/db") == "postgresql://u:***@h/db"
    assert redact_dsn("host=h password=a\\ b dbname=x") == "host=h password=*** dbname=x"
    for uri in ("postgresql://h:5432/db", "postgresql://h1:5432,[::1]:5433,h3/db?sslmode=require", "postgresql:///db"):
        assert redact_dsn(uri) == uri
    # a password of digits only is no port either past 65535
    assert redact_dsn("postgresql://walbus:123456/db") == "postgresql://walbus:***"
    assert redact_dsn("host=h password='a b' dbname=x") == "host=h password=*** dbname=x"
    assert redact_dsn("postgresql://u@h/db and user@example.com") == "postgresql://u@h/db and user@example.com"


def test_log_lines_and_config_dumps_hide_passwords() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("walbus.test.redact")
    log.addHandler(handler)
    try:
        log.error("connect failed: postgresql://u:p@ss@h/db", extra={"dsn": "host=h password='se cret'"})
    finally:
        log.removeHandler(handler)
    line = stream.getvalue()
    assert "p@ss" not in line and "ss@h" not in line and "se cret" not in line and "cret" not in line

    cfg = ProducerConfig(pg_dsn="postgresql://u:p@ss%40w@h/db", kafka_bootstrap="k")
    assert "ss" not in describe(cfg)["pg_dsn"].replace("postgresql", "")


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://u:p%zzsecret@h/db",  # bad percent-encoding: libpq quotes the password
        "postgresql://u:sec ret@h/db",  # libpq quotes "sec ret"
        "host=h password=se cret dbname=x",  # libpq quotes "cret"
        "host=h password='se cret dbname=x",
        "postgresql://u:secret@h/db?secret=1",
    ],
)
def test_dsn_parse_errors_show_no_part_of_the_dsn(dsn: str) -> None:
    with pytest.raises(ConfigError, match="--pg-dsn is not a valid connection string") as caught:
        _ = ProducerConfig(pg_dsn=dsn, kafka_bootstrap="k").database
    message = str(caught.value)
    assert "sec" not in message and "cret" not in message and "zz" not in message


@pytest.mark.parametrize("dsn", ["postgresql://walbus:SECRET/db", "host=h port=SECRET", "postgresql://h1:5432,h2:SECRET/db"])
def test_a_port_that_is_no_number_is_a_config_error_that_does_not_show_it(dsn: str) -> None:
    # user:password without '@host': libpq reads the password as the port, its errors print it
    from walbus.config import parse_dsn

    with pytest.raises(ConfigError, match="port that is not a number") as caught:
        parse_dsn(dsn, "--pg-dsn")
    assert "SECRET" not in str(caught.value)
    assert parse_dsn("postgresql://h1:5432,h2/db", "--pg-dsn")["port"] == "5432,"


def test_an_unencoded_at_in_a_uri_password_is_a_config_error() -> None:
    from walbus.config import parse_dsn

    cfg = ProducerConfig(pg_dsn="postgresql://u:p@ss@h/db", kafka_bootstrap="k")
    with pytest.raises(ConfigError, match="%40") as caught:
        _ = cfg.database
    assert "ss" not in str(caught.value).replace("password", "")
    assert parse_dsn("postgresql://u:p%40ss@h/db", "--pg-dsn")["password"] == "p@ss"
    assert ProducerConfig(pg_dsn="postgresql://u:pa:ss@h/shop", kafka_bootstrap="k").database == "shop"


@pytest.mark.parametrize("text", [
    "postgresql://127.0.0.1:1/db?user=u&password=a@SECRET",  # host:port read as user:, the query's '@'
    "host=h password=\"x\"SECRET dbname=d",  # libpq quotes with ' only
    "postgresql://u:pa\tSECRET@h/db",  # a tab in the password
    # libpq reads an unquoted password's backslash-escaped spaces as its own: "a SECRET x"
    "host=h password=a\\ SECRET\\ x dbname=d",
    repr("host=h password=a\\ SECRET dbname=d"),  # the same in a repr()
    "host=h password='a'\\ SECRET",
    # user:password with no '@host': libpq takes the password for the port
    "postgresql://walbus:Hunter2SECRET/fd_1",
    "postgresql://walbus:Hunter2SECRET",
    "cannot connect to PostgreSQL at postgresql://walbus:pw#SECRET/db: failed",
    "postgresql://h1:5432,walbus:SECRET/db",
    "postgresql://[::1]:SECRET/db",
    "postgresql://walbus:123456/db".replace("123456", "SECRET"),
])
def test_passwords_the_redaction_missed(text: str) -> None:
    # A configuration fuzz found each printed, in the producer's start line and its connection errors.
    assert "SECRET" not in redact_dsn(text)


def test_argument_errors_never_echo_a_value(capsys: pytest.CaptureFixture[str]) -> None:
    # "unrecognized arguments: --pg-dns postgresql://u:PW@…" printed a mistyped flag's value.
    from walbus.app.tail import TailConfig
    from walbus.config import load_config

    with pytest.raises(SystemExit):
        load_config(TailConfig, ["--topic", "t", "--kafka-bootstrap", "k:1", "--pg-dns", "postgresql://u:SECRET@h/db",
                                 "--kafka-sasl-pasword=SECRET2", "SECRET3"], prog="walbus tail", env={})
    err = capsys.readouterr().err
    # only what is close to one of the command's flags (tail has no --pg-dsn): a re-fuzz found
    # values that start with '--' or hold spaces listed as flags
    assert "unrecognized arguments: --kafka-sasl-pasword (did you mean --kafka-sasl-password?) and 3 other" in err, err
    assert "SECRET" not in err


def test_debug_logs_never_show_a_sasl_login() -> None:
    # `--log-level debug` printed aiokafka's dump of a SASL PLAIN login: user NUL user NUL password.
    from walbus.logs import setup_logging

    stream = io.StringIO()
    root, log = logging.getLogger(), logging.getLogger("aiokafka.conn")
    saved = root.handlers[:], root.level, logging.getLogger("aiokafka").level, log.level
    try:
        setup_logging("debug", stream=stream)
        assert not log.isEnabledFor(logging.DEBUG)  # its request dumps stay off under debug
        for login in (b"u\x00u\x00Top'Secret)1", b'u\x00u\x00Top"Secret\'1'):
            # what aiokafka.conn logs, formatted as any log line is (the level aside)
            log.info("%s Request 2: %s", "<conn>", f"SaslAuthenticateRequest_v1(sasl_auth_bytes={login!r})")
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        logging.getLogger("aiokafka").setLevel(saved[2])
        log.setLevel(saved[3])
    out = stream.getvalue()
    assert out.count("sasl_auth_bytes=***") == 2 and "Secret" not in out, out
