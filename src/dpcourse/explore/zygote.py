"""Start torchrun's workers as forks of a process that has imported torch already (a *zygote*),
instead of new interpreters that each import it again: the suite's plumbing, off unless a test
session turns it on (``tests/conftest.py``); a notebook's launches never use it.

Why: on the course's 2-core machine a worker spends about 5 s of CPU importing torch and its
compiler (``torch._dynamo``, which building an optimizer or a DDP imports) before its first line,
and the suite makes hundreds of 2-rank launches.

What a worker started this way is, and how each difference from ``python -u lab.py`` is closed
(``tests/test_zygote.py`` compares the two, item by item):

- Its interpreter has imported torch, ``torch.distributed`` and ``torch._dynamo`` and used none of
  them. A zygote whose imports started a thread (OpenMP starts its pool on import unless
  OMP_NUM_THREADS is 1: a fork has no pool, and GNU OpenMP hangs in it), or said anything (a
  warning, a line on its stderr, which a new interpreter would say in every worker), serves no
  one; none is started for a launch whose OMP_NUM_THREADS is not 1.
- Its environment is the one asked for (``os.environ``, and ``/proc/PID/environ``, rewritten in
  place), with what the zygote's imports set in ``os.environ`` where unset (torch's compiler sets
  TORCHINDUCTOR_CACHE_DIR), as a worker that builds an optimizer or a DDP, and so imports
  ``torch._dynamo``, has it. Variables that torch, numpy (OpenBLAS: OMP_NUM_THREADS) or tqdm read
  when imported, and the directory they note (``torch._dynamo``'s debug folder,
  ``multiprocessing``'s), must be the zygote's own: the zygote refuses any other. A launch that
  differs from it in anything but the variables a worker reads at run time (``RUNTIME``) is
  served by zygotes started with its environment in its directory (the last ``POOLS`` kinds are
  kept; a one-off kind gets new interpreters); one that is not ``python -u script ...`` (or
  ``python script ...`` with PYTHONUNBUFFERED set) gets a new interpreter.
- Its ``/proc/PID/cmdline`` is its command line, rewritten in place, and ``sys.argv``,
  ``sys.orig_argv``, ``sys.path[0]``, ``__main__`` with its ``__file__`` and ``__loader__`` are
  those of ``python -u script``; it runs in its own session (before its pid is given), in the
  directory asked for, with stdin from /dev/null, stdout and stderr unbuffered on the files torchrun
  gave, no other file open, the signal handlers and mask of a process that torchrun's agent starts.
- Torch's, Python's and numpy's random generators are seeded anew from the OS, as a new process's
  are. Each local rank has its own zygote, so the ranks of a launch do not share Python's
  string-hash secret.
- It exits as the interpreter would: ``SystemExit``'s code and message; an uncaught exception's
  traceback (``sys.excepthook``, ``sys.last_*`` kept), status 1; a syntax error's place, status 1;
  a script it cannot open, status 2; an uncaught KeyboardInterrupt by SIGINT after the rest of the
  exit; atexit handlers, non-daemon threads joined, files flushed.

What stays different:

- Its parent is the zygote, not torchrun's agent: the agent waits on it through the zygote's
  socket and signals it by pid and session (a session already gone, once the zygote has reaped
  the worker, is a worker that has ended, where Popen's zombie would still take the signal). A
  zygote that dies takes its workers with it (SIGKILL), as torchrun is told.
- Its /proc command line and environment are followed by NUL bytes up to the zygote's own
  length (``ps`` shows spaces; psutil's ``cmdline()`` empty strings); GLIBC_TUNABLES in /proc is
  as set, not split as glibc splits it at a process's start.
- ``py-spy dump``, ``inspect.stack()`` and ``traceback.print_stack()`` show the zygote's three
  frames (``<module>``, ``_serve``, ``_become``) under the lab's.
- A script that imports no ``torch._dynamo`` has it all the same (and its environment variable).
- The objects it has from the zygote (torch's) stay frozen (``gc.freeze``), so its collections,
  its exit's included, do not walk them, as a lab's exit does not (``dpcourse.lab`` freezes at
  exit): walking them in a fork copies every page they are on, a second of each worker's exit.
- The string-hash secret and the address layout of a rank are the same at every launch of the
  session, and two agents on one host (a two-node test) share a zygote per local rank.
- Its CPU time is counted under the zygote, not the test's process.

The zygote is started by the test process (``ensure``, from its main thread) and dies with it
(``PR_SET_PDEATHSIG``). This file runs as a script (the zygote) and is imported (the client); the
zygote imports nothing of ``dpcourse``, and drops its own folder from ``sys.path``, so a worker's
``import dpcourse`` reads the files as they are.

horovodrun --gloo's workers (``horovod_execute``) are served alike, when the suite passes
horovodrun the zygotes' sockets: horovod's output prefixes, its stop on another worker's failure,
and its middleman's end of the workers when horovodrun goes.
"""
from __future__ import annotations

