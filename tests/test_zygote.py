"""The suite's forked workers (dpcourse/explore/zygote.py) against new interpreters: a worker forked
from a zygote must be what ``python -u script`` is, item by item, or the suite's launches would pass
for reasons a learner's would not."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import run, torchrun_cmd
from dpcourse.explore import zygote

PROBE = textwrap.dedent('''
    import gc, json, os, random, signal, sys, threading
    import numpy, torch
    import torch._dynamo  # as every lab that builds an optimizer or a DDP imports it
    out = sys.argv[1]

    def proc(name):
        with open(f"/proc/self/{name}", "rb") as f:
            return [p.decode() for p in f.read().split(b"\\0") if p]

    said = {
        "main_keys": sorted(k for k in globals() if k.startswith("__")),
        "main_loader": type(__loader__).__name__, "annotations": __annotations__,
        "stdin_type": [type(sys.stdin).__name__, type(sys.stdin.buffer).__name__],
        "argv": sys.argv, "path0": sys.path[0], "file": __file__, "cwd": os.getcwd(),
        "orig_argv": sys.orig_argv, "name": __name__,
        "main_is_me": sys.modules["__main__"].__dict__ is globals(),
        "environ": dict(os.environ), "proc_environ": dict(v.split("=", 1) for v in proc("environ")),
        "cmdline": proc("cmdline"),
        "fds": sorted(os.listdir("/proc/self/fd")), "tasks": len(os.listdir("/proc/self/task")),
        "py_threads": threading.active_count(), "torch_threads": torch.get_num_threads(),
        "stdin": os.readlink("/proc/self/fd/0"), "session_leader": os.getsid(0) == os.getpid(),
        "streams": [(s.encoding, s.errors, s.line_buffering, s.write_through)
                    for s in (sys.stdout, sys.stderr)],
        "handlers": {n: str(signal.getsignal(getattr(signal, n)))
                     for n in ("SIGINT", "SIGTERM", "SIGCHLD", "SIGPIPE", "SIGHUP", "SIGQUIT",
                               "SIGUSR1", "SIGALRM", "SIGXFSZ")},
        "gc": [gc.get_freeze_count(), gc.isenabled(), gc.get_threshold()],
        "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "random": [torch.initial_seed(), random.random(), float(numpy.random.random()),
                   hash("a string")],
    }
    with open(out, "w") as f:
        json.dump(said, f)
    print("stdout line"); print("stderr line", file=sys.stderr); print("stdout again")
''')

ENDINGS = {  # what a script does last: each must end the zygote's worker as it ends python's
    "code": "sys.exit(3)",
    "message": "sys.exit('bye: a message')",
    "exception": "def f():\n    raise ValueError('a learner error')\nf()",
    "interrupt": "import atexit\natexit.register(lambda: print('atexit ran', flush=True))\n"
                 "raise KeyboardInterrupt",
    "syntax": "x = (",
    "atexit": "import atexit\natexit.register(lambda: print('atexit ran', flush=True))",
    "thread": "import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.3), "
              "print('thread ran', flush=True))).start()",
    "unflushed": "f = open(sys.argv[1], 'w')\nf.write('kept')",
}


@pytest.fixture
def zygotes():
    """Zygotes for local ranks 0 and 1 in this process, with this process's environment."""
    was = zygote.enabled()
    zygote.enable(True)
    env = _env()
    zygote.ensure(2, env)
    assert all(zygote.zygote_of(env, r).ready(120) for r in (0, 1))
    yield env
    zygote.enable(was)


def _env(**extra):
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}


def _start(how, script, args, env, tmp_path, rank=0):
    """(process, stdout file, stderr file) for ``python -u script args``: a new interpreter
    (``Popen``) or a fork of local rank ``rank``'s zygote."""
    out, err = open(tmp_path / f"{how}.out", "w"), open(tmp_path / f"{how}.err", "w")
    argv = [sys.executable, "-u", str(script), *map(str, args)]
    if how == "fresh":  # as torchrun's agent starts it: stdin /dev/null, its signals by default
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err, start_new_session=True,
                                stdin=subprocess.DEVNULL, preexec_fn=_agents_signals)
    else:
        proc = zygote.spawn(argv, env, out, err, rank)
        assert proc is not None, "the zygote refused a launch it may serve"
    out.close()
    err.close()
    return proc, tmp_path / f"{how}.out", tmp_path / f"{how}.err"


