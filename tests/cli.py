"""Our console scripts run in-process with `--check-config`, as tests call them."""

from __future__ import annotations

import contextlib
import io
from importlib.metadata import entry_points

# ftsync's console scripts by name, from the installed package's metadata.
SCRIPTS = {ep.name: ep for ep in entry_points(group="console_scripts")
           if ep.value.split(".")[0] in ("coordinator", "learner", "chaos")}


def run_check(argv: list[str]) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of the console script argv[0] with --check-config."""
    main = SCRIPTS[argv[0]].load()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([*argv[1:], "--check-config"])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (1 if exc.code else 0)
    return code, out.getvalue(), err.getvalue()
