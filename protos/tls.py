"""TLS for every ftsync channel, from one certificate, key and CA per process.

Coordinators, learners, replicas and the CLIs all configure TLS with the same
three files (`TlsConfig`): the certificate this process presents, its key,
and the CA that signs the other side. A server given a CA requires client
certificates (mutual TLS); a client given a certificate presents it. Files
are read and checked once, when a process starts (`load`), so a missing,
expired or mismatched file is refused in one line that names it instead of
surfacing as a failed handshake later. The same material makes gRPC
credentials and the `ssl` contexts of the raw bulk connections, so both
halves of a channel are secured alike.

Plaintext stays the default on loopback, where the README's commands run;
a server on any other address needs TLS or an explicit `insecure`
(`check_server`).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

# Names that client certificates for the two roles beside learners are issued to
# (`ftsync-coordinator certs` makes both): replicas replicating to each other, and
# operators calling Admin.
REPLICA_NAME = "ftsync-coordinator"
ADMIN_NAME = "ftsync-admin"


class TlsError(ValueError):
    """TLS settings or files that cannot be used; the message names the file."""


@dataclass(frozen=True)
class TlsConfig:
    """Paths of PEM files; all empty: plaintext."""

    # Certificate this process presents: a server's, or a client's for mutual TLS.
    cert: str = ""
    key: str = ""
    # CA that signs the other side: clients verify servers with it; a server
    # given it requires client certificates signed by it.
    ca: str = ""
    # Serve plaintext on a non-loopback address (refused otherwise).
    insecure: bool = False

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("tls.cert and tls.key go together (got only "
                             f"{'tls.cert' if self.cert else 'tls.key'})")

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)


@dataclass(frozen=True)
class TlsMaterial:
    """The checked bytes of a `TlsConfig`'s files."""

    cert: bytes | None
    key: bytes | None
    ca: bytes | None
    # The names the certificate is issued to: its CN and DNS/IP SANs.
    names: frozenset[str]
    # Where they came from (`ssl` reads a certificate chain only from files).
    config: TlsConfig

    @property
    def can_serve(self) -> bool:
        return self.cert is not None


def load(config: TlsConfig | None,
         now: datetime.datetime | None = None) -> TlsMaterial | None:
    """Read and check the files; None for plaintext. Raises `TlsError`."""
    if config is None or not config.enabled:
        return None
    now = now or datetime.datetime.now(datetime.UTC)
    ca = _read(config.ca, "tls.ca") if config.ca else None
    if ca is not None:
        try:
            authorities = x509.load_pem_x509_certificates(ca)
        except ValueError as exc:
            raise TlsError(f"tls.ca {config.ca}: not a PEM certificate ({exc})") from None
        for authority in authorities:
            _check_validity(authority, f"tls.ca {config.ca}", now)
    if not config.cert:
        return TlsMaterial(None, None, ca, frozenset(), config)
    cert, key = _read(config.cert, "tls.cert"), _read(config.key, "tls.key")
    try:
        leaf = x509.load_pem_x509_certificates(cert)[0]
    except ValueError as exc:
        raise TlsError(f"tls.cert {config.cert}: not a PEM certificate ({exc})") from None
    try:
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as exc:
        raise TlsError(f"tls.key {config.key}: not an unencrypted PEM private key "
                       f"({exc})") from None
    if _public_bytes(private.public_key()) != _public_bytes(leaf.public_key()):
        raise TlsError(f"tls.key {config.key} is not the key of tls.cert {config.cert}")
    _check_validity(leaf, f"tls.cert {config.cert}", now)
    return TlsMaterial(cert, key, ca, frozenset(certificate_names(leaf)), config)


