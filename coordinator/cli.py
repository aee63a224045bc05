"""`ftsync-coordinator`: run the daemon (`serve`, the default), watch one (`status`),
probe one (`health`), drain one for an upgrade (`drain`) or make the certificates
a secure run needs (`certs`)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import grpc
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from coordinator import admin
from coordinator.certs import CertsError, make_certificates
from coordinator.config import ConfigError, CoordinatorConfig, describe, load, parse_overrides
from coordinator.durability import StateError
from protos import ftsync_pb2 as pb
from protos import ftsync_pb2_grpc as pb_grpc
from protos import tls
from protos.settings import number_or_auto


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command == "status":
        sys.exit(_status(args))
    if args.command == "certs":
        sys.exit(_certs(args))
    if args.command in ("health", "drain"):
        sys.exit(admin.run(args))
    if args.check_config:
        sys.exit(_check_config(args))
    try:
        config = _config(args)
    except ConfigError as exc:
        sys.exit(f"ftsync-coordinator: {exc}")
    from coordinator.daemon import serve

    try:
        asyncio.run(serve(config))
    except StateError as exc:
        sys.exit(f"ftsync-coordinator: cannot resume from {config.state_dir}: {exc}")
    except ConfigError as exc:
        sys.exit(f"ftsync-coordinator: {exc}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ftsync-coordinator",
        description="The ftsync synchronizer daemon: merges learners' fragments over gRPC.")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="run the daemon (default)")
    status = sub.add_parser("status", help="show a live table of a running daemon")
    health = sub.add_parser("health", help="probe the health service: exit 0 if the "
                                           "coordinator can commit (SERVING), else 1")
    drain = sub.add_parser("drain", help="commit the open rounds, hand leadership to an "
                                         "in-sync standby and exit, for an upgrade")
    certs = sub.add_parser("certs", help="write a CA and coordinator, admin and learner "
                                         "certificates")
    for p in (parser, serve):
        p.add_argument("--config", help="TOML configuration file")
        p.add_argument("--listen", help="HOST:PORT to serve on (port 0: any free port)")
        p.add_argument("--state-dir", help="directory for durable state")
        p.add_argument("--min-quorum", type=number_or_auto("a count"),
                       help="contributions needed to close a round, or auto")
        p.add_argument("--sync-mode", type=int, metavar="M",
                       help="lock-step baseline: quorum M learners, no grace window, "
                            "no stale contributions (overrides those keys of --set)")
        p.add_argument("--event-log", help="append JSONL events to this file")
        p.add_argument("--prometheus-listen", metavar="HOST:PORT",
                       help="serve /metrics at HOST:PORT, or at PORT on 127.0.0.1")
        p.add_argument("--etcd", metavar="HOST:PORT[,HOST:PORT...]",
                       help="run as one replica of a highly available synchronizer")
        p.add_argument("--replica-id", help="this replica's name (with --etcd)")
        p.add_argument("--advertise", help="HOST:PORT learners and replicas reach this one at")
        tls.add_flags(p, "this coordinator's certificate (served to learners, replicas and "
                         "operators, and presented to etcd and other replicas)")
        p.add_argument("--insecure", action="store_true", default=None,
                       help="serve plaintext on a non-loopback address (tls.insecure)")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override any config key, e.g. policy.gamma=0.3")
        p.add_argument("--check-config", action="store_true",
                       help="check the flags, the config and the files it names (tokens, "
                            "TLS), print the configuration and exit: 0 valid, 2 not")
    status.add_argument("--address", default="127.0.0.1:50051", help="daemon HOST:PORT")
    status.add_argument("--once", action="store_true", help="print one table and exit")
    status.add_argument("--interval", type=float, default=1.0, help="seconds between updates")
    status.add_argument("--token", default=os.environ.get("FTSYNC_ADMIN_TOKEN"),
                        help="the daemon's auth.admin_token, if it has one "
                             "(or FTSYNC_ADMIN_TOKEN)")
    tls.add_flags(status, "an operator's client certificate (admin.pem of `certs`)")
    for p in (health, drain):
        p.add_argument("--address", default="127.0.0.1:50051", help="daemon HOST:PORT")
    health.add_argument("--service", default="",
                        help="the service to ask about (default: the whole server)")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds to wait")
    tls.add_flags(health, "a client certificate, where the daemon requires one")
    drain.add_argument("--timeout", type=float, default=30.0,
                       help="seconds the daemon may take to commit its open rounds and "
                            "hand over")
    drain.add_argument("--token", default=os.environ.get("FTSYNC_ADMIN_TOKEN"),
                       help="the daemon's auth.admin_token, if it has one "
                            "(or FTSYNC_ADMIN_TOKEN)")
    tls.add_flags(drain, "an operator's client certificate (admin.pem of `certs`)")
    certs.add_argument("--out", required=True, help="directory to write the files into")
    certs.add_argument("--host", action="extend", nargs="+", default=[], metavar="NAME",
                       help="DNS names and IP addresses the coordinator and learners are "
                            "reached at (localhost and 127.0.0.1 always)")
    certs.add_argument("--learner", action="extend", nargs="+", default=[], metavar="ID",
                       help="learner ids to issue client certificates to")
    certs.add_argument("--days", type=int, default=365, help="validity in days")
    certs.add_argument("--reuse-ca", action="store_true",
                       help="issue from the CA already in --out instead of refusing")
    certs.add_argument("--force", action="store_true",
                       help="replace a CA already in --out")
    return parser


def _config(args: argparse.Namespace) -> CoordinatorConfig:
    overrides = parse_overrides(args.set)
    flags = {
        "listen": args.listen, "state_dir": args.state_dir,
        "policy.min_quorum": args.min_quorum, "event_log": args.event_log,
        "metrics.prometheus_listen": args.prometheus_listen,
        "ha.replica_id": args.replica_id, "ha.advertise": args.advertise,
        "tls.cert": args.tls_cert, "tls.key": args.tls_key, "tls.ca": args.tls_ca,
        "tls.insecure": args.insecure,
    }
    if args.sync_mode is not None:
        flags["policy.min_quorum"] = args.sync_mode
        flags["policy.grace_max_s"] = 0
        # In lock-step every push is based on the version just published. One that is
        # not missed its round (which closed without it: M others, an adversary among
        # them, made quorum); merged into the next round it would put its learner a
        # round out of phase with the others, and lock-step learners out of phase wait
        # on each other. Refused as stale, its learner applies that version and is
        # back in phase at its next push.
        flags["policy.max_staleness"] = 0
    for key, value in flags.items():
        if value is not None:
            overrides[key] = _toml_literal(value)
    if args.etcd is not None:
        endpoints = [e.strip() for e in args.etcd.split(",") if e.strip()]
        overrides["ha.etcd"] = "[" + ", ".join(_toml_literal(e) for e in endpoints) + "]"
    return load(CoordinatorConfig, args.config, overrides)


def _check_config(args: argparse.Namespace) -> int:
    """What a start checks before it touches anything, and nothing more: the state
    directory, etcd and the ports are not looked at, so it runs anywhere the
    files are (a pod's init container, a test)."""
    from coordinator.daemon import server_tls

    try:
        config = _config(args)
        config.tokens()
        server_tls(config)
    except ValueError as exc:  # ConfigError and TlsError
        print(f"ftsync-coordinator: {exc}", file=sys.stderr)
        return 2
    print(describe(config))
    return 0


def _toml_literal(value: object) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value).lower() if isinstance(value, bool) else str(value)


