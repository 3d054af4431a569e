"""The room's hub, end to end on the local two-node Slurm (room/jupyterhub_config.py,
dpcourse.cluster.hub).

Two test learners (local accounts with passwords, made and removed here) log in through PAM. The
first, in headless Chromium, starts a server from the spawn form: a Slurm job running as that
learner; opens notebook 00 of their own copy through the hub's proxy and runs its first cell; and
is refused the second learner's server. The second learner's server, started through the hub's
API, is stopped by jupyterhub-idle-culler once idle; the first one's by the hub's stop. Each stop
ends the Slurm job. The hub's start time and the time from the click to a running JupyterLab are
printed, and the screenshots go to build/room/.

Root only (the hub runs as root and submits as each learner through sudo); skipped elsewhere,
except in CI (CI=true), which has what it needs (.ci/run).
"""
import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil
import pytest

from conftest import ROOT
from dpcourse.cluster import hub
from dpcourse.lab.rendezvous import free_port
from test_browser import CHROMIUM, _stop, node  # noqa: F401 - node: the fixture, playwright-core

pytestmark = pytest.mark.slow

DRIVER = ROOT / "tests" / "browser" / "hub_session.mjs"
SHOTS = ROOT / "build" / "room"
TOKEN = secrets.token_hex(16)  # the test's own hub service: start, watch and cull servers
EXTRA = f"""
c.JupyterHub.services.append({{"name": "dpcourse-test", "api_token": "{TOKEN}"}})
c.JupyterHub.load_roles.append({{"name": "dpcourse-test", "services": ["dpcourse-test"],
    "scopes": ["admin:users", "admin:servers", "list:users", "read:users:activity",
               "read:servers", "delete:servers", "list:services", "read:services"]}})
"""