def certificate_names(certificate: x509.Certificate) -> list[str]:
    """The certificate's common name, then its DNS and IP subject alternative names."""
    names = [str(a.value) for a in certificate.subject.get_attributes_for_oid(
        NameOID.COMMON_NAME)]
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return names
    names += san.get_values_for_type(x509.DNSName)
    names += [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    return names


def _read(path: str, key: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TlsError(f"{key} {path}: cannot read it ({exc.strerror})") from None


def _public_bytes(public: Any) -> bytes:
    return bytes(public.public_bytes(serialization.Encoding.DER,
                                     serialization.PublicFormat.SubjectPublicKeyInfo))


def _check_validity(certificate: x509.Certificate, what: str, now: datetime.datetime) -> None:
    if now > certificate.not_valid_after_utc:
        raise TlsError(f"{what} expired on {certificate.not_valid_after_utc:%Y-%m-%d %H:%M} "
                       f"UTC; issue a new one (ftsync-coordinator certs)")
    if now < certificate.not_valid_before_utc:
        raise TlsError(f"{what} is not valid before "
                       f"{certificate.not_valid_before_utc:%Y-%m-%d %H:%M} UTC")


# -- the command-line flags -----------------------------------------------------------


def add_flags(parser: argparse.ArgumentParser, cert_help: str,
              ca_help: str = "CA that signs the other side; on a server, client certificates "
                             "are then required (mutual TLS)") -> None:
    """--tls-cert, --tls-key and --tls-ca, the same on every console script."""
    parser.add_argument("--tls-cert", metavar="PEM", help=f"TLS certificate: {cert_help}")
    parser.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    parser.add_argument("--tls-ca", metavar="PEM", help=ca_help)


def from_flags(args: argparse.Namespace, insecure: bool = False) -> TlsConfig:
    """The settings the flags give; ValueError for a certificate without its key."""
    return TlsConfig(cert=args.tls_cert or "", key=args.tls_key or "", ca=args.tls_ca or "",
                     insecure=insecure)


def as_flags(config: TlsConfig) -> list[str]:
    """The flags that give `config` to another ftsync process."""
    flags = ["--tls-cert", config.cert, "--tls-key", config.key] if config.cert else []
    return [*flags, "--tls-ca", config.ca] if config.ca else flags


# -- plaintext only on loopback ------------------------------------------------------


def is_loopback(address: str) -> bool:
    """Whether HOST:PORT names this machine only (an empty or wildcard host does not)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_server(address: str, material: TlsMaterial | None, insecure: bool,
                 what: str) -> None:
    """What every server checks before it listens on `address`: TLS needs a
    certificate of its own, and plaintext beyond loopback needs `insecure`."""
    if material is not None and not material.can_serve:
        raise TlsError(f"{what}: tls.ca alone is not enough to serve TLS; give --tls-cert "
                       f"and --tls-key (tls.cert, tls.key) too")
    if material is None and not insecure and not is_loopback(address):
        raise TlsError(f"{what} would listen on {address} without TLS: give --tls-cert and "
                       f"--tls-key (tls.cert, tls.key), or --insecure (tls.insecure) to "
                       f"serve plaintext beyond loopback")


# -- gRPC ---------------------------------------------------------------------------


def add_port(server: grpc.aio.Server, address: str, material: TlsMaterial | None) -> int:
    """Bind `address` with TLS when there is material; the bound port (0: failed)."""
    if material is None:
        return int(server.add_insecure_port(address))
    if material.cert is None or material.key is None:
        raise TlsError("a server needs tls.cert and tls.key, not only tls.ca")
    credentials = grpc.ssl_server_credentials(
        [(material.key, material.cert)], root_certificates=material.ca,
        require_client_auth=material.ca is not None)
    return int(server.add_secure_port(address, credentials))


def channel_credentials(material: TlsMaterial) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=material.ca,
                                        private_key=material.key,
                                        certificate_chain=material.cert)


def aio_channel(address: str, material: TlsMaterial | None,
                options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    if material is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, channel_credentials(material), options=list(options))


def channel(address: str, material: TlsMaterial | None,
            options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A blocking channel, for the command-line tools."""
    if material is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, channel_credentials(material), options=list(options))


def peer_names(context: grpc.aio.ServicerContext[Any, Any]) -> frozenset[str] | None:
    """Names in the client's verified certificate; None without one (plaintext or
    TLS without client certificates)."""
    auth = context.auth_context() or {}
    names = [*auth.get("x509_common_name", ()), *auth.get("x509_subject_alternative_name", ())]
    if not names:
        return None
    return frozenset(n.decode() if isinstance(n, bytes) else str(n) for n in names)


# -- raw bulk connections -----------------------------------------------------------


def server_context(material: TlsMaterial) -> ssl.SSLContext:
    """What a bulk port accepts: our certificate, and the CA's clients when one is set."""
    if material.cert is None:
        raise TlsError("a server needs tls.cert and tls.key, not only tls.ca")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(context, material)
    if material.ca is not None:
        context.load_verify_locations(cadata=material.ca.decode())
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(material: TlsMaterial) -> ssl.SSLContext:
    """What a bulk client checks: the server's certificate against our CA (or the
    system's) and its name against the host dialled; presents ours if we have one."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if material.ca is not None:
        context.load_verify_locations(cadata=material.ca.decode())
    else:
        context.load_default_certs()
    if material.cert is not None:
        _load_chain(context, material)
    return context


def _load_chain(context: ssl.SSLContext, material: TlsMaterial) -> None:
    context.load_cert_chain(material.config.cert, material.config.key)


# -- saying why a connection failed --------------------------------------------------

# What a server's TLS alert means for the client that received it.
_ALERTS = {
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "requires a client certificate: give --tls-cert and "
                                         "--tls-key",
    "SSLV3_ALERT_HANDSHAKE_FAILURE": "requires a client certificate: give --tls-cert and "
                                     "--tls-key",
    "TLSV1_ALERT_UNKNOWN_CA": "does not trust this client's certificate: it is not signed by "
                              "the CA the server was given (its tls.ca)",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "refused this client's certificate as expired",
    "SSLV3_ALERT_BAD_CERTIFICATE": "refused this client's certificate",
    "TLSV1_ALERT_DECRYPT_ERROR": "refused this client's certificate",
}


def diagnose(address: str, material: TlsMaterial | None, timeout_s: float = 3.0) -> str:
    """Why a gRPC connection to `address` fails at the TLS layer, in words; "" when
    TLS is not the problem (or the server cannot be reached at all). gRPC reports
    every handshake failure as an unavailable server ("Socket closed"), so this
    repeats the handshake with Python's `ssl`, which names the alert."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        raw = socket.create_connection((host, int(port)), timeout=timeout_s)
    except (OSError, ValueError):
        return ""
    with raw:
        if material is None:
            probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            probe.check_hostname = False
            probe.verify_mode = ssl.CERT_NONE
            try:
                probe.wrap_socket(raw, server_hostname=host).close()
            except (OSError, ssl.SSLError):
                return ""  # not a TLS server: something else is wrong
            return (f"{address} serves TLS and this client speaks plaintext: give --tls-ca "
                    f"(and --tls-cert/--tls-key where it requires client certificates)")
        context = client_context(material)
        context.set_alpn_protocols(["h2"])  # gRPC servers close connections without it
        try:
            conn = context.wrap_socket(raw, server_hostname=host)
        except ssl.SSLCertVerificationError as exc:
            return (f"the certificate {address} presents is not trusted: {exc.verify_message} "
                    f"(is --tls-ca the CA that signed it, and is {host!r} among its names?)")
        except ssl.SSLError as exc:
            if exc.reason in _ALERTS:
                return f"{address} {_ALERTS[exc.reason]}"
            return (f"the TLS handshake with {address} failed ({exc.reason or exc}): is it "
                    f"serving TLS?")
        except OSError:
            return ""
        with conn:
            # Under TLS 1.3 a server judges the client's certificate after the client's
            # side of the handshake is done; its verdict comes on the first read: an
            # alert, or (gRPC's servers) the connection closed without a word.
            conn.settimeout(timeout_s)
            try:
                conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                answered = conn.recv(1)
            except ssl.SSLError as exc:
                if exc.reason in _ALERTS:
                    return f"{address} {_ALERTS[exc.reason]}"
                return f"{address} ended the TLS session ({exc.reason or exc})"
            except OSError:
                return ""
            if answered:
                return ""
            if material.cert is None:
                return f"{address} {_ALERTS['TLSV13_ALERT_CERTIFICATE_REQUIRED']}"
            return (f"{address} closed the connection on this client's certificate: it is not "
                    f"signed by the CA the server trusts (its tls.ca), or the server does not "
                    f"accept it")
    return ""
    return ""
