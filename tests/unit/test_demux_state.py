"""The last-row store and the demux options: no services."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest

from demux.config import parse_config
from demux.positions import checkpoint_text
from demux.state import StateStore
from demux.transaction import transactional_id
from walbus.config import ConfigError
from walbus.contract import database_topic, table_topic
from walbus.kafka import DEFAULT_MAX_MESSAGE_BYTES

ROW = orjson.dumps({"id": 1, "doc": "x", "__op": "c", "__lsn": 1, "__commit_lsn": 2, "__seq": 0, "__xid": 3, "__ts": "t"})


def test_pending_changes_are_visible_then_committed(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    store = StateStore(path)
    assert store.checkpoint() is None
    store.track("public.t", [])
    store.apply([("public.t", b"k1", ROW)])
    assert store.get("public.t", b"k1") == {"id": 1, "doc": "x"}
    assert set(store.keys("public.t")) == {b"k1"}
    store.commit("g|src|0|10")
    store.apply([("public.t", b"k1", None), ("public.t", b"k2", ROW)])
    assert set(store.keys("public.t")) == {b"k2"}
    assert store.get("public.t", b"k1") is None
    store.rollback()  # an aborted transaction leaves the committed content
    assert set(store.keys("public.t")) == {b"k1"}
    store.close()
    again = StateStore(path)
    assert again.checkpoint() == "g|src|0|10"
    assert again.get("public.t", b"k1") == {"id": 1, "doc": "x"}
    assert len(again) == 1
    again.close()


def test_find_a_key_by_other_columns_follows_changes_aborts_and_reloads(tmp_path: Path) -> None:
    """StateStore.find (an identity without the key, REPLICA IDENTITY USING INDEX): its index
    follows the open transaction, forgets an aborted one, and is rebuilt when the table is loaded."""
    def row(i: int, code: str) -> bytes:
        return orjson.dumps({"id": i, "code": code, "__op": "c"})

    store = StateStore(tmp_path / "s.sqlite")
    assert store.find("public.t", {"code": "a"}) is None  # not tracked: nothing known
    store.track("public.t", [(b"1", row(1, "a"))])
    assert store.indexed == set()
    assert store.find("public.t", {"code": "a"}) == b"1"
    assert store.indexed == {"public.t"}  # its changes must come through apply now
    store.apply([("public.t", b"1", row(1, "b")), ("public.t", b"2", row(2, "a"))])
    assert (store.find("public.t", {"code": "a"}), store.find("public.t", {"code": "b"})) == (b"2", b"1")
    store.rollback()
    assert (store.find("public.t", {"code": "a"}), store.find("public.t", {"code": "b"})) == (b"1", None)
    store.apply([("public.t", b"1", None)])
    store.commit("c")
    assert store.find("public.t", {"code": "a"}) is None
    store.track("public.t", [(b"3", row(3, "a"))])  # loaded again from the topic
    assert store.find("public.t", {"code": "a"}) == b"3"
    assert store.find("public.t", {"code": "a", "id": 4}) is None
    store.close()


def test_only_tracked_tables_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    store = StateStore(path)
    store.apply([("public.t", b"k", ROW)])
    assert store.pending == {}  # not tracked: nothing kept
    assert store.track("public.t", [(b"a", ROW), (b"b", ROW)]) == 2
    store.apply([("public.t", b"k", ROW), ("public.u", b"k", ROW), ("public.t", b"a", None)])
    assert set(store.keys("public.t")) == {b"b", b"k"}
    store.commit("c1")
    store.close()
    store = StateStore(path)
    assert store.tracked == {"public.t"} and len(store) == 2
    store.reset("c2")
    assert store.tracked == set() and len(store) == 0 and store.checkpoint() == "c2"
    store.close()


def test_ids() -> None:
    assert transactional_id("grp", "walbus.shop", 3) == "grp.walbus.shop.3"
    from aiokafka import TopicPartition

    assert checkpoint_text("g", TopicPartition("t", 1), None) == "g|t|1|-1"


def test_config_defaults_and_errors() -> None:
    cfg = parse_config(["--kafka-bootstrap", "k:9092", "--source-topic", "walbus.shop"])
    assert cfg.database_name == "shop" and cfg.group == "walbus-demux.walbus.shop"
    assert cfg.dlq == "walbus.shop.dlq"
    limit = str(DEFAULT_MAX_MESSAGE_BYTES)
    assert dict(cfg.topic_configs(compact=True)) == {"cleanup.policy": "compact", "max.message.bytes": limit}
    cfg = parse_config(["--kafka-bootstrap", "k", "--source-topic", "cdc_shop", "--segment-ms", "1000",
                        "--delete-retention-ms", "5", "--min-compaction-lag-ms", "0"])
    assert cfg.database_name == "cdc_shop"
    # The producer's database topic escapes the name (contract.database_topic): read back once.
    for database in ("my db", "shop-20x", "ö", "a.b"):
        source = database_topic("walbus", database)
        derived = parse_config(["--kafka-bootstrap", "k", "--source-topic", source]).database_name
        assert derived == database
        assert table_topic("walbus", derived, "public", "t").startswith(source + ".")
    # A name not of that escaping ("-DE" is no UTF-8): as it is; a bare UnicodeDecodeError stopped
    # the demux before (an operations fuzz).
    derived = parse_config(["--kafka-bootstrap", "k", "--source-topic", "walbus.shop-DE"]).database_name
    assert derived == "shop-DE" and table_topic("walbus", derived, "public", "t") == "walbus.shop-2DDE.public.t"
    assert dict(cfg.topic_configs(compact=True)) == {
        "cleanup.policy": "compact", "segment.ms": "1000", "delete.retention.ms": "5", "min.compaction.lag.ms": "0",
        "max.message.bytes": limit}
    assert dict(cfg.topic_configs(compact=False)) == {
        "cleanup.policy": "delete", "segment.ms": "1000", "max.message.bytes": limit}
    with pytest.raises(ConfigError, match="--txn-max-records"):
        parse_config(["--kafka-bootstrap", "k", "--source-topic", "s", "--txn-max-records", "0"])
    with pytest.raises(ConfigError, match="--source-topic"):
        parse_config(["--kafka-bootstrap", "k"])
    with pytest.raises(ConfigError, match="--topic-prefix"):
        parse_config(["--kafka-bootstrap", "k", "--source-topic", "s", "--topic-prefix", "cdc events"])
    with pytest.raises(ConfigError, match="--dlq-topic"):
        parse_config(["--kafka-bootstrap", "k", "--source-topic", "s", "--dlq-topic", "s dlq"])
    with pytest.raises(ConfigError, match="--source-topic"):
        parse_config(["--kafka-bootstrap", "k", "--source-topic", "walbus.ö"])


def test_topic_errors_are_sorted_into_transient_permanent_and_colliding() -> None:
    """Transient: retried. Permanent: the topic is unusable (DLQ). Colliding: the hashed name."""
    from aiokafka.errors import (
        InvalidReplicationFactorError,
        InvalidTopicError,
        KafkaConnectionError,
        KafkaTimeoutError,
        NotControllerError,
        PolicyViolationError,
        RequestTimedOutError,
        TopicAuthorizationFailedError,
    )

    from demux.topics import _transient, _unusable

    for error in (KafkaConnectionError("down"), KafkaTimeoutError(), RequestTimedOutError(), NotControllerError()):
        assert _transient(error), error
    for error in (InvalidTopicError("bad"), PolicyViolationError(), TopicAuthorizationFailedError(),
                  InvalidReplicationFactorError()):
        assert not _transient(error), error
        info = _unusable("t", error)
        assert info.unusable is not None and "t cannot be created" in info.unusable and not info.collides
    clash = _unusable("w.d.public.c_d", InvalidTopicError(
        "creating topic w.d.public.c_d: Topic 'w.d.public.c_d' collides with existing topics: w.d.public_c.d"))
    assert clash.collides and clash.unusable is not None


def test_store_file_names_stay_within_a_file_systems_limit(tmp_path: Path) -> None:
    # The default group names the topic too: a database named in non-ASCII (3 bytes a
    # character) made the name pass 255 bytes, and the worker could not open its store,
    # failing and retrying forever (a fuzz).
    from demux.state import store_file_name

    assert store_file_name("walbus-demux.walbus.shop", "walbus.shop", 0) == "walbus-demux.walbus.shop__walbus.shop-0.sqlite"
    topic = database_topic("walbus", "hj_" + "日" * 13 + "_12345")  # each 日 is -E6-97-A5 in it
    names = {store_file_name(f"walbus-demux.{t}", t, p) for t in (topic, topic + "x") for p in (0, 1)}
    assert len(names) == 4 and all(len(n.encode()) <= 255 for n in names)
    for name in names:
        StateStore(tmp_path / name).close()  # opens


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_the_state_directory_and_its_stores_are_private(tmp_path: Path, umask: int) -> None:
    # They hold the current rows of the tables: 0755/0644 under the default umask (777 under 000).
    old = os.umask(umask)
    try:
        store = StateStore(tmp_path / "new" / "state" / "s.sqlite")
        store.track("public.t", [])
        store.apply([("public.t", b"k1", ROW)])
        store.commit("g|src|0|1")
        made = sorted(p.name for p in (tmp_path / "new" / "state").iterdir())
        modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "new" / "state").iterdir()}
        store.close()
    finally:
        os.umask(old)
    assert (tmp_path / "new" / "state").stat().st_mode & 0o777 == 0o700
    assert "s.sqlite-wal" in made and set(modes.values()) == {0o600}, modes


def test_an_open_state_directory_is_warned_of_and_an_old_store_closed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    state = tmp_path / "mine"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    (state / "s.sqlite").touch(mode=0o644)
    (state / "s.sqlite").chmod(0o644)  # as an older demux left it
    (state / "s.sqlite-wal").touch()
    (state / "s.sqlite-wal").chmod(0o644)
    with caplog.at_level("WARNING"):
        StateStore(state / "s.sqlite").close()
        StateStore(state / "s.sqlite").close()
    assert state.stat().st_mode & 0o777 == 0o755  # the operator's directory keeps its mode
    assert len([r for r in caplog.records if "open to other users" in r.getMessage()]) == 1  # once
    assert {p.stat().st_mode & 0o777 for p in state.iterdir()} == {0o600}


def test_a_state_dir_that_cannot_be_one_stops_the_demux_at_start(tmp_path: Path) -> None:
    # A --state-dir that was a file (or under one) failed in each partition worker, which retried
    # forever with backoff ('partition worker failed …: FileExistsError'), exit only by a signal.
    import signal

    from demux.service import main

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        for state_dir, reason in ((a_file, "it is not a directory"), (a_file / "sub", "Not a directory")):
            with pytest.raises(ConfigError, match=f"--state-dir {state_dir}: {reason}"):
                main(["--source-topic", "walbus.x", "--kafka-bootstrap", "127.0.0.1:1", "--state-dir", str(state_dir)])
    finally:  # main takes SIGTERM and SIGHUP over until its event loop runs
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_find_prefers_a_known_row_to_one_marked_unknown(tmp_path: Path) -> None:
    """A row marked unknown (its change too large for its topic) keeps its columns, so that it
    stays findable by its REPLICA IDENTITY index; its store row may then be stale (a later update
    of it also dead-lettered) while another row took those index values: the live row is found,
    however the index was built (the store's rows come in key order)."""
    from demux.rekey import unknown_row

    def row(i: int, code: int) -> bytes:
        return orjson.dumps({"id": i, "code": code})

    store = StateStore(tmp_path / "s.sqlite")
    store.track("public.t", [(b"1", row(1, 10)), (b"2", unknown_row("too large", row(2, 10)))])
    assert store.find("public.t", {"code": 10}) == b"1"
    store.apply([("public.t", b"3", unknown_row("too large", row(3, 20)))])
    assert store.find("public.t", {"code": 20}) == b"3"  # the only row with it
    store.apply([("public.t", b"1", None)])  # the live row deleted: no row is found by its values
    assert store.find("public.t", {"code": 10}) is None
    store.close()
