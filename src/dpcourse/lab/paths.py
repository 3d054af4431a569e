"""Where the course is: the checkout a notebook, a lab or a command runs in (its one job)."""
from __future__ import annotations

from pathlib import Path


def project_root(start: Path | None = None) -> Path | None:
    """The course checkout that contains ``start`` (or the working directory), if any: the nearest
    folder upwards whose pyproject.toml names the dpcourse package."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        p = d / "pyproject.toml"
        if p.is_file() and 'name = "dpcourse"' in p.read_text(errors="ignore"):
            return d
    return None
