"""Every package of the source tree is in pyproject's package list: the wheel (and so the
image) holds only those listed, while an editable install finds the rest anyway."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_directory_is_listed_for_the_wheel() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())
                 ["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts)
             for top in ("protos", "coordinator", "learner", "chaos")
             for init in (ROOT / top).rglob("__init__.py")}
    assert found - listed == set(), f"not in [tool.setuptools].packages: {found - listed}"
