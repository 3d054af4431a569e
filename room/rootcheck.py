"""May root run the room's hub from here? Standard library only, so it runs before anything is
imported from the trees it checks.

    sudo /usr/bin/python3 -I room/rootcheck.py        # the course, its .venv, the proxy, the state

Whoever can change a file that a root process runs or reads is root. So every file and folder
under the course's checkout, its .venv, the interpreter the .venv points to (and its standard
library), configurable-http-proxy with node, and the hub's state folder must be owned by root and
writable by root alone, and so must each folder on the way to them (a root-owned sticky folder such
as /tmp excepted). A link is followed to what it names, which is checked the same way.

room/jupyterhub_config.py runs ``first_unsafe`` before it imports the course's library when the hub
runs as root, and refuses to start with the first offending path. The room's default is a service
user, not root (docs/instructor.md, "Deploying the hub").
"""
from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path


def _bad(st: os.stat_result) -> bool:
    """Not root's alone: another owner, or writable by group or others (a root sticky folder aside,
    where others may add files but not replace root's)."""
    sticky = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX and st.st_uid == 0
    return st.st_uid != 0 or bool(st.st_mode & 0o022 and not sticky)


def _say(path: Path, st: os.stat_result) -> str:
    return f"{path} (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})"


def _on_the_way(path: Path) -> str | None:
    for p in [*reversed(path.parents), path]:
        try:
            st = p.lstat()
        except FileNotFoundError:
            return None
        if not stat.S_ISLNK(st.st_mode) and _bad(st):  # a link's own mode means nothing
            return _say(p, st)
    return None


def first_unsafe(trees) -> str | None:
    """The first path under ``trees`` (or on the way to one) that root must not trust, or None."""
    seen: set[str] = set()
    todo = [Path(os.path.abspath(t)) for t in trees if t]
    while todo:
        top = todo.pop(0)
        if str(top) in seen:
            continue
        seen.add(str(top))
        if problem := _on_the_way(top):  # a missing file too: who may create it?
            return problem
        if not os.path.lexists(top):
            continue
        if str(real := Path(os.path.realpath(top))) != str(top):
            todo.append(real)  # a link on the way or at the end (.venv/bin/python): what it names
            if top.is_symlink():
                continue
        if not top.is_dir():
            continue
        for folder, dirs, files in os.walk(top):
            for name in dirs + files:
                p = Path(folder, name)
                st = p.lstat()
                if stat.S_ISLNK(st.st_mode):
                    target = os.path.realpath(p)
                    if not target.startswith(str(top) + os.sep):
                        todo.append(Path(target))  # outside this tree: check it too
                    continue
                if _bad(st):
                    return _say(p, st)
    return None


def hub_trees(course: Path, state: str, proxy: str = "") -> list:
    """What the hub runs or reads: the course (its .venv inside), the interpreter behind the .venv
    and its standard library, the proxy and node, the state folder."""
    python = Path(os.path.realpath(course / ".venv" / "bin" / "python"))
    stdlib = python.parent.parent / "lib" / python.name  # e.g. /usr/lib/python3.11
    venv = [sys.prefix] if sys.prefix != sys.base_prefix else []  # a .venv outside the course
    # the proxy the hub will run (dpcourse.cluster.hub.Settings finds it the same way):
    # make room-setup's, else the one on PATH; of a program, its package folder too
    # (.../configurable-http-proxy)
    local = course / "build" / "room" / "node_modules"
    proxy = proxy or (str(local) if local.exists()
                      else shutil.which("configurable-http-proxy") or str(local))
    trees = [course, *venv, python, stdlib, proxy, shutil.which("node") or "", state]
    if os.path.isfile(real := os.path.realpath(proxy)):
        trees.append(str(Path(real).parent.parent))
    return trees


if __name__ == "__main__":
    course = Path(__file__).resolve().parent.parent
    state = os.environ.get("DPCOURSE_HUB_STATE", "/var/lib/dpcourse-hub")
    problem = first_unsafe(hub_trees(course, state, os.environ.get("DPCOURSE_HUB_PROXY", "")))
    print(f"not safe for root: {problem}" if problem else "safe for root: it is root's alone")
    sys.exit(1 if problem else 0)
