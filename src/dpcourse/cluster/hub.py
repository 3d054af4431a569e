"""The room's hub (room/jupyterhub_config.py): its settings, each learner's Slurm job, and a demo.

    python -m dpcourse.cluster.hub prepare  # in a learner's job: ~/dpcourse, their copy, if missing
    make room-demo                          # (as root) a local two-node Slurm, three test learners
                                            # and the hub on http://127.0.0.1:8000, until Ctrl-C

``Settings`` holds what an instructor sets once (account, partition, reservation, limits, the
idle timeout, .venv or container); each field can also come from DPCOURSE_HUB_<FIELD>. The hub
submits ``BATCH_SCRIPT`` as the learner (batchspawner's SlurmSpawner, through sudo -u), with
``Settings.prologue()`` before the server: the course's environment, the learner's own copy of
the course, and where `make check` leaves its records for the live view (dpcourse.cluster.room).
"""
from __future__ import annotations

import argparse
import dataclasses
import html
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path

from dpcourse.lab.paths import project_root

# What a learner's copy holds (copied once, at their first start): what they read, run and edit.
LEARNER_TREE = ("README.md", "Makefile", "pyproject.toml", "environment.yml", "notebooks", "labs",
                "slurm")

# Each learner's server: one Slurm job, submitted as the learner. batchspawner fills in the
# {{...}} (jinja2): the form's choices, the prologue and the server's command.
JOB_NAME = "dpcourse-room"  # each learner's server (their own jupyter.sbatch: dpcourse-jupyter)
BATCH_SCRIPT = """#!/bin/bash
#SBATCH --job-name=""" + JOB_NAME + """
#SBATCH --output={{homedir}}/""" + JOB_NAME + """-%j.log
#SBATCH --chdir={{homedir}}
#SBATCH --export={{keepvars}}
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --no-requeue
{% if account %}#SBATCH --account={{account}}
{% endif %}{% if partition %}#SBATCH --partition={{partition}}
{% endif %}{% if reservation %}#SBATCH --reservation={{reservation}}
{% endif %}{% if time %}#SBATCH --time={{time}}
{% endif %}{% if cpus %}#SBATCH --cpus-per-task={{cpus}}
{% endif %}{% if gpus and gpus != "0" %}#SBATCH --gpus-per-node={{gpus}}
{% endif %}{% if memory and memory != "0" %}#SBATCH --mem={{memory}}G
{% endif %}
set -euo pipefail
umask 077
trap 'echo "dpcourse: the server was stopped (from the hub, or by the time limit)"' TERM
{{prologue}}
{{cmd}}
"""

TIME = re.compile(r"^(?:(\d+)-)?(\d{1,2}):([0-5]\d):([0-5]\d)$")  # D-HH:MM:SS or HH:MM:SS
FIELDS = ("account", "partition", "reservation", "time", "cpus", "gpus", "memory")  # the form's


def _seconds(limit: str) -> int:
    m = TIME.match(limit.strip())
    if not m:
        raise ValueError(f"time limit {limit!r}: write it as HH:MM:SS, e.g. 02:00:00")
    days, h, mi, s = (int(g or 0) for g in m.groups())
    return ((days * 24 + h) * 60 + mi) * 60 + s