def _agents_signals():
    """What a worker of torchrun's agent starts with: the agent takes SIGINT and SIGTERM back from
    whatever ignored them and torchrun handles SIGHUP and SIGQUIT, so exec leaves all four at their
    defaults (the test process may run under nohup, or in the background with SIGINT ignored)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def _said(how, env, tmp_path, rank=0):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    result = tmp_path / "probe.json"  # one name, so that the command lines are alike
    proc, out, err = _start(how, script, [result, "x y"], {**env, "RANK": str(rank)}, tmp_path,
                            rank)
    assert proc.wait(60) == 0, err.read_text()
    return json.loads(result.read_text()), out.read_text(), err.read_text()


def test_a_zygotes_worker_is_what_a_new_interpreter_is(zygotes, tmp_path):
    fresh, fresh_out, fresh_err = _said("fresh", zygotes, tmp_path)
    forked, out, err = _said("zygote", zygotes, tmp_path)
    random_fresh, random_forked = fresh.pop("random"), forked.pop("random")
    # torch's objects, from the zygote, stay frozen in its worker (the module's docstring says why)
    assert fresh["gc"][0] == 0 and forked["gc"][0] > 100_000
    fresh["gc"][0] = forked["gc"][0] = None
    # glibc, starting a new process, splits GLIBC_TUNABLES where it stands in /proc/PID/environ
    # ("a=1:b=2" shows as "a=1", "b=2"); the zygote applied the same tunables when it started
    for said in (fresh, forked):
        said["proc_environ"] = {k: v for k, v in said["proc_environ"].items()
                                if k != "GLIBC_TUNABLES" and not k.startswith("glibc.")}
        said["proc_environ_tunables"] = said["environ"].pop("GLIBC_TUNABLES", None)
    assert {k: v for k, v in forked.items() if v != fresh[k]} == {}, \
        {k: v for k, v in fresh.items() if v != forked[k]}
    set_by_torch = {"TORCHINDUCTOR_CACHE_DIR"} - set(zygotes)  # its import's, not the start's
    assert forked["proc_environ"] == {k: v for k, v in forked["environ"].items()
                                      if k not in set_by_torch}
    assert forked["environ"]["RANK"] == "0"
    assert forked["proc_environ_tunables"] == os.environ.get("GLIBC_TUNABLES")
    assert zygote.PAD not in forked["environ"]
    assert forked["fds"] == ["0", "1", "2", "3"] and forked["tasks"] == 1  # 3: the listing's own
    assert forked["torch_threads"] == 1 and forked["session_leader"]
    assert (out, err) == (fresh_out, fresh_err) == ("stdout line\nstdout again\n", "stderr line\n")
    # a second worker of the same zygote draws other random numbers, as a new process does; one
    # of another rank's zygote has another string-hash secret
    again, _, _ = _said("zygote", zygotes, tmp_path)
    other, _, _ = _said("zygote", zygotes, tmp_path, rank=1)
    assert all(a != b for a, b in zip(random_forked[:3], again["random"][:3]))
    assert random_forked[3] != other["random"][3]
    assert len({random_fresh[0], random_forked[0], again["random"][0]}) == 3


def test_what_torchs_import_sets_in_the_environment_a_worker_has_as_a_new_one_does(tmp_path):
    """torch's import sets TORCHINDUCTOR_CACHE_DIR where it is unset: the zygote's import did, and
    its worker has it as a new interpreter's import would give it."""
    env = {k: v for k, v in _env().items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    was = zygote.enabled()
    zygote.enable(True)
    try:
        zygote.ensure(1, env)
        zygote.ensure(1, env)  # an environment met twice has zygotes
        assert zygote.zygote_of(env, 0).ready(120)
        fresh, _, _ = _said("fresh", env, tmp_path)
        forked, _, _ = _said("zygote", env, tmp_path)
    finally:
        zygote.enable(was)
    assert forked["environ"] == fresh["environ"]
    assert "TORCHINDUCTOR_CACHE_DIR" in forked["environ"]
    assert "TORCHINDUCTOR_CACHE_DIR" not in forked["proc_environ"]  # as a new process's start


def test_a_worker_with_more_than_one_openmp_thread_is_a_new_interpreter(zygotes, tmp_path):
    """OpenMP starts its pool of OMP_NUM_THREADS threads when torch loads; a fork would have none
    of them (GNU OpenMP hangs there): such a launch gets no zygote, and a zygote that has threads
    serves no one."""
    two = {**zygotes, "OMP_NUM_THREADS": "2"}
    for _ in range(2):  # met twice: still none
        zygote.ensure(1, two)
    assert zygote.zygote_of(two, 0) is None
    assert zygote.spawn([sys.executable, "-u", tmp_path / "x.py"], two, None, None, 0) is None
    threaded = zygote.Zygote(0, two, os.getcwd())  # one started all the same: it refuses
    try:
        assert threaded.ready(120)
        assert zygote.spawn([sys.executable, "-u", tmp_path / "x.py"], two, None, None, 0,
                            path=threaded.path) is None
    finally:
        threaded.stop()
    fresh, _, _ = _said("fresh", two, tmp_path)
    assert fresh["torch_threads"] == 2


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_it_ends_as_a_new_interpreter_ends(zygotes, tmp_path, ending):
    script = tmp_path / "end.py"
    script.write_text("import sys\nprint('started', flush=True)\n" + ENDINGS[ending] + "\n")
    seen = {}
    for how in ("fresh", "zygote"):
        kept = tmp_path / f"{how}.kept"
        proc, out, err = _start(how, script, [kept], zygotes, tmp_path)
        code = proc.wait(60)
        seen[how] = (code, out.read_text(), err.read_text(),
                     kept.read_text() if kept.exists() else None)
    assert seen["zygote"] == seen["fresh"]
    code, out, err, kept = seen["zygote"]
    expected = {"code": 3, "message": 1, "exception": 1, "interrupt": -signal.SIGINT, "syntax": 1}
    assert code == expected.get(ending, 0)
    if ending == "exception":
        assert err.startswith("Traceback (most recent call last):\n  File ") and \
            err.endswith("ValueError: a learner error\n")
        assert "zygote" not in err
    if ending == "unflushed":
        assert kept == "kept"
    if ending == "interrupt":  # the rest of the exit first, then the signal
        assert out == "started\natexit ran\n"
    if ending == "syntax":
        assert out == "" and err.startswith("  File ")
        assert "SyntaxError: '(' was never closed" in err


def test_a_script_it_cannot_open_is_said_as_the_interpreter_says_it(zygotes, tmp_path):
    seen = {}
    for how in ("fresh", "zygote"):
        proc, out, err = _start(how, tmp_path / "no_such_lab.py", [], zygotes, tmp_path)
        seen[how] = (proc.wait(60), out.read_text(), err.read_text())
    assert seen["zygote"] == seen["fresh"]
    assert seen["zygote"][0] == 2 and "can't open file" in seen["zygote"][2]


def test_torchruns_agent_can_stop_its_worker_by_its_session(zygotes, tmp_path):
    script = tmp_path / "sleeps.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(120)\n")
    proc, out, _ = _start("zygote", script, [], zygotes, tmp_path)
    deadline = time.monotonic() + 30
    while "up" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.1)
    os.killpg(proc.pid, signal.SIGTERM)  # what torchrun's SubprocessHandler.close does
    assert proc.wait(30) == -signal.SIGTERM


