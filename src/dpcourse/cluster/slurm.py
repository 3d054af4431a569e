"""The course's Slurm templates: what a job would run, without submitting it; and a local cluster.

    .venv/bin/python -m dpcourse.cluster.slurm dry-run slurm/multi_node.sbatch  # as written
    .venv/bin/python -m dpcourse.cluster.slurm dry-run slurm/multi_node.sbatch --nodes 4
        # sbatch options
    .venv/bin/python -m dpcourse.cluster.slurm dry-run slurm/cpu.sbatch -- --epochs 1
        # lab options after --
    sudo .venv/bin/python -m dpcourse.cluster.slurm demo
        # a two-node Slurm on this machine, one real job
    sudo .venv/bin/python -m dpcourse.cluster.slurm demo --keep
        # ... that stays up for your own sbatch, until Ctrl-C

``dry-run`` reads the template's ``#SBATCH`` lines (and the sbatch options you give, which win,
as they do for sbatch), sets the variables Slurm would set in such a job (SLURM_NNODES,
SLURM_GPUS_ON_NODE, SLURM_JOB_NODELIST = node[001-00N], ...), and runs the script with stand-ins
for ``srun`` and ``scontrol``: every srun line is printed with its variables filled in, nothing
starts. For the line that trains, it works out the world size (nodes × processes per node) and
which ranks land on which node, and names what does not add up (a torchrun told of 1 node in a
4-node job, more processes than GPUs, ...). The exit status is 1 when something does not.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from dpcourse.lab.errors import CourseError

JOB_ID = 424242  # the pretend job's id (its rendezvous port is 20000 + JOB_ID % 10000)


# ------------------------------------------------------------------------------- sbatch options
def directives(text: str) -> list[str]:
    """The options of a script's ``#SBATCH`` lines, in order, as argv words (a '#' starts a comment;
    ``##SBATCH`` lines are switched off). sbatch stops reading them at the first command."""
    words = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#SBATCH"):
            words += shlex.split(stripped[len("#SBATCH"):], comments=True)
        elif stripped and not stripped.startswith("#"):
            break
    return words


def _job_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("-N", "--nodes", default="1")
    p.add_argument("-n", "--ntasks", type=int, default=None)
    p.add_argument("--ntasks-per-node", type=int, default=None)
    p.add_argument("-c", "--cpus-per-task", type=int, default=1)
    p.add_argument("-G", "--gpus", default=None)
    p.add_argument("--gpus-per-node", default=None)
    p.add_argument("--gres", default=None)
    p.add_argument("-a", "--array", default=None)
    p.add_argument("-J", "--job-name", default=None)
    return p


def _count(spec: str | None) -> int:
    """'4', 'a100:4' or 'gpu:a100:4' → 4; None → 0."""
    if not spec:
        return 0
    return int(spec.rsplit(":", 1)[-1])


@dataclass
class Job:
    """What Slurm would grant the script: its nodes, tasks, CPUs and GPUs."""

    name: str
    nodes: int
    tasks_per_node: int
    cpus_per_task: int
    gpus_per_node: int
    array_task: int | None = None

    @property
    def hosts(self) -> list[str]:
        return [f"node{i:03d}" for i in range(1, self.nodes + 1)]

    def environment(self, root: Path) -> dict[str, str]:
        env = {"SLURM_JOB_ID": str(JOB_ID), "SLURM_JOBID": str(JOB_ID), "SLURM_JOB_NAME": self.name,
               "SLURM_SUBMIT_DIR": str(root), "SLURM_NNODES": str(self.nodes),
               "SLURM_JOB_NUM_NODES": str(self.nodes),
               "SLURM_NTASKS": str(self.nodes * self.tasks_per_node),
               "SLURM_NTASKS_PER_NODE": str(self.tasks_per_node),
               "SLURM_CPUS_PER_TASK": str(self.cpus_per_task),
               "SLURM_JOB_NODELIST": f"node[001-{self.nodes:03d}]" if self.nodes > 1 else "node001",
               "SLURMD_NODENAME": "node001", "SLURM_NODEID": "0", "SLURM_PROCID": "0"}
        # SLURM_GPUS_PER_NODE: what --gpus-per-node asked for; _ON_NODE: what the node got
        if self.gpus_per_node:
            env.update(SLURM_GPUS_ON_NODE=str(self.gpus_per_node),
                       SLURM_GPUS_PER_NODE=str(self.gpus_per_node))
        if self.array_task is not None:
            env.update(SLURM_ARRAY_JOB_ID=str(JOB_ID), SLURM_ARRAY_TASK_ID=str(self.array_task),
                       SLURM_JOB_ID=str(JOB_ID + 1 + self.array_task))
        return env


