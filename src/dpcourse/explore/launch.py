"""Run ``torchrun`` from a notebook cell (or a test) and watch it.

    from dpcourse.explore.launch import torchrun, lab
    run = torchrun(lab("hello"), nproc=2)            # streams "[rank0]: ..." lines as they come
    run.returncode, run.log                          # exit status, rank 0's JSON-lines log
    run = horovodrun(lab("fashion_horovod"), nproc=2)  # the same, for a Horovod lab (make horovod)
    run = python(lab("hello"))                       # one plain process, no launcher

Each line a worker prints comes back tagged with its rank (torchrun's own ``--tee``). On Linux,
from a process that has imported torch (a notebook's kernel, a test), torchrun's agent runs in a
fork of it (``_ForkedTorchrun``) rather than in a new interpreter that imports torch again
(``DPCOURSE_FORK_LAUNCHER=0``: the new interpreter). An
interrupt (the notebook's stop button) or the timeout stops the whole process group, so no
orphaned worker keeps a port or a core. Multi-process code must live in a real ``.py`` file:
a function defined in a notebook cannot be pickled into ``mp.spawn`` workers.
"""
from __future__ import annotations

import functools
import gc
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

# STUB and not_done live beside CourseError, without torch (make check reads them); the notebooks'
# checks import them from here
from dpcourse.lab.errors import STUB, CourseError, not_done  # noqa: F401
from dpcourse.lab.metrics import read_log
from dpcourse.lab.paths import project_root


@dataclass
class Run:
    """What a launch left behind."""

    command: list[str]
    returncode: int
    lines: list[str] = field(default_factory=list)
    log: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    agent_lines: list[str] = field(default_factory=list)  # torchrun's own output, untagged
    echoed: bool = True  # whether the ranks' lines were shown as they came

    def rank_lines(self, rank: int) -> list[str]:
        """The lines rank ``rank`` printed, without their tag."""
        tag = f"[rank{rank}]:"
        return [line[len(tag):] for line in self.lines if line.startswith(tag)]


LAB_SUFFIXES = (".py", ".sbatch")  # labs/ holds Python labs and Slurm job scripts


def lab(name: str, start: Path | None = None) -> Path:
    """The lab script ``name`` that belongs with this notebook.

    A notebook under ``solutions/`` runs the complete ``solutions/labs/<name>.py``; a student
    notebook under ``notebooks/`` runs the learner's own ``labs/<name>.py``; ``$DPCOURSE_LABS``,
    when set, names another folder of labs. A name with another suffix (``first_job.sbatch``)
    is taken as it is.
    """
    name = name if Path(name).suffix in LAB_SUFFIXES else f"{name}.py"
    if os.environ.get("DPCOURSE_LABS"):  # another folder of labs (tests of wrong answers use it)
        path = Path(os.environ["DPCOURSE_LABS"]) / name
        if not path.is_file():
            raise CourseError(f"No lab script {path} (DPCOURSE_LABS is set).")
        return path
    here = (start or Path.cwd()).resolve()
    top = project_root(here)
    if top is None:
        raise CourseError(f"Run this from inside the course checkout (cwd is {here}).")
    in_solutions = (top / "solutions") in (here, *here.parents)
    path = (top / "solutions" / "labs" if in_solutions else top / "labs") / name
    if not path.is_file():
        raise CourseError(f"No lab script {path}. "
                          f"Run `make student` to regenerate the student copies.")
    return path


def load_lab(name: str, start: Path | None = None):
    """The lab script ``lab(name)`` imported as a module, as its file is saved now: a notebook reads
    a lab's functions or its options (``load_lab("fashion_ddp").scaled_lr``). Its ``main()`` does
    not run (it runs under ``if __name__ == "__main__"``), and each call reads the file again, so an
    edit shows."""
    path = lab(name, start)
    spec = importlib.util.spec_from_file_location(f"lab_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# glibc's malloc hands every block over 128 KiB to the program straight from the OS (mmap) and gives
# it back on free (munmap), so each training step page-faults its activations in again: on this
# course's 2-core machine a Horovod run of notebook 11's check spent 12 s of 13 in the kernel.
# Blocks up to 1 GiB from the heap, and freed memory kept there for the next step, as the caching
# allocators that PyTorch's performance tuning guide recommends on CPUs (jemalloc, tcmalloc) do:
# that run took 8.8 s instead of 13.3 (elapsed training 3.3 s instead of 7.8). glibc reads
# GLIBC_TUNABLES when a process starts; an existing setting wins.
# https://www.gnu.org/software/libc/manual/html_node/Memory-Allocation-Tunables.html
CPU_MALLOC = "glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=1073741824"


def job_cores() -> int:
    """The cores this process may use: its CPU affinity (in a Slurm job, what the job was given, not
    the node's)."""
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else (os.cpu_count() or 1))