@dataclasses.dataclass
class Settings:
    """The room, as an instructor sets it once (room/jupyterhub_config.py's EDIT block)."""
    course: Path
    account: str = ""
    partition: str = ""
    reservation: str = ""
    time: str = "02:00:00"
    cpus: int = 8
    gpus: int = 1
    max_cpus: int = 16
    max_gpus: int = 1
    memory: int = 16  # GB (sbatch --mem); 0: the site's default, which may be a whole node's
    max_memory: int = 64
    max_time: str = "08:00:00"
    idle_timeout: int = 3600
    cull_every: int = 60
    container: str = ""
    data: str = ""
    room_records: str = ""
    admins: tuple = ()
    allowed_groups: tuple = ()
    pam_service: str = "dpcourse-hub"  # /etc/pam.d/dpcourse-hub: room/pam/dpcourse-hub, the site's
    site_prologue: str = ""
    poll_s: int = 5
    bind_url: str = "http://127.0.0.1:8000"
    subdomain_host: str = ""  # e.g. "https://hub.example.org": each server on its own subdomain
    hub_bind_url: str = "http://127.0.0.1:8081"
    hub_connect_url: str = ""
    proxy_api_url: str = "http://127.0.0.1:8001"  # the proxy's own API, for the hub alone
    proxy: str = ""
    state: Path = Path()
    start_timeout: int = 1200

    @classmethod
    def from_env(cls, **given) -> Settings:
        """``given`` (the configuration file's values), each overridden by DPCOURSE_HUB_<NAME>."""
        values = {}
        for f in dataclasses.fields(cls):
            raw = os.environ.get(f"DPCOURSE_HUB_{f.name.upper()}")
            value = given.get(f.name, f.default) if raw is None else raw
            if f.type in ("int", int):
                value = int(value)
            elif f.name in ("admins", "allowed_groups") and isinstance(value, str):
                value = tuple(v for v in value.replace(",", " ").split() if v)
            values[f.name] = value
        s = cls(**values)
        s.course = Path(s.course).resolve()
        s.state = Path(s.state) if str(s.state) not in ("", ".") else Path("/var/lib/dpcourse-hub")
        s.hub_connect_url = s.hub_connect_url or s.hub_bind_url
        local = s.course / "build" / "room" / "node_modules" / ".bin" / "configurable-http-proxy"
        s.proxy = s.proxy or (str(local) if local.exists()
                              else shutil.which("configurable-http-proxy") or str(local))
        return s

    def make_state(self) -> Path:
        """The hub's state folder (database, cookie secret), the hub's user's alone."""
        self.state.mkdir(parents=True, exist_ok=True)
        self.state.chmod(0o700)
        return self.state

    def refusals(self) -> list[str]:
        """Why the hub must not start with these settings (each with what to do), or []."""
        out = []
        if not self.allowed_groups:
            out.append("allowed_groups is empty: name the training group (only its members log "
                       "in), in room/jupyterhub_config.py or DPCOURSE_HUB_ALLOWED_GROUPS")
        if not (Path("/etc/pam.d") / self.pam_service).is_file():
            out.append(f"no PAM service /etc/pam.d/{self.pam_service}: install room/pam/"
                       f"dpcourse-hub there with the site's rules (docs/instructor.md)")
        return out

    def _in_container(self) -> str:
        """``apptainer exec`` of the course's image, with the course (what a learner's first start
        copies) and the data and room folders bound at the same paths; "" without a container."""
        if not self.container:
            return ""
        binds = ",".join(str(p) for p in (self.course, self.data, self.room_records) if p)
        return f"apptainer exec --nv --bind {shlex.quote(binds)} {shlex.quote(self.container)} "

    def prologue(self) -> str:
        """The job's lines before the server: the site's (in a login environment), the course's
        environment, the learner's copy, and the variables every notebook and `make check` read."""
        lines = []
        if self.site_prologue:  # e.g. module load apptainer: `module` comes from /etc/profile.d
            lines += ["set +eu; source /etc/profile; set -eu  # the login environment: module, "
                      "the site's paths", self.site_prologue]
        if not self.container:
            venv = shlex.quote(str(self.course / ".venv" / "bin"))
            lines += [f"export PATH={venv}:$PATH",
                      f'python -c "" 2>/dev/null || {{ echo "dpcourse: $USER cannot run the '
                      f"course's Python ({venv}/python): install the course where every learner "
                      f'can read it, or ask the room\'s instructor" >&2; exit 1; }}']
        for name, value in (("DPCOURSE_DATA", self.data), ("DPCOURSE_ROOM", self.room_records)):
            if value:
                lines.append(f"export {name}={shlex.quote(value)}")
        course = shlex.quote(str(self.course))
        lines.append(f"{self._in_container()}python -m dpcourse.cluster.hub prepare "
                     f"--course {course}")
        return "\n".join(lines)

    def singleuser_wrapper(self) -> str:
        """What runs `jupyterhub-singleuser` (batchspawner's port-reporting wrapper)."""
        return f"{self._in_container()}batchspawner-singleuser"

    def options_form(self) -> str:
        """The spawn page's form: account, partition, reservation, time, CPUs and GPUs, with the
        room's values filled in."""
        def field(name, label, value, kind="text", extra=""):
            return (f'<div class="form-group"><label for="{name}">{label}</label>'
                    f'<input class="form-control" id="{name}" name="{name}" type="{kind}" '
                    f'value="{html.escape(str(value))}" {extra}></div>')
        return "\n".join([
            field("account", "Account (sbatch --account)", self.account),
            field("partition", "Partition", self.partition),
            field("reservation", "Reservation", self.reservation),
            field("time", f"Time limit (HH:MM:SS, at most {self.max_time})", self.time),
            field("cpus", "CPUs", self.cpus, "number", f'min="1" max="{self.max_cpus}"'),
            field("gpus", "GPUs", self.gpus, "number", f'min="0" max="{self.max_gpus}"'),
            field("memory", f"Memory in GB (at most {self.max_memory})", self.memory, "number",
                  f'min="1" max="{self.max_memory}"'),
        ])

    def options_from_form(self, form: dict) -> dict:
        """The form's values, checked, as the batch script's variables. A wrong value is refused
        with what to change (JupyterHub shows the message above the form)."""
        return self.checked({k: (v or [""])[0] for k, v in form.items()})

    def pre_spawn_hook(self, spawner) -> None:
        """Every start, from the form or the REST API: only the form's fields, checked again, reach
        the job script (batchspawner merges user_options into its variables as they come)."""
        spawner.user_options = self.checked(spawner.user_options or {})

    def checked(self, given: dict) -> dict:
        """``given``'s values of the form's fields (FIELDS; anything else is dropped), checked
        against the room's limits; a wrong one is refused with what to change."""
        def one(name, default=""):
            value = str(given.get(name, "") or "").strip()
            return value or default

        words = {k: one(k) for k in ("account", "partition", "reservation")}
        for k, v in words.items():
            if v and not re.fullmatch(r"[\w.-]+", v):
                raise ValueError(f"{k} {v!r}: letters, digits, '.', '_' and '-' only")
        limit = one("time", self.time)
        if _seconds(limit) > _seconds(self.max_time) or _seconds(limit) == 0:
            raise ValueError(f"time limit {limit}: give one above 0 and at most {self.max_time}")
        try:
            cpus, gpus = int(one("cpus", str(self.cpus))), int(one("gpus", str(self.gpus)))
            memory = int(one("memory", str(self.memory)))
        except ValueError:
            raise ValueError("CPUs, GPUs and memory (GB) are whole numbers") from None
        if not 1 <= cpus <= self.max_cpus or not 0 <= gpus <= self.max_gpus:
            raise ValueError(f"CPUs 1 to {self.max_cpus}, GPUs 0 to {self.max_gpus}")
        if self.memory and not 1 <= memory <= self.max_memory:
            raise ValueError(f"memory 1 to {self.max_memory} GB")
        return {**words, "time": limit, "cpus": str(cpus), "gpus": str(gpus),
                "memory": str(memory if self.memory else 0)}