def _certs(args: argparse.Namespace) -> int:
    try:
        issued = make_certificates(args.out, args.host, args.learner, days=args.days,
                                   reuse_ca=args.reuse_ca, force=args.force)
    except (CertsError, OSError) as exc:
        print(f"ftsync-coordinator certs: {exc}", file=sys.stderr)
        return 2
    origin = "issued from the existing CA" if issued.reused_ca else "with a new CA"
    print(f"wrote {', '.join(issued.files)} into {issued.directory} ({origin})")
    return 0


def _status(args: argparse.Namespace) -> int:
    console = Console()
    try:
        material = tls.load(tls.from_flags(args))
    except (ValueError, tls.TlsError) as exc:
        console.print(f"[red]ftsync-coordinator status: {exc}[/red]")
        return 2
    channel = tls.channel(args.address, material)
    stub = pb_grpc.AdminStub(channel)
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else ()
    previous: tuple[float, pb.StatusResponse] | None = None
    try:
        if args.once:
            console.print(render_status(
                stub.Status(pb.StatusRequest(), timeout=5, metadata=metadata), None))
            return 0
        with Live(console=console, auto_refresh=False) as live:
            while True:
                status = stub.Status(pb.StatusRequest(), timeout=5, metadata=metadata)
                now = time.monotonic()
                live.update(render_status(status, previous and (now - previous[0],
                                                                previous[1])), refresh=True)
                previous = (now, status)
                time.sleep(args.interval)
    except grpc.RpcError as exc:
        problem = ("refused by" if exc.code() == grpc.StatusCode.UNAUTHENTICATED
                   else "cannot reach")
        console.print(f"[red]{problem} the coordinator at {args.address}: "
                      f"{exc.code().name} {exc.details()}[/red]")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        channel.close()


