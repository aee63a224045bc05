"""`ftsync-coordinator certs`: a CA and the certificates a secure run needs.

Writes, into one directory, a CA (`ca.pem`, `ca.key`), the coordinator's
certificate (`coordinator.pem`/`.key`, issued to `ftsync-coordinator` with
every host given as a subject alternative name, localhost and 127.0.0.1
always; replicas also present it to each other and to etcd), an operator's
client certificate (`admin.pem`/`.key`, issued to `ftsync-admin`, for
Admin calls), and one per learner (`learner-ID.pem`/`.key`, issued to the
learner's id, with the same hosts, since learners also serve their peers).
Keys are written readable by their owner only. An existing CA is never
overwritten unless asked: every certificate it signed would stop being
trusted; `reuse_ca` issues more certificates from it instead.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from protos.tls import ADMIN_NAME, REPLICA_NAME

ALWAYS_HOSTS = ("localhost", "127.0.0.1")
# A learner id becomes a certificate name: keep it to what a DNS name may hold.
_LEARNER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


class CertsError(ValueError):
    """Arguments or an output directory that cannot be used."""


@dataclass(frozen=True)
class Issued:
    """What one call wrote."""

    directory: Path
    files: tuple[str, ...]
    reused_ca: bool


def make_certificates(out: str | Path, hosts: Sequence[str], learners: Sequence[str], *,
                      days: int = 365, reuse_ca: bool = False, force: bool = False,
                      now: datetime.datetime | None = None) -> Issued:
    """Write the CA (unless reused) and the coordinator's, admin's and learners'
    certificates; see the module docstring. Raises `CertsError`."""
    if days < 1:
        raise CertsError(f"--days must be at least 1 (got {days})")
    for learner in learners:
        if not _LEARNER_ID.fullmatch(learner):
            raise CertsError(f"--learner {learner!r}: a learner id in a certificate must be "
                             f"letters, digits, '.', '_' or '-', starting with a letter or "
                             f"digit, at most 63 characters")
        if learner in (ADMIN_NAME, REPLICA_NAME):
            raise CertsError(f"--learner {learner!r} is the name of a role's certificate")
    names = _host_names(hosts)
    directory = Path(out)
    ca_cert_path, ca_key_path = directory / "ca.pem", directory / "ca.key"
    ca_exists = ca_cert_path.exists() or ca_key_path.exists()
    if ca_exists and not (reuse_ca or force):
        raise CertsError(f"{ca_cert_path} exists: pass --reuse-ca to issue more certificates "
                         f"from it, or --force to replace it (whatever it signed stops being "
                         f"trusted)")
    now = now or datetime.datetime.now(datetime.UTC)
    directory.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    if ca_exists and reuse_ca:
        ca_cert, ca_key = _load_ca(ca_cert_path, ca_key_path)
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _ca_certificate(ca_key, now, days)
        _write(directory, "ca", ca_cert, ca_key, written)
    issue = [(REPLICA_NAME, "coordinator", names), (ADMIN_NAME, "admin", [])]
    issue += [(learner, f"learner-{learner}", [learner, *names]) for learner in learners]
    for subject, stem, sans in issue:
        key = ec.generate_private_key(ec.SECP256R1())
        certificate = _leaf_certificate(subject, sans, key, ca_cert, ca_key, now, days)
        _write(directory, stem, certificate, key, written)
    return Issued(directory, tuple(written), ca_exists and reuse_ca)


def _host_names(hosts: Sequence[str]) -> list[str]:
    names: list[str] = []
    for host in (*ALWAYS_HOSTS, *hosts):
        host = host.strip()
        if not host or any(c.isspace() for c in host) or "/" in host:
            raise CertsError(f"--host {host!r} is not a DNS name or IP address")
        if host not in names:
            names.append(host)
    return names


def _subject_alternative_names(names: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _ca_certificate(key: ec.EllipticCurvePrivateKey, now: datetime.datetime,
                    days: int) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ftsync CA")])
    return (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))


def _leaf_certificate(subject: str, sans: Sequence[str], key: ec.EllipticCurvePrivateKey,
                      ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
                      now: datetime.datetime, days: int) -> x509.Certificate:
    # Every certificate may both serve and be presented as a client's: replicas
    # and learners are each server and client of their peers.
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(min(now + datetime.timedelta(days=days),
                                 ca_cert.not_valid_after_utc))
            .add_extension(_subject_alternative_names([subject, *sans]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))


def _load_ca(cert_path: Path, key_path: Path) -> tuple[x509.Certificate,
                                                       ec.EllipticCurvePrivateKey]:
    try:
        certificate = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise CertsError(f"cannot reuse the CA in {cert_path.parent}: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertsError(f"{key_path}: the CA key is not an elliptic-curve key made by "
                         f"ftsync-coordinator certs")
    return certificate, key


def _write(directory: Path, stem: str, certificate: x509.Certificate,
           key: ec.EllipticCurvePrivateKey, written: list[str]) -> None:
    key_path = directory / f"{stem}.key"
    key_bytes = key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(key_bytes)
    os.chmod(key_path, 0o600)  # an existing file keeps its mode through O_CREAT
    (directory / f"{stem}.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    written += [f"{stem}.pem", f"{stem}.key"]