def slurm_commands(sudo: str = "", which=shutil.which) -> dict:
    """The hub's Slurm commands, each run as the learner through sudo, by full paths (sudo's
    secure_path may not hold the site's Slurm). Only sbatch keeps the environment it is given
    (-E: the server's own variables, its token among them); squeue and scancel get sudo's reset
    one, so no variable of the hub's reaches a process the learner owns."""
    sudo = sudo or which("sudo") or "/usr/bin/sudo"
    sbatch, squeue, scancel = (which(c) or f"/usr/bin/{c}" for c in ("sbatch", "squeue", "scancel"))
    return {"batch_submit_cmd": f"{sudo} -E -u {{username}} {sbatch} --parsable",
            "batch_query_cmd": f"{sudo} -u {{username}} {squeue} -h -j {{job_id}} -o '%T %B'",
            "batch_cancel_cmd": f"{sudo} -u {{username}} {scancel} {{job_id}}",
            "batch_cancel_by_name_cmd": f"{sudo} -u {{username}} {scancel} --name={JOB_NAME} "
                                        "--user={username}"}


def sudoers(service_user: str, groups, which=shutil.which) -> str:
    """/etc/sudoers.d/dpcourse-hub: the hub's service user may run sbatch, squeue and scancel as
    the training group's members (never root), and nothing else; sbatch alone keeps its
    environment (SETENV, for sudo -E). Check it with visudo -cf before installing it."""
    if not re.fullmatch(r"[a-z_][a-z0-9_.-]*", service_user):
        raise ValueError(f"service user {service_user!r}: not a user name")
    for g in groups:
        if not re.fullmatch(r"[a-z_][a-z0-9_.-]*", g):
            raise ValueError(f"group {g!r}: not a group name")
    if not groups:
        raise ValueError("name the training group(s) whose members the hub may act as")
    sbatch, squeue, scancel = (which(c) or f"/usr/bin/{c}" for c in ("sbatch", "squeue", "scancel"))
    learners = ", ".join(f"%{g}" for g in groups)
    # no aliases: sudo keeps the first definition of an alias name, so a second room's rule that
    # reused one would give its hub the first room's learners
    return f"""\
# /etc/sudoers.d/{service_user} (0440 root:root), from: python -m dpcourse.cluster.hub sudoers
# The room's hub runs as {service_user} and submits, watches and cancels each learner's JupyterLab
# as that learner: the members of {", ".join(groups)}, never root. Nothing else.
Defaults:{service_user} env_keep += "SLURM_CONF"
{service_user} ALL = ({learners}, !root) NOPASSWD: SETENV: {sbatch} --parsable
{service_user} ALL = ({learners}, !root) NOPASSWD: {squeue} -h -j * -o %T %B, {scancel} *
"""