import collections
import itertools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

# What a worker reads at run time, never on import: torchrun's and horovodrun's per-worker
# variables, the course's own (the zygote imports no dpcourse), pytest's per-test name. Any other
# difference from the zygote's environment starts a new interpreter.
RUNTIME = ("LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
           "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTEST_CURRENT_TEST", "PYTHONUNBUFFERED",
           "NCCL_SOCKET_IFNAME")
# horovodrun's per-worker variables: read by hvd.init(), and the zygote imports no horovod
RUNTIME_PREFIXES = ("TORCHELASTIC_", "DPCOURSE_", "HOROVOD_")
PAD = "DPCOURSE_ZYGOTE_PAD"  # the zygote's room for a worker's environment in /proc/PID/environ
ENV_ROOM, ARG_ROOM = 65536, 16384
PRELOAD = ("torch", "torch.distributed", "torch._dynamo")


def runtime(key: str) -> bool:
    return key != PAD and (key in RUNTIME or key.startswith(RUNTIME_PREFIXES))


def _fixed(env: dict) -> dict:
    return {k: v for k, v in env.items() if not runtime(k) and k != PAD}


# ---------------------------------------------------------------------------------------------
# The client: the test process starts zygotes; torchrun's agent (a fork of it) asks them for workers

# the zygotes of the last POOLS environments (in what a worker reads on import), by local rank
_pools: "collections.OrderedDict[tuple, dict[int, Zygote]]" = collections.OrderedDict()
POOLS = 3  # the suite runs labs from the checkout and from solutions/ (the exercises)
_numbers = itertools.count()
_seen: dict[tuple, int] = {}  # environments met once, without zygotes
_enabled = False


def enable(on: bool = True) -> None:
    """Use zygotes for the launches this process makes from now on (a test session)."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled and sys.platform.startswith("linux")


class Zygote:
    def __init__(self, rank: int, env: dict, cwd: str):
        self.rank, self.env, self.cwd = rank, {k: str(v) for k, v in env.items() if k != PAD}, cwd
        # one name per zygote: another environment's zygote of the same rank has its own
        name = f"zygote-{os.getpid()}-{next(_numbers)}-{rank}.sock"
        self.path = os.path.join(_socket_dir(), name)
        if os.path.exists(self.path):
            os.unlink(self.path)
        full = {**self.env, PAD: "x" * ENV_ROOM}  # last: the room in /proc/PID/environ
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.path, "." * ARG_ROOM], env=full,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, cwd=cwd)

    def alive(self) -> bool:
        """Whether the zygote runs: asked by its state in /proc, which the agent (a fork of the
        process that started it, not its parent) can read too."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
        except OSError:
            return False

    def ready(self, timeout: float) -> bool:
        """Whether the zygote listens, waited for up to ``timeout`` s while it imports torch."""
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.path):
            if not self.alive() or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        if os.path.exists(self.path):
            os.unlink(self.path)


def _socket_dir() -> str:
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"dpcourse-zygotes-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def _key(env: dict) -> tuple:
    return tuple(sorted(_fixed(env).items()))


