"""The room's spawner, and the one call a learner's server makes to the hub (jupyterhub_config.py).

``RoomSpawner`` is batchspawner's SlurmSpawner with three changes:
- **the server's report carries a port and nothing else.** batchspawner 1.3.0's own handler of
  ``POST /hub/api/batchspawner`` sets *any* attribute of the spawner that the server's token posts
  (``setattr(spawner, key, value)``). That token is ``$JUPYTERHUB_API_TOKEN`` in the learner's own
  JupyterLab, and the spawner's attributes include the commands the hub runs (``exec_prefix``,
  ``batch_query_cmd``, ...): one request from a learner's terminal made the hub run a command of
  the learner's choosing as the hub's user. ``PortReport`` replaces that handler: it takes
  ``{"port": <int 1024-65535>}`` from the spawner's own token while that spawner is starting, and
  answers anything else with 400 and one log line naming the user.
- **a job is never lost track of.** Only Slurm's "Invalid job id" (or a job in an ended state) means
  the job is gone; any other failure of ``squeue`` (a slurmctld restarting, "Zero Bytes were
  transmitted") is "unknown", and the next poll asks again. Upstream, any error outside a narrow
  pattern counted as gone: the hub forgot a running job, which then held its GPU until its time
  limit, out of the culler's reach.
- **a server the hub gives up on is cancelled**: by its job id, else (a submission whose output
  could not be read) by the job's name and the learner; ``scancel`` is tried again when it fails.
  And the environment a job is submitted with is logged by its names only: ``--debug`` no longer
  writes every server's token into the hub's log.
"""
from __future__ import annotations

import asyncio
import json
import re

from batchspawner import JobStatus, SlurmSpawner
from batchspawner.batchspawner import format_template
from jupyterhub.apihandlers import APIHandler, default_handlers
from tornado import web
from traitlets import Unicode

GONE = re.compile(r"Invalid job id specified")  # squeue's word for a job it does not know
# Slurm's ended states: the job is over (squeue shows it for MinJobAge seconds after it ends)
ENDED = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "SPECIAL_EXIT", "TIMEOUT"}
PORTS = range(1024, 65536)  # a server's port: never a privileged one (22 is the node's ssh)


class PortReport(APIHandler):
    """``POST /hub/api/batchspawner``: the port a starting server listens on, and nothing else."""

    def _refuse(self, user: str, why: str) -> None:
        self.log.warning("batchspawner report refused, from %s: %s", user, why)
        raise web.HTTPError(400, why)

    @web.authenticated
    def post(self):
        user = self.current_user
        name = getattr(user, "name", "?")
        token = self.get_auth_token()
        spawner = next((s for s in getattr(user, "spawners", {}).values()
                        if token and s.api_token == token), None)
        if spawner is None:
            self._refuse(name, "only a server's own token may report its port")
        if spawner.pending != "spawn" or spawner.port:
            self._refuse(name, "a port is reported once, while the server is starting")
        try:
            body = json.loads(self.request.body or b"null")
        except ValueError:
            body = None
        if not isinstance(body, dict) or set(body) != {"port"}:
            keys = sorted(body) if isinstance(body, dict) else type(body).__name__
            self._refuse(name, f'the report is {{"port": <number>}} alone, not {keys}'[:200])
        port = body["port"]
        if type(port) is not int or port not in PORTS:
            self._refuse(name, f"port {port!r}: a whole number from 1024 to 65535"[:200])
        spawner.port = port
        self.set_status(201)
        self.finish(json.dumps({"message": "port recorded"}))


def install_port_report() -> None:
    """Put ``PortReport`` where batchspawner's handler was (importing batchspawner appends its own
    to JupyterHub's API handlers; the hub builds its routes from that list after the config)."""
    default_handlers[:] = [h for h in default_handlers if h[0] != r"/api/batchspawner"]
    default_handlers.append((r"/api/batchspawner", PortReport))


class RoomSpawner(SlurmSpawner):
    """SlurmSpawner that keeps track of its jobs (see the module's docstring)."""

    cancel_tries = 4  # scancel, and again after 2, 4 and 8 s

    def _command(self, template: str, **extra) -> str:
        subvars = {**self.get_req_subvars(), **extra}
        return " ".join((format_template(self.exec_prefix, **subvars),
                         format_template(template, **subvars))).strip()

    async def submit_batch_script(self):
        """batchspawner's, with the environment logged by names (the values hold the token)."""
        subvars = self.get_req_subvars()
        cmd = self._command(self.batch_submit_cmd)
        subvars["cmd"] = self.cmd_formatted_for_batch()
        subvars.update(self.user_options or {})
        script = await self._get_batch_script(**subvars)
        self.log.info("Submitting %s's server: %s", self.user.name, cmd)
        self.log.debug("Spawner submitting script:\n%s", script)
        self.log.debug("Spawner submitting environment (names): %s",
                       ", ".join(sorted(self.get_env())))
        out = await self.run_command(cmd, input=script, env=self.get_env())
        try:
            self.job_id = self.parse_job_id(out)
        except Exception:  # noqa: BLE001 - any output that names no job
            self.log.error("%s's job: sbatch answered %r, which names no job", self.user.name,
                           out[-300:])
            self.job_id = ""
        return self.job_id

    async def query_job_status(self):
        if not self.job_id:
            self.job_status = ""
            return JobStatus.NOTFOUND
        cmd = self._command(self.batch_query_cmd, job_id=self.job_id)
        try:
            out = await self.run_command(cmd)
        except Exception as err:  # noqa: BLE001 - stderr of squeue, or the command not running
            said = str(err).strip()
            if GONE.search(said):
                self.job_status = ""
                return JobStatus.NOTFOUND
            self.log.warning("squeue for %s's job %s failed, kept and asked again at the next "
                             "poll: %s", self.user.name, self.job_id, said[-300:])
            self.job_status = f"UNKNOWN {said[-300:]}"
            return JobStatus.UNKNOWN
        self.job_status = out
        state = (out.split() or [""])[0]
        if not state:  # squeue no longer lists it
            return JobStatus.NOTFOUND
        if self.state_isrunning():
            return JobStatus.RUNNING
        if self.state_ispending():
            return JobStatus.PENDING
        if state in ENDED:
            return JobStatus.NOTFOUND
        return JobStatus.UNKNOWN  # SUSPENDED, REQUEUED, ...: still Slurm's, not gone

    async def cancel_batch_job(self):
        """scancel the job by its id, else by its name and the learner; tried again on failure."""
        if self.job_id:
            cmd = self._command(self.batch_cancel_cmd, job_id=self.job_id)
        else:
            cmd = self._command(self.batch_cancel_by_name_cmd)
        for attempt in range(self.cancel_tries):
            try:
                self.log.info("Cancelling %s's server: %s", self.user.name, cmd)
                await self.run_command(cmd)
                return
            except RuntimeError as err:  # scancel failed (Slurm busy): try again
                if attempt + 1 == self.cancel_tries:
                    self.log.error("could not cancel %s's job (%s): %s; cancel it by hand",
                                   self.user.name, cmd, err)
                    raise
                await asyncio.sleep(2 ** (attempt + 1))

    batch_cancel_by_name_cmd = Unicode(
        "", help="scancel of the learner's server by the job's name and the learner, for a job "
        "whose id was never read").tag(config=True)

    async def start(self):
        try:
            return await super().start()
        except Exception:
            if not self.job_id:  # sbatch may have made a job whose id we could not read
                await self.cancel_batch_job()
            raise