def prepare(course: Path, dest: Path | None = None) -> Path:
    """The learner's own copy of the course (``dest``, ~/dpcourse), made once; later starts keep it
    and every edit in it. .venv points at the course's environment, so `make check` works there."""
    dest = dest or Path.home() / "dpcourse"
    if (dest / "pyproject.toml").exists():
        return dest
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in LEARNER_TREE:
        src = course / name
        if src.is_dir():
            shutil.copytree(src, tmp / name)
        elif src.exists():
            shutil.copy2(src, tmp / name)
    venv = course / ".venv"
    if not venv.exists() and (Path(sys.prefix) / ".installed-stamp").exists():
        venv = Path(sys.prefix)  # in the course's container: its /opt/venv, set up in the image
    if venv.exists():
        (tmp / ".venv").symlink_to(venv)
    stamp = venv / ".installed-stamp"
    if stamp.exists():  # the copy's `make check` finds the shared .venv set up: no install
        for name in ("Makefile", "pyproject.toml"):
            os.utime(tmp / name, ns=(stamp.stat().st_mtime_ns,) * 2)
    if (course / "data").exists() and not os.environ.get("DPCOURSE_DATA"):
        (tmp / "data").symlink_to(course / "data")
    tmp.rename(dest)  # whole, or not there: a job killed while copying leaves no half copy
    print(f"dpcourse: your copy of the course is {dest}", flush=True)
    return dest


