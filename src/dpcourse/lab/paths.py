"""Where the course is (the checkout a notebook, a lab or a command runs in), and a folder that is
this user's alone (a node-local copy's). Without torch: the data's staging command uses it."""
from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from dpcourse.lab.errors import CourseError


def project_root(start: Path | None = None) -> Path | None:
    """The course checkout that contains ``start`` (or the working directory), if any: the nearest
    folder upwards whose pyproject.toml names the dpcourse package."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        p = d / "pyproject.toml"
        if p.is_file() and 'name = "dpcourse"' in p.read_text(errors="ignore"):
            return d
    return None


def own_folder(path) -> Path:
    """``path`` as a folder of this user's alone, for a node-local copy: made here (mode 0700, where
    it is not there), or, where it is, a folder (not a link) that this user owns and no one else
    can write to. Anything else raises. On a disk that every user shares (/tmp), a folder at a name
    others can guess (a job's id) may be another user's, made beforehand so that the job reads
    their files, or writes through their links."""
    path = Path(path).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
        return path
    except FileExistsError:
        pass
    except OSError as err:
        raise CourseError(f"cannot make {path} ({err.strerror}): choose a node-local folder you "
                          "can write to.") from None
    st = path.lstat()
    why = ("a link" if stat.S_ISLNK(st.st_mode) else "not a folder" if not stat.S_ISDIR(st.st_mode)
           else f"owned by {_user(st.st_uid)}" if st.st_uid != os.geteuid()
           else f"others can write to it (mode {st.st_mode & 0o777:o})" if st.st_mode & 0o022
           else None)
    if why:
        raise CourseError(
            f"{path} is there already and is not yours alone ({why}): another user may have made "
            "it, for this job to read their files or write through their links. Where it is not "
            "there, the copy makes it itself (mode 0700); if it is yours, delete it, or choose "
            "another folder (the course's jobs: export LOCAL_DATA=...).")
    return path


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