def _threads_per_worker(nproc: int) -> int:
    return max(1, job_cores() // nproc)


def torchrun(script: str | os.PathLike, *args: str, nproc: int = 2, timeout: float = 300,
             log_json: bool = True, env: dict | None = None, echo: bool = True,
             ranks: str | None = None, max_restarts: int = 0) -> Run:
    """Launch ``torchrun --standalone --nproc-per-node nproc script *args`` and stream its output.

    ``log_json`` adds ``--log-json <tmp>`` and returns rank 0's records in ``Run.log`` (a
    restarted run's attempts append to it). ``max_restarts``: torchrun's ``--max-restarts``, the
    times it starts every worker again after one fails.
    ``ranks="0"`` shows only rank 0's lines. A non-zero exit is returned, not raised, so a
    notebook can show what went wrong; check ``run.returncode`` (or call ``run_ok``).
    """
    tmpdir = Path(tempfile.mkdtemp(prefix="dpcourse-run-"))
    # torchrun, less its teardown
    cmd = [sys.executable, "-m", "dpcourse.lab.torchrun", "--standalone",
           f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "--tee=3",
           f"--log-dir={tmpdir / 'torchrun'}"]
    # Each line tagged "[rankN]:". The variable, not torchrun's --log-line-prefix-template, which
    # PyTorch 2.11 lacks (seen on a GPU node's 2.11: "unrecognized arguments"); 2.14 reads both.
    env = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:", **(env or {})}
    shown = ["torchrun", "--standalone", f"--nproc-per-node={nproc}",  # what a learner would type
             *([f"--max-restarts={max_restarts}"] if max_restarts else [])]
    return _launch(cmd, shown, script, args, tmpdir, nproc, timeout, log_json, env, echo, ranks,
                   untag=None)


# horovodrun tags a rank's lines "[1]<stdout>:" (gloo) or "[1,1]<stderr>:" (MPI): made "[rank1]:".
_HOROVOD_TAG = re.compile(r"^\[(?:\d+,)?(\d+)\]<std(?:out|err)>:")


def horovodrun(script: str | os.PathLike, *args: str, nproc: int = 2, timeout: float = 300,
               log_json: bool = True, env: dict | None = None, echo: bool = True,
               ranks: str | None = None, controller: str = "gloo") -> Run:
    """Launch ``horovodrun --gloo -np nproc python script *args`` (``controller="mpi"``: ``--mpi``),
    as ``torchrun`` does: the same ``Run``, each line tagged "[rankN]:". Horovod must be
    installed (``make horovod``)."""
    exe = Path(sys.executable).with_name("horovodrun")
    if not exe.exists():
        raise CourseError("Horovod is not installed in this environment: run `make horovod` in the "
                          "course folder (it builds Horovod in about 3 minutes), then restart the "
                          "kernel.")
    tmpdir = Path(tempfile.mkdtemp(prefix="dpcourse-run-"))
    # horovodrun, less its start-up probe (dpcourse/lab/horovodrun.py): the answer is asked
    # here, once
    cmd = [sys.executable, "-m", "dpcourse.lab.horovodrun", f"--{controller}", "-np", str(nproc),
           sys.executable]
    shown = ["horovodrun", f"--{controller}", "-np", str(nproc), "python"]
    built = _horovod_built()
    env = {**({"DPCOURSE_HOROVOD_BUILT": built} if built is not None else {}), **(env or {})}
    return _launch(cmd, shown, script, args, tmpdir, nproc, timeout, log_json, env, echo, ranks,
                   untag=_horovod_untag)


@functools.cache
def _horovod_built() -> str | None:
    """Which controllers Horovod was built with ("gloo,mpi"), asked in this process, where torch is
    loaded already; None when horovod.torch does not load (horovodrun's own probe then says why)."""
    try:
        import horovod.torch as hvd
    except Exception:  # noqa: BLE001 - any failure to load: leave the question to horovodrun
        return None
    return ",".join(name for name, built in (("gloo", hvd.gloo_built), ("mpi", hvd.mpi_built))
                    if built())


def _horovod_untag(line: str) -> str:
    line = _HOROVOD_TAG.sub(lambda m: f"[rank{m.group(1)}]:", line)
    return re.sub(r"\[\d+,\d+\]<std(?:out|err)>:$", "", line)  # mpirun's tag of an empty write


def python(script: str | os.PathLike, *args: str, timeout: float = 300, log_json: bool = True,
           env: dict | None = None, echo: bool = True) -> Run:
    """Run ``python script *args``: one process and no launcher (every lab's one-process mode),
    returned as ``torchrun`` returns its runs, each line tagged "[rank0]:". Cheaper than
    ``torchrun(..., nproc=1)``, which starts a launcher process beside the worker."""
    tmpdir = Path(tempfile.mkdtemp(prefix="dpcourse-run-"))
    return _launch([sys.executable], ["python"], script, args, tmpdir, 1, timeout, log_json, env,
                   echo, None, untag=lambda line: f"[rank0]:{line}")


# A line tagged twice: by the launcher and by torch's excepthook ("[rank1]:[rank1]: ..."), or by
# the launcher and by the course's errors, which name their rank ("[rank1]:[rank 1] ")
_TWICE = re.compile(r"^(\[rank(\d+)\]:)(?:\1|\[rank \2\] )")


def _launch(cmd, shown, script, args, tmpdir, nproc, timeout, log_json, env, echo, ranks,
            untag) -> Run:
    """Run a launcher's command, stream its ranks' lines (tagged "[rankN]:"), collect rank 0's
    log."""
    log_path = tmpdir / "log.jsonl"
    cmd = [*cmd, str(script), *map(str, args)]
    if log_json:
        cmd += ["--log-json", str(log_path)]
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    # Set the threads per worker ourselves: torchrun's default is 1, with a warning banner.
    child_env.setdefault("OMP_NUM_THREADS", str(_threads_per_worker(nproc)))
    child_env.setdefault("GLIBC_TUNABLES", CPU_MALLOC)
    if echo:  # what a learner would type; the tagging and log flags are plumbing
        print("$", shlex.join([*shown, _relative(script), *map(str, args)]), flush=True)

    start = time.perf_counter()
    proc = None
    if _can_fork(cmd):
        try:
            proc = _ForkedTorchrun(cmd[3:], child_env)
        except OSError:
            # no memory to fork this process (vm.overcommit_memory=2): a new interpreter
            proc = None
    if proc is None:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=child_env, start_new_session=True, bufsize=1)
    lines: list[str] = []
    agent: list[str] = []  # the launcher's own lines: warnings and, on failure, its traceback

    # ranks="0": show rank 0's lines, but keep every rank's, so that a failure can be named
    shown_tags = None if ranks is None else tuple(f"[rank{r.strip()}]:"
                                                  for r in str(ranks).split(","))

    def pump():
        for line in proc.stdout:
            line = line.rstrip("\n")
            if untag is not None:  # the launcher's own tags, made "[rankN]:"
                line = untag(line)
            # one tag is enough
            line = _TWICE.sub(r"\1", line)
            if line.startswith("[rank"):
                lines.append(line)
                if echo and (shown_tags is None or line.startswith(shown_tags)):
                    print(line, flush=True)
            else:
                agent.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise CourseError(f"The run took longer than {timeout:.0f} s and was stopped (every "
                          f"rank). If it should have ended sooner, a rank may be waiting in a "
                          "collective that another rank never calls (a hang: a collective under "
                          "`if rank == 0:`, say); otherwise give it a larger timeout= or fewer "
                          "--max-steps.") from None
    except KeyboardInterrupt:
        _stop(proc)
        raise CourseError("Interrupted: every rank of the run was stopped.") from None
    finally:
        reader.join(5)
        log = read_log(log_path) if log_path.exists() else []
        shutil.rmtree(tmpdir, ignore_errors=True)  # the launcher's per-rank log files and ours
    if proc.returncode != 0 and echo:
        hidden = [line for line in lines
                  if shown_tags is not None and not line.startswith(shown_tags)]
        if hidden:  # the failing rank may be one we did not show: its last lines
            print("\n".join(hidden[-6:]), flush=True)
        print(failure_summary(agent, proc.returncode, shown[0]), flush=True)
    return Run(cmd, proc.returncode, lines, log, time.perf_counter() - start, agent, echo)