# ------------------------------------------------------------------ local learners (demo, tests)
def unreachable(paths, user: str) -> list[Path]:
    """The folders on the way to ``paths`` that ``user`` may not enter (no x permission for them,
    as owner, group or other): where a learner's job would fail to find the course."""
    import pwd

    pw = pwd.getpwnam(user)
    groups = set(os.getgrouplist(user, pw.pw_gid))
    out: list[Path] = []
    for path in paths:
        for d in reversed(Path(path).resolve().parents):
            st = d.stat()
            bit = 0o100 if st.st_uid == pw.pw_uid else 0o010 if st.st_gid in groups else 0o001
            if not st.st_mode & bit and d not in out:
                out.append(d)
    return out


@contextmanager
def lend_access(user: str, paths):
    """Let ``user`` through the folders on the way to ``paths`` (an ACL entry u:USER:x, enter but
    not list) while the block runs; then each folder's ACL exactly as it was. For the demo's and
    the test's own accounts on a machine where the course's Python sits in root's home; a site
    installs the course in a shared folder that every learner can read instead."""
    saved = []
    try:
        for d in unreachable(paths, user):
            before = subprocess.run(["getfacl", "--absolute-names", str(d)], check=True,
                                    capture_output=True, text=True).stdout
            saved.append((d, before))
            subprocess.run(["setfacl", "-m", f"u:{user}:x", str(d)], check=True,
                           capture_output=True)
        yield [d for d, _ in saved]
    finally:
        for d, before in reversed(saved):
            subprocess.run(["setfacl", "--restore=-"], input=before, text=True,
                           capture_output=True)


def course_paths(course: Path) -> list[Path]:
    """What a learner's job reads: the course, its .venv's real interpreter and standard library."""
    python = Path(os.path.realpath(course / ".venv" / "bin" / "python"))
    return [course / "pyproject.toml", python, Path(sys.base_prefix) / "lib"]


def add_learner(name: str, password: str, groups=()) -> None:
    """A local Unix account with a home and a password (root only), in ``groups``: a learner for
    the demo or the test. remove_learner() takes it away again, home and all."""
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash",
                    *(["--groups", ",".join(groups)] if groups else []), name], check=True,
                   capture_output=True)
    subprocess.run(["chpasswd"], input=f"{name}:{password}", text=True, check=True,
                   capture_output=True)


def remove_learner(name: str) -> None:
    """The account, its home and its processes (end its Slurm jobs first: they would restart
    nothing, but a job's step may still be running as the learner)."""
    for _ in range(40):
        if subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True).returncode != 0:
            break  # no process left (pkill found none, or there is no such user)
        time.sleep(0.25)
    subprocess.run(["userdel", "--remove", name], capture_output=True)
    if subprocess.run(["id", name], capture_output=True).returncode == 0:
        raise RuntimeError(f"could not remove the account {name}: userdel --remove {name}")


