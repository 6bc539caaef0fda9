"""`--group-instance-id`: static group membership of the demux (no services)."""

from __future__ import annotations

import pytest

from demux.config import parse_config
from walbus.config import ConfigError


def test_membership_is_dynamic_unless_named() -> None:
    assert parse_config(["--kafka-bootstrap", "k:9092", "--source-topic", "walbus.db"]).group_instance_id is None
    cfg = parse_config(["--kafka-bootstrap", "k:9092", "--source-topic", "walbus.db", "--group-instance-id", "demux-1"])
    assert cfg.group_instance_id == "demux-1"


def test_an_empty_instance_id_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--group-instance-id"):
        parse_config(["--kafka-bootstrap", "k:9092", "--source-topic", "walbus.db", "--group-instance-id", " "])