def _can_fork(cmd: list[str]) -> bool:
    """Whether to run the torchrun agent in a fork of this process (``_ForkedTorchrun``): on Linux,
    where this process has imported torch already (it has, having imported this module: a notebook's
    kernel, a test, the course's command-line tools), unless DPCOURSE_FORK_LAUNCHER=0, and unless
    this process has started CUDA (a kernel that put a tensor on a GPU, make gpu-check after naming
    its GPUs): CUDA does not support fork after it has started, and although the agent never calls
    it, such a fork is not worth the 2 s it saves."""
    torch = sys.modules.get("torch")
    return (cmd[1:3] == ["-m", "dpcourse.lab.torchrun"] and sys.platform.startswith("linux")
            and torch is not None and os.environ.get("DPCOURSE_FORK_LAUNCHER", "1") != "0"
            and not torch.cuda.is_initialized())


class _ForkedTorchrun:
    """torchrun's agent (``dpcourse.lab.torchrun``: torchrun's own ``main``) in a fork of this
    process, in a session of its own, its output on a pipe: what ``subprocess.Popen`` of
    ``python -m dpcourse.lab.torchrun`` gives (``pid``, ``stdout``, ``wait``, ``returncode``),
    without the new interpreter's import of torch, which this process has done already: 2 of the 5
    seconds a launch took on the course's 2-core machine. The workers are new interpreters as
    before, started by the agent."""

    def __init__(self, args: list[str], env: dict, cwd: str | os.PathLike | None = None):
        env = {str(k): str(v) for k, v in env.items()}  # as Popen would insist, before the fork
        parent = os.getpid()
        read, write = os.pipe()
        stop_signals = {signal.SIGINT, signal.SIGTERM}
        # none between fork and setsid
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
        try:
            # Python 3.12+ warns of fork in a threaded process: the child only runs torchrun's
            # main and exits
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                self._agent(args, env, read, write, parent, old_mask, cwd)  # never returns
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        os.close(write)
        self.pid, self.returncode = pid, None
        self.stdout = open(read, "r", buffering=1, encoding="utf-8", errors="replace")

    @staticmethod
    def _agent(args, env, read, write, parent, old_mask, cwd=None) -> None:
        """The child: its own session, the pipe as stdout and stderr, nothing else of the caller's
        open (a kernel's sockets, a pipe of another launch), gone when the caller is, in ``cwd``
        (Popen's); then torchrun's main."""
        code = 1
        try:
            gc.freeze()  # no collection copies the caller's heap, nor finalises what it owns
            os.setsid()
            os.dup2(write, 1)
            os.dup2(write, 2)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            # read, write, devnull and every other inherited one
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            # SIGTERM when the caller dies (a kernel restarted mid-run): torchrun then stops its
            # workers
            try:
                import ctypes
                # PR_SET_PDEATHSIG
                ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)
            except (OSError, AttributeError):
                pass
            if os.getppid() != parent:
                return
            sys.stdout = open(1, "w", buffering=1, closefd=False, encoding="utf-8",
                              errors="backslashreplace")
            sys.stderr = open(2, "w", buffering=1, closefd=False, encoding="utf-8",
                              errors="backslashreplace")
            os.environ.clear()
            os.environ.update(env)
            if cwd is not None:
                os.chdir(cwd)
            from dpcourse.lab.torchrun import main
            sys.argv = ["torchrun", *args]
            code = main()
        except BaseException:  # noqa: BLE001 - said on the pipe, as an agent that failed to start
            try:
                import traceback
                traceback.print_exc()
            except BaseException:  # noqa: BLE001
                pass
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: as Popen, say 0
                self.returncode = 0
                return 0
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.001
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(["torchrun"], timeout)
            time.sleep(pause)
            pause = min(0.02, pause * 2)
        return self.returncode