@contextmanager
def local_room(course: Path, names, state: Path, tag: str = ""):
    """(root; the demo and the tests) A room's accounts on this machine, set up as the guide's
    "Deploying the hub" sets them up on a login node: the training group with the learners
    ``names`` (fresh passwords), the hub's service user (in shadow, for PAM), its sudoers rule
    (``sudoers()``, checked by visudo) and the course's PAM service, each named with ``tag``; the
    state folder the service user's. Yields a namespace (group, service, passwords, env: the
    hub's DPCOURSE_HUB_* for them). Afterwards every account, file and ACL is gone or as it was."""
    tag = tag or secrets.token_hex(3)
    group, service = f"dpctrn{tag}", f"dpchub{tag}"
    sudoers_file = Path(f"/etc/sudoers.d/dpcourse-hub-{tag}")
    pam_file = Path(f"/etc/pam.d/dpcourse-hub-{tag}")
    passwords = {n: secrets.token_urlsafe(12) for n in names}
    made: list[str] = []
    with ExitStack() as undo:
        try:
            subprocess.run(["groupadd", group], check=True, capture_output=True)
            undo.callback(subprocess.run, ["groupdel", group], capture_output=True)
            subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", str(state),
                            "--shell", "/usr/sbin/nologin", "--groups", "shadow", service],
                           check=True, capture_output=True)
            made.append(service)
            for n in names:
                add_learner(n, passwords[n], groups=[group])
                made.append(n)
            rule = sudoers(service, [group])
            checked = subprocess.run(["visudo", "-cf", "-"], input=rule, text=True,
                                     capture_output=True)
            if checked.returncode != 0:
                raise RuntimeError(f"visudo refused the hub's sudoers rule: {checked.stderr}")
            undo.callback(lambda: sudoers_file.unlink(missing_ok=True))
            sudoers_file.write_text(rule)
            sudoers_file.chmod(0o440)
            undo.callback(lambda: pam_file.unlink(missing_ok=True))
            shutil.copyfile(course / "room" / "pam" / "dpcourse-hub", pam_file)
            state.mkdir(parents=True, exist_ok=True)
            shutil.chown(state, service, service)
            state.chmod(0o700)
            for n in [service, *names]:
                undo.enter_context(lend_access(n, [*course_paths(course), state]))
            env = {"DPCOURSE_HUB_STATE": str(state), "DPCOURSE_HUB_ALLOWED_GROUPS": group,
                   "DPCOURSE_HUB_PAM_SERVICE": pam_file.name, "HOME": str(state)}
            yield argparse.Namespace(group=group, service=service, passwords=passwords, env=env)
        finally:
            for n in reversed(made):
                remove_learner(n)
            if service in made:  # the state folder was the service user's, who is gone
                shutil.rmtree(state, ignore_errors=True)


