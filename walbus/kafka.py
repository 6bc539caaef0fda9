"""Kafka helpers shared by the services: connection options, topic creation and checks."""

from __future__ import annotations

import asyncio
import enum
import logging
import re
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.conn import collect_hosts, create_conn
from aiokafka.errors import (
    AuthenticationFailedError,
    AuthenticationMethodNotSupported,
    IllegalSaslStateError,
    KafkaConnectionError,
    KafkaError,
    LeaderNotAvailableError,
    SaslAuthenticationFailed,
    TopicAlreadyExistsError,
    UnknownTopicOrPartitionError,
    UnsupportedSaslMechanismError,
    for_code,
)
from aiokafka.partitioner import murmur2
from aiokafka.protocol.admin import SaslHandShakeRequest
from aiokafka.protocol.metadata import MetadataRequest

from walbus.config import ConfigError, option

log = logging.getLogger("walbus.kafka")
_T = TypeVar("_T")

# The largest record walbus creates its topics for (their max.message.bytes, docs/contract.md):
# large enough for rows with big TOAST values; the broker default (1 MB) is not.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# How long a service keeps asking about a topic it just created or found while the broker it
# asks does not know it yet (on a cluster, metadata reaches each broker in its own time).
METADATA_WAIT_S = 30.0
# How long a one-shot reader (a warehouse load) keeps retrying a transient fault, e.g. a partition
# whose leader just died: the cluster elects a new one within a broker session timeout (~9 s).
OFFSETS_WAIT_S = 120.0
# Kafka's default when a topic sets nothing (the broker's message.max.bytes).
BROKER_DEFAULT_MAX_MESSAGE_BYTES = 1048588
# What a one-record batch adds to key, value and headers (v2 batch header and record framing),
# rounded up: a record fits a topic when its parts plus this are within max.message.bytes.
RECORD_OVERHEAD_BYTES = 128


def partition_for(key: bytes, partitions: int) -> int:
    """Kafka's default partitioner for a keyed record: murmur2 of the key bytes, as the Java
    client computes it, so every Kafka client agrees with walbus on a key's partition."""
    return 0 if partitions <= 1 else (murmur2(key) & 0x7FFFFFFF) % partitions


def record_fits(limit: int, key: bytes | None, value: bytes | None, headers_bytes: int = 0) -> bool:
    """Whether one record, sent alone, stays within a topic's ``max.message.bytes``."""
    return len(key or b"") + len(value or b"") + headers_bytes + RECORD_OVERHEAD_BYTES <= limit


def cut_to_fit(
    max_bytes: int, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]],
) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
    """A dead letter as the topic can take it: whole when it fits, else its key cut to 1,000
    bytes and its value to what is left, with headers saying so (``walbus.value.truncated``:
    the value's size; ``walbus.value.cut``: why). One definition for the demux and the client."""
    header_bytes = sum(len(k) + len(v) for k, v in headers) + 200  # + the cut headers below
    if not record_fits(max_bytes, key, value, header_bytes):
        size = len(key or b"") + len(value or b"")
        headers = [*headers, ("walbus.value.truncated", str(len(value or b"")).encode()),
                   ("walbus.value.cut", f"source record of {size} bytes is over the dead-letter "
                    f"topic's max.message.bytes={max_bytes}".encode())]
        key = key[:1000] if key is not None else None
        room = max_bytes - RECORD_OVERHEAD_BYTES - header_bytes - len(key or b"")
        value = (value or b"")[:max(0, room)]
    if key is None and value is None:
        value = b""  # a record needs a key or a value: an empty value stands for neither
    return key, value, headers


async def topic_partitions(
    client_kwargs: Mapping[str, Any], topic: str, *, wait: bool = True, poll_interval: float = 1.0
) -> list[TopicPartition]:
    """The topic's partitions in order. ``wait``: until the topic exists (a service may start
    before its source); else a missing topic raises :class:`LookupError`."""
    warned = False
    admin = AIOKafkaAdminClient(**client_kwargs)
    await admin.start()
    try:
        while True:
            # The consumer's own metadata cache only learns topics it is subscribed to.
            described = await admin.describe_topics([topic])
            for t in described:
                if t["topic"] == topic and not t["error_code"] and t["partitions"]:
                    return [TopicPartition(topic, p["partition"]) for p in sorted(t["partitions"], key=lambda p: p["partition"])]
            if not wait:
                raise LookupError(f"topic {topic} does not exist")
            if not warned:
                log.info("waiting for topic to exist", extra={"topic": topic})
                warned = True
            await asyncio.sleep(poll_interval)
    finally:
        await admin.close()


