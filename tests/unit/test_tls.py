"""TLS files and the certificate helper: what is refused, and why, before anything
connects; what `ftsync-coordinator certs` writes."""

from __future__ import annotations

import datetime
import stat
from pathlib import Path

import pytest
from cryptography import x509

from coordinator.certs import CertsError, make_certificates
from protos import tls
from protos.tls import ADMIN_NAME, REPLICA_NAME, TlsConfig, TlsError


def config(directory: Path, stem: str, ca: bool = True) -> TlsConfig:
    return TlsConfig(cert=str(directory / f"{stem}.pem"), key=str(directory / f"{stem}.key"),
                     ca=str(directory / "ca.pem") if ca else "")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    make_certificates(out, ["coordinator-0.ftsync", "10.1.2.3"], ["l0", "l1"])
    return out


def test_certs_writes_a_ca_and_one_certificate_per_role_and_learner(certs: Path) -> None:
    names = sorted(p.name for p in certs.iterdir())
    assert names == sorted(f"{stem}.{ext}" for stem in
                           ("ca", "coordinator", "admin", "learner-l0", "learner-l1")
                           for ext in ("pem", "key"))
    for key in certs.glob("*.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    coordinator = tls.load(config(certs, "coordinator"))
    assert coordinator is not None
    assert {REPLICA_NAME, "localhost", "127.0.0.1", "coordinator-0.ftsync",
            "10.1.2.3"} <= coordinator.names
    learner = tls.load(config(certs, "learner-l0"))
    assert learner is not None and "l0" in learner.names and "l1" not in learner.names
    admin = tls.load(config(certs, "admin"))
    assert admin is not None and ADMIN_NAME in admin.names


def test_certs_refuses_to_overwrite_a_ca_unless_asked(certs: Path) -> None:
    before = (certs / "ca.pem").read_bytes()
    with pytest.raises(CertsError, match="--reuse-ca"):
        make_certificates(certs, [], ["l2"])
    assert not (certs / "learner-l2.pem").exists()
    issued = make_certificates(certs, [], ["l2"], reuse_ca=True)
    assert issued.reused_ca and (certs / "ca.pem").read_bytes() == before
    authority = x509.load_pem_x509_certificate(before)
    x509.load_pem_x509_certificate((certs / "learner-l2.pem").read_bytes()) \
        .verify_directly_issued_by(authority)


def test_certs_force_replaces_the_ca(tmp_path: Path) -> None:
    make_certificates(tmp_path, [], [])
    before = (tmp_path / "ca.pem").read_bytes()
    make_certificates(tmp_path, [], [], force=True)
    assert (tmp_path / "ca.pem").read_bytes() != before


@pytest.mark.parametrize("learner, problem", [
    ("", "a learner id"), ("has space", "a learner id"), ("-dash", "a learner id"),
    (ADMIN_NAME, "role"), (REPLICA_NAME, "role")])
def test_certs_refuses_learner_ids_a_certificate_cannot_carry(tmp_path: Path, learner: str,
                                                              problem: str) -> None:
    with pytest.raises(CertsError, match=problem):
        make_certificates(tmp_path, [], [learner])
    assert list(tmp_path.iterdir()) == []


def test_certs_refuses_a_bad_host_and_days(tmp_path: Path) -> None:
    with pytest.raises(CertsError, match="--host"):
        make_certificates(tmp_path, ["a b"], [])
    with pytest.raises(CertsError, match="--days"):
        make_certificates(tmp_path, [], [], days=0)
    assert list(tmp_path.iterdir()) == []


def test_an_expired_or_not_yet_valid_certificate_is_refused_at_load(tmp_path: Path) -> None:
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=30)
    make_certificates(tmp_path, [], ["l0"], days=2, now=past)
    with pytest.raises(TlsError, match=r"tls.ca .*expired on"):
        tls.load(config(tmp_path, "learner-l0"))
    with pytest.raises(TlsError, match=r"tls.cert .*expired on"):
        tls.load(config(tmp_path, "learner-l0", ca=False))
    with pytest.raises(TlsError, match="not valid before"):
        tls.load(config(tmp_path, "learner-l0", ca=False),
                 now=past - datetime.timedelta(days=1))


def test_files_that_cannot_be_used_are_named(certs: Path, tmp_path: Path) -> None:
    with pytest.raises(TlsError, match=r"tls.cert .*missing.pem: cannot read it"):
        tls.load(TlsConfig(cert=str(tmp_path / "missing.pem"), key=str(certs / "admin.key")))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(TlsError, match=r"tls.ca .*junk.pem: not a PEM certificate"):
        tls.load(TlsConfig(ca=str(tmp_path / "junk.pem")))
    with pytest.raises(TlsError, match=r"tls.key .*junk.pem: not an unencrypted PEM"):
        tls.load(TlsConfig(cert=str(certs / "admin.pem"), key=str(tmp_path / "junk.pem")))
    with pytest.raises(TlsError, match="is not the key of"):
        tls.load(TlsConfig(cert=str(certs / "admin.pem"), key=str(certs / "learner-l0.key")))
    with pytest.raises(ValueError, match=r"tls\.cert and tls\.key go together"):
        TlsConfig(cert=str(certs / "admin.pem"))


def test_no_files_is_plaintext_and_a_ca_alone_is_a_client_without_a_certificate(
        certs: Path) -> None:
    assert tls.load(TlsConfig()) is None and tls.load(None) is None
    client_only = tls.load(TlsConfig(ca=str(certs / "ca.pem")))
    assert client_only is not None and not client_only.can_serve


@pytest.mark.parametrize("address, loopback", [
    ("127.0.0.1:50051", True), ("127.8.9.1:1", True), ("localhost:5", True), ("[::1]:5", True),
    ("0.0.0.0:50051", False), ("[::]:50051", False), (":50051", False),
    ("10.0.0.5:50051", False), ("coordinator:50051", False)])
def test_plaintext_is_allowed_on_loopback_only(address: str, loopback: bool) -> None:
    assert tls.is_loopback(address) == loopback
    if loopback:
        tls.check_server(address, None, False, "a server")
    else:
        with pytest.raises(TlsError, match="without TLS: give --tls-cert"):
            tls.check_server(address, None, False, "a server")
    tls.check_server(address, None, True, "a server")


def test_ftsync_learner_refuses_a_certificate_issued_to_another_learner(certs: Path) -> None:
    import subprocess
    import sys

    files = ["--tls-cert", str(certs / "learner-l0.pem"), "--tls-key",
             str(certs / "learner-l0.key"), "--tls-ca", str(certs / "ca.pem")]

    def check(learner: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "learner", "--check-config", "--task",
                               "synthetic", "--learner-id", learner, *files],
                              capture_output=True, text=True, timeout=60)

    assert check("l0").returncode == 0
    refused = check("l1")
    assert refused.returncode == 2
    assert "--tls-cert is issued to" in refused.stderr and "'l1'" in refused.stderr
