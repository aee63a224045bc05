"""Per-pair network cuts inside a container: `unreachable` routes over netlink.

The docker backend of the chaos harness cuts one container off from chosen
others (a learner from the leader, the leader from etcd) without touching the
rest of its links: in each side's network namespace it adds a host route that
makes the other side's address unreachable, and deletes it to heal. Docker
offers no per-pair rule of its own, and the image has no `ip` or `iptables`,
so this module speaks rtnetlink with the standard library only. It runs as
`python3 -c SOURCE add|del ADDRESS...` in a short-lived helper container that
shares the target's network namespace and holds CAP_NET_ADMIN, so it works on
any image with a Python and needs nothing of the harness's code in it.

Sends to a cut address fail at once (EHOSTUNREACH); what the other side sends
arrives, but nothing answers it, so its connections go silent as over a cut
cable. With the route on both sides no byte crosses either way.
"""

from __future__ import annotations

import os
import socket
import struct
import sys

_RTM_NEWROUTE, _RTM_DELROUTE, _NLMSG_ERROR = 24, 25, 2
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_EXCL, _NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
_RT_TABLE_MAIN, _RTPROT_STATIC, _RT_SCOPE_UNIVERSE, _RTN_UNREACHABLE = 254, 4, 0, 7
_RTA_DST = 1


def _request(kind: int, flags: int, address: str, seq: int) -> bytes:
    rtmsg = struct.pack("=BBBBBBBBI", socket.AF_INET, 32, 0, 0, _RT_TABLE_MAIN,
                        _RTPROT_STATIC, _RT_SCOPE_UNIVERSE, _RTN_UNREACHABLE, 0)
    dst = struct.pack("=HH", 8, _RTA_DST) + socket.inet_aton(address)
    body = rtmsg + dst
    return struct.pack("=IHHII", 16 + len(body), kind, flags, seq, 0) + body


def change(action: str, addresses: list[str]) -> list[str]:
    """Add (`add`) or delete (`del`) an unreachable route to each address; returns
    a line per address that failed (a route already there or already gone is not
    a failure: heals and re-applications are idempotent)."""
    kind = _RTM_NEWROUTE if action == "add" else _RTM_DELROUTE
    flags = _NLM_F_REQUEST | _NLM_F_ACK | (_NLM_F_CREATE | _NLM_F_EXCL if action == "add" else 0)
    failed = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        for seq, address in enumerate(addresses, start=1):
            sock.send(_request(kind, flags, address, seq))
            reply = sock.recv(65536)
            kind_got = struct.unpack_from("=H", reply, 4)[0]
            error = -struct.unpack_from("=i", reply, 16)[0] if kind_got == _NLMSG_ERROR else 0
            benign = {"add": 17, "del": 3}[action]  # EEXIST, ESRCH
            if error and error != benign:
                failed.append(f"{action} {address}: {os.strerror(error)}")
    return failed


def main(argv: list[str]) -> int:
    if len(argv) < 1 or argv[0] not in ("add", "del"):
        print("usage: routes add|del ADDRESS...", file=sys.stderr)
        return 2
    failed = change(argv[0], argv[1:])
    for line in failed:
        print(line, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
