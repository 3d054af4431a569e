"""JupyterHub for a workshop room: each learner's JupyterLab is a Slurm job on the training account.

    sudo -u dpcourse-hub HOME=/var/lib/dpcourse-hub \
        .venv/bin/jupyterhub -f room/jupyterhub_config.py     # on the login node, as its user
    sudo make room-demo                       # on a laptop: a local Slurm, the same set-up

The hub logs learners in with their own Unix accounts (PAM: the site's passwords) and submits each
learner's server as a Slurm job *as that learner* (sudo -u: their account, their files, their fair
share). The job runs `jupyterhub-singleuser` from the course's .venv, or inside the course's
container (apptainer exec), in the learner's own copy of the course (~/dpcourse, made at their
first start). Servers idle for IDLE_TIMEOUT seconds are stopped, so a forgotten one does not hold
the reservation. docs/instructor.md, "Deploying the hub", is the guide: the service user, its
sudoers rule (python -m dpcourse.cluster.hub sudoers), the PAM service (room/pam/dpcourse-hub),
HTTPS.

Set the room once, below (EDIT), or through the DPCOURSE_HUB_* variables of the same names (e.g. in
/etc/dpcourse-hub.env, which room/dpcourse-hub.service reads: the checkout stays as it came).
"""
import os
import runpy
import sys
from pathlib import Path
from urllib.parse import urlparse

c = get_config()  # noqa: F821 - JupyterHub provides get_config() to its configuration file
COURSE = Path(__file__).resolve().parent.parent  # the checkout the learners' copies come from

# ---------------------------------------------------------------- EDIT: the room, set once
EDIT = dict(
    account="",            # the training account (sbatch --account); "" for the site's default
    partition="",          # e.g. "gpu"
    reservation="",        # the workshop's reservation, if the centre made one
    time="02:00:00",       # each server's time limit (a learner may ask for less); within the
    max_time="08:00:00",   # reservation: a job that would outlast it never starts
    cpus=8, max_cpus=16,   # CPUs per server, and the most the form allows
    gpus=1, max_gpus=1,    # GPUs per server (0: a CPU-only room), and the most
    memory=16, max_memory=64,  # GB per server (sbatch --mem), and the most; 0: the site's default
    idle_timeout=3600,     # seconds without activity before a server is stopped
    container="",          # the course's .sif: run the servers in it instead of .venv
    site_prologue="",      # lines the job runs first, in a login environment: "module load ..."
    data="",               # DPCOURSE_DATA for every server (a shared, read-only copy)
    room_records="",       # DPCOURSE_ROOM: where `make check` leaves records for the live view
    allowed_groups=(),     # who may log in: the training group, e.g. ("trn01",); required
    bind_url="http://127.0.0.1:8000",      # what the browsers open: behind the site's HTTPS proxy
    hub_bind_url="http://127.0.0.1:8081",  # the hub's API for the servers: an internal address
    hub_connect_url="",    # how a compute node reaches it, if not hub_bind_url
    proxy_api_url="http://127.0.0.1:8001",  # the proxy's own API, the hub's alone
    subdomain_host="",     # "https://hub.example.org": each server on its own subdomain (advised)
    admins=(),             # instructors: the admin page, start and stop servers (not enter them)
    pam_service="dpcourse-hub",     # /etc/pam.d/dpcourse-hub, from room/pam/dpcourse-hub
    state="/var/lib/dpcourse-hub",  # the hub's database and cookie secret: the hub's user's alone
)
# ----------------------------------------------------------------

# The hub runs as a service user (docs/instructor.md, "Deploying the hub"). As root, everything it
# runs or reads must be root's alone, since whoever could change it would be root: checked file by
# file (room/rootcheck.py, standard library only) before the course's library is imported.
EXTRA = os.environ.get("DPCOURSE_HUB_EXTRA_CONFIG", "")  # tests and make room-demo add to this file
if os.geteuid() == 0:
    check = runpy.run_path(str(COURSE / "room" / "rootcheck.py"))
    trees = check["hub_trees"](COURSE, os.environ.get("DPCOURSE_HUB_STATE") or EDIT["state"],
                               os.environ.get("DPCOURSE_HUB_PROXY", ""))
    if problem := check["first_unsafe"]([*trees, EXTRA]):
        sys.exit(f"dpcourse hub: root would run or read what others may change: {problem}; run "
                 "the hub as its service user (docs/instructor.md, 'Deploying the hub') or make "
                 "all of it root's alone")
elif EXTRA and ((st := os.stat(EXTRA)).st_uid not in (0, os.geteuid()) or st.st_mode & 0o022):
    sys.exit(f"dpcourse hub: {EXTRA} may be changed by others: not loaded")

from dpcourse.cluster import hub, hubspawner  # noqa: E402 - after the check above

ROOM = hub.Settings.from_env(course=COURSE, **EDIT)
if refusals := ROOM.refusals():
    sys.exit("dpcourse hub: not started: " + "; ".join(refusals))
ROOM.make_state()