@dataclass(kw_only=True)
class KafkaOptions:
    """Broker address and security options, shared by every service's config."""

    kafka_bootstrap: str = option(help="Kafka bootstrap servers, host:port[,host:port]")
    kafka_security_protocol: str = option(
        "PLAINTEXT", help="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL",
        choices=["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"],
    )
    kafka_sasl_mechanism: str = option(
        "PLAIN", help="SASL mechanism", choices=["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]
    )
    kafka_sasl_username: str | None = option(None, help="SASL user name")
    kafka_sasl_password: str | None = option(None, help="SASL password", secret=True)
    kafka_ssl_cafile: str | None = option(None, help="CA bundle to verify the brokers")
    kafka_ssl_certfile: str | None = option(None, help="client certificate (mutual TLS)")
    kafka_ssl_keyfile: str | None = option(None, help="client key (mutual TLS)")
    kafka_ssl_key_password: str | None = option(
        None, help="passphrase of an encrypted client key", secret=True
    )

    def kafka_client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for any aiokafka client; ConfigError for settings no client can use."""
        check_bootstrap(self.kafka_bootstrap)
        self._check_unused()
        kw: dict[str, Any] = {
            "bootstrap_servers": self.kafka_bootstrap,
            "security_protocol": self.kafka_security_protocol,
        }
        if self.kafka_security_protocol.startswith("SASL"):
            if not (self.kafka_sasl_username and self.kafka_sasl_password):
                raise ConfigError("SASL needs --kafka-sasl-username and --kafka-sasl-password")
            kw.update(
                sasl_mechanism=self.kafka_sasl_mechanism,
                sasl_plain_username=self.kafka_sasl_username,
                sasl_plain_password=self.kafka_sasl_password,
            )
        if self.kafka_security_protocol in ("SSL", "SASL_SSL"):
            try:
                ctx = ssl.create_default_context(cafile=self.kafka_ssl_cafile)
            except (OSError, ssl.SSLError) as e:
                raise ConfigError(f"--kafka-ssl-cafile {self.kafka_ssl_cafile}: {_tls_reason(e)}") from None
            if self.kafka_ssl_certfile:
                files = f"--kafka-ssl-certfile {self.kafka_ssl_certfile} / --kafka-ssl-keyfile {self.kafka_ssl_keyfile}"
                # Without a passphrase, a callable that refuses: OpenSSL would otherwise ask for
                # one on the terminal (a service hangs) or fail with "Invalid argument".
                try:
                    ctx.load_cert_chain(
                        self.kafka_ssl_certfile, self.kafka_ssl_keyfile, password=self.kafka_ssl_key_password or _no_passphrase
                    )
                except _KeyEncrypted:
                    raise ConfigError(
                        f"--kafka-ssl-keyfile {self.kafka_ssl_keyfile or self.kafka_ssl_certfile} is encrypted: "
                        "give its passphrase with --kafka-ssl-key-password (or WALBUS_KAFKA_SSL_KEY_PASSWORD)"
                    ) from None
                except ssl.SSLError as e:
                    # OpenSSL says only "PEM lib" for a wrong passphrase
                    hint = " (a wrong --kafka-ssl-key-password?)" if self.kafka_ssl_key_password and e.library == "SSL" else ""
                    raise ConfigError(f"{files}: {_tls_reason(e)}{hint}") from None
                except OSError as e:
                    raise ConfigError(f"{files}: {_tls_reason(e)}") from None
            kw["ssl_context"] = ctx
        return kw


    def _check_unused(self) -> None:
        """A warning for security options the protocol does not use (once per process: this
        runs for each client); a key without its certificate is an error."""
        protocol = self.kafka_security_protocol
        ssl_set = [f"--kafka-ssl-{n}" for n in ("cafile", "certfile", "keyfile", "key-password")
                   if getattr(self, f"kafka_ssl_{n.replace('-', '_')}")]
        sasl_set = [f"--kafka-sasl-{n}" for n in ("username", "password") if getattr(self, f"kafka_sasl_{n}")]
        unused = (ssl_set if protocol not in ("SSL", "SASL_SSL") else []) + (sasl_set if not protocol.startswith("SASL") else [])
        if unused and (protocol, *unused) not in _WARNED_UNUSED:
            _WARNED_UNUSED.add((protocol, *unused))
            log.warning(f"{', '.join(unused)} not used with --kafka-security-protocol {protocol}")
        if protocol in ("SSL", "SASL_SSL") and (self.kafka_ssl_keyfile or self.kafka_ssl_key_password) \
                and not self.kafka_ssl_certfile:
            raise ConfigError("--kafka-ssl-keyfile and --kafka-ssl-key-password need --kafka-ssl-certfile (the client certificate)")


_WARNED_UNUSED: set[tuple[str, ...]] = set()


class _KeyEncrypted(Exception):
    pass


def _no_passphrase() -> str:
    raise _KeyEncrypted


def _tls_reason(e: OSError) -> str:
    return (e.reason or str(e)) if isinstance(e, ssl.SSLError) else (e.strerror or str(e))


def check_bootstrap(servers: str) -> None:
    """ConfigError unless ``servers`` is host[:port][,host[:port]…] with ports 1 to 65535, each
    read as aiokafka reads it (a host alone means port 9092; an IPv6 address in brackets when a
    port follows): '[::1' passed a looser check and failed in aiokafka's parse with a traceback,
    and a host holding a space was looked up as a name until 'cannot reach Kafka'."""
    for server in servers.split(","):
        if not _bootstrap_server_ok(server.strip()):
            raise ConfigError(f"--kafka-bootstrap {servers!r}: give host:port[,host:port], ports 1 to 65535 "
                              "(an IPv6 address as [address]:port)")


def _bootstrap_server_ok(server: str) -> bool:
    if server.startswith("["):
        m = re.fullmatch(r"\[([^\[\]\s]+)\](?::(\d+))?", server)
        host, port = (m[1], m[2] or "9092") if m else ("", "")
    elif ":" not in server:
        host, port = server, "9092"
    else:
        try:
            socket.inet_pton(socket.AF_INET6, server)  # aiokafka takes a bare IPv6 address, port 9092
            return True
        except (OSError, ValueError):
            host, _, port = server.rpartition(":")
    # Neither whitespace nor a control character is in any host name; nor a bracket outside [].
    plain_host = bool(host) and not any(ch.isspace() or not ch.isprintable() or ch in "[]" for ch in host)
    return plain_host and port.isascii() and port.isdigit() and 0 < int(port) <= 65535


# walbus's own topics on a cluster of this many brokers or more: replicated 3 times, and an
# acks=all write needs 2 in-sync replicas, so one broker may be down (or restarting) and no
# acknowledged record is on one disk only.
REPLICATED_CLUSTER_BROKERS = 3
REPLICATED_FACTOR = 3
REPLICATED_MIN_INSYNC = 2


def default_replication_factor(brokers: int) -> int:
    """The replication factor of a topic walbus creates when none is given."""
    return REPLICATED_FACTOR if brokers >= REPLICATED_CLUSTER_BROKERS else 1


def replication_configs(replication_factor: int) -> tuple[tuple[str, str], ...]:
    """Topic configs that go with a replication factor: min.insync.replicas=2 from RF 3 on."""
    if replication_factor >= REPLICATED_FACTOR:
        return (("min.insync.replicas", str(REPLICATED_MIN_INSYNC)),)
    return ()


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int = 1
    # None: picked from the cluster's size (default_replication_factor).
    replication_factor: int | None = None
    configs: tuple[tuple[str, str], ...] = ()


class KafkaAdmin:
    """A thin wrapper over aiokafka's admin client: create-if-missing and config checks."""

    def __init__(self, *, client_kwargs: dict[str, Any], request_timeout_ms: int = 30000) -> None:
        # Ours replaces a request_timeout_ms of the caller's connection options (a Feed's
        # client_kwargs take any): passed besides it, the admin was never made (KeyError).
        self._admin = AIOKafkaAdminClient(**{**client_kwargs, "request_timeout_ms": request_timeout_ms})

    async def start(self) -> None:
        await self._admin.start()

    async def close(self) -> None:
        await self._admin.close()

    async def __aenter__(self) -> KafkaAdmin:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def list_topics(self) -> set[str]:
        return set(await self._admin.list_topics())

    async def committed(self, group: str, tp: TopicPartition) -> tuple[int, str] | None:
        """The group's committed offset of ``tp`` and its metadata (consumer.committed() drops it); None: none."""
        om = (await self._admin.list_consumer_group_offsets(group, partitions=[tp])).get(tp)
        return None if om is None or om.offset < 0 else (om.offset, om.metadata)

    async def ensure_topic(self, spec: TopicSpec) -> bool:
        """Create the topic if it is missing; True when this call created it.

        Returns once the brokers describe the topic: right after CreateTopics the
        metadata may not list it yet, and callers go on to ask its partitions.
        """
        created = await self._create(spec)
        await self._wait_until_described(spec.name)
        return created

    async def broker_count(self) -> int:
        """How many brokers the cluster has now (from its metadata)."""
        cluster = await self._admin.describe_cluster()
        return len(cluster["brokers"])

    async def _create(self, spec: TopicSpec) -> bool:
        rf = spec.replication_factor
        if rf is None:
            rf = default_replication_factor(await self.broker_count())
        # The spec's own configs win over the defaults that go with the replication factor.
        configs = dict(replication_configs(rf)) | dict(spec.configs)
        new = NewTopic(name=spec.name, num_partitions=spec.partitions, replication_factor=rf, topic_configs=configs)
        try:
            resp = await self._admin.create_topics([new])
        except TopicAlreadyExistsError:
            return False
        for entry in resp.topic_errors:
            code = entry[1]
            if code == 0:
                log.info("created topic", extra={"topic": spec.name, "partitions": spec.partitions, "replication_factor": rf})
                return True
            err = for_code(code)
            if err is TopicAlreadyExistsError:
                return False
            message = entry[2] if len(entry) > 2 else ""
            raise err(f"creating topic {spec.name}: {message}")
        return False

    async def _wait_until_described(self, topic: str, timeout: float = 10.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                await self.partitions(topic)
                return
            except (UnknownTopicOrPartitionError, LeaderNotAvailableError):
                if asyncio.get_running_loop().time() >= deadline:
                    return  # the caller's next request reports it
                await asyncio.sleep(0.05)

    async def delete_topics(self, topics: list[str]) -> None:
        # In requests of 100: one DeleteTopics request for hundreds of topics times out.
        for i in range(0, len(topics), 100):
            await self._admin.delete_topics(topics[i:i + 100])

    async def topic_config(self, topic: str, keys: list[str] | None = None) -> dict[str, str]:
        res = ConfigResource(ConfigResourceType.TOPIC, topic, {k: None for k in keys} if keys else None)
        responses = await self._admin.describe_configs([res])
        out: dict[str, str] = {}
        for resp in responses:
            for resource in resp.resources:
                if resource[0]:  # e.g. a broker that does not know the topic yet: no silent defaults
                    raise for_code(resource[0])(f"describing topic {topic}: {resource[1]}")
                for entry in resource[4]:
                    out[entry[0]] = entry[1]
        return out

    async def alter_topic_config(self, topic: str, configs: dict[str, str]) -> None:
        """Set topic configs (incrementally: others keep their values)."""
        res = ConfigResource(ConfigResourceType.TOPIC, topic, configs)
        for resp in await self._admin.alter_configs([res]):
            for code, message, *_ in resp.resources:
                if code:
                    raise for_code(code)(f"altering topic {topic}: {message}")

    async def max_message_bytes(self, topic: str, *, wait: float = 0.0) -> int:
        """The topic's ``max.message.bytes`` (the broker's default when the topic sets none);
        ``wait`` as in :meth:`partitions`."""
        conf = await self._until_known(lambda: self.topic_config(topic, ["max.message.bytes"]), wait)
        value = conf.get("max.message.bytes")
        try:
            return int(value) if value is not None else BROKER_DEFAULT_MAX_MESSAGE_BYTES
        except ValueError:
            return BROKER_DEFAULT_MAX_MESSAGE_BYTES

    async def partitions(self, topic: str, *, wait: float = 0.0) -> int:
        """The topic's partition count. ``wait``: seconds to keep asking while the broker asked
        does not know the topic yet (a new topic reaches each broker's metadata in its own time)."""
        return await self._until_known(lambda: self._partitions(topic), wait)

    async def _until_known(self, call: Callable[[], Awaitable[_T]], wait: float) -> _T:
        deadline = asyncio.get_running_loop().time() + wait
        while True:
            try:
                return await call()
            except (UnknownTopicOrPartitionError, LeaderNotAvailableError):
                if asyncio.get_running_loop().time() >= deadline:
                    raise
                await asyncio.sleep(0.1)

    async def _partitions(self, topic: str) -> int:
        desc = await self._admin.describe_topics([topic])
        for t in desc:
            if t["topic"] == topic:
                if t["error_code"]:
                    raise for_code(t["error_code"])(f"topic {topic}")
                return len(t["partitions"])
        raise UnknownTopicOrPartitionError(f"topic {topic}")


# A broker's answers to a login that retrying cannot mend.
_LOGIN_REFUSED = (SaslAuthenticationFailed, UnsupportedSaslMechanismError, AuthenticationFailedError, AuthenticationMethodNotSupported)
# How long one look at why a broker refuses may take (per bootstrap server).
REFUSAL_PROBE_S = 10.0


async def broker_refusal(client_kwargs: Mapping[str, Any]) -> str | None:
    """Why a bootstrap server refuses this client, when one does: a login, a certificate or a
    security protocol its listener does not take, which no retry mends. None when none refuses
    (down, unreachable: transient; or answering).

    aiokafka's bootstrap drops the reason (it raises "Unable to bootstrap" for all of them): one
    direct connection to each server, with the same settings, finds it."""
    for host, port, _ in collect_hosts(client_kwargs["bootstrap_servers"], randomize=False):
        try:
            reason = await asyncio.wait_for(_refusal(host, port, client_kwargs), REFUSAL_PROBE_S)
        except (TimeoutError, OSError, KafkaError):
            continue
        if reason:
            return f"{host}:{port} {reason}"
    return None


async def _refusal(host: str, port: int, kw: Mapping[str, Any]) -> str | None:
    protocol = kw.get("security_protocol", "PLAINTEXT")
    settings = {k: kw[k] for k in ("security_protocol", "ssl_context", "sasl_mechanism",
                                   "sasl_plain_username", "sasl_plain_password") if k in kw}
    try:
        conn = await create_conn(host, port, request_timeout_ms=int(REFUSAL_PROBE_S * 1000), **settings)
        try:
            await conn.send(MetadataRequest([]))
        finally:
            conn.close()
        return None
    except UnsupportedSaslMechanismError:
        offered = ", ".join(await _sasl_mechanisms(host, port, kw.get("ssl_context"))) or "others"
        return f"takes no {kw.get('sasl_mechanism')} login on this port ({offered}): check --kafka-sasl-mechanism"
    except _LOGIN_REFUSED as e:
        return f"refuses the login: {e}"
    except IllegalSaslStateError:
        return f"takes no SASL login on this port: check --kafka-security-protocol (not {protocol}?)"
    except ssl.SSLCertVerificationError as e:
        return f"has a certificate this client does not trust: {e.verify_message} (check --kafka-ssl-cafile)"
    except ConnectionRefusedError:
        return None
    except (KafkaConnectionError, ConnectionError, ssl.SSLEOFError):
        # closed at once: a listener for another protocol, or a TLS alert aiokafka drops
        return await _closed_why(host, port, protocol, kw.get("ssl_context"))
    except ssl.SSLError as e:
        return f"fails the TLS handshake: {_tls_reason(e)} (check --kafka-security-protocol)"


async def _closed_why(host: str, port: int, protocol: str, ctx: ssl.SSLContext | None) -> str | None:
    if ctx is not None:
        try:
            reader, writer = await asyncio.open_connection(host, port, ssl=ctx)
        except (ConnectionError, ssl.SSLEOFError):
            pass  # no TLS on that port? asked below
        else:
            try:
                # a broker that rejects the client's certificate says so after the handshake
                await asyncio.wait_for(reader.read(1), 2.0)
            except (ssl.SSLError, ConnectionError) as e:
                if isinstance(e, ssl.SSLError) and not isinstance(e, ssl.SSLEOFError):
                    return (f"refuses this client's certificate: {_tls_reason(e)} (does the listener want "
                            "--kafka-ssl-certfile/--kafka-ssl-keyfile, from a CA it trusts, unexpired?)")
            except TimeoutError:
                pass
            finally:
                writer.close()
            return None
        if await _speaks_kafka(host, port):
            return f"speaks Kafka without TLS on this port: check --kafka-security-protocol (not {protocol}?)"
        return None
    if await _speaks_tls(host, port):
        return f"wants TLS on this port: check --kafka-security-protocol (SSL or SASL_SSL, not {protocol}?)"
    if protocol == "PLAINTEXT":
        mechanisms = await _sasl_mechanisms(host, port)
        if mechanisms:
            return (f"wants a SASL login on this port ({', '.join(mechanisms)}): "
                    "check --kafka-security-protocol (SASL_PLAINTEXT?)")
    return None


async def _speaks_tls(host: str, port: int) -> bool:
    """Whether Kafka answers over TLS there (its certificate unchecked: only the protocol asked)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    return await _speaks_kafka(host, port, ctx)


async def _speaks_kafka(host: str, port: int, ctx: ssl.SSLContext | None = None) -> bool:
    """Whether Kafka answers there (an ApiVersions request), without TLS or with ``ctx``."""
    try:
        conn = await create_conn(host, port, request_timeout_ms=int(REFUSAL_PROBE_S * 1000), ssl_context=ctx,
                                 security_protocol="PLAINTEXT" if ctx is None else "SSL")
    except (OSError, KafkaError):
        return False
    conn.close()
    return True


async def _sasl_mechanisms(host: str, port: int, ctx: ssl.SSLContext | None = None) -> list[str]:
    """The SASL mechanisms a listener offers (a handshake, no login); none on a plain one."""
    try:
        conn = await create_conn(host, port, request_timeout_ms=int(REFUSAL_PROBE_S * 1000), ssl_context=ctx,
                                 security_protocol="PLAINTEXT" if ctx is None else "SSL")
    except (OSError, KafkaError):
        return []
    try:
        response = await conn.send(SaslHandShakeRequest("PLAIN"))
    except (OSError, KafkaError):
        return []
    finally:
        conn.close()
    return list(response.enabled_mechanisms) if response.error_code in (0, UnsupportedSaslMechanismError.errno) else []


async def wait_for_broker(
    client_kwargs: dict[str, Any], *, attempts: int = 0, max_delay: float = 60.0, stop: asyncio.Event | None = None
) -> bool:
    """Retry until the brokers answer (attempts=0: forever), with backoff and jitter from 1 s.

    Returns True once they answer, False when ``stop`` was set first (SIGTERM while waiting)."""
    from walbus.retry import Backoff

    backoff = Backoff(maximum=max_delay)
    while stop is None or not stop.is_set():
        admin = KafkaAdmin(client_kwargs=client_kwargs, request_timeout_ms=10000)
        try:
            return await until_stopped(_answers(admin), stop) is not Stopped.STOPPED
        except (KafkaConnectionError, KafkaError, OSError) as e:
            await until_stopped(raise_refusal(client_kwargs, e), stop)
            if attempts and backoff.failures + 1 >= attempts:
                raise KafkaConnectionError(
                    f"Kafka at {client_kwargs.get('bootstrap_servers')} did not answer after {backoff.failures + 1} attempts: {e}"
                ) from e
            await backoff.wait(log, "reaching kafka", e, stop=stop)
        finally:
            await admin.close()
    return False


async def _answers(admin: KafkaAdmin) -> bool:
    await admin.start()
    await admin.list_topics()
    return True


class Stopped(enum.Enum):
    """What :func:`until_stopped` returns for a step it abandoned."""

    STOPPED = "stopped"


async def until_stopped(step: Awaitable[_T], stop: asyncio.Event | None) -> _T | Stopped:
    """``await step``, abandoned (cancelled; Stopped.STOPPED) once ``stop`` is set: a step waiting for an
    answer (a broker or server that accepts connections and says nothing waits out a 10-20 s
    request timeout, then its retries) looks at no stop flag, so a SIGTERM was not answered."""
    task = asyncio.ensure_future(step)
    if stop is None:
        return await task
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait({task})  # its clean-up (closing connections) runs
    if not task.cancelled():
        task.exception()  # whatever it ended with, it was abandoned (and is not logged as unretrieved)
    return Stopped.STOPPED


async def raise_refusal(client_kwargs: Mapping[str, Any], error: BaseException) -> None:
    """ConfigError when ``error`` (a failed connection) is a broker refusing this client: a
    wrong login or certificate is not retried (see :func:`broker_refusal`)."""
    if isinstance(error, KafkaConnectionError):
        reason = await broker_refusal(client_kwargs)
        if reason:
            raise ConfigError(f"Kafka at {reason}")


async def require_topics(client_kwargs: dict[str, Any], topics: list[str]) -> None:
    """A ConfigError naming the ``topics`` Kafka does not have: a command reading a topic the
    user named (a typo) printed an empty result and exit 0, as if there were nothing to see."""
    async with KafkaAdmin(client_kwargs=client_kwargs) as admin:
        existing = set(await admin.list_topics())
    missing = [t for t in topics if t not in existing]
    if missing:
        raise ConfigError(f"topic {missing[0]} does not exist" if len(missing) == 1
                          else f"topics {', '.join(missing)} do not exist")


async def require_broker(client_kwargs: dict[str, Any]) -> None:
    """For commands that start by asking Kafka: brokers that do not answer after a few tries
    are a configuration error (exit 2, one line), not a traceback."""
    try:
        await wait_for_broker(client_kwargs, attempts=3, max_delay=4)
    except KafkaError as e:
        raise ConfigError(f"cannot reach Kafka at {client_kwargs.get('bootstrap_servers')}: {e}") from None


Offsets = dict[int, int]  # partition -> offset


async def retry_retriable(
    op: Callable[[], Awaitable[_T]], what: str, *, within: float = OFFSETS_WAIT_S,
    client_kwargs: Mapping[str, Any] | None = None,
) -> _T:
    """``await op()``, again with jittered backoff while it raises a retriable Kafka error
    (a dead partition leader, a broker not ready, a connection lost), for ``within`` seconds;
    other errors are raised at once. ``op`` should make a new client each time, so that
    fresh metadata finds a partition's new leader. ``client_kwargs``: a broker refusing them
    is a ConfigError at once (see :func:`raise_refusal`)."""
    from walbus.retry import Backoff

    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    backoff = Backoff(initial=0.25, maximum=5.0)
    while True:
        try:
            return await op()
        except KafkaError as e:
            if client_kwargs is not None:
                await raise_refusal(client_kwargs, e)
            if not e.retriable or loop.time() >= deadline:
                raise
            await backoff.wait(log, what, e)


async def topic_offsets(
    client_kwargs: dict[str, Any], topic: str, *, within: float = OFFSETS_WAIT_S
) -> tuple[Offsets, Offsets]:
    """Each partition's earliest and end offset of ``topic``; retriable faults are retried
    (see ``retry_retriable``)."""
    return await retry_retriable(
        lambda: _topic_offsets(client_kwargs, topic), f"reading the offsets of {topic}", within=within,
        client_kwargs=client_kwargs,
    )


async def _topic_offsets(client_kwargs: dict[str, Any], topic: str) -> tuple[Offsets, Offsets]:
    async with KafkaAdmin(client_kwargs=client_kwargs) as admin:
        count = await admin.partitions(topic, wait=METADATA_WAIT_S)
    consumer = AIOKafkaConsumer(**client_kwargs, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(count)]
        earliest = await consumer.beginning_offsets(tps)
        latest = await consumer.end_offsets(tps)
        return ({tp.partition: int(o) for tp, o in earliest.items()}, {tp.partition: int(o) for tp, o in latest.items()})
    finally:
        await consumer.stop()


async def stop_consumer(consumer: AIOKafkaConsumer) -> None:
    """``consumer.stop()``, finished even when aiokafka lets a CancelledError out of it.

    A fetch that failed (its broker away, or just back) sleeps out its retry back-off
    unguarded; cancelled there by the fetcher's close, its CancelledError leaves ``stop()``
    (aiokafka issue #647) before the other fetches are cancelled and the connections closed.
    The caller's task was not cancelled, so it must not end as if it were (a Feed's ``async
    with`` raised CancelledError after a broker outage): the rest of the close is done here."""
    try:
        await consumer.stop()
        return
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the caller's own cancellation
    log.debug("aiokafka's consumer stop raised CancelledError (a fetch in back-off): closing the rest")
    fetcher = getattr(consumer, "_fetcher", None)
    pending = list(getattr(fetcher, "_pending_tasks", ()))
    for fetch in pending:
        fetch.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    client = getattr(consumer, "_client", None)
    if client is not None:
        await client.close()
