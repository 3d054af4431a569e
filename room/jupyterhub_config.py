"""JupyterHub for a workshop room: each learner's JupyterLab is a Slurm job on the training account.

    sudo -E .venv/bin/jupyterhub -f room/jupyterhub_config.py     # on the login node, as root
    make room-demo                                                # on a laptop: a local Slurm

The hub runs as root on a node the learners reach (the login node, or a VM beside the cluster),
logs learners in with their own Unix accounts (PAM: the site's passwords), and submits each
learner's server as a Slurm job *as that learner* (sudo -u, so the job is theirs: their account,
their files, their fair share). The job runs `jupyterhub-singleuser` from the course's .venv, or
inside the course's container (apptainer exec), in the learner's own copy of the course
(~/dpcourse, made at their first start). Servers idle for IDLE_TIMEOUT seconds are stopped, so a
forgotten one does not hold the reservation. docs/instructor.md, "A room", is the guide.

Set the room once, below (EDIT), or through the DPCOURSE_HUB_* variables of the same names.
"""
import os
import sys
from pathlib import Path

from dpcourse import hub

c = get_config()  # noqa: F821 - JupyterHub provides get_config() to its configuration file

# ---------------------------------------------------------------- EDIT: the room, set once
ROOM = hub.Settings.from_env(
    course=Path(__file__).resolve().parent.parent,  # the checkout the learners' copies come from
    account="",            # the training account (sbatch --account); "" for the site's default
    partition="",          # e.g. "gpu"
    reservation="",        # the workshop's reservation, if the centre made one
    time="02:00:00",       # each server's time limit (the learner may ask for less)
    cpus=8,                # CPUs per server
    gpus=1,                # GPUs per server (0: a CPU-only room)
    max_cpus=16, max_gpus=4, max_time="08:00:00",   # what the form allows
    idle_timeout=3600,     # seconds without activity before a server is stopped
    container="",          # the course's .sif: run the servers in it instead of .venv
    data="",               # DPCOURSE_DATA for every server (a shared, read-only copy)
    room_records="",       # DPCOURSE_ROOM: where `make check` leaves records for the live view
)
# ----------------------------------------------------------------

# Who: the site's accounts (PAM, as ssh uses them). On a site with single sign-on, use its
# OAuthenticator instead (pip install oauthenticator; see the site's JupyterHub notes).
c.JupyterHub.authenticator_class = "pam"
c.Authenticator.allow_all = True              # every account that PAM accepts; or allowed_users
c.Authenticator.admin_users = set(ROOM.admins)

# Where: the address the learners' browsers use. Behind the site's HTTPS reverse proxy, bind to
# 127.0.0.1; on its own, give it a certificate (c.JupyterHub.ssl_cert / ssl_key) and bind to
# https://0.0.0.0:443. Never serve plain HTTP beyond one machine: passwords cross it.
c.JupyterHub.bind_url = ROOM.bind_url
# The hub's own API, which each server (on a compute node) calls back: an address the compute
# nodes can reach, e.g. the login node's name on the cluster's internal network.
c.JupyterHub.hub_bind_url = ROOM.hub_bind_url
c.JupyterHub.hub_connect_url = ROOM.hub_connect_url
c.ConfigurableHTTPProxy.command = [ROOM.proxy]   # configurable-http-proxy: make room-setup
c.JupyterHub.db_url = f"sqlite:///{ROOM.state}/jupyterhub.sqlite"
c.JupyterHub.cleanup_servers = False  # restarting the hub leaves the learners' jobs running
c.JupyterHub.cookie_secret_file = str(ROOM.state / "jupyterhub_cookie_secret")
c.ConfigurableHTTPProxy.pid_file = str(ROOM.state / "jupyterhub-proxy.pid")

# What: each learner's server, a Slurm job submitted as the learner.
c.JupyterHub.spawner_class = "batchspawner.SlurmSpawner"
import batchspawner  # noqa: E402, F401 - adds the hub API a server reports its port to

c.Spawner.start_timeout = ROOM.start_timeout  # a job may wait in the queue this long
c.Spawner.http_timeout = 300                  # and its JupyterLab this long to answer
c.Spawner.default_url = "/lab"
c.Spawner.notebook_dir = "~/dpcourse"
c.Spawner.env_keep = ["LANG", "LC_ALL", "SLURM_CONF"]  # nothing else of the hub's environment
c.BatchSpawnerBase.exec_prefix = "sudo -E -u {username}"  # sbatch, squeue, scancel as the learner
c.SlurmSpawner.req_srun = ""                   # one process: the server itself
c.SlurmSpawner.batch_script = hub.BATCH_SCRIPT
c.SlurmSpawner.req_prologue = ROOM.prologue()
c.SlurmSpawner.batchspawner_singleuser_cmd = ROOM.singleuser_wrapper()
c.SlurmSpawner.options_form = ROOM.options_form()
c.SlurmSpawner.options_from_form = ROOM.options_from_form

# When: stop servers idle for IDLE_TIMEOUT seconds (jupyterhub-idle-culler, a hub service).
c.JupyterHub.load_roles = [{
    "name": "idle-culler",
    "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"],
    "services": ["idle-culler"],
}]
c.JupyterHub.services = [{
    "name": "idle-culler",
    "command": [sys.executable, "-m", "jupyterhub_idle_culler",
                f"--timeout={ROOM.idle_timeout}", f"--cull-every={ROOM.cull_every}"],
}]
if os.environ.get("DPCOURSE_HUB_EXTRA_CONFIG"):  # tests and `make room-demo`: their own additions
    load_subconfig(os.environ["DPCOURSE_HUB_EXTRA_CONFIG"])  # noqa: F821 - JupyterHub's
