"""The room's spawner keeps track of its jobs (dpcourse.cluster.hubspawner.RoomSpawner), on the
local Slurm.

A learner's job is never forgotten on a failed squeue (only "Invalid job id" means gone), and a
server the hub gives up on leaves no job in the queue: cancelled by its id (scancel tried again
when it fails), or by the job's name and the learner when its id was never read. The hub's
commands are the room's own (hub.slurm_commands), run as a real local account through sudo; only
squeue and scancel are wrapped, to fail once as a busy slurmctld does.
"""
import asyncio
import os
import secrets
import shutil
import subprocess
import tempfile
import types
from pathlib import Path

import pytest

from dpcourse.cluster import hub

pytestmark = pytest.mark.slow

BUSY = "slurm_load_jobs error: Zero Bytes were transmitted or received"


@pytest.fixture
def learner(slurm, monkeypatch):
    if os.geteuid() != 0 or not shutil.which("sudo"):
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs as root with sudo (.ci/run)", pytrace=False)
        pytest.skip("root and sudo: the spawner submits as a local account")
    for k, v in slurm.env.items():
        monkeypatch.setenv(k, v)
    name = f"dps{secrets.token_hex(3)}"
    hub.add_learner(name, secrets.token_urlsafe(12))
    try:
        yield name
    finally:
        slurm.run(["scancel", "-u", name])
        hub.remove_learner(name)


@pytest.fixture
def stand_ins():
    """squeue and scancel that fail once each time a flag file is made, then run the real one."""
    folder = Path(tempfile.mkdtemp(prefix="dpcourse-stand-ins-"))
    folder.chmod(0o777)  # the learner runs them and removes the flag
    for tool in ("squeue", "scancel"):
        script = folder / tool
        script.write_text(f"#!/bin/sh\nif [ -e {folder}/{tool}.fail ]; then rm -f {folder}/"
                          f"{tool}.fail; echo '{BUSY}' >&2; exit 1; fi\n"
                          f"exec {shutil.which(tool)} \"$@\"\n")
        script.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def _spawner(name: str, tools: Path):
    from dpcourse.cluster.hubspawner import RoomSpawner

    which = {"squeue": str(tools / "squeue"), "scancel": str(tools / "scancel")}
    s = RoomSpawner(user=types.SimpleNamespace(name=name))
    s.get_env = dict  # the server's variables: for a submission, which these tests do by hand
    s.exec_prefix = ""
    # root's sudo keeps the test cluster's SLURM_CONF (the hub's user has env_keep for it)
    for key, cmd in hub.slurm_commands("sudo --preserve-env=SLURM_CONF",
                                       which=lambda c: which.get(c) or shutil.which(c)).items():
        setattr(s, key, cmd)
    return s


def _submit(name: str) -> str:
    script = (f"#!/bin/bash\n#SBATCH --job-name={hub.JOB_NAME}\n#SBATCH --output=/dev/null\n"
              "sleep 300\n")
    done = subprocess.run(["sudo", "--preserve-env=SLURM_CONF", "-u", name, shutil.which("sbatch"),
                           "--parsable", "--chdir=/tmp"], input=script, text=True,
                          capture_output=True, timeout=60, check=True)
    return done.stdout.strip().split(";")[0]


def _queued(slurm, name: str) -> list[str]:
    return slurm.run(["squeue", "-h", "-u", name, "-o", "%i"]).stdout.split()


def _until_gone(slurm, name: str) -> list[str]:
    for _ in range(60):
        if not (left := _queued(slurm, name)):
            return left
        subprocess.run(["sleep", "0.5"])
    return left


def test_a_failed_squeue_keeps_the_server(slurm, learner, stand_ins):
    from batchspawner import JobStatus

    s = _spawner(learner, stand_ins)
    s.job_id = _submit(learner)
    (stand_ins / "squeue.fail").touch()
    assert asyncio.run(s.query_job_status()) == JobStatus.UNKNOWN
    assert asyncio.run(s.poll()) is None and s.job_id, "the hub forgot a job on a busy squeue"
    assert asyncio.run(s.query_job_status()) in (JobStatus.RUNNING, JobStatus.PENDING)
    s.job_id = "999999"  # Slurm's own word for a job it does not know: gone
    assert asyncio.run(s.query_job_status()) == JobStatus.NOTFOUND


def test_a_server_given_up_on_leaves_no_job(slurm, learner, stand_ins):
    s = _spawner(learner, stand_ins)
    s.cancel_tries = 2
    s.job_id = _submit(learner)  # by its id, with scancel failing once
    (stand_ins / "scancel.fail").touch()
    asyncio.run(s.stop(now=True))
    assert not (stand_ins / "scancel.fail").exists(), "scancel was not tried"
    assert _until_gone(slurm, learner) == [], "the job stayed in the queue"
    _submit(learner)  # and a job whose id the hub never read: by its name and the learner
    s.job_id = ""
    asyncio.run(s.stop(now=True))
    assert _until_gone(slurm, learner) == [], "the job whose id was lost stayed in the queue"


def test_the_submit_log_names_the_variables_not_their_values(slurm, learner, stand_ins, caplog):
    """At --debug the hub logged the environment each job is submitted with, every server's token
    among it; now only the names."""
    import logging

    token = secrets.token_hex(16)
    s = _spawner(learner, stand_ins)
    s.log = logging.getLogger("dpcourse-test-hub")
    s.get_env = lambda: {"JUPYTERHUB_API_TOKEN": token, "SLURM_CONF": os.environ["SLURM_CONF"]}
    s.batch_script = (f"#!/bin/bash\n#SBATCH --job-name={hub.JOB_NAME}\n"
                      "#SBATCH --output=/dev/null\n#SBATCH --chdir=/tmp\nsleep 300\n")
    s.batchspawner_singleuser_cmd, s.cmd = "", ["true"]
    with caplog.at_level(logging.DEBUG, logger="dpcourse-test-hub"):
        job = asyncio.run(s.submit_batch_script())
    assert job and job in _queued(slurm, learner)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "JUPYTERHUB_API_TOKEN" in logged and token not in logged, logged