def ensure(nproc: int, env: dict, cwd: str | None = None) -> None:
    """In the test process, before it forks torchrun's agent: a zygote for each of local ranks
    0..nproc-1 whose environment is ``env`` (the agent's) in what a worker reads on import, started
    in ``cwd`` (the agent's; torch's compiler and multiprocessing note it on import). The session's
    first environment gets zygotes at once, any other when it comes a second time (a test's one-off
    environment is not worth starting zygotes for); the zygotes of the ``POOLS`` environments used
    last are kept, older ones stopped. Only the main thread starts zygotes: a zygote dies with the
    thread that started it (PR_SET_PDEATHSIG)."""
    if not enabled() or threading.current_thread() is not threading.main_thread():
        return
    if env.get("OMP_NUM_THREADS") != "1":  # OpenMP would start its pool on import: no zygote
        return
    cwd = os.path.abspath(cwd or os.getcwd())
    key = (_key(env), cwd)
    if key not in _pools and not _seen.get(key) and _pools:
        _seen[key] = 1  # a one-off environment (a test's): new interpreters, no zygotes to start
        return
    pool = _pools.setdefault(key, {})
    _pools.move_to_end(key)
    for rank in range(nproc):
        if rank not in pool or not pool[rank].alive():
            pool[rank] = Zygote(rank, env, cwd)
    while len(_pools) > POOLS:
        for z in _pools.popitem(last=False)[1].values():
            z.stop()


def zygote_of(env: dict, local_rank: int, cwd: str | None = None) -> "Zygote | None":
    return _pools.get((_key(env), os.path.abspath(cwd or os.getcwd())), {}).get(local_rank)


def stop_all() -> None:
    for pool in _pools.values():
        for z in pool.values():
            z.stop()
    _pools.clear()
    _seen.clear()


SOCKETS = "DPCOURSE_ZYGOTE_SOCKETS"


def sockets(nproc: int, env: dict, cwd: str | None = None) -> dict:
    """For a launcher that is a new interpreter (horovodrun): ``{SOCKETS: "0=path,1=path"}``, the
    sockets of the zygotes of ranks 0..nproc-1 for ``env``, or {} where there are none."""
    if not enabled():
        return {}
    ensure(nproc, env, cwd)
    pool = _pools.get((_key(env), os.path.abspath(cwd or os.getcwd())), {})
    if any(rank not in pool for rank in range(nproc)):
        return {}
    return {SOCKETS: ",".join(f"{rank}={pool[rank].path}" for rank in range(nproc))}


def _nproc(args: list[str]) -> int | None:
    """``--nproc-per-node N`` (or ``=N``, or the underscore spelling) from torchrun's arguments."""
    for i, arg in enumerate(args):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            if arg == flag and i + 1 < len(args) and args[i + 1].isdigit():
                return int(args[i + 1])
            if arg.startswith(flag + "=") and arg.split("=", 1)[1].isdigit():
                return int(arg.split("=", 1)[1])
    return None


def before_agent(args: list[str], env: dict, cwd: str | None = None) -> None:
    """In the test process, before it forks an agent with torchrun ``args``: start its zygotes."""
    n = _nproc(args)
    if enabled() and n:
        ensure(n, env, cwd)