def render_status(status: pb.StatusResponse,
                  previous: tuple[float, pb.StatusResponse] | None) -> Group:
    """Learners, fragments and rates; rates need the previous poll."""
    versions_rate = mb_in_rate = 0.0
    if previous is not None and previous[0] > 0:
        dt, before = previous
        versions_rate = (sum(f.commits for f in status.fragments)
                         - sum(f.commits for f in before.fragments)) / dt
        mb_in_rate = (status.bytes_in - before.bytes_in) / dt / 1e6
    live = sum(1 for learner in status.learners if learner.live)
    rejected = ", ".join(f"{k}={v}" for k, v in sorted(status.rejections.items())) or "none"
    summary = (f"run {status.run_id or '-'}  up {status.uptime_s:.0f}s  quorum "
               f"{status.min_quorum or 'auto'}  learners {live}/{len(status.learners)} live  "
               f"in {status.bytes_in / 1e6:.1f} MB  out {status.bytes_out / 1e6:.1f} MB  "
               f"commits/s {versions_rate:.2f}  MB/s in {mb_in_rate:.1f}  rejected: {rejected}")
    learners = Table(title="learners", expand=False)
    for column in ("learner", "live", "heartbeat", "step time", "step", "contributions",
                   "rejections", "backlog", "MB in", "host"):
        learners.add_column(column, justify="right" if column != "learner" else "left")
    for learner in status.learners:
        learners.add_row(
            learner.learner_id, "yes" if learner.live else "[red]no[/red]",
            f"{learner.heartbeat_age_s:.1f}s ago",
            f"{learner.step_time_s * 1000:.0f} ms" if learner.step_time_s else "-",
            str(learner.local_step), str(learner.contributions), str(learner.rejections),
            str(learner.backlog), f"{learner.bytes_in / 1e6:.1f}", learner.host)
    fragments = Table(title="fragments", expand=False)
    for column in ("fragment", "version", "params", "open round", "round age", "grace left",
                   "commits", "merged", "last commit"):
        fragments.add_column(column, justify="right")
    for fragment in status.fragments:
        fragments.add_row(
            str(fragment.fragment), str(fragment.version), f"{fragment.numel:,}",
            ",".join(fragment.round_learners) or "-",
            f"{fragment.round_age_s:.1f}s" if fragment.round_learners else "-",
            f"{fragment.grace_left_s:.2f}s" if fragment.grace_left_s >= 0 else "-",
            str(fragment.commits), str(fragment.merged_contributions),
            f"{fragment.last_commit_age_s:.1f}s ago" if fragment.last_commit_age_s >= 0 else "-")
    return Group(summary, learners, fragments)