def test_a_launch_it_cannot_be_is_given_a_new_interpreter(zygotes, tmp_path):
    script = tmp_path / "x.py"
    script.write_text("")
    refused = {
        "an environment torch reads on import": ([sys.executable, "-u", script],
                                                 _env(TORCH_DISTRIBUTED_DEBUG="DETAIL")),
        "another interpreter": (["/usr/bin/python3", "-u", script], zygotes),
        "a module": ([sys.executable, "-u", "-m", "json.tool"], zygotes),
        "neither -u nor PYTHONUNBUFFERED": ([sys.executable, script],
                                            {k: v for k, v in zygotes.items()
                                             if k != "PYTHONUNBUFFERED"}),
        "a command line longer than its room": ([sys.executable, "-u", script,
                                                 "x" * 2 * zygote.ARG_ROOM], zygotes),
    }
    for why, (argv, env) in refused.items():
        assert zygote.spawn(argv, env, None, None, 0) is None, why
    assert zygote.spawn([sys.executable, "-u", script], zygotes, None, None, 5) is None  # no zygote
    # the zygote itself refuses another environment, asked by its socket (as horovodrun asks)
    path = zygote.zygote_of(zygotes, 0).path
    assert zygote.spawn([sys.executable, "-u", script], _env(TORCH_DISTRIBUTED_DEBUG="DETAIL"),
                        None, None, 0, path=path) is None
    assert zygote.spawn([sys.executable, "-u", script], zygotes, None, None, 0, cwd="/",
                        path=path) is None  # another directory
    # a runtime variable may differ: torchrun's, the course's own
    ok = zygote.spawn([sys.executable, "-u", script], _env(RANK="1", DPCOURSE_LABS="/x"),
                      None, None, 0)
    assert ok is not None and ok.wait(60) == 0