class Worker:
    """What ``subprocess.Popen`` gives torchrun's agent (``pid``, ``poll``, ``wait``,
    ``send_signal``, ``returncode``) for a worker forked by a zygote, which says on the socket when
    the worker has exited and how."""

    def __init__(self, conn: socket.socket, pid: int, args):
        self.conn, self.pid, self.args, self.returncode = conn, pid, args, None
        self.stdin = self.stdout = self.stderr = None

    def _read(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        poller = select.poll()
        poller.register(self.conn, select.POLLIN)
        if poller.poll(None if timeout is None else max(0, int(timeout * 1000))):
            msg = self.conn.recv(64)
            if not msg.startswith(b"exit "):  # the zygote died: its worker goes too, as said
                try:
                    os.killpg(self.pid, signal.SIGKILL)
                except OSError:
                    pass
            self.returncode = int(msg.split()[1]) if msg.startswith(b"exit ") else -9
            self.conn.close()

    def poll(self) -> int | None:
        self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _wait_for(path: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _script(args: list[str], env: dict) -> int | None:
    """Where the script is in ``args`` when they are ``python -u script ...`` or, with
    PYTHONUNBUFFERED set (unbuffered alike), ``python script ...``; else None."""
    if not args or args[0] != sys.executable:
        return None
    at = 2 if args[1:2] == ["-u"] else 1 if env.get("PYTHONUNBUFFERED") else None
    if at is None or len(args) <= at or args[at].startswith("-") or not args[at].endswith(".py"):
        return None
    return at


def spawn(args, env: dict, stdout, stderr, local_rank: int, cwd: str | None = None,
          path: str | None = None, tied: bool = False):
    """``args`` (``python -u script ...``, or ``python script ...`` with PYTHONUNBUFFERED set) as a
    fork of local rank ``local_rank``'s zygote (in torchrun's agent, or for a one-process run in
    the test process), or None (the caller starts a new interpreter) when there is none or the
    launch is not one it may serve."""
    env = {str(k): str(v) for k, v in env.items()}
    args = [str(a) for a in args]
    script = _script(args, env)
    if path is None:  # the zygote of this environment that this process started
        z = zygote_of(env, local_rank, cwd)
        if z is None or script is None or not z.ready(120):
            return None
        path = z.path
    elif script is None or not _wait_for(path, 120):
        return None
    fds = [(f.fileno() if f is not None else fd) for f, fd in ((stdout, 1), (stderr, 2))]
    request = json.dumps({"argv": args, "script": script, "env": env, "tied": tied,
                          "cwd": os.path.abspath(cwd or os.getcwd())}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(60)  # a zygote that does not answer: a new interpreter
    try:
        conn.connect(path)
        socket.send_fds(conn, [request], fds)
        reply = conn.recv(4096)
    except OSError:
        conn.close()
        return None
    conn.settimeout(None)
    if not reply.startswith(b"pid "):  # "refuse <why>": another environment, or too long
        conn.close()
        return None
    return Worker(conn, int(reply.split()[1]), args)


def horovod_execute(paths: dict[int, str]) -> None:
    """horovod's ``safe_shell_exec.execute`` for horovodrun --gloo's local workers, each a fork of
    its local rank's zygote (``paths``: the zygotes' sockets), run as horovod runs them: lines
    prefixed "[rank]<stdout>:" by horovod's own ``prefix_connection``, stopped (SIGTERM, then
    SIGKILL after horovod's grace) when one of ``events`` is set, a signal's exit status as the
    shell reports it (128 + N). Any command that is not ``env K=V ... python script ...`` goes to
    horovod's own."""
    import shlex
    import threading

    from horovod.runner.common.util import safe_shell_exec

    original = safe_shell_exec.execute

    def execute(command, env=None, stdout=None, stderr=None, index=None, events=None,
                prefix_output_with_timestamp=False):
        try:
            words = shlex.split(command)
        except ValueError:
            words = []
        if env is not None or not words or words[0] != "env":
            return original(command, env, stdout, stderr, index, events,
                            prefix_output_with_timestamp)
        assigned = {}
        at = 1
        while at < len(words) and "=" in words[at] and not words[at].startswith("="):
            key, value = words[at].split("=", 1)
            assigned[key] = value
            at += 1
        argv = words[at:]
        worker_env = {**os.environ, **assigned}
        local = int(assigned.get("HOROVOD_LOCAL_RANK", -1))
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        with open(out_w, "w") as out, open(err_w, "w") as err:
            worker = spawn(argv, worker_env, out, err, local, path=paths.get(local),
                           tied=True)  # horovod's middleman ends it when horovodrun goes
        if worker is None:
            os.close(out_r)
            os.close(err_r)
            return original(command, env, stdout, stderr, index, events,
                            prefix_output_with_timestamp)
        forward = [threading.Thread(target=safe_shell_exec.prefix_connection, daemon=True,
                                    args=(open(fd, "rb"), stream, name, index,
                                          prefix_output_with_timestamp))
                   for fd, stream, name in ((out_r, stdout or sys.stdout, "stdout"),
                                            (err_r, stderr or sys.stderr, "stderr"))]
        for thread in forward:
            thread.start()
        while worker.poll() is None:
            if any(event.is_set() for event in events or ()):
                worker.send_signal(signal.SIGTERM)
                try:
                    worker.wait(safe_shell_exec.GRACEFUL_TERMINATION_TIME_S)
                except subprocess.TimeoutExpired:
                    try:
                        os.killpg(worker.pid, signal.SIGKILL)  # and what it started
                    except ProcessLookupError:
                        pass
                break
            try:
                worker.wait(0.1)
            except subprocess.TimeoutExpired:
                pass
        code = worker.wait()
        for thread in forward:
            thread.join()
        return 128 + abs(code) if code < 0 else code

    safe_shell_exec.execute = execute


# ---------------------------------------------------------------------------------------------
# The zygote


def _regions() -> tuple[int, int, int, int]:
    """This process's argument and environment areas (arg_start, arg_end, env_start, env_end:
    /proc/PID/stat's fields 48-51, proc(5))."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return tuple(int(x) for x in fields[45:49])


def _serve(path: str) -> None:
    import ctypes
    import gc
    import importlib
    import tempfile
    import warnings
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG: gone with the test process
    del sys.path[0]  # this file's folder: nothing in it may stand for what torch imports
    # a worker's signals as torchrun's agent leaves them (Python's own, the rest by default), not
    # as the test process had them (ignored under nohup, say)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    started = dict(os.environ)
    own = _key(started), os.getcwd()  # what a worker must share with this zygote
    # What the imports say (a warning, a C++ message on fd 2) a new interpreter would say in every
    # worker: a zygote that heard anything serves no one (every launch a new interpreter).
    said = tempfile.TemporaryFile()
    stderr = os.dup(2)
    os.dup2(said.fileno(), 2)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for name in PRELOAD:
            importlib.import_module(name)
    os.dup2(stderr, 2)
    os.close(stderr)
    said.seek(0)
    heard = bool(warned) or bool(said.read(1))
    said.close()
    # what the imports set in os.environ (torch: TORCHINDUCTOR_CACHE_DIR), as a worker's would
    set_by_imports = {k: v for k, v in os.environ.items() if k not in started}
    threads = len(os.listdir("/proc/self/task"))  # 1: no pool started (OMP_NUM_THREADS=1)
    gc.collect()
    gc.freeze()  # what the workers share stays shared: no collection touches its pages
    arg_start, arg_end, env_start, env_end = _regions()

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path + ".new")
    server.listen(64)
    os.rename(path + ".new", path)  # the client waits for the name: bound and listening
    waiting: dict[int, socket.socket] = {}
    tied: dict[socket.socket, int] = {}  # a client whose worker goes when it goes (horovod's)
    while True:
        ready, _, _ = select.select([server, wake_r, *tied], [], [], 5.0)
        try:
            os.read(wake_r, 4096)
        except BlockingIOError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                tied.pop(conn, None)
                try:
                    conn.send(b"exit %d" % os.waitstatus_to_exitcode(status))
                except OSError:
                    pass
                conn.close()
        for conn in [c for c in ready if c in tied]:  # its client has gone: so does its worker
            try:
                os.killpg(tied.pop(conn), signal.SIGKILL)
            except OSError:
                pass
        if server not in ready:
            continue
        conn, _ = server.accept()
        conn.settimeout(30)
        try:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 4)
            request = json.loads(msg)
        except (OSError, ValueError):
            conn.close()
            continue
        argv_block = b"\0".join(os.fsencode(a) for a in request["argv"]) + b"\0"
        env = request["env"]
        env_block = b"".join(os.fsencode(f"{k}={v}") + b"\0" for k, v in env.items())
        why = ("files" if len(fds) != 2 else
               "what it heard on import" if heard else
               f"{threads} threads" if threads != 1 else
               "environment" if (_key(env), request["cwd"]) != own else
               "too long" if len(argv_block) > arg_end - arg_start
               or len(env_block) > env_end - env_start else None)
        if why:
            conn.send(b"refuse " + why.encode())
            conn.close()
            for fd in fds:
                os.close(fd)
            continue
        go_r, go_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            server.close()
            for other in waiting.values():
                other.close()
            conn.close()
            signal.set_wakeup_fd(-1)
            os.close(wake_r)
            os.close(wake_w)
            os.close(go_r)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()  # before the client hears its pid: torchrun may signal its session then
            os.close(go_w)
            _become(request, fds, (arg_start, arg_end, argv_block), (env_start, env_end, env_block),
                    set_by_imports)
            # _become raises SystemExit: the interpreter's own exit, as a script's
        os.close(go_w)
        os.read(go_r, 1)  # EOF once the child has its session
        os.close(go_r)
        for fd in fds:
            os.close(fd)
        waiting[pid] = conn
        if request.get("tied"):
            tied[conn] = pid
        try:
            conn.send(b"pid %d" % pid)
        except OSError:
            pass


def _become(request: dict, fds: list[int], args_area, env_area, set_by_imports: dict) -> None:
    """In the fork (its own session already): become ``python -u script ...`` as a new interpreter
    would be, run it, exit as it would."""
    import atexit
    import ctypes
    import importlib.machinery
    import io
    import random
    import types

    interrupted = []

    def die_by_sigint():  # registered first, so run last: Python's exit on an uncaught ^C
        if interrupted:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)

    atexit.register(die_by_sigint)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))

    os.environ.clear()
    os.environ.update(request["env"])
    for start, end, block in (args_area, env_area):  # what /proc/PID/cmdline and environ show
        ctypes.memmove(start, block + b"\0" * (end - start - len(block)), end - start)
    for key, value in set_by_imports.items():  # after /proc: a new process's shows its start
        os.environ.setdefault(key, value)

    import torch
    torch.default_generator.seed()  # a new process's: 64 random bits of its own
    random.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()

    # -u: stdout and stderr unbuffered (write-through), stdin buffered, as Python makes them
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=sys.__stdin__.encoding,
        errors=sys.__stdin__.errors)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding=sys.__stdout__.encoding,
        errors=sys.__stdout__.errors, write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding=sys.__stderr__.encoding,
        errors="backslashreplace", write_through=True)

    argv, at = request["argv"], request["script"]
    try:
        os.chdir(request["cwd"])
        script = os.path.abspath(argv[at])
        with io.open_code(script) as f:
            source = f.read()
    except OSError as err:  # as the interpreter says it, with its status
        print(f"{argv[0]}: can't open file {os.path.abspath(argv[at])!r}: [Errno {err.errno}] "
              f"{err.strerror}", file=sys.stderr)
        raise SystemExit(2) from None
    sys.argv = argv[at:]
    sys.orig_argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.realpath(argv[at])))
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=script, __builtins__=__builtins__, __cached__=None,
                         __annotations__={},
                         __loader__=importlib.machinery.SourceFileLoader("__main__", script))
    sys.modules["__main__"] = main
    try:
        code = compile(source, script, "exec", dont_inherit=True)
    except SyntaxError as err:  # the interpreter prints where, without a traceback
        err = err.with_traceback(None)
        sys.last_type, sys.last_value, sys.last_traceback = type(err), err, None
        sys.excepthook(type(err), err, None)
        raise SystemExit(1) from None
    try:
        exec(code, main.__dict__)
    except SystemExit:
        raise  # the interpreter's own handling: its code, a message printed
    except BaseException as err:  # noqa: BLE001 - printed as the interpreter prints it
        err = err.with_traceback(err.__traceback__.tb_next)  # from the script's frames on
        # kept, as the interpreter keeps them, with what its frames hold, until the very end
        sys.last_type, sys.last_value, sys.last_traceback = type(err), err, err.__traceback__
        sys.last_exc = err
        sys.excepthook(type(err), err, err.__traceback__)
        if isinstance(err, KeyboardInterrupt):
            interrupted.append(True)
        raise SystemExit(1) from None
    raise SystemExit(0)


if __name__ == "__main__":
    _serve(sys.argv[1])
