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
    # Spark's source (Java 17) cannot decrypt an openssl-encrypted PKCS#8 key (PBES2): it
    # gets the key decrypted, in memory
    spark = spark_kafka_options(options)
    assert "kafka.ssl.key.password" not in spark
    assert spark["kafka.ssl.keystore.key"] == (pki / "client.key").read_text()
    # an unencrypted key ignores the option, as OpenSSL does
    assert "ssl_context" in mtls(pki, kafka_ssl_key_password="unused").kafka_client_kwargs()


def test_spark_gets_pkcs8_keys_and_the_ca_inline(pki: Path) -> None:
    # A PKCS#1 key ("BEGIN RSA PRIVATE KEY") was passed verbatim: Kafka's PEM keystore takes
    # PKCS#8 only, and Spark's source failed with "Failed to create new KafkaAdminClient". The
    # CA file went by path (kafka.ssl.truststore.location): it had to exist on every executor.
    from cryptography.hazmat.primitives import serialization

    from warehouse.read import spark_kafka_options

    ca = pki / "client.pem"  # self-signed: its own CA
    spark = spark_kafka_options(mtls(pki, "client_pkcs1.key", kafka_ssl_cafile=str(ca)))
    assert spark["kafka.ssl.keystore.key"].startswith("-----BEGIN PRIVATE KEY-----")
    converted = serialization.load_pem_private_key(spark["kafka.ssl.keystore.key"].encode(), None)
    original = serialization.load_pem_private_key((pki / "client.key").read_bytes(), None)
    assert converted.private_numbers() == original.private_numbers()  # type: ignore[union-attr]
    assert spark["kafka.ssl.truststore.certificates"] == ca.read_text()
    assert spark["kafka.ssl.truststore.type"] == "PEM" and "kafka.ssl.truststore.location" not in spark
    # a PKCS#8 key goes as it is
    assert spark_kafka_options(mtls(pki))["kafka.ssl.keystore.key"] == (pki / "client.key").read_text()


@pytest.mark.parametrize("field", ["kafka_sasl_username", "kafka_sasl_password"])
def test_a_control_character_in_a_sasl_login_is_refused_for_spark(field: str) -> None:
    # orjson wrote "\u0001", which Spark's JAAS parser reads as "u0001": another password.
    from warehouse.read import spark_kafka_options

    login = {"kafka_sasl_username": "alice", "kafka_sasl_password": "pw", field: "a\x01b"}
    options = KafkaOptions(kafka_bootstrap="k:1", kafka_security_protocol="SASL_PLAINTEXT", **login)
    with pytest.raises(ConfigError, match=f"--{field.replace('_', '-')} holds a control character"):
        spark_kafka_options(options)
    ok = KafkaOptions(kafka_bootstrap="k:1", kafka_security_protocol="SASL_PLAINTEXT",
                      kafka_sasl_username="alice", kafka_sasl_password='q"\\ é;')
    assert 'password="q\\"\\\\ é;";' in spark_kafka_options(ok)["kafka.sasl.jaas.config"]


def test_security_options_the_protocol_does_not_use_are_not_silently_ignored(
    pki: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    # --kafka-ssl-* with PLAINTEXT, --kafka-sasl-* with SSL and a key without its certificate
    # were dropped without a word.
    caplog.set_level("WARNING", logger="walbus.kafka")
    for _ in range(2):  # once, however many clients are made
        KafkaOptions(kafka_bootstrap="k:1", kafka_ssl_cafile="/x/ca.pem", kafka_sasl_username="u").kafka_client_kwargs()
    KafkaOptions(kafka_bootstrap="k:1", kafka_security_protocol="SSL", kafka_sasl_password="pw").kafka_client_kwargs()
    assert [r.getMessage() for r in caplog.records] == [
        "--kafka-ssl-cafile, --kafka-sasl-username not used with --kafka-security-protocol PLAINTEXT",
        "--kafka-sasl-password not used with --kafka-security-protocol SSL",
    ]
    with pytest.raises(ConfigError, match="need --kafka-ssl-certfile"):
        KafkaOptions(kafka_bootstrap="k:1", kafka_security_protocol="SSL",
                     kafka_ssl_keyfile=str(pki / "client.key")).kafka_client_kwargs()
