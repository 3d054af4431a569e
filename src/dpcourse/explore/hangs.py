"""Where every rank of a hung run waits: py-spy's dump of each worker, by rank.

In a hang nothing moves, so one look at each rank's Python stack says where it waits.
``py-spy dump --pid PID`` prints a running process's stack; from a second terminal,
``py-spy dump --subprocesses --pid AGENT`` does torchrun's agent and every worker at once. A
notebook cell cannot type into a second terminal while its launch waits, so ``stacks_while_hung``
launches the lab, looks at every worker until each one sits in the same collective twice in a row,
keeps each rank's dump and stops the run::

    from dpcourse.explore.hangs import stacks_while_hung
    hung = stacks_while_hung(lab("hang"), "--bug", "skip", "--timeout", "120")
    hung.waits          # {0: 'all_reduce at hang.py:72 (train_step)', 1: 'barrier at ...'}
    print(hung.stacks[1])  # rank 1's dump, as py-spy prints it

py-spy reads another process's memory (ptrace): as root, or where the kernel allows it
(``kernel.yama.ptrace_scope`` 0; in a container, ``--cap-add SYS_PTRACE``).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dpcourse.explore.launch import Run, torchrun
from dpcourse.lab.errors import CourseError


@dataclass
class Hang:
    """What ``stacks_while_hung`` saw: each rank's py-spy dump and the line it waits at."""

    stacks: dict[int, str]  # rank: py-spy's dump of its process, as the command prints it
    waits: dict[int, str]  # rank: "<collective> at <file>:<line> (<function>)"
    pids: dict[int, int]  # rank: its process id
    seconds: float  # from the launch to the dumps
    run: Run | None = field(default=None, repr=False)  # the launch, once its workers were stopped


def py_spy() -> str:
    """The py-spy program beside this Python, or on the PATH."""
    here = Path(sys.executable).with_name("py-spy")
    found = str(here) if here.exists() else shutil.which("py-spy")
    if found is None:
        raise CourseError("py-spy is not installed: pip install py-spy (into the course's .venv).")
    return found


class PtraceRefused(CourseError):
    """The kernel did not let py-spy read the process: no look at any rank will do better."""


# what py-spy says when the kernel refuses it ptrace ("Permission Denied: Try running again with
# elevated permissions ..."; "Operation not permitted (os error 1)")
_REFUSED = ("permission denied", "operation not permitted")


def dump(pid: int, as_json: bool = False) -> str:
    """``py-spy dump --pid PID`` (``--json``: its threads and frames as JSON). A process py-spy
    cannot read raises CourseError; one the kernel will not let it read, PtraceRefused."""
    cmd = [py_spy(), "dump", "--pid", str(pid)] + (["--json"] if as_json else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        said = (out.stderr.strip() or out.stdout.strip() or "no output").splitlines()[-1]
        refused = any(words in said.lower() for words in _REFUSED)
        raise (PtraceRefused if refused else CourseError)(
            f"py-spy could not read process {pid}: {said[:200]}. It needs ptrace: run as root, "
            "or allow it (kernel.yama.ptrace_scope=0; a container's --cap-add SYS_PTRACE).")
    return out.stdout


def workers(script: str | os.PathLike, root: int | None = None) -> dict[int, int]:
    """{rank: pid} of the processes under ``root`` (default: this one) that run ``script`` with a
    RANK in their environment: torchrun's workers, not its agent."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
    below, todo = set(), [root or os.getpid()]
    while todo:
        pid = todo.pop()
        children = [p for p, parent in parents.items() if parent == pid and p not in below]
        below.update(children)
        todo += children
    found = {}
    for pid in below:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = dict(v.split("=", 1) for v in f.read().decode(errors="replace")
                               .split("\0") if "=" in v)
        except OSError:
            continue
        if str(script) in cmdline and environ.get("RANK", "").isdigit():
            found[int(environ["RANK"])] = pid
    return found


def waiting_at(threads: list[dict]) -> str | None:
    """"<collective> at <file>:<line> (<function>)" for a main thread that waits in a collective
    (its innermost frame in torch.distributed's distributed_c10d.py), else None."""
    main = next((t for t in threads if t.get("thread_name") == "MainThread"), None)
    frames = main["frames"] if main else []
    if not frames or not frames[0]["filename"].endswith("distributed_c10d.py"):
        return None
    torch_dir = str(Path(frames[0]["filename"]).parents[1])
    ours = next((f for f in frames if not f["filename"].startswith(torch_dir)), None)
    where = f"{Path(ours['filename']).name}:{ours['line']} ({ours['name']})" if ours else "?"
    return f"{frames[0]['name']} at {where}"


def stacks_while_hung(script: str | os.PathLike, *args: str, nproc: int = 2,
                      patience: float = 60.0, env: dict | None = None) -> Hang:
    """Launch ``torchrun ... script *args``; once every rank has waited in the same collective at
    two looks half a second apart, keep each rank's py-spy dump, stop the workers (SIGTERM) and
    return them. Give the lab a timeout longer than ``patience``. A run that ends, or does not hang
    within ``patience`` seconds, raises CourseError; py-spy refused ptrace, PtraceRefused at the
    first look."""
    launched: dict = {}

    def launch():
        try:
            launched["run"] = torchrun(script, *args, nproc=nproc, timeout=patience + 60,
                                       log_json=False, env=env, echo=False)
        except CourseError as err:  # stopped past its timeout: said below
            launched["error"] = err

    start = time.perf_counter()
    thread = threading.Thread(target=launch, daemon=True)
    thread.start()
    pids, before = {}, None
    try:
        while True:
            time.sleep(0.5)
            if not thread.is_alive():
                raise CourseError(f"{Path(script).name} ended without hanging.")
            if time.perf_counter() - start > patience:
                raise CourseError(f"{Path(script).name} did not hang within {patience:.0f} s.")
            pids = workers(script)
            if len(pids) < nproc:
                continue
            now = {}
            for rank, pid in pids.items():
                try:
                    now[rank] = waiting_at(json.loads(dump(pid, as_json=True)))
                except PtraceRefused:
                    raise  # said at once: looking again will not help
                except (CourseError, ValueError, KeyError):  # not yet Python, or gone
                    now[rank] = None
            if None not in now.values() and now == before:
                break
            before = now
        seconds = time.perf_counter() - start
        stacks = {rank: dump(pid) for rank, pid in sorted(pids.items())}
    finally:
        for pid in workers(script).values() or pids.values():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        thread.join(60)
    return Hang(stacks, dict(sorted(now.items())), pids, seconds, launched.get("run"))