# Who: the site's accounts (PAM, through the course's own service, so the site's rules for a web
# log-in live in one file), the training group only, never root. On a site with single sign-on
# (and MFA), use its OAuthenticator instead.
c.JupyterHub.authenticator_class = "pam"
c.PAMAuthenticator.service = ROOM.pam_service
c.PAMAuthenticator.open_sessions = False  # a learner's session is their Slurm job
c.Authenticator.allowed_groups = set(ROOM.allowed_groups)
c.Authenticator.blocked_users = {"root"}
# The learner's name as the system has it, and a plain one: JupyterHub lowercases names, and
# `sudo -u` with a lowercased Name is another account; the hub's commands hold {username} unquoted.
c.PAMAuthenticator.pam_normalize_username = True
c.Authenticator.username_pattern = r"^[a-z_][a-z0-9_.-]{0,31}$"
# Instructors see the room and start or stop servers; JupyterHub's admin role could also enter
# every learner's server and run code as them, which no centre allows.
c.JupyterHub.load_roles = [
    {"name": "instructor", "users": list(ROOM.admins),
     "scopes": ["admin-ui", "list:users", "read:users", "admin:servers"]},
    {"name": "idle-culler", "services": ["idle-culler"],
     "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"]},
]

# Where: the address the learners' browsers use. Behind the site's HTTPS reverse proxy, bind to
# 127.0.0.1; on its own, give it a certificate (c.JupyterHub.ssl_cert / ssl_key) and bind to
# https://0.0.0.0:443. Never serve plain HTTP beyond one machine: passwords cross it.
c.JupyterHub.bind_url = ROOM.bind_url
# Each learner's server on a subdomain of its own (alice.hub.example.org): a learner controls what
# their own server serves, and on the hub's one origin a page of theirs could act in the JupyterLab
# of another learner who opens it. Needs a wildcard DNS entry and certificate; JupyterHub's
# security overview asks for it wherever learners are not trusted.
if ROOM.subdomain_host:
    c.JupyterHub.subdomain_host = ROOM.subdomain_host
# The hub's own API, which each server (on a compute node) calls back: an address the compute
# nodes reach, e.g. the login node's name on the cluster's internal network.
c.JupyterHub.hub_bind_url = ROOM.hub_bind_url
c.JupyterHub.hub_connect_url = ROOM.hub_connect_url
if urlparse(ROOM.hub_connect_url).hostname in ("127.0.0.1", "localhost", "0.0.0.0"):
    print(f"dpcourse hub: servers reach the hub at {ROOM.hub_connect_url}: right on one machine "
          "(make room-demo), wrong on a cluster: set hub_connect_url", file=sys.stderr)
c.ConfigurableHTTPProxy.command = [ROOM.proxy]   # configurable-http-proxy: make room-setup
c.ConfigurableHTTPProxy.api_url = ROOM.proxy_api_url
c.JupyterHub.db_url = f"sqlite:///{ROOM.state}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = str(ROOM.state / "jupyterhub_cookie_secret")
c.ConfigurableHTTPProxy.pid_file = str(ROOM.state / "jupyterhub-proxy.pid")
c.JupyterHub.cleanup_servers = False  # restarting the hub leaves the learners' jobs running

# What: each learner's server, a Slurm job submitted as the learner (sudo -u). The course's
# spawner (dpcourse.cluster.hubspawner): batchspawner's SlurmSpawner, whose API call from the
# servers takes a port and nothing else, which never forgets a job on a failed squeue, and which
# cancels what it gives up on.
c.JupyterHub.spawner_class = hubspawner.RoomSpawner
hubspawner.install_port_report()

c.Spawner.start_timeout = ROOM.start_timeout   # a job may wait this long in the queue
c.Spawner.http_timeout = 300                   # and its JupyterLab this long to answer
c.Spawner.poll_interval = 120                  # squeue for each running server, every 2 minutes
c.BatchSpawnerBase.startup_poll_interval = ROOM.poll_s  # and for each starting one
c.Spawner.default_url = "/lab"
c.Spawner.notebook_dir = "~/dpcourse"
c.Spawner.env_keep = ["LANG", "LC_ALL", "SLURM_CONF"]  # nothing else of the hub's environment
c.Spawner.pre_spawn_hook = ROOM.pre_spawn_hook  # the form's fields only, checked, also via the API
c.BatchSpawnerBase.exec_prefix = ""  # each command below holds its own sudo -u {username}
for name, command in hub.slurm_commands().items():
    setattr(c.RoomSpawner, name, command)
c.SlurmSpawner.req_srun = ""                   # one process: the server itself
c.SlurmSpawner.batch_script = hub.BATCH_SCRIPT
c.SlurmSpawner.req_prologue = ROOM.prologue()
c.SlurmSpawner.batchspawner_singleuser_cmd = ROOM.singleuser_wrapper()
c.SlurmSpawner.options_form = ROOM.options_form()
c.SlurmSpawner.options_from_form = ROOM.options_from_form

# When: stop servers idle for IDLE_TIMEOUT seconds (jupyterhub-idle-culler, a hub service).
c.JupyterHub.services = [{
    "name": "idle-culler",
    "command": [sys.executable, "-m", "jupyterhub_idle_culler",
                f"--timeout={ROOM.idle_timeout}", f"--cull-every={ROOM.cull_every}"],
}]

# Tests and `make room-demo` add to this file: only a file that its owner (root or the hub's user)
# alone may write, checked above.
if EXTRA:
    load_subconfig(EXTRA)  # noqa: F821 - JupyterHub's