def _missing(why: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI needs the hub test's tools (.ci/run installs them): {why}", pytrace=False)
    pytest.skip(why)


def _api(base: str, method: str, path: str, body=None):
    req = urllib.request.Request(f"{base}/hub/api{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"token {TOKEN}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read()
        return json.loads(text) if text else None


def _until(what: str, check, timeout: float, log):
    """Poll ``check`` until it returns something true; fail with the hub's log after ``timeout``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if found := check():
            return found
        time.sleep(0.5)
    pytest.fail(f"{what} within {timeout:g} s."
                + (f" The hub's log ends:\n{log.read_text()[-4000:]}" if log else ""))


def _jobs(slurm) -> dict[str, str]:
    """{job id: user} of the jobs Slurm holds now."""
    out = slurm.run(["squeue", "-h", "-o", "%i %u"]).stdout.split()
    return dict(zip(out[::2], out[1::2]))


@pytest.fixture
def proxy():
    """configurable-http-proxy, as make room-setup installs it (npm) into build/room/."""
    proxy = ROOT / "build" / "room" / "node_modules" / ".bin" / "configurable-http-proxy"
    if not proxy.exists():
        done = subprocess.run(["make", "room-setup"], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            _missing(f"make room-setup (npm install configurable-http-proxy) failed:\n"
                     f"{done.stdout[-1500:]}{done.stderr[-1500:]}")
    return proxy


@pytest.fixture
def own_tmp():
    """A folder of the test's own, outside pytest's (whose top folder pytest itself chmods when a
    run starts, which would take away the hub's user's passage through it)."""
    folder = hub.Path(tempfile.mkdtemp(prefix="dpcourse-hub-test-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def room(slurm, proxy, own_tmp):
    """The hub, as room/jupyterhub_config.py sets it up, against the local Slurm, run as its service
    user through real sudo (hub.local_room: the training group with two learners, the service user,
    its sudoers rule, the course's PAM service). A namespace: url, api (the hub's own API address,
    which the servers call), log, took (s to start), passwords, service, group."""
    for tool in ("sudo", "visudo", "setfacl", "useradd", "groupadd", "chpasswd"):
        if not shutil.which(tool):
            _missing(f"no {tool} (apt-get install sudo acl passwd)")
    if os.geteuid() != 0:
        _missing("the test makes local accounts, a sudoers rule and a PAM service (root)")
    names = [f"dpt{secrets.token_hex(3)}" for _ in range(2)]
    before = {p: hub.unreachable([p], "nobody") for p in hub.course_paths(ROOT)}
    port, hub_port = free_port(), free_port()
    extra = own_tmp / "extra.py"
    extra.write_text(EXTRA)
    extra.chmod(0o644)
    log = own_tmp / "hub.log"
    with hub.local_room(ROOT, names, own_tmp / "state") as accounts:
        env = {**os.environ, **slurm.env, **accounts.env,
               "DPCOURSE_HUB_BIND_URL": f"http://127.0.0.1:{port}",
               "DPCOURSE_HUB_HUB_BIND_URL": f"http://127.0.0.1:{hub_port}",
               "DPCOURSE_HUB_PROXY_API_URL": f"http://127.0.0.1:{free_port()}",
               "DPCOURSE_HUB_CPUS": "1", "DPCOURSE_HUB_GPUS": "0", "DPCOURSE_HUB_TIME": "00:20:00",
               "DPCOURSE_HUB_MEMORY": "1", "DPCOURSE_HUB_MAX_MEMORY": "4",
               "DPCOURSE_HUB_DATA": str(ROOT / "data"), "DPCOURSE_HUB_EXTRA_CONFIG": str(extra)}
        proc = hub.start_hub(ROOT, env, log, user=accounts.service)
        try:
            took = hub.wait_up(f"http://127.0.0.1:{port}", proc, log)
            print(f"the hub answered {took:.1f} s after it started", flush=True)
            yield argparse.Namespace(url=f"http://127.0.0.1:{port}",
                                     api=f"http://127.0.0.1:{hub_port}", log=log, took=took,
                                     hub_env=env, **vars(accounts))
        finally:
            hub.stop_hub(proc)
            _stop([], "dpcourse-hub-test")  # the driver's Chromium, should it outlive the driver
            for n in names:  # their jobs first (the hub leaves jobs running when it stops)
                slurm.run(["scancel", "-u", n])
            _until("the learners' jobs ended",
                   lambda: not set(_jobs(slurm).values()) & set(names), 60, None)
    assert not any(n in line for n in [*names, accounts.service] for line in open("/etc/passwd")), \
        "an account stayed"
    assert not any(hub.unreachable([p], "nobody") != before[p] for p in before), \
        "a folder's ACL was not put back"


def test_two_learners_in_the_room(node, room, slurm):  # noqa: F811 - node: the fixture
    base, log, hub_s = room.url, room.log, room.took
    first, second = list(room.passwords)
    names = {first, second}

    # The second learner's server, started through the hub's API (as an instructor's script
    # could): a Slurm job of that learner's, on an emulated node.
    _api(base, "POST", f"/users/{second}")  # the hub knows a learner once they exist there
    _api(base, "POST", f"/users/{second}/server",
         {"time": "00:20:00", "cpus": "1", "gpus": "0", "memory": "1", "account": "",
          "partition": "", "reservation": ""})

    # The first learner, in the browser: log in, the form, Start, a notebook, another's server.
    env = {**os.environ, "DPCOURSE_TEST_PASSWORD": room.passwords[first]}
    done = subprocess.run([node, str(DRIVER), f"--hub={base}", f"--user={first}",
                           "--password-env=DPCOURSE_TEST_PASSWORD",
                           "--notebook=notebooks/00_setup.ipynb", f"--other={second}",
                           f"--out={SHOTS}", f"--chromium={CHROMIUM}"],
                          cwd=DRIVER.parent, env=env, capture_output=True, text=True, timeout=600)
    lines = done.stdout.strip().splitlines()
    assert lines, f"the browser driver printed nothing:\n{done.stderr[-3000:]}"
    seen = json.loads(lines[-1])
    print(json.dumps({k: v for k, v in seen.items() if k != "screenshots"}, indent=1), flush=True)
    assert "failure" not in seen, f"{seen['failure']}\nThe hub's log:\n{log.read_text()[-4000:]}"
    assert seen["logged_in"]
    assert {f["name"] for f in seen["form_fields"]} >= {"account", "time", "cpus", "gpus"}
    assert seen["lab_url"].startswith(f"{base}/user/{first}/lab")
    assert seen["execution_count"] == 1 and "torch" in seen["cell_output"], seen["cell_output"]
    other = seen["other"]
    assert other["status"] == 403 or f"/user/{first}/" in other["url"], \
        f"the first learner reached the second's server: {other}"
    print(f"hub start {hub_s:.1f} s; click to a running JupyterLab {seen['spawn_s']} s", flush=True)

    # Both servers are Slurm jobs, each its learner's, and the processes run as that learner.
    def both_running():
        jobs = _jobs(slurm)
        return jobs if set(jobs.values()) == names else None

    _until("both servers running as Slurm jobs, each its learner's", both_running, 240, log)
    owners = {p.info["username"] for p in psutil.process_iter(["cmdline", "username"])
              if any("jupyterhub-singleuser" in a for a in p.info["cmdline"] or ())}
    assert owners == names, f"the servers run as {owners}, not as {names}"
    assert (hub.Path(f"/home/{first}") / "dpcourse" / "notebooks").is_dir()

    # Stopping a server ends its job.
    _api(base, "DELETE", f"/users/{first}/server")
    _until(f"{first}'s job ended after its server was stopped",
           lambda: first not in _jobs(slurm).values(), 120, log)

    # jupyterhub-idle-culler, with a short timeout, stops the idle one, and its job ends. (The
    # room's own culler, a hub service with the room's timeout, is there too.)
    services = _api(base, "GET", "/services")
    assert "idle-culler" in services, services
    culler = subprocess.Popen([sys.executable, "-m", "jupyterhub_idle_culler", "--timeout=5",
                               "--cull-every=2", f"--url={base}/hub/api"],
                              env={**os.environ, "JUPYTERHUB_API_TOKEN": TOKEN},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _until(f"the culler stopped {second}'s idle server",
               lambda: not _api(base, "GET", f"/users/{second}")["servers"], 120, log)
    finally:
        culler.terminate()
        culled = culler.communicate(timeout=30)[0]
    assert f"Culling server {second}" in culled or second in culled, culled
    _until(f"{second}'s job ended after the culler", lambda: not _jobs(slurm), 120, log)


def test_room_demo_starts_a_room_and_stops_only_what_it_started(proxy, slurm):
    """make room-demo's command: its own Slurm, two learners who can log in, the hub; Ctrl-C stops
    the hub, the jobs and the accounts, and puts back the folders' ACLs."""
    import requests

    if os.geteuid() != 0 or not shutil.which("setfacl"):
        _missing("make room-demo runs as root, with setfacl (apt-get install acl)")
    before = {p: hub.unreachable([p], "nobody") for p in hub.course_paths(ROOT)}
    port = free_port()
    # started ignoring SIGINT, as a background job of a shell without job control starts: the
    # demo hears Ctrl-C all the same (it installs Python's handler itself)
    demo = subprocess.Popen([sys.executable, "-m", "dpcourse.cluster.hub", "demo", "--learners",
                             "2", f"--port={port}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    out, accounts = [], {}
    try:
        for line in demo.stdout:
            out.append(line)
            if m := re.match(r"\s+(learner\d+)\s+password (\S+)", line):
                accounts[m[1]] = m[2]
            if line.startswith("Ctrl-C") or "Ctrl-C stops" in line:
                break
        assert len(accounts) == 2, "".join(out)
        name, password = next(iter(accounts.items()))
        s = requests.Session()
        s.get(f"http://127.0.0.1:{port}/hub/login", timeout=30)
        r = s.post(f"http://127.0.0.1:{port}/hub/login", timeout=30,
                   data={"username": name, "password": password, "_xsrf": s.cookies["_xsrf"]})
        assert "/hub/spawn" in r.url, f"{name} could not log in: {r.url}"
    finally:
        demo.send_signal(signal.SIGINT)
        rest = demo.communicate(timeout=120)[0]
    assert demo.returncode == 0, "".join(out) + rest
    assert "the room is stopped" in rest, rest
    for n in accounts:
        assert subprocess.run(["id", n], capture_output=True).returncode != 0, f"{n} is still there"
    assert {p: hub.unreachable([p], "nobody") for p in before} == before, "an ACL was not put back"
    # nothing of the removed accounts stays in the course (root's check would refuse it)
    left = [p for p in (ROOT / "build" / "room-demo").rglob("*") if p.lstat().st_uid != 0]
    assert not left, f"the demo left files of accounts it removed: {left[:5]}"
    left = [p.pid for p in psutil.process_iter(["cmdline"])
            if any(f"127.0.0.1:{port}" in a for a in p.info["cmdline"] or ())]
    assert not left, f"the demo left processes: {left}"


def _job_env(slurm, job_id: str) -> dict:
    """A job's environment as slurmctld keeps it (StateSaveLocation/hash.N/job.ID/environment):
    what the learner has in their job, the server's token among it."""
    folder = hub.Path(slurm.conf).parent / "state" / f"hash.{int(job_id) % 10}" / f"job.{job_id}"
    raw = (folder / "environment").read_bytes()
    pairs = [item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item]
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _post(url: str, token: str | None, body) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}  # as batchspawner-singleuser sends it
    req = urllib.request.Request(url, method="POST", data=data,
                                 headers={**headers, "Authorization": f"token {token}"} if token
                                 else headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_a_server_s_token_reports_a_port_and_nothing_else(room, slurm):
    """The attack of issue 42, as a learner makes it: with the token of their own starting server,
    post the spawner's commands, an address and bad ports to /hub/api/batchspawner. Each is
    refused (400, a log line naming the learner), none runs, and the real report that follows
    still starts the server."""
    from dpcourse.cluster import localslurm

    learner = next(iter(room.passwords))
    # what each smuggled command would create: in /tmp, which the hub's user (or root) may write
    marker = hub.Path(f"/tmp/dpcourse-hub-attack-{secrets.token_hex(4)}")
    nodes = ",".join(localslurm.NODES)
    slurm.run(["scontrol", "update", f"nodename={nodes}", "state=drain", "reason=dpcourse-test"])
    try:  # the job waits in the queue: the server is starting, with no port yet
        _api(room.url, "POST", f"/users/{learner}")
        _api(room.url, "POST", f"/users/{learner}/server",
             {"time": "00:20:00", "cpus": "1", "gpus": "0", "memory": "1"})
        job = _until("the learner's job in the queue",
                     lambda: next((j for j, u in _jobs(slurm).items() if u == learner), None),
                     60, room.log)
        token = _job_env(slurm, job)["JUPYTERHUB_API_TOKEN"]
        url = f"{room.api}/hub/api/batchspawner"
        run = f"touch {marker}; echo RUNNING n1"
        attacks = {
            "exec_prefix": ({"exec_prefix": run}, "alone"),
            "batch_submit_cmd": ({"batch_submit_cmd": run}, "alone"),
            "batch_query_cmd": ({"exec_prefix": "", "batch_query_cmd": run}, "alone"),
            "batch_cancel_cmd": ({"batch_cancel_cmd": run}, "alone"),
            "ip": ({"ip": "127.0.0.1"}, "alone"),
            "port and ip": ({"port": 8888, "ip": "127.0.0.1"}, "alone"),
            "port as a string": ({"port": "8888"}, "whole number from 1024"),
            "port 22": ({"port": 22}, "whole number from 1024"),
            "port true": ({"port": True}, "whole number from 1024"),
            "an unknown key": ({"state": "x"}, "alone"),
            "a list": ([8888], "alone"),
            "not JSON": (b"port=8888", "alone"),
        }
        for what, (body, says) in attacks.items():
            status, text = _post(url, token, body)
            assert status == 400 and says in text, \
                f"{what}: {status} {text[:300]}\n{room.log.read_text()[-3000:]}"
        # another token: none (403), or an instructor service's (not a server's: 400)
        assert _post(url, None, {"port": 8888})[0] == 403
        status, text = _post(url, TOKEN, {"port": 8888})
        assert status == 400 and "server's own token" in text, text
        refusals = [line for line in room.log.read_text().splitlines()
                    if "batchspawner report refused" in line]
        assert sum(f"from {learner}" in line for line in refusals) == len(attacks), refusals
    finally:
        slurm.run(["scontrol", "update", f"nodename={nodes}", "state=resume"])
    # The real report (batchspawner-singleuser in the job) still starts the server; the hub polled
    # squeue all along with its own command.
    _until("the learner's server ready after the attacks",
           lambda: (_api(room.url, "GET", f"/users/{learner}")["servers"].get("", {})
                    .get("ready")), 240, room.log)
    status, text = _post(url, token, {"port": 8888})  # and once running, no report at all
    assert status == 400 and "while the server is starting" in text, text
    assert not marker.exists(), "a command posted by the learner ran"
    _api(room.url, "DELETE", f"/users/{learner}/server")
    _until("the job ended", lambda: learner not in _jobs(slurm).values(), 120, room.log)


def _refused(env: dict, log, user: str = "") -> str:
    """Start the hub with ``env``; it must exit by itself, with one line saying why."""
    proc = hub.start_hub(ROOT, env, log, user=user)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        hub.stop_hub(proc)
        pytest.fail(f"the hub started instead of refusing; its log:\n{log.read_text()[-2000:]}")
    said = log.read_text().strip()
    assert proc.returncode != 0 and "Traceback" not in said, said
    return said.splitlines()[-1]


def test_log_in_is_for_the_training_group_only(room, tmp_path):
    """A member logs in; an account outside the training group gets 403. Without allowed_groups,
    or without the course's PAM service, the hub refuses to start, with one line."""
    import requests

    def log_in(name, password):
        s = requests.Session()
        s.get(f"{room.url}/hub/login", timeout=30)
        return s.post(f"{room.url}/hub/login", timeout=30, allow_redirects=True,
                      data={"username": name, "password": password, "_xsrf": s.cookies["_xsrf"]})

    member = next(iter(room.passwords))
    assert "/hub/spawn" in log_in(member, room.passwords[member]).url
    # The hub's service user may act as the members of this room's group, and no one else
    rights = subprocess.run(["sudo", "-l", "-U", room.service], capture_output=True, text=True)
    assert f"(%{room.group}, !root) SETENV: NOPASSWD:" in rights.stdout, rights.stdout
    # A name that differs from a member's by case only is another account: it gets no session
    # (JupyterHub lowercases names; the hub would then act as the member)
    upper = member.capitalize()
    subprocess.run(["useradd", "--badname", "--groups", room.group, upper], check=True)
    subprocess.run(["chpasswd"], input=f"{upper}:{room.passwords[member]}x", text=True, check=True)
    try:
        r = log_in(upper, f"{room.passwords[member]}x")
        assert r.status_code == 403 and "/hub/spawn" not in r.url, (r.status_code, r.url)
    finally:
        hub.remove_learner(upper)
    outsider, password = f"dpo{secrets.token_hex(3)}", secrets.token_urlsafe(12)
    hub.add_learner(outsider, password)  # a real account with a right password, in no group
    try:
        r = log_in(outsider, password)
        assert r.status_code == 403 and "/hub/spawn" not in r.url, (r.status_code, r.url)
    finally:
        hub.remove_learner(outsider)

    env = {**room.hub_env, "DPCOURSE_HUB_BIND_URL": f"http://127.0.0.1:{free_port()}",
           "DPCOURSE_HUB_HUB_BIND_URL": f"http://127.0.0.1:{free_port()}",
           "DPCOURSE_HUB_PROXY_API_URL": f"http://127.0.0.1:{free_port()}"}
    line = _refused({**env, "DPCOURSE_HUB_ALLOWED_GROUPS": ""}, tmp_path / "a.log", room.service)
    assert "allowed_groups is empty" in line, line
    line = _refused({**env, "DPCOURSE_HUB_PAM_SERVICE": "dpcourse-none"}, tmp_path / "b.log",
                    room.service)
    assert "no PAM service /etc/pam.d/dpcourse-none" in line, line


def test_root_refuses_what_others_may_change(tmp_path):
    """As root, the hub checks every file it would run or read before it imports the course's
    library: a file deep in its state folder that others may write stops it, named."""
    if os.geteuid() != 0:
        _missing("the hub's check for root runs as root")
    state = tmp_path / "state"
    (state / "deep").mkdir(parents=True)
    state.chmod(0o700)
    planted = state / "deep" / "jupyterhub_cookie_secret"
    planted.write_text("x")
    planted.chmod(0o666)
    env = {**os.environ, "DPCOURSE_HUB_STATE": str(state)}
    line = _refused(env, tmp_path / "hub.log")
    assert f"root would run or read what others may change: {planted} (owner uid 0, mode 666)" \
        in line, line