def start_hub(course: Path, env: dict, log: Path, user: str = "") -> subprocess.Popen:
    """jupyterhub -f room/jupyterhub_config.py, in its own session (so that it and its proxy and
    culler stop together), logging to ``log``; as ``user`` through sudo (with ``env``) if given."""
    as_user = ["sudo", "-E", "-u", user, "--"] if user else []
    with open(log, "ab") as out:
        return subprocess.Popen([*as_user, str(Path(sys.executable).parent / "jupyterhub"), "-f",
                                 str(course / "room" / "jupyterhub_config.py")],
                                cwd=course, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_up(url: str, hub: subprocess.Popen, log: Path, timeout: float = 120) -> float:
    """Seconds until the hub answers at ``url`` (its /hub/api); a clear error if it died."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if hub.poll() is not None:
            raise RuntimeError(f"the hub exited ({hub.returncode}); its log, {log}:\n"
                               + log.read_text()[-3000:])
        try:
            urllib.request.urlopen(f"{url}/hub/api", timeout=2)
            return time.perf_counter() - start
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"the hub did not answer at {url} within {timeout:g} s; see {log}")


def stop_hub(hub: subprocess.Popen) -> None:
    """The hub, its proxy and its culler (one session): SIGTERM, then SIGKILL."""
    if hub.poll() is None:
        os.killpg(hub.pid, signal.SIGTERM)
        try:
            hub.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(hub.pid, signal.SIGKILL)
            hub.wait()


def demo(learners: int = 3, port: int = 8000) -> int:
    """A room on this machine: a two-node Slurm, ``learners`` local accounts with fresh passwords,
    and the hub. Ctrl-C stops the hub, cancels the learners' jobs, and removes the accounts: only
    what the demo started."""
    from dpcourse.cluster import localslurm

    # Ctrl-C is how it stops: heard even where it was started ignoring SIGINT (a background job
    # of a shell without job control), as localslurm.demo does
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.geteuid() != 0:
        print("make room-demo runs as root: it starts Slurm and adds local accounts "
              "(sudo make room-demo)", file=sys.stderr)
        return 1
    course = project_root(Path(__file__)) or Path.cwd()
    names = [f"learner{i}" for i in range(1, learners + 1)]
    taken = [n for n in names if subprocess.run(["id", n], capture_output=True).returncode == 0]
    if taken:
        print(f"accounts {', '.join(taken)} already exist: the demo makes its own (userdel them, "
              "or they are another demo's)", file=sys.stderr)
        return 1
    state = course / "build" / "room-demo"
    hub = None
    with localslurm.start() as cluster, local_room(course, names, state / "hub") as room:
        passwords = room.passwords
        try:
            env = {**os.environ, **cluster.env, **room.env,
                   "DPCOURSE_HUB_BIND_URL": f"http://127.0.0.1:{port}",
                   "DPCOURSE_HUB_GPUS": "0", "DPCOURSE_HUB_CPUS": "1", "DPCOURSE_HUB_MAX_CPUS": "2",
                   "DPCOURSE_HUB_TIME": "01:00:00", "DPCOURSE_HUB_IDLE_TIMEOUT": "900",
                   "DPCOURSE_HUB_MEMORY": "1", "DPCOURSE_HUB_MAX_MEMORY": "4",
                   "DPCOURSE_HUB_ROOM_RECORDS": str(state / "records"),
                   "DPCOURSE_DATA": str(course / "data")}
            from dpcourse.cluster import (
                room as rooms,  # the live view's records: each learner's own folder
            )
            shutil.rmtree(state / "records", ignore_errors=True)  # a past demo's learners are gone
            rooms.setup(state / "records", users=names)
            log = state / "hub.log"
            for attempt in range(3):  # a port found free may be taken before the hub binds it
                env.update({f"DPCOURSE_HUB_{k}": f"http://127.0.0.1:{p}" for k, p in  # not 8081,
                            zip(("HUB_BIND_URL", "PROXY_API_URL"), localslurm._free_ports(2))})
                before = log.stat().st_size if log.exists() else 0
                hub = start_hub(course, env, log, user=room.service)
                try:
                    took = wait_up(f"http://127.0.0.1:{port}", hub, log)
                    break
                except RuntimeError:  # the hub exited, or did not answer in time
                    taken = b"EADDRINUSE" in log.read_bytes()[before:]  # this start's lines only
                    if hub.poll() is None or not taken or attempt == 2:
                        raise
                    hub = None  # it exited: start it again on other free ports
                    print("a port given to the hub was taken meanwhile: again, on others",
                          flush=True)
            print(f"\nThe room's hub is up (in {took:.1f} s): http://127.0.0.1:{port}\n")
            for n in names:
                print(f"    {n}  password {passwords[n]}")
            print(f"\nEach learner's server is a Slurm job on the local nodes (squeue: SLURM_CONF="
                  f"{cluster.conf} squeue). The live view: python -m dpcourse.kit.course room "
                  f"{state / 'records'}\nCtrl-C stops the hub, the jobs and the accounts.",
                  flush=True)
            hub.wait()
        except KeyboardInterrupt:
            print("\nstopping the room", flush=True)
        finally:
            if hub is not None:
                stop_hub(hub)
            for n in names:  # the learners' servers: the hub leaves their jobs running
                cluster.run(["scancel", "-u", n])
            cluster.settle()
            shutil.rmtree(state / "records", ignore_errors=True)  # the demo learners' folders
            print("the room is stopped: hub, jobs and accounts", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpcourse.cluster.hub",
                                description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="the learner's own copy of the course, if missing")
    prep.add_argument("--course", type=Path, required=True, help="the checkout to copy from")
    prep.add_argument("--dest", type=Path, default=None, help="default: ~/dpcourse")
    su = sub.add_parser("sudoers", help="the sudoers rule of the hub's service user (stdout)")
    su.add_argument("--user", default="dpcourse-hub", help="the hub's service user")
    su.add_argument("--group", action="append", required=True, help="the training group")
    d = sub.add_parser("demo", help="a local Slurm, test learners and the hub, until Ctrl-C")
    d.add_argument("--learners", type=int, default=3)
    d.add_argument("--port", type=int, default=8000)
    args = p.parse_args(argv)
    if args.command == "prepare":
        prepare(args.course, args.dest)
        return 0
    if args.command == "sudoers":
        print(sudoers(args.user, args.group), end="")
        return 0
    return demo(args.learners, args.port)


if __name__ == "__main__":
    sys.exit(main())