def test_the_suites_torchrun_forks_its_workers_from_the_zygotes(tmp_path):
    """conftest turns the zygotes on; a launch through it runs its ranks as their forks (their
    parent is a zygote); one that sets what torch reads on import, as forks of zygotes started
    with it."""
    script = tmp_path / "parent.py"
    script.write_text("import os\nprint('parent', os.environ['RANK'], os.getppid())\n")
    if not zygote.enabled():
        pytest.skip("DPCOURSE_ZYGOTES=0")
    pids = []
    other = {"TORCH_SOMETHING_READ_ON_IMPORT": str(tmp_path)}  # an environment this session has
    for extra in ({}, other, other):                               # not met before
        out = run(torchrun_cmd(2, script), env=extra)
        assert out.returncode == 0, out.stdout
        pids.append(dict(line.split()[-2:] for line in out.stdout.splitlines()
                         if line.startswith("parent")))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    detail = {**env, **other}
    assert pids[0] == {str(r): str(zygote.zygote_of(env, r).proc.pid) for r in (0, 1)}
    # an environment met once: new interpreters (their parent is the agent, not a zygote); met
    # again, zygotes of its own
    assert not set(pids[1].values()) & {str(z.proc.pid) for p in zygote._pools.values()
                                         for z in p.values()}
    assert pids[2] == {str(r): str(zygote.zygote_of(detail, r).proc.pid) for r in (0, 1)}


def test_a_one_process_lab_is_a_fork_of_rank_0s_zygote(tmp_path):
    if not zygote.enabled():
        pytest.skip("DPCOURSE_ZYGOTES=0")
    script = tmp_path / "one.py"
    script.write_text("import os, sys\nprint('parent', os.getppid())\nsys.exit(4)\n")
    out = run([sys.executable, script])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    assert (out.returncode, out.stdout) == (4, f"parent {zygote.zygote_of(env, 0).proc.pid}\n"), \
        [(k[1], [(z.proc.pid, z.alive()) for z in p.values()]) for k, p in zygote._pools.items()]


def test_horovodruns_gloo_workers_are_forks_of_the_zygotes_and_say_as_horovod_does(tmp_path):
    """horovodrun --gloo (as notebook 11 starts it) runs its workers as forks of the zygotes:
    their lines tagged "[N]<stdout>:" as horovod tags them, a failure's exit status as its shell
    reports it."""
    if not zygote.enabled():
        pytest.skip("DPCOURSE_ZYGOTES=0")
    if not (Path(sys.executable).parent / "horovodrun").exists():
        pytest.skip("Horovod is not installed (make horovod)")
    script = tmp_path / "hvd.py"
    script.write_text("import os, sys\nprint('parent', os.environ['HOROVOD_RANK'], os.getppid())\n"
                      "print('to stderr', file=sys.stderr)\n"
                      "sys.exit(3 if os.environ['HOROVOD_RANK'] == '1' else 0)\n")
    out = run([sys.executable, "-m", "dpcourse.lab.horovodrun", "--gloo", "-np", "2",
               sys.executable, script], timeout=120)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    parents = dict(line.split()[-2:] for line in out.stdout.splitlines() if "parent" in line)
    assert parents == {str(r): str(zygote.zygote_of(env, r).proc.pid) for r in (0, 1)}, out.stdout
    lines = out.stdout.splitlines()
    assert "[0]<stderr>:to stderr" in lines and "[1]<stderr>:to stderr" in lines
    assert any(line.startswith("[1]<stdout>:parent 1 ") for line in lines)
    assert "Process 1 exit with status code 3." in lines and out.returncode != 0
