"""The event log of coordinators and learners: one JSON object per line.

Joins, leaves, pushes (invoked, acknowledged, rejected with reason),
commits with their manifests, pulls. The chaos harness merges the logs of
every process to check exactly-once and liveness invariants after a run,
so both sides write the same format through this one class.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TextIO


class EventLog:
    """Appends events to a file, or drops them when no path is configured."""

    def __init__(self, path: str, source: str = "coordinator") -> None:
        self.source = source
        self._out: TextIO | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._out = open(path, "a", buffering=1)  # noqa: SIM115 (lives as long as the log)

    def emit(self, kind: str, **fields: Any) -> None:
        if self._out is None:
            return
        record = {"t": time.time(), "source": self.source, "kind": kind, **fields}
        self._out.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
