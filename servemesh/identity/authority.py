"""The mesh's certificate authority: one self-signed CA, and leaf certificates it signs.

Every leaf is good for both ends of a TLS connection (server and client auth), because
every service both serves and calls. A leaf names its identity three ways: a SPIFFE-style
URI (`spiffe://<mesh>/<identity>`, what Envoy matches), a DNS name
(`<identity>.<mesh>.internal`, what a Python client checks through
`grpc.ssl_target_name_override`, so the address it dials never matters), and the loopback
names and addresses, so that grpcurl with `-cacert` alone works against the edge.

Keys are ECDSA P-256: small, and quick to sign and verify on every new connection.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK_NAMES = ("localhost",)
LOOPBACK_ADDRESSES = ("127.0.0.1", "::1")


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, both PEM."""

    cert_pem: bytes
    key_pem: bytes

    @property
    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)


def dns_name(identity: str, mesh: str) -> str:
    """The DNS name a leaf of `identity` carries (clients verify it, whatever address they dial)."""
    return f"{identity}.{mesh}.internal"


def spiffe_id(identity: str, mesh: str) -> str:
    return f"spiffe://{mesh}/{identity}"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _private_key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def create_authority(mesh: str, *, days: int = 3650) -> KeyPair:
    """A new self-signed CA for the mesh named `mesh`."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, mesh),
            x509.NameAttribute(NameOID.COMMON_NAME, f"{mesh} mesh CA"),
        ]
    )
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _private_key_pem(key))


def issue_leaf(
    authority: KeyPair,
    identity: str,
    mesh: str,
    *,
    days: int = 30,
    extra_names: tuple[str, ...] = (),
) -> KeyPair:
    """A certificate for `identity`, signed by `authority`, for server and client auth.

    `extra_names`: more DNS names or IP addresses it answers to (the edge's public names)."""
    ca_cert = authority.certificate
    ca_key = serialization.load_pem_private_key(authority.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the mesh CA key is not an EC key")
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(spiffe_id(identity, mesh)),
        x509.DNSName(dns_name(identity, mesh)),
    ]
    for entry in (*LOOPBACK_NAMES, *LOOPBACK_ADDRESSES, *extra_names):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(entry)))
        except ValueError:
            names.append(x509.DNSName(entry))
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, mesh),
                    x509.NameAttribute(NameOID.COMMON_NAME, identity),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _private_key_pem(key))


def time_left(cert_pem: bytes) -> dt.timedelta:
    cert = x509.load_pem_x509_certificate(cert_pem)
    return cert.not_valid_after_utc - _now()


def lifetime(cert_pem: bytes) -> dt.timedelta:
    cert = x509.load_pem_x509_certificate(cert_pem)
    return cert.not_valid_after_utc - cert.not_valid_before_utc
