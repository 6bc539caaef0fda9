"""A broker refusing the client (login, certificate, security protocol) is a configuration
error naming the reason, at once: not "did not answer", not retried.

This module starts its own single-node broker (the local stack's jars) with a SASL PLAIN
listener, a TLS one and a mutual-TLS one, its PKI made here.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from walbus.app.dev.kafka import KafkaInstance
from walbus.app.dev.processes import free_port
from walbus.config import ConfigError
from walbus.kafka import KafkaOptions, require_broker, wait_for_broker

pytestmark = pytest.mark.integration

PASSWORD = "alice-secret"


def _cert(name: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[str, ec.EllipticCurvePrivateKey] | None = None,
          *, ca: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer or (name, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(
            ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(*items: Any) -> bytes:
    out = b""
    for item in items:
        if isinstance(item, x509.Certificate):
            out += item.public_bytes(serialization.Encoding.PEM)
        else:
            out += item.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())
    return out


@dataclass
class SecuredBroker:
    plaintext: str
    sasl: str
    tls: str
    mtls: str
    pki: Path


@dataclass
class _Secured(KafkaInstance):
    extra: dict[str, str] = field(default_factory=dict)

    def write_config(self) -> None:
        super().write_config()
        # later keys win in a properties file
        with (self.home / "server.properties").open("a") as fh:
            fh.writelines(f"{k}={v}\n" for k, v in self.extra.items())


@pytest.fixture(scope="module")
def secured() -> Iterator[SecuredBroker]:
    state = Path(tempfile.mkdtemp(prefix="walbus-kafka-sec-"))
    pki = state / "pki"
    pki.mkdir()
    ca_key, other_key, broker_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(4))
    ca = _cert("walbus-test-ca", ca_key, ca=True)
    (pki / "ca.pem").write_bytes(_pem(ca))
    (pki / "other-ca.pem").write_bytes(_pem(_cert("another-ca", other_key, ca=True)))
    (pki / "broker.pem").write_bytes(_pem(broker_key, _cert("localhost", broker_key, ("walbus-test-ca", ca_key))))
    (pki / "client.pem").write_bytes(_pem(_cert("client", client_key, ("walbus-test-ca", ca_key))))
    (pki / "client.key").write_bytes(_pem(client_key))

    port, controller, sasl, tls, mtls = (free_port() for _ in range(5))
    broker = _Secured(state, port, controller)
    broker.extra = {
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller},"
                     f"SASL_PLAINTEXT://127.0.0.1:{sasl},SSL://127.0.0.1:{tls},MTLS://127.0.0.1:{mtls}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port},SASL_PLAINTEXT://127.0.0.1:{sasl},"
                                f"SSL://127.0.0.1:{tls},MTLS://127.0.0.1:{mtls}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT,"
                                          "SSL:SSL,MTLS:SSL",
        "sasl.enabled.mechanisms": "PLAIN",
        "listener.name.sasl_plaintext.plain.sasl.jaas.config":
            f'org.apache.kafka.common.security.plain.PlainLoginModule required user_alice="{PASSWORD}";',
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(pki / "broker.pem"),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(pki / "ca.pem"),
        "listener.name.mtls.ssl.client.auth": "required",
    }
    try:
        broker.start()
        yield SecuredBroker(broker.bootstrap, f"127.0.0.1:{sasl}", f"127.0.0.1:{tls}", f"127.0.0.1:{mtls}", pki)
    finally:
        broker.stop()
        shutil.rmtree(state, ignore_errors=True)


def _kwargs(bootstrap: str, **options: Any) -> dict[str, Any]:
    return KafkaOptions(kafka_bootstrap=bootstrap, **options).kafka_client_kwargs()


def _cases(b: SecuredBroker) -> list[tuple[dict[str, Any], str]]:
    sasl = {"kafka_security_protocol": "SASL_PLAINTEXT", "kafka_sasl_mechanism": "PLAIN", "kafka_sasl_username": "alice"}
    ca = str(b.pki / "ca.pem")
    return [
        (_kwargs(b.sasl, **sasl, kafka_sasl_password="wrong"), "refuses the login: .*Invalid username or password"),
        (_kwargs(b.sasl, **{**sasl, "kafka_sasl_mechanism": "SCRAM-SHA-256"}, kafka_sasl_password=PASSWORD),
         r"takes no SCRAM-SHA-256 login on this port \(PLAIN\): check --kafka-sasl-mechanism"),
        (_kwargs(b.sasl), r"wants a SASL login on this port \(PLAIN\)"),
        (_kwargs(b.plaintext, **sasl, kafka_sasl_password=PASSWORD), "takes no SASL login on this port"),
        (_kwargs(b.tls, kafka_security_protocol="SSL", kafka_ssl_cafile=str(b.pki / "other-ca.pem")),
         "has a certificate this client does not trust: .*--kafka-ssl-cafile"),
        (_kwargs(b.tls), "wants TLS on this port"),
        (_kwargs(b.plaintext, kafka_security_protocol="SSL", kafka_ssl_cafile=ca), "speaks Kafka without TLS"),
        (_kwargs(b.mtls, kafka_security_protocol="SSL", kafka_ssl_cafile=ca), "refuses this client's certificate"),
    ]


async def test_a_refusing_broker_is_a_configuration_error_naming_the_reason(secured: SecuredBroker) -> None:
    # Each was "cannot reach Kafka …: did not answer after 3 attempts: Unable to bootstrap",
    # the reason dropped; the demux's wait retried them forever.
    for kwargs, reason in _cases(secured):
        with pytest.raises(ConfigError, match=reason):
            await require_broker(kwargs)
        with pytest.raises(ConfigError, match=reason):  # the demux's wait: forever, but for this
            await asyncio.wait_for(wait_for_broker(kwargs), 30)
    ca = str(secured.pki / "ca.pem")
    for kwargs in (
        _kwargs(secured.sasl, kafka_security_protocol="SASL_PLAINTEXT", kafka_sasl_mechanism="PLAIN",
                kafka_sasl_username="alice", kafka_sasl_password=PASSWORD),
        _kwargs(secured.tls, kafka_security_protocol="SSL", kafka_ssl_cafile=ca),
        _kwargs(secured.mtls, kafka_security_protocol="SSL", kafka_ssl_cafile=ca,
                kafka_ssl_certfile=str(secured.pki / "client.pem"), kafka_ssl_keyfile=str(secured.pki / "client.key")),
    ):
        await require_broker(kwargs)  # the right settings: answered


async def test_a_broker_that_is_down_is_still_transient() -> None:
    with pytest.raises(ConfigError, match="did not answer after 3 attempts"):
        await require_broker(_kwargs(f"127.0.0.1:{free_port()}"))
