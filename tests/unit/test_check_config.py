"""`--check-config` of ftsync-coordinator and ftsync-learner: what a start would
refuse, refused before anything is bound, dialled or written; a valid set-up
printed (secrets only as set or not). tests/unit/test_k8s.py runs the
Kubernetes manifests' command lines through it."""

from __future__ import annotations

from pathlib import Path

from coordinator.certs import make_certificates
from tests.cli import run_check


def test_coordinator_check_config_checks_what_a_start_checks(tmp_path: Path) -> None:
    make_certificates(tmp_path / "certs", [], [])
    code, out, _ = run_check(["ftsync-coordinator", "--listen", "0.0.0.0:50051", "--insecure"])
    assert code == 0 and "tls.insecure = True" in out
    refusals = {
        "without TLS": ["--listen", "0.0.0.0:50051"],
        "tls.ca alone": ["--tls-ca", str(tmp_path / "certs" / "ca.pem")],
        "not a PEM certificate": ["--tls-ca", str(tmp_path / "empty.pem")],
        "cannot read config": ["--config", str(tmp_path / "none.toml")],
        "tokens_file": ["--set", f"auth.tokens_file={tmp_path / 'none.toml'}"],
        "unknown key 'policy.quorum'": ["--set", "policy.quorum=2"],
    }
    (tmp_path / "empty.pem").write_text("")
    for words, args in refusals.items():
        code, out, err = run_check(["ftsync-coordinator", "serve", *args])
        assert code == 2 and words in err and not out, (args, err)
        assert len(err.strip().splitlines()) == 1, err


def test_learner_check_config_refuses_an_address_without_a_port() -> None:
    code, out, _ = run_check(["ftsync-learner", "--coordinator", "etcd://e-0:2379,e-1:2379/run",
                              "--token", "secret", "--device", "cuda:7"])
    assert code == 0 and "--token = '<set>'" in out and "secret" not in out
    for address in ("coordinator", "c:50051,c2", "etcd://e-0/run", "etcd:///run", "a b:1"):
        code, _, err = run_check(["ftsync-learner", "--coordinator", address])
        assert code == 2, (address, err)


def test_coordinator_check_config_takes_a_quorum_that_chooses_itself() -> None:
    code, out, _ = run_check(["ftsync-coordinator", "--min-quorum", "auto",
                              "--set", "policy.min_quorum_max=3"])
    assert code == 0, out
    assert "policy.min_quorum = 'auto'" in out and "policy.min_quorum_max = 3" in out
    code, out, err = run_check(["ftsync-coordinator", "--min-quorum", "most"])
    assert code == 2 and "--min-quorum: must be a count or auto (got 'most')" in err, err
    assert not out
    code, out, err = run_check(["ftsync-coordinator", "--set", "policy.min_quorum=most"])
    assert code == 2 and "policy.min_quorum must be int or one of ['auto']" in err, err
    code, out, err = run_check(["ftsync-coordinator", "--set", "policy.min_quorum_max=-1"])
    assert code == 2 and "policy.min_quorum_max must be >= 0" in err, err


def test_sync_every_auto_and_its_bounds_are_checked_by_name() -> None:
    code, out, _ = run_check(["ftsync-learner", "--sync-every", "auto"])
    assert code == 0 and "--sync-every = 'auto'" in out, out
    refusals = {
        ("ftsync-learner", "--sync-every", "banana"):
            "--sync-every: must be a number of steps or auto (got 'banana')",
        ("ftsync-learner", "--sync-every", "auto", "--lockstep"):
            "sync_every 'auto' needs lockstep off",
        ("ftsync-coordinator", "--set", "policy.h_min=0"): "policy.h_min must be >= 1",
        ("ftsync-coordinator", "--set", "policy.h_min=8", "--set", "policy.h_max=4"):
            "policy.h_max must be >= policy.h_min (8)",
    }
    for argv, words in refusals.items():
        code, out, err = run_check(list(argv))
        assert code == 2 and words in err and not out, (argv, err)
    code, out, _ = run_check(["ftsync-coordinator", "--set", "policy.h_max=20"])
    assert code == 0 and "policy.h_max = 20" in out, out
