"""Kafka security settings: client keys, what Spark is given, and how refusals are reported."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from walbus.config import ConfigError
from walbus.kafka import KafkaOptions

KEY_PASSWORD = "KeyPass-7"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A self-signed client certificate, its key as PKCS#8, encrypted PKCS#8 and PKCS#1 PEM."""
    d = tmp_path_factory.mktemp("pki")
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "client")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    (d / "client.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem, pkcs8 = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
    (d / "client.key").write_bytes(key.private_bytes(pem, pkcs8, serialization.NoEncryption()))
    (d / "client_enc.key").write_bytes(
        key.private_bytes(pem, pkcs8, serialization.BestAvailableEncryption(KEY_PASSWORD.encode()))
    )
    (d / "client_pkcs1.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption())
    )
    return d


def mtls(pki: Path, key: str = "client.key", **options: Any) -> KafkaOptions:
    return KafkaOptions(
        kafka_bootstrap="127.0.0.1:9093", kafka_security_protocol="SSL",
        kafka_ssl_certfile=str(pki / "client.pem"), kafka_ssl_keyfile=str(pki / key), **options,
    )


def test_an_encrypted_client_key_takes_its_passphrase_and_never_prompts(pki: Path) -> None:
    # Without a passphrase option, OpenSSL asked "Enter PEM pass phrase:" on the terminal (the
    # command hung) or failed with "Invalid argument"; Spark's source had no key password either.
    from warehouse.read import spark_kafka_options

    with pytest.raises(ConfigError, match=r"client_enc\.key is encrypted: give its passphrase with --kafka-ssl-key-password"):
        mtls(pki, "client_enc.key").kafka_client_kwargs()
    with pytest.raises(ConfigError, match=r"wrong --kafka-ssl-key-password"):
        mtls(pki, "client_enc.key", kafka_ssl_key_password="nope").kafka_client_kwargs()
    options = mtls(pki, "client_enc.key", kafka_ssl_key_password=KEY_PASSWORD)
    assert "ssl_context" in options.kafka_client_kwargs()
    spark = spark_kafka_options(options)
    assert spark["kafka.ssl.key.password"] == KEY_PASSWORD
    assert spark["kafka.ssl.keystore.key"].startswith("-----BEGIN ENCRYPTED PRIVATE KEY-----")
    # an unencrypted key ignores the option, as OpenSSL does
    assert "ssl_context" in mtls(pki, kafka_ssl_key_password="unused").kafka_client_kwargs()
