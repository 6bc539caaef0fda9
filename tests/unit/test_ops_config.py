"""Per-command env vars, repeated list flags and self-explaining --help (no services)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from demux.config import DemuxConfig
from producer.config import ProducerConfig
from walbus.app.tail import TailConfig
from walbus.config import load_config, split_list
from warehouse.cli import LoadConfig

DEMUX_ARGS = ["--source-topic", "walbus.shop", "--kafka-bootstrap", "k:9092"]


def demux(env: dict[str, str]) -> DemuxConfig:
    return load_config(DemuxConfig, DEMUX_ARGS, prog="walbus demux", env=env, section="demux")


def tail(env: dict[str, str]) -> TailConfig:
    return load_config(TailConfig, ["--topic", "walbus.shop", "--kafka-bootstrap", "k"], prog="walbus tail", env=env, section="tail")


def test_tail_does_not_take_the_demux_group_from_a_shared_env(caplog: pytest.LogCaptureFixture) -> None:
    # One shell env for both: tail must not read (and commit) as the demux' group.
    env = {"WALBUS_GROUP_ID": "walbus-demux.walbus.shop"}
    with caplog.at_level(logging.WARNING, "walbus.config"):
        assert tail(env).group_id is None
    assert "WALBUS_TAIL_GROUP_ID" in caplog.text
    assert tail({**env, "WALBUS_TAIL_GROUP_ID": "debugging"}).group_id == "debugging"


def test_the_demux_group_has_its_own_env_var_and_the_old_one_is_deprecated(caplog: pytest.LogCaptureFixture) -> None:
    assert demux({"WALBUS_DEMUX_GROUP_ID": "g1", "WALBUS_GROUP_ID": "other"}).group_id == "g1"
    with caplog.at_level(logging.WARNING, "walbus.config"):
        assert demux({"WALBUS_GROUP_ID": "g2"}).group_id == "g2"
    assert "deprecated" in caplog.text and "WALBUS_DEMUX_GROUP_ID" in caplog.text


def test_state_dir_and_metrics_port_are_per_command() -> None:
    env = {"WALBUS_DEMUX_STATE_DIR": "/var/lib/walbus", "WALBUS_DEMUX_METRICS_PORT": "9188",
           "WALBUS_PRODUCE_METRICS_PORT": "9187", "WALBUS_PG_DSN": "dbname=shop", "WALBUS_KAFKA_BOOTSTRAP": "k"}
    cfg = demux(env)
    assert (cfg.state_dir, cfg.metrics_port) == ("/var/lib/walbus", 9188)
    produce = load_config(ProducerConfig, [], prog="walbus produce", env=env, section="produce")
    assert produce.metrics_port == 9187


def test_flags_beat_the_per_command_env_which_beats_the_shared_one() -> None:
    env = {"WALBUS_TOPIC_PREFIX": "shared", "WALBUS_DEMUX_TOPIC_PREFIX": "own"}
    assert demux(env).topic_prefix == "own"
    cfg = load_config(DemuxConfig, [*DEMUX_ARGS, "--topic-prefix", "flag"], prog="d", env=env, section="demux")
    assert cfg.topic_prefix == "flag"


def spark_conf(argv: list[str], env: dict[str, str] | None = None) -> list[str]:
    base = ["--topic", "walbus.shop", "--warehouse", "/tmp/wh", "--kafka-bootstrap", "k"]
    cfg = load_config(LoadConfig, [*base, *argv], prog="w", env=env or {}, section="warehouse")
    return cfg.spark_conf


def test_repeated_spark_conf_keeps_every_value() -> None:
    assert spark_conf(["--spark-conf", "a.b=1", "--spark-conf", "c.d=2"]) == ["a.b=1", "c.d=2"]


def test_spark_conf_values_may_hold_commas() -> None:
    packages = "spark.jars.packages=io.delta:delta-spark_2.13:4.0.0,org.x:y:1.0"
    assert spark_conf(["--spark-conf", packages, "--spark-conf", "e=f"]) == [packages, "e=f"]
    assert spark_conf([], {"WALBUS_SPARK_CONF": f"{packages},spark.x=1"}) == [packages, "spark.x=1"]
    settings = load_config(
        LoadConfig, ["--topic", "t", "--warehouse", "w", "--kafka-bootstrap", "k", "--spark-conf", packages],
        prog="w", env={},
    ).spark_settings()
    assert settings["spark.jars.packages"] == "io.delta:delta-spark_2.13:4.0.0,org.x:y:1.0"


def test_plain_lists_still_split_at_commas() -> None:
    assert split_list("a, b,,c") == ["a", "b", "c"]
    assert split_list("k=1,2,j=3", key_values=True) == ["k=1,2", "j=3"]


def test_help_shows_defaults_choices_and_env_vars(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_config(DemuxConfig, ["--help"], prog="walbus demux", env={}, section="demux")
    text = " ".join(capsys.readouterr().out.split())
    assert "default: 20000" in text  # --txn-max-records
    assert "choices: debug, info, warning, error" in text
    assert "env: WALBUS_DEMUX_GROUP_ID; WALBUS_GROUP_ID deprecated" in text
    assert "default: walbus-demux-state" in text


def test_every_duration_states_its_unit() -> None:
    """Durations are milliseconds when the option ends in _ms (Kafka's own names), else seconds,
    and then the help says so."""
    import dataclasses

    from walbus.app.status import StatusConfig
    from warehouse.cli import SqlConfig

    for cls in (ProducerConfig, DemuxConfig, TailConfig, StatusConfig, LoadConfig, SqlConfig):
        for f in dataclasses.fields(cls):
            if f.name.endswith("_ms"):
                continue
            if any(word in f.name for word in ("interval", "delay", "timeout", "duration", "_seconds")):
                assert "seconds" in f.metadata["help"], f"{cls.__name__}.{f.name}: unit not stated"


def test_dev_and_demo_help_show_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from walbus.app.demo import main as demo
    from walbus.app.dev.cli import main as dev

    for entry, argv in ((demo, ["--help"]), (dev, ["up", "--help"])):
        with pytest.raises(SystemExit):
            entry(argv)
    text = " ".join(capsys.readouterr().out.split())
    assert "default: 30" in text  # demo --rows
    assert "default: 4.4.0" in text or "default 4.4.0" in text  # dev up --kafka-version


def test_version_and_the_status_command_are_listed(capsys: pytest.CaptureFixture[str]) -> None:
    from walbus import __version__
    from walbus.app.cli import main as walbus

    assert walbus(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"walbus {__version__}"
    assert walbus(["--help"]) == 0
    assert "status" in capsys.readouterr().out


@pytest.mark.parametrize(("cls", "argv", "message"), [
    # --max-in-flight 0 was taken: nothing ever reached Kafka and SIGTERM was not answered (a fuzz)
    (ProducerConfig, ["--max-in-flight", "0"], "--max-in-flight: 0 is out of range (it must be at least 1 and at most 1000)"),
    (ProducerConfig, ["--metrics-port", "70000"], "--metrics-port: 70000 is out of range"),
    (ProducerConfig, ["--heartbeat-interval", "nan"], "--heartbeat-interval: NaN is not a number"),
    (ProducerConfig, ["--snapshot-workers", "-1"], "--snapshot-workers: -1 is out of range"),
    (ProducerConfig, ["--retry-max-delay", "0"], "--retry-max-delay: 0.0 is out of range"),
    (DemuxConfig, ["--segment-ms", "0"], "--segment-ms: 0 is out of range"),
    (LoadConfig, ["--numeric-scale", "39"], "--numeric-scale: 39 is out of range (it must be at least 0 and at most 38)"),
])
def test_numbers_out_of_range_are_configuration_errors(cls: type, argv: list[str], message: str) -> None:
    from walbus.config import ConfigError

    required = ["--kafka-bootstrap", "k:9092", *{ProducerConfig: ["--pg-dsn", "dbname=x"], DemuxConfig: ["--source-topic", "walbus.x"],
                                                 LoadConfig: ["--topic", "walbus.x", "--warehouse", "/tmp/wh"]}[cls]]
    with pytest.raises(ConfigError) as err:
        load_config(cls, [*required, *argv], prog="walbus test", env={})
    assert message in str(err.value)


def test_settings_no_client_can_use_are_configuration_errors(tmp_path: Any) -> None:
    # Each ended in "fatal: <Python exception>", exit 1, with a traceback (a configuration fuzz).
    import socket

    from walbus.config import ConfigError, load_toml
    from walbus.kafka import KafkaOptions
    from walbus.metrics import new_registry, serve_metrics

    def kwargs(**options: Any) -> None:
        KafkaOptions(**{"kafka_bootstrap": "127.0.0.1:9092", **options}).kafka_client_kwargs()

    for bootstrap in ("::::", "127.0.0.1:99999", "", "host:x", "a:1,"):
        with pytest.raises(ConfigError, match="--kafka-bootstrap"):
            kwargs(kafka_bootstrap=bootstrap)
    kwargs(kafka_bootstrap="a:1,[::1]:9092,b")
    with pytest.raises(ConfigError, match=r"--kafka-ssl-cafile /nonexistent/ca\.pem: No such file"):
        kwargs(kafka_security_protocol="SSL", kafka_ssl_cafile="/nonexistent/ca.pem")
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(ConfigError, match="--kafka-ssl-cafile"):
        kwargs(kafka_security_protocol="SSL", kafka_ssl_cafile=str(not_pem))
    with pytest.raises(ConfigError, match="--kafka-ssl-certfile"):
        kwargs(kafka_security_protocol="SSL", kafka_ssl_certfile=str(not_pem))
    with pytest.raises(ConfigError, match="cannot be read: Is a directory"):
        load_toml(tmp_path)
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'a = "\xff"\n')
    with pytest.raises(ConfigError, match="is not UTF-8"):
        load_toml(latin)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match="Address already in use"):
            serve_metrics(taken.getsockname()[1], new_registry())
    with pytest.raises(SystemExit):  # argparse's choices: exit 2 with the choices listed
        load_config(ProducerConfig, ["--pg-dsn", "dbname=x", "--kafka-bootstrap", "k:1", "--log-level", "verbose"],
                    prog="walbus produce", env={})


def test_a_command_scoped_option_is_not_taken_from_the_top_of_a_config_file(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # README: top-level keys apply to every service; but tail ignores the shared
    # WALBUS_GROUP_ID because it would commit the demux's offsets, and took a top-level
    # group_id all the same (a configuration fuzz).
    path = tmp_path / "walbus.toml"
    path.write_text('group_id = "walbus-demux.walbus.shop"\nkafka_bootstrap = "k:1"\n[tail]\nmax_events = 3\nmax_event = 4\n')
    with caplog.at_level(logging.WARNING):
        cfg = load_config(TailConfig, ["--topic", "walbus.shop", "--config", str(path)], prog="walbus tail", env={}, section="tail")
    assert cfg.group_id is None and cfg.max_events == 3 and cfg.kafka_bootstrap == "k:1"
    assert "group_id at the top of" in caplog.text and "keys this command does not take: max_event" in caplog.text


def test_a_config_file_value_of_the_wrong_type_is_refused_not_coerced(tmp_path: Any) -> None:
    # TOML's 1.9 became 1 partition and `true` a heartbeat of 1.0 s, without a word (a fuzz).
    from walbus.config import ConfigError

    path = tmp_path / "walbus.toml"
    required = ["--pg-dsn", "dbname=x", "--kafka-bootstrap", "k:1", "--config", str(path)]
    for line, message in (("partitions = 1.9", "--partitions: 1.9 is not a valid int"),
                          ("partitions = true", "--partitions: True is not a valid int"),
                          ("heartbeat_interval = true", "--heartbeat-interval: True is not a valid float"),
                          ("topic = false", "--topic: False is not a valid str")):
        path.write_text(line + "\n")
        with pytest.raises(ConfigError, match=message):
            load_config(ProducerConfig, required, prog="walbus produce", env={}, section="produce")
    # A list's items were made text whatever they were: [["public.t"]] the pattern "['public.t']"
    # (an fnmatch class: it matched tables named p, u, b…), [1] the table pattern "1" (a fuzz).
    for line in ('tables = [["public.t"]]', 'tables = ["public.a", 1]', "mask_columns = [true]",
                 'exclude_tables = [{ a = "b" }]'):
        path.write_text(line + "\n")
        with pytest.raises(ConfigError, match=r"is not a valid list of str"):
            load_config(ProducerConfig, required, prog="walbus produce", env={}, section="produce")
    path.write_text("partitions = 3.0\nheartbeat_interval = 2\n")
    cfg = load_config(ProducerConfig, required, prog="walbus produce", env={}, section="produce")
    assert (cfg.partitions, cfg.heartbeat_interval) == (3, 2.0)


@pytest.mark.parametrize("flag", ["--topic", "--publication", "--signal-topic", "--signal-table"])
def test_an_empty_name_is_refused_not_taken_for_the_default(flag: str) -> None:
    # An empty --topic wrote to the default topic (and an empty --signal-topic read no signals).
    from producer.config import load
    from walbus.config import ConfigError

    with pytest.raises(ConfigError, match=f"{flag} is empty"):
        load(["--pg-dsn", "dbname=x", "--kafka-bootstrap", "k:1", flag, " "])


@pytest.mark.parametrize("rows", ["-1", "0", "1000001"])
def test_demo_rows_out_of_range_are_a_usage_error(rows: str, capsys: pytest.CaptureFixture[str]) -> None:
    from walbus.app.demo import main as demo

    with pytest.raises(SystemExit) as exit_:
        demo(["--rows", rows])
    assert exit_.value.code == 2 and "--rows must be between 1 and 1000000" in capsys.readouterr().err


def test_configuration_errors_never_echo_a_secret(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A TOML list for a password, a DSN in a number's flag, an ambiguous abbreviation with its
    # value and a '-'-value after a mistyped flag were all printed as given (a re-fuzz).
    import os
    import signal

    for name in [n for n in os.environ if n.startswith("WALBUS_")]:
        monkeypatch.delenv(name)  # the file's values must count: env vars beat them

    from walbus.app.cli import main

    def walbus(argv: list[str]) -> int:
        sigterm = signal.getsignal(signal.SIGTERM)
        try:
            return main(argv)
        finally:  # the CLI takes SIGTERM over before it imports a service
            signal.signal(signal.SIGTERM, sigterm)

    path = tmp_path / "walbus.toml"
    for line in ('kafka_sasl_password = ["TomlSecret2"]', 'pg_dsn = ["postgresql://u:TomlSecret1@h/db"]'):
        path.write_text(line + "\n")
        assert walbus(["produce", "--pg-dsn", "dbname=x", "--kafka-bootstrap", "k:1", "--config", str(path)]
                      if "sasl" in line else ["produce", "--kafka-bootstrap", "k:1", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert "is not a valid str" in err and "Secret" not in err, err
    assert walbus(["produce", "--pg-dsn", "dbname=x", "--kafka-bootstrap", "k:1", "--partitions=postgresql://u:s3cretPW99@h/db"]) == 2
    for argv in (["tail", "--topic", "x", "--kafka-sasl=s3cretPW99"],
                 ["produce", "--pg-dsn", "dbname=x", "--kafka-sasl-pasword", "-Xs3cretPW99"],
                 # and (a re-fuzz) a value with spaces, or one that starts with '--'
                 ["tail", "--topic", "x", "--kafka-sasl=correct horse s3cretPW99"],
                 ["warehouse", "sql", "--kafka-sasl-password", "--s3cretPW99"],
                 ["produce", "--pg-dsn", "dbname=x", "--bogus", "--s3cretPW99"]):
        with pytest.raises(SystemExit):
            walbus(argv)
    err = capsys.readouterr().err
    assert "s3cretPW99" not in err and "horse" not in err and "--kafka-sasl=…" in err, err
    assert "--kafka-sasl-pasword (did you mean --kafka-sasl-password?)" in err, err


def test_an_integer_past_64_bits_is_refused_and_logs_survive_one() -> None:
    # --retry-attempts 99999999999999999999999 was taken, and the start-up log line (with the
    # config) died in orjson ("Integer exceeds 64-bit range").
    import io

    from walbus.config import ConfigError
    from walbus.logs import setup_logging

    with pytest.raises(ConfigError, match="--retry-attempts: 99999999999999999999999 is out of range"):
        load_config(ProducerConfig, ["--pg-dsn", "dbname=x", "--kafka-bootstrap", "k:1", "--retry-attempts",
                                     "99999999999999999999999"], prog="walbus produce", env={})
    with pytest.raises(ConfigError, match="--parallel-tables: 0 is out of range"):
        load_config(LoadConfig, ["--kafka-bootstrap", "k:1", "--topic", "walbus.x", "--warehouse", "/tmp/wh",
                                 "--parallel-tables", "0"], prog="walbus warehouse load", env={})
    out = io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    setup_logging("info", stream=out)
    try:
        logging.getLogger("walbus.test").info("big", extra={"n": 2**70})
    finally:
        root.handlers[:], root.level = handlers, level
    assert '"n": 1180591620717411303424' in out.getvalue()


def test_a_heartbeat_interval_too_short_to_mean_one_is_refused() -> None:
    from producer.config import load
    from walbus.config import ConfigError

    with pytest.raises(ConfigError, match=r"--heartbeat-interval must be 0 \(off\) or at least 0\.1 s"):
        load(["--pg-dsn", "dbname=x", "--kafka-bootstrap", "k:1", "--heartbeat-interval", "1e-9"])
    assert load(["--pg-dsn", "dbname=x", "--kafka-bootstrap", "k:1", "--heartbeat-interval", "0"]).heartbeat_interval == 0


def test_any_empty_setting_is_refused_not_taken_for_the_default() -> None:
    # `warehouse load --warehouse ""` loaded into the working directory and `demux --group-id ""`
    # took the default group (a re-fuzz): a blank value of any option is refused.
    from walbus.config import ConfigError

    with pytest.raises(ConfigError, match="--warehouse is empty"):
        load_config(LoadConfig, ["--kafka-bootstrap", "k:1", "--topic", "walbus.x", "--warehouse", ""], prog="w", env={})
    with pytest.raises(ConfigError, match="--group-id is empty"):
        load_config(DemuxConfig, ["--kafka-bootstrap", "k:1", "--source-topic", "walbus.x"], prog="d",
                    env={"WALBUS_DEMUX_GROUP_ID": " "}, section="demux")


def test_keys_and_tables_no_command_takes_are_warned_of(
    tmp_path: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `kafka-boostrap` at the top of a shared file was ignored without a word (the default used).
    from walbus import config
    from walbus.app import commands

    monkeypatch.setattr(config, "_catalog", None)
    commands.register()  # as the CLI does
    path = tmp_path / "walbus.toml"
    path.write_text('kafka-boostrap = "k:1"\nstate-dir = "d"\ntables = ["a"]\n[producer]\ntopic = "x"\n[demux]\ngroup-id = "g"\n')
    with caplog.at_level(logging.WARNING):
        load_config(TailConfig, ["--topic", "t", "--kafka-bootstrap", "k:1", "--config", str(path)],
                    prog="walbus tail", env={}, section="tail")
    (warning,) = [r for r in caplog.records if r.name == "walbus.config"]
    assert "kafka-boostrap (did you mean kafka-bootstrap?), [producer] (did you mean [produce]?)" in warning.getMessage()
    assert warning.ignored_keys == ["kafka-boostrap", "[producer]"]  # other commands' keys and tables are no typos


def test_every_config_class_is_known_to_the_typo_check() -> None:
    import re
    from pathlib import Path

    from walbus.app.commands import COMMAND_CONFIGS

    root = Path(__file__).resolve().parents[2]
    read = {m for d in ("walbus", "producer", "demux", "warehouse") for p in (root / d).rglob("*.py")
            for m in re.findall(r"load_config\(\s*(\w+Config)\b", p.read_text())}
    listed = {spec.partition(":")[2] for specs in COMMAND_CONFIGS.values() for spec in specs}
    assert read == listed


def test_configuration_warnings_are_json_lines(tmp_path: Any) -> None:
    # Logged before the command set up its logging, they came out as plain text.
    import json
    import subprocess
    import sys

    path = tmp_path / "walbus.toml"
    path.write_text('kafka-boostrap = "k:1"\n[tail]\ntopik = "x"\n')
    done = subprocess.run(
        [sys.executable, "-m", "walbus.app.cli", "tail", "--config", str(path), "--kafka-bootstrap", "k:1", "--topic", "t",
         "--max-events", "-1"],
        capture_output=True, text=True, timeout=60, env={**__import__("os").environ, "WALBUS_GROUP_ID": "g"},
    )
    assert done.returncode == 2, done.stderr
    *lines, error = done.stderr.splitlines()
    assert error.startswith("walbus tail: error: --max-events"), done.stderr
    msgs = [json.loads(line)["msg"] for line in lines]
    assert len(msgs) == 3 and all(m for m in msgs), msgs


def test_a_bootstrap_aiokafka_cannot_parse_or_resolve_is_a_configuration_error() -> None:
    # '[::1' passed the check, then aiokafka's own parse raised ValueError: 'walbus tail: fatal:
    # ValueError: not enough values to unpack', exit 1 with a traceback; 'host1 host2:9092' was
    # looked up as one host name, three times, before 'cannot reach Kafka' (a configuration fuzz).
    from aiokafka.conn import collect_hosts

    from walbus.config import ConfigError
    from walbus.kafka import check_bootstrap

    for bad in ("[::1", "[::1]]:9092", "[a]b:9092", "[]:9092", "[::1]:", "[::1]:0", "host1 host2:9092",
                "a:1,host\tb:2", "a\x00b:9092", "a:1 2"):
        with pytest.raises(ConfigError, match="--kafka-bootstrap"):
            check_bootstrap(bad)
    for good in ("a:1,[::1]:9092,b", "[::1]", "::1", "[fe80::1%eth0]:9093", " broker-1.example.com:9092 , b:1"):
        check_bootstrap(good)
        assert all(1 <= port <= 65535 for _, port, _ in collect_hosts(good))


_BAD_TOPICS = ["walbus bad", "..", ".", "t" * 250, "wal/bus", "walbus.sh\u00f6p", "a\nb"]


def _topic_cases() -> list[tuple[str, str, list[str], str]]:
    """(command config, section, the other required flags, the topic flag) of every command
    that takes a topic name."""
    return [
        ("walbus.app.tail:TailConfig", "tail", [], "--topic"),
        ("walbus.app.groups:GroupsConfig", "groups", [], "--topic"),
        ("walbus.app.groups:GroupsConfig", "groups", [], "--topic-prefix"),
        ("walbus.app.deadletters:DeadLettersConfig", "dead-letters", ["--group-id", "g"], "--topic"),
        ("walbus.app.deadletters:DeadLettersConfig", "dead-letters", ["--topic", "walbus.x", "--demux"], "--dlq-topic"),
        ("walbus.app.status:StatusConfig", "status", [], "--topic"),
        ("walbus.app.status:StatusConfig", "status", ["--pg-dsn", "dbname=x"], "--topic-prefix"),
        ("warehouse.cli:LoadConfig", "warehouse", ["--warehouse", "/tmp/wh"], "--topic"),
        ("warehouse.cli:StreamConfig", "warehouse", ["--warehouse", "/tmp/wh"], "--topic"),
        ("warehouse.cli:SqlConfig", "warehouse", ["--warehouse", "/tmp/wh"], "--topic"),
        ("demux.config:DemuxConfig", "demux", [], "--source-topic"),
        ("demux.config:DemuxConfig", "demux", ["--source-topic", "walbus.x"], "--dlq-topic"),
        ("producer.config:ProducerConfig", "produce", ["--pg-dsn", "dbname=x"], "--topic"),
        ("producer.config:ProducerConfig", "produce", ["--pg-dsn", "dbname=x"], "--signal-topic"),
    ]


@pytest.mark.parametrize(("spec", "section", "required", "flag"), _topic_cases())
def test_a_topic_name_kafka_cannot_have_is_a_configuration_error(spec: str, section: str, required: list[str], flag: str) -> None:
    # `walbus tail --topic 'walbus bad'` said "waiting for topic walbus bad to exist" and waited
    # forever (Kafka can never create it); so did every other reader of such a name.
    import importlib

    from producer.config import load as load_producer
    from walbus.config import ConfigError

    module, _, name = spec.partition(":")
    cls = getattr(importlib.import_module(module), name)
    kafka = ["--kafka-bootstrap", "k:9092"] if "kafka_bootstrap" in cls.__dataclass_fields__ else []
    for bad in _BAD_TOPICS:
        argv = [*kafka, *required, flag, bad]
        with pytest.raises(ConfigError, match=f"^{flag} must be a Kafka topic name") as err:
            if cls is ProducerConfig:
                load_producer(argv)
            else:
                load_config(cls, argv, prog="walbus test", env={}, section=section)
        assert "\n" not in str(err.value).replace(repr(bad), "")
    # ... and a good one still passes (groups' --topic: a list).
    load_config(cls, [*kafka, *required, flag, "walbus.My-db_1"], prog="walbus test", env={},
                section=section)


@pytest.mark.parametrize("source", ["env", "file"])
def test_a_topic_name_from_the_env_or_a_file_is_checked_too(source: str, tmp_path: Any) -> None:
    from walbus.app.groups import GroupsConfig
    from walbus.config import ConfigError

    path = tmp_path / "walbus.toml"
    path.write_text('[groups]\ntopic = ["walbus.ok", "walbus bad"]\n')
    env = {"WALBUS_GROUPS_TOPIC": "walbus.ok,walbus bad"} if source == "env" else {"WALBUS_CONFIG": str(path)}
    with pytest.raises(ConfigError, match=r"^--topic must be a Kafka topic name.*'walbus bad'"):
        load_config(GroupsConfig, ["--kafka-bootstrap", "k:9092"], prog="walbus groups", env=env, section="groups")


def test_tail_of_a_topic_name_kafka_cannot_have_exits_at_once() -> None:
    import os
    import subprocess
    import sys

    # An unreachable broker, so that before the fix it ends too (with "cannot reach Kafka").
    done = subprocess.run(
        [sys.executable, "-m", "walbus.app.cli", "tail", "--topic", "walbus bad", "--kafka-bootstrap", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=120, env={k: v for k, v in os.environ.items() if not k.startswith("WALBUS_")},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "walbus tail: error: --topic must be a Kafka topic name ([A-Za-z0-9._-], at most 249 characters), got 'walbus bad'"
    ]


def test_a_metrics_address_no_socket_takes_is_a_configuration_error(tmp_path: Any) -> None:
    # A host name too long to encode (70 'é': idna refuses it) or holding a NUL (from a TOML
    # file) was 'walbus status: fatal: TypeError: encoding of hostname failed', exit 1, a traceback.
    import os
    import subprocess
    import sys

    from walbus.config import ConfigError
    from walbus.metrics import new_registry, serve_metrics

    for addr in ("é" * 70, "a\x00b", "\ud800", "999.1.1.1"):
        with pytest.raises(ConfigError, match=r"^--metrics-port 1 on --metrics-addr "):
            serve_metrics(1, new_registry(), addr=addr)
    path = tmp_path / "walbus.toml"
    path.write_text('[status]\nmetrics_addr = "a\\u0000b"\n')
    done = subprocess.run(
        [sys.executable, "-m", "walbus.app.cli", "status", "--config", str(path), "--topic", "walbus.x",
         "--kafka-bootstrap", "127.0.0.1:1", "--metrics-port", "1"],
        capture_output=True, text=True, timeout=60, env={k: v for k, v in os.environ.items() if not k.startswith("WALBUS_")},
    )
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1 and "--metrics-addr 'a\\x00b'" in done.stderr, done.stderr


def test_tail_as_a_group_whose_dead_letter_topics_kafka_cannot_have_is_a_configuration_error() -> None:
    # `walbus tail --group-id <300 characters>` was 'walbus tail: fatal: ValueError: the
    # dead-letter topics of group …', exit 1, with a traceback (the Feed refuses such a group).
    from walbus.app.tail import main as tail_main
    from walbus.config import ConfigError

    with pytest.raises(ConfigError, match=r"^the dead-letter topics of group 'g+' on walbus\.x: must be a Kafka topic name"):
        tail_main(["--topic", "walbus.x", "--kafka-bootstrap", "127.0.0.1:1", "--group-id", "g" * 300])
