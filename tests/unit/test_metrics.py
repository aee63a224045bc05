"""The coordinator's instruments: what `Admin.Status` reads from them."""

from __future__ import annotations

from coordinator.config import MetricsConfig
from coordinator.metrics import Metrics


def test_status_counts_come_from_the_instruments() -> None:
    metrics = Metrics(MetricsConfig())
    try:
        metrics.rejections.add(1, {"reason": "stale", "rpc": "PushFragment"})
        metrics.rejections.add(2, {"reason": "stale", "rpc": "Join"})
        metrics.rejections.add(1, {"reason": "not_finite", "rpc": "PushFragment"})
        metrics.bytes_in.add(4000)
        metrics.bytes_in.add(96)
        counts = metrics.counts()
        assert counts.by("ftsync_rejections", "reason") == {"stale": 3, "not_finite": 1}
        assert counts.total("ftsync_bytes_in") == 4096
        assert counts.total("ftsync_bytes_out") == 0
    finally:
        metrics.close()