def job_from(words: list[str], template: Path) -> Job:
    args, _ = _job_parser().parse_known_args(words)
    nodes = int(str(args.nodes).split("-")[0])
    per_node = args.ntasks_per_node or (-(-args.ntasks // nodes) if args.ntasks else 1)
    gpus = (_count(args.gpus_per_node) or _count(args.gres)
            or (-(-_count(args.gpus) // nodes) if args.gpus else 0))
    first = int(re.match(r"\d+", args.array).group()) if args.array else None
    return Job(args.job_name or template.name, nodes, per_node, args.cpus_per_task, gpus, first)


# ------------------------------------------------------------------------------ the stand-ins
RECORD = """#!/bin/sh
# dpcourse.cluster.slurm dry-run: record this command instead of running it
exec "{python}" -c 'import json, os, sys; print(json.dumps(sys.argv[1:]),
    file=open(os.environ["DRYRUN_STEPS"], "a"))' {what} "$@"
"""
PYTHON = """#!/bin/sh
# dpcourse.cluster.slurm dry-run: a one-line `python -c` runs (a template may compute a port \
with it);
# the rest is recorded
if [ "$1" = "-c" ]; then exec "{python}" "$@"; fi
exec "{python}" -c 'import json, os, sys; print(json.dumps(sys.argv[1:]),
    file=open(os.environ["DRYRUN_STEPS"], "a"))' direct "$0" "$@"
"""
SCONTROL = """#!/bin/sh
# dpcourse.cluster.slurm dry-run: `scontrol show hostnames` of the pretend node list
[ "$1 $2" = "show hostnames" ] || {{ echo "dry-run: scontrol $* is not simulated" >&2; exit 1; }}
printf '%s\\n' {hosts}
"""


@dataclass
class Step:
    """One srun line (or a command the script ran itself): its words, what it starts, and how
    many."""

    argv: list[str]
    nodes: int
    tasks_per_node: int
    direct: bool = False         # run by the batch script itself, on the first node only: no srun
    program: str = ""            # torchrun | python | other
    world_size: int | None = None
    procs_per_node: int | None = None
    nnodes: int | None = None    # the nodes a torchrun is told of (--nnodes; 1 with --standalone)
    trains: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def command(self) -> str:
        return shlex.join(self.argv if self.direct else ["srun", *self.argv])


@dataclass
class DryRun:
    job: Job
    printed: str                 # what the script itself printed
    steps: list[Step]
    problems: list[str]

    @property
    def training(self) -> Step | None:
        return next((s for s in self.steps if s.trains), None)

    def report(self) -> str:
        j = self.job
        gpus = f", {j.gpus_per_node} GPU(s) per node" if j.gpus_per_node else ", no GPUs"
        lines = [f"job: {j.nodes} node(s) × {j.tasks_per_node} task(s) per node, "
                 f"{j.cpus_per_task} CPU(s) per task{gpus}"
                 + (f" (array task {j.array_task})" if j.array_task is not None else "")]
        lines += [line for line in self.printed.splitlines() if line.strip()]
        for step in self.steps:
            lines.append(("$ " if not step.direct else "$ (no srun) ") + step.command)
            if step.world_size:
                lines.append("  → " + describe(step, j))
        if not self.training:
            lines.append("(no srun line starts a lab: nothing to count)")
        lines += ([f"✗ {p}" for p in self.problems]
                  or (["✓ the numbers add up"] if self.training else []))
        return "\n".join(lines)


def _option(words: list[str], *names: str) -> str | None:
    """The value of --name=V / --name V / -x V in ``words`` (the last one given), or None.
    --rdzv_backend and --rdzv-backend are the same option (torchrun takes both spellings)."""
    def spelled(word: str) -> str:
        return word.replace("_", "-") if word.startswith("--") else word

    value, names = None, [spelled(n) for n in names]
    for i, word in enumerate(words):
        key, _, _ = word.partition("=")
        for name in names:
            if spelled(word) == name and i + 1 < len(words):
                value = words[i + 1]
            elif "=" in word and spelled(key) == name:
                value = word.split("=", 1)[1]
    return value


LOOPBACK = ("localhost", "127.", "0.0.0.0", "::1")


def analyse(argv: list[str], job: Job, direct: bool = False) -> Step:
    """What one srun line starts: its tasks, and for a torchrun or python lab, its processes.
    ``direct``: a command the batch script ran itself, on the job's first node, without srun."""
    i, srun_words = 0, []
    # srun's own options come first
    while not direct and i < len(argv) and argv[i].startswith("-"):
        word = argv[i]
        takes_value = "=" not in word and word in ("-n", "--ntasks", "-N", "--nodes",
                                                   "--ntasks-per-node", "-c", "--cpus-per-task",
                                                   "-J", "--job-name")
        srun_words += argv[i:i + 1 + takes_value]
        i += 1 + takes_value
    program = argv[i:]
    nodes = int(_option(srun_words, "-N", "--nodes") or job.nodes)
    per_node = _option(srun_words, "--ntasks-per-node")
    # Inside a job, srun's --ntasks defaults to the job's (SLURM_NTASKS); a --ntasks-per-node that
    # does not match it is ignored, with a warning ("can't honor --ntasks-per-node").
    ntasks = int(_option(srun_words, "-n", "--ntasks") or job.nodes * job.tasks_per_node)
    ignored = per_node is not None and int(per_node) * nodes != ntasks
    step = Step(argv, 1, 1, direct=True) if direct else Step(argv, nodes, -(-ntasks // nodes))
    if ignored:
        step.problems.append(f"srun --ntasks-per-node={per_node} on {nodes} node(s) is "
                             f"{int(per_node) * nodes} task(s), but the step inherits the job's "
                             f"{ntasks} (SLURM_NTASKS): Slurm ignores --ntasks-per-node and "
                             f"starts {ntasks}. Give --ntasks too")
    names = [Path(w).name for w in program]
    if "torchrun" in names:
        step.program = "torchrun"
        words = program[names.index("torchrun") + 1:]
        standalone = "--standalone" in words
        nnodes = 1 if standalone else int(_option(words, "--nnodes") or 1)
        step.nnodes = nnodes
        nproc = _option(words, "--nproc-per-node") or "1"
        step.procs_per_node = int(nproc) if nproc.isdigit() else None
        step.trains = any(w.endswith(".py") for w in words)
        torchruns = step.nodes * step.tasks_per_node
        if step.procs_per_node:
            step.world_size = nnodes * step.procs_per_node
        if step.tasks_per_node != 1:
            step.problems.append(f"srun starts {step.tasks_per_node} torchruns per node: one per "
                                 "node, and --nproc-per-node processes from each "
                                 "(srun --ntasks-per-node=1)")
        elif standalone and torchruns > 1:
            step.problems.append(f"torchrun --standalone on each of {torchruns} nodes: "
                                 f"{torchruns} separate jobs that never meet. "
                                 "Across nodes: --nnodes and a c10d rendezvous")
        elif nnodes != torchruns and not direct:
            step.problems.append(f"torchrun --nnodes={nnodes}, but srun starts {torchruns} "
                                 f"torchrun(s), one per node: --nnodes=\"$SLURM_NNODES\"")
        endpoint, backend = _option(words, "--rdzv-endpoint"), _option(words, "--rdzv-backend")
        if not standalone and nnodes > 1 and endpoint is None:
            step.problems.append("torchrun across nodes without --rdzv-endpoint: they cannot find "
                                 "each other (--rdzv-backend=c10d "
                                 "--rdzv-endpoint=\"$MASTER_ADDR:$MASTER_PORT\")")
        elif not standalone and nnodes > 1:
            host = endpoint.rsplit(":", 1)[0].strip("[]") if ":" in endpoint else endpoint
            if backend != "c10d":
                step.problems.append("torchrun across nodes with "
                                     f"--rdzv-backend={backend or 'static (the default)'}: "
                                     "each node then needs its own --node-rank, or all of them "
                                     "take node rank 0. --rdzv-backend=c10d: the torchruns agree "
                                     "on the ranks among themselves")
            if host.startswith(LOOPBACK):
                step.problems.append(f"--rdzv-endpoint={endpoint} is each node's own loopback "
                                     "address: every node's torchrun waits at home and they never "
                                     "meet. The job's first node: "
                                     "--rdzv-endpoint=\"$MASTER_ADDR:$MASTER_PORT\"")
            elif host not in job.hosts:
                step.problems.append(f"--rdzv-endpoint={endpoint}: {host} is not a node of this "
                                     f"job ({', '.join(job.hosts[:2])}"
                                     f"{', …' if job.nodes > 2 else ''}). The job's first node, "
                                     "from its node list: "
                                     "--rdzv-endpoint=\"$MASTER_ADDR:$MASTER_PORT\"")
    elif any(n.startswith("python") for n in names):
        step.program = "python"
        words = program[next(i for i, n in enumerate(names) if n.startswith("python")) + 1:]
        step.trains = (bool(words) and words[0].endswith(".py")
                       or words[:2] == ["-m", "dpcourse.explore.scaling"])
        if words and words[0].endswith(".py"):
            step.procs_per_node = step.tasks_per_node
            step.world_size = step.nodes * step.tasks_per_node
    else:
        step.program = names[0] if names else ""
    if direct and step.trains and job.nodes > 1:
        step.problems.append(f"{step.program} without srun runs on the job's first node only, "
                             f"once: the other {job.nodes - 1} node(s) start nothing. "
                             "Put srun --kill-on-bad-exit=1 in front")
    if step.procs_per_node and job.gpus_per_node and step.procs_per_node > job.gpus_per_node:
        step.problems.append(f"{step.procs_per_node} processes per node but {job.gpus_per_node} "
                             "GPU(s): one GPU per process (or the rest train on the CPU)")
    if step.procs_per_node and job.gpus_per_node and step.procs_per_node < job.gpus_per_node:
        one_each = ('torchrun --nproc-per-node="$SLURM_GPUS_ON_NODE"' if step.program == "torchrun"
                    else "#SBATCH --ntasks-per-node= the GPUs of a node")
        step.problems.append(f"{step.procs_per_node} process(es) per node for {job.gpus_per_node} "
                             f"GPUs: {job.gpus_per_node - step.procs_per_node} GPU(s) per node "
                             f"sit idle; one process per GPU: {one_each}")
    return step


def describe(step: Step, job: Job) -> str:
    """'2 nodes × 4 processes = world size 8: ranks 0-3 on node001, 4-7 on node002'."""
    k, per = step.world_size, step.procs_per_node
    hosts = job.hosts[:step.nodes]
    # a separate world per node
    alone = step.program == "torchrun" and step.nnodes == 1 and step.nodes > 1
    spans = [f"{(a := 0 if alone else r * per)}{f'-{a + per - 1}' if per > 1 else ''} on {h}"
             for r, h in enumerate(hosts)]
    ranks = "ranks " + ", ".join(spans if len(spans) <= 4 else [*spans[:2], "…", spans[-1]])
    if alone:
        return (f"{step.nodes} torchruns, each alone on its node: {step.nodes} separate worlds of "
                f"size {per}: {ranks}")
    if step.program == "torchrun" and step.nnodes != step.nodes:
        return (f"srun starts {step.nodes} torchrun(s) × {per} process(es) = {step.nodes * per} "
                f"processes, but each torchrun is told of {step.nnodes} node(s) (a world of {k}): "
                "they do not form one group")
    how = (f"{step.nodes} node(s) × {per} process(es) per node"
           + (" (torchrun)" if step.program == "torchrun" else " (srun tasks)"))
    return f"{how} = world size {k}: {ranks}"


def dry_run(template: str | os.PathLike, sbatch_options=(), lab_args=(),
            root: Path | None = None) -> DryRun:
    """Run ``template`` as Slurm would start it, with stand-ins for srun and scontrol."""
    from dpcourse.lab.paths import project_root

    template = Path(template)
    if not template.is_file():
        raise CourseError(f"{template}: no such template (they are in slurm/).")
    root = root or project_root(template.resolve().parent) or Path.cwd()
    job = job_from(directives(template.read_text()) + list(sbatch_options), template)
    with tempfile.TemporaryDirectory(prefix="dpcourse-dryrun-") as tmp:
        tmp = Path(tmp)
        # srun and scontrol on PATH; the course's python and torchrun in a stand-in course folder
        # (COURSE), so that nothing trains, even a launch line without srun. Its paths are shown
        # as the real course folder's.
        course = tmp / "course"
        stand_ins = {tmp / "bin" / "srun": RECORD.format(python=sys.executable, what="srun"),
                     tmp / "bin" / "scontrol": SCONTROL.format(hosts=" ".join(job.hosts)),
                     course / ".venv" / "bin" / "python": PYTHON.format(python=sys.executable),
                     course / ".venv" / "bin" / "torchrun": RECORD.format(python=sys.executable,
                                                                          what='direct "$0"')}
        for path, text in stand_ins.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            path.chmod(stat.S_IRWXU)
        (course / "slurm").symlink_to(root / "slurm")
        steps_file = tmp / "steps.jsonl"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        env.update(job.environment(root), PATH=f"{tmp / 'bin'}:{env.get('PATH', '')}",
                   DRYRUN_STEPS=str(steps_file), COURSE=str(course))
        # as env.sh falls back
        env.setdefault("DATA", env.get("DPCOURSE_DATA") or str(root / "data"))
        try:
            done = subprocess.run(["bash", str(template.resolve()), *map(str, lab_args)], cwd=root,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=60)
        except subprocess.TimeoutExpired:
            raise CourseError(f"{template}: the dry run did not finish within 60 s: the script "
                              "waits for something that only a real job has.") from None
        shown = lambda text: text.replace(str(course), str(root)).replace(str(tmp), "$TMP")  # noqa: E731
        printed = shown(done.stdout)
        records = ([json.loads(line) for line in steps_file.read_text().splitlines()]
                   if steps_file.exists() else [])
    steps = []
    for how, *argv in records:
        step = analyse([shown(w) for w in argv], job, direct=how == "direct")
        steps.append(step)
    problems = [p for s in steps for p in s.problems]
    if done.returncode:
        last = ([line for line in printed.splitlines() if line.strip()]
                or ["(it printed nothing)"])[-1]
        problems.insert(0, f"the script stopped with exit status {done.returncode}: {last.strip()}")
    training = next((s for s in steps if s.trains), None)
    if training is not None and lab_args:
        lab_at = next((i for i, w in enumerate(training.argv) if w.endswith(".py")), 0)
        given = [str(a) for a in lab_args]
        if not any(training.argv[i:i + len(given)] == given
                   for i in range(lab_at, len(training.argv))):
            problems.append(f"the options given to the script ({shlex.join(given)}) do not reach "
                            "the lab: end the launch line with \"$@\"")
    if training is not None and training.world_size == 1:
        problems.append("world size 1: one process, nothing is data-parallel")
    return DryRun(job, printed, steps, problems)


# ---------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    lab_args = []
    if "--" in argv:
        cut = argv.index("--")
        argv, lab_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="python -m dpcourse.cluster.slurm",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1].replace("``", "'"))
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dry-run", help="print what a template would run, without submitting it")
    d.add_argument("template")
    demo = sub.add_parser("demo", help="start a two-node Slurm on this machine (root), "
                                       "run slurm/multi_node.sbatch, stop it")
    demo.add_argument("--save", default=None, metavar="DIR",
                      help="keep the job's output and rank 0's log here")
    demo.add_argument("--keep", action="store_true",
                      help="run no job: keep the cluster up for your own sbatch, squeue and srun "
                           "until Ctrl-C")
    args, sbatch_options = p.parse_known_args(argv)
    if args.command == "dry-run":
        result = dry_run(args.template, sbatch_options, lab_args)
        print(result.report())
        return 1 if result.problems else 0
    if sbatch_options:
        p.error(f"unknown options: {' '.join(sbatch_options)}")
    from dpcourse.cluster import localslurm

    return localslurm.demo(lab_args, args.save, args.keep)


if __name__ == "__main__":
    sys.exit(main())
