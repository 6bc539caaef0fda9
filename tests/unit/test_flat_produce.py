"""Flat produce requests (walbus.aiokafka_shortcuts): the same bytes as aiokafka's own encoder
for every ProduceRequest version, whatever the topics, partitions, transactional id and
buffer types; a flexible (compact) version is left to aiokafka."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka.protocol.produce import ProduceRequest
from hypothesis import given, settings
from hypothesis import strategies as st

from walbus import aiokafka_shortcuts as adapter

BUFFERS = st.one_of(st.none(), st.binary(max_size=300), st.binary(max_size=50).map(bytearray), st.binary(max_size=50).map(memoryview))
TOPICS = st.lists(
    st.tuples(st.text(min_size=1, max_size=40), st.lists(st.tuples(st.integers(0, 2**31 - 1), BUFFERS), max_size=4)),
    max_size=4,
)


@settings(max_examples=300)
@given(TOPICS, st.one_of(st.none(), st.text(max_size=30)), st.sampled_from([-1, 0, 1]), st.integers(0, 2**31 - 1))
def test_a_flat_request_is_aiokafkas_request(topics: list[tuple[str, list[tuple[int, Any]]]], tid: str | None,
                                             acks: int, timeout: int) -> None:
    for struct_class in ProduceRequest._CLASSES:
        txn = tid if struct_class.API_VERSION >= 3 else None
        theirs = ProduceRequest(transactional_id=txn, required_acks=acks, timeout=timeout, topics=topics).build(struct_class)
        ours = adapter.FlatProduceRequest(transactional_id=txn, required_acks=acks, timeout=timeout, topics=topics).build(struct_class)
        assert type(ours) is not struct_class and isinstance(ours, struct_class)  # encoded flat, same version and API
        assert ours.encode() == theirs.encode()


def test_the_flat_request_prepares_the_version_both_sides_speak() -> None:
    request = adapter.FlatProduceRequest(transactional_id=None, required_acks=-1, timeout=1000, topics=[("t", [(0, b"x")])])
    for versions, expected in (({0: (3, 7)}, 7), ({0: (3, 5)}, 5), ({0: (0, 2)}, 2)):
        built = request.prepare(versions)
        assert expected == built.API_VERSION and built.API_KEY == 0
        assert built.encode() == ProduceRequest(None, -1, 1000, [("t", [(0, b"x")])]).prepare(versions).encode()


def test_a_flexible_version_is_encoded_by_aiokafka() -> None:
    """A later aiokafka's compact (flexible) ProduceRequest is not what encode_produce writes:
    it is built as aiokafka's own struct."""
    newest = ProduceRequest._CLASSES[-1]
    flexible = type("ProduceRequest_flexible", (newest,), {"FLEXIBLE_VERSION": True})
    built = adapter.FlatProduceRequest(transactional_id=None, required_acks=-1, timeout=1000, topics=[]).build(flexible)
    assert type(built) is flexible


def test_the_probe_passes_and_the_sender_builds_flat_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    assert adapter.SHORTCUTS.flat_produce and adapter._sender.ProduceRequest is adapter.FlatProduceRequest
    # The probe (run before installing) checks the sender still builds aiokafka's own requests.
    monkeypatch.setattr(adapter._sender, "ProduceRequest", ProduceRequest)
    assert adapter._probe_flat_produce()
    monkeypatch.setattr(adapter._sender, "ProduceRequest", type("Other", (ProduceRequest,), {}))
    assert not adapter._probe_flat_produce()  # somebody else's request class there: leave it alone