def failure_summary(agent_lines: list[str], returncode: int, launcher: str = "torchrun") -> str:
    """One line instead of the launcher's traceback: which rank failed first, how."""
    text = "\n".join(agent_lines)
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", text, re.S)
    if m:
        return (f"torchrun: rank {m.group(1)} failed first (exit code {m.group(2)}); the other "
                "ranks were stopped. Its message is in the lines above.")
    m = re.search(r"Process (\d+) exit with status code (-?\d+)", text)  # horovodrun --gloo
    if m:
        return (f"horovodrun: rank {m.group(1)} failed (exit code {m.group(2)}); the other ranks "
                "were stopped. Its message is in the lines above.")
    tail = [line for line in agent_lines if line.strip()][-3:]
    return f"{launcher} exited with status {returncode}." + ("\n" + "\n".join(tail) if tail else "")


def _relative(path) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:
        return str(path)


def run_ok(run: Run) -> Run:
    """Raise one short error if the run failed (for cells that must not go on after a failure).

    A lab that stopped at one of its unfinished exercises (``not_done``) raises NotImplementedError,
    so that ``make check`` reports the check as "not done yet" rather than failed.
    """
    if run.returncode != 0:
        if not run.echoed:  # a silent run: show how it ended
            print("\n".join(run.lines[-12:]), flush=True)
        script = next((c for c in run.command if c.endswith(".py")), "the lab")
        if not_done(run.lines + run.agent_lines):
            # the file whose stub it met: the lab, or a file it imports (sweep.py runs
            # fashion_study.py, which imports fashion_ddp.py)
            stub, at = _stub_at(run.lines)
            if stub is None:
                stub = _relative(script)
                at = next((m.group(1) for line in reversed(run.lines) if (m := re.search(
                    rf'File ".*{re.escape(Path(script).name)}", line (\d+)', line))), None)
            raise NotImplementedError(f"Exercise: {stub} still has an exercise to do"
                                      + (f" (line {at})" if at else "") + ". Complete it, save "
                                      "the file and run this cell again.")
        cause = _cause(run.lines)
        raise CourseError(f"{_relative(script)} failed (exit status {run.returncode})"
                          + (f": {cause}" if cause else "; the lines above say why."))
    return run


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _stub_at(lines: list[str]) -> tuple[str | None, str | None]:
    """(file, line) of the stub a run stopped at, as its output names it: explain's one line
    ('File "labs/x.py", line N, in f: Exercise: ...'), or the last frame of a traceback that ends in
    "NotImplementedError: Exercise"; (None, None) when it names none."""
    found, frame = (None, None), None
    for line in lines:
        if (m := _FRAME.search(line)) and "Exercise" in line[m.end():]:
            found = m.groups()
        elif m:
            frame = m.groups()
        elif "NotImplementedError: Exercise" in line and frame:
            found = frame
    return found


# What the other ranks say once one has failed: the first rank's error is the cause, not these.
_ECHOES = ("Horovod has been shut down", "lost another rank")


def _cause(lines: list[str]) -> str:
    """The last error a rank printed ('[rank1]: TypeError: ...', or a C++ exception that ended it:
    '[rank0]:  what():  [enforce fail at ...'), else its last line, for a one-line verdict. What the
    other ranks say once one has failed (_ECHOES) is the cause only when nothing else was said."""
    said = [line for line in lines
            if line.split(":", 1)[-1].strip() not in ("", "Terminated", "Killed")]
    first_hand = [line for line in said if not any(echo in line for echo in _ECHOES)]
    errors = [line for line in first_hand
              if re.match(r"\[rank\d+\]:\s*([\w.]*(Error|Exception|Exit)\w*: |what\(\): )", line)]
    return (errors or first_hand or said or [""])[-1].strip()


def _stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the launcher and its workers (one process group), SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # no group (yet): the launcher alone, if it is still there
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
