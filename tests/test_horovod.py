"""The Horovod lab (solutions/labs/fashion_horovod.py) under horovodrun (gloo and MPI), mpirun and
srun, against the DDP lab; `make horovod` builds Horovod. Skipped where Horovod is not installed,
except in CI, which builds it (.ci/run) and so must run these."""
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import AT_ONCE_S, ROOT, run, torchrun_cmd
from dpcourse.lab.metrics import read_log

LAB = ROOT / "solutions" / "labs" / "fashion_horovod.py"
DDP_LAB = ROOT / "solutions" / "labs" / "fashion_ddp.py"
HOROVODRUN = str(Path(sys.executable).with_name("horovodrun"))
# horovodrun as notebook 11 starts it (dpcourse.explore.launch.horovodrun): horovodrun less its
# ~2.5 s start-up probe, told the build in DPCOURSE_HOROVOD_BUILT (the horovod fixture). The tests
# of a learner's mistakes and of `make horovod` run the installed horovodrun itself.
HOROVODRUN_NB = [sys.executable, "-m", "dpcourse.lab.horovodrun"]
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np"]

pytestmark = [pytest.mark.slow]
needs_horovod = pytest.mark.usefixtures("horovod")


@pytest.fixture(scope="module")
def horovod():
    if importlib.util.find_spec("horovod") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI builds Horovod (.ci/run: make horovod): it is missing", pytrace=False)
        pytest.skip("Horovod is not installed: make horovod")
    from dpcourse.explore.launch import _horovod_built

    with pytest.MonkeyPatch.context() as env:
        env.setenv("DPCOURSE_HOROVOD_BUILT", _horovod_built())  # for HOROVODRUN_NB
        yield


def launch(cmd, log, *args, timeout=240):
    """Run a launcher command on a lab with --log-json; (CompletedProcess, rank 0's records)."""
    done = run([*cmd, *map(str, args), "--log-json", log], timeout=timeout)
    return done, (read_log(log) if Path(log).exists() else [])


@needs_horovod
def test_horovodrun_reaches_the_ddp_labs_accuracy(tmp_path):
    """A quarter of an epoch (60 of 234 steps; 0.8409 for both, measured), the same data, seed and
    settings, on 2 processes: the test accuracies agree to 0.5 %."""
    args = ["--epochs", "1", "--max-steps", "60", "--global-batch-size", "256",
            "--lr-scaling", "linear"]
    hvd, hvd_log = launch([*HOROVODRUN_NB, "-np", "2", sys.executable, LAB],
                          tmp_path / "hvd.jsonl", *args)
    assert hvd.returncode == 0, hvd.stdout
    ddp, ddp_log = launch(torchrun_cmd(2, DDP_LAB), tmp_path / "ddp.jsonl", *args)
    assert ddp.returncode == 0, ddp.stdout
    h, d = hvd_log[-1], ddp_log[-1]
    assert h["framework"] == "horovod" and h["world_size"] == d["world_size"] == 2
    assert h["test_images"] == 10_000 and h["replicas_max_diff"] == 0.0
    assert h["step"] == d["step"] == 60 and h["peak_lr"] == d["peak_lr"] == 0.3
    assert abs(h["test_accuracy"] - d["test_accuracy"]) <= 0.005, (h, d)
    assert h["test_accuracy"] > 0.8, h
    print(f"60 steps, 2 processes: Horovod ({h['controller']}) {h['test_accuracy']:.4f} "
          f"in {h['elapsed_s']:.1f} s, "
          f"DDP {d['test_accuracy']:.4f} in {d['elapsed_s']:.1f} s")


@needs_horovod
def test_gloo_and_mpi_controllers_and_mpirun_train_alike(tmp_path):
    """The same 30 steps under horovodrun --gloo, horovodrun --mpi and plain mpirun:
    the same losses."""
    args = [LAB, "--max-steps", "30", "--log-every", "10", "--no-eval"]
    runs = {"gloo": [*HOROVODRUN_NB, "--gloo", "-np", "2", sys.executable],
            "mpi": [*HOROVODRUN_NB, "--mpi", "-np", "2", sys.executable],
            "mpirun": [*MPIRUN, "2", sys.executable]}
    losses = {}
    for name, cmd in runs.items():
        done, log = launch(cmd, tmp_path / f"{name}.jsonl", *args)
        assert done.returncode == 0, done.stdout
        assert log[0]["controller"] == ("gloo" if name == "gloo" else "mpi"), log[0]
        losses[name] = [r["train_loss"] for r in log if r["event"] == "train"]
        assert len(losses[name]) == 3 and log[-1]["replicas_max_diff"] == 0.0
    assert losses["gloo"] == pytest.approx(losses["mpi"], rel=1e-5) == losses["mpirun"], losses


@needs_horovod
def test_one_process_equals_the_plain_optimizer(tmp_path):
    """On one process Horovod's average is the gradient itself: the weights end
    equal to --no-hvd's."""
    weights = {}
    for name, extra in (("hvd", []), ("plain", ["--no-hvd"])):
        done = run([sys.executable, LAB, "--max-steps", "15", "--no-eval",
                    "--save-model", tmp_path / f"{name}.pt", *extra], timeout=120)
        assert done.returncode == 0, done.stdout
        weights[name] = torch.load(tmp_path / f"{name}.pt", weights_only=True)
    assert all(torch.equal(weights["hvd"][k], weights["plain"][k]) for k in weights["hvd"])
    two = run([HOROVODRUN, "--gloo", "-np", "2", sys.executable, LAB, "--no-hvd",
               "--max-steps", "5"], timeout=60)
    assert two.returncode != 0 and ("--no-hvd trains without hvd.DistributedOptimizer: "
                                    "launch one process" in two.stdout)


@needs_horovod
def test_resume_broadcasts_rank0s_checkpoint(tmp_path):
    """Stopped at step 10 and resumed (only rank 0 reads the checkpoint; the broadcasts share it):
    the same weights as an uninterrupted run of 20 steps, and replicas still equal."""
    base = [*HOROVODRUN_NB, "--gloo", "-np", "2", sys.executable, LAB,
            "--deterministic", "--no-eval", "--global-batch-size", "64"]
    whole = run([*base, "--max-steps", "20", "--save-model", tmp_path / "whole.pt"], timeout=180)
    assert whole.returncode == 0, whole.stdout
    first = run([*base, "--max-steps", "10", "--checkpoint-dir", tmp_path / "ck"], timeout=180)
    assert first.returncode == 0, first.stdout
    second, log = launch([*base, "--max-steps", "20", "--checkpoint-dir", tmp_path / "ck",
                          "--resume", "auto", "--save-model", tmp_path / "resumed.pt"],
                         tmp_path / "log.jsonl")
    assert second.returncode == 0 and "resumed at step 10" in second.stdout, second.stdout
    assert log[0]["event"] == "resume" and log[-1]["replicas_max_diff"] == 0.0
    a, b = (torch.load(tmp_path / f, weights_only=True) for f in ("whole.pt", "resumed.pt"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@needs_horovod
def test_a_learners_mistake_is_one_line_within_seconds():
    start = time.monotonic()
    done = run([HOROVODRUN, "--gloo", "-np", "2", sys.executable, LAB, "--global-batch-size", "7"],
               timeout=2 * AT_ONCE_S)
    assert done.returncode != 0 and time.monotonic() - start < AT_ONCE_S
    said = [line for line in done.stdout.splitlines()
            if "does not split into 2 equal per-worker batches" in line]
    ranks = [line for line in done.stdout.splitlines() if line.startswith(("[0]", "[1]"))]
    # (horovodrun has its own)
    assert len(said) == 1 and not any("Traceback" in line for line in ranks), done.stdout


@needs_horovod
def test_make_horovod_is_idempotent_and_checks_the_build():
    """`make horovod` on an installed Horovod: no rebuild, and horovodrun --check-build lists
    PyTorch, gloo and (with libopenmpi-dev) MPI."""
    if shutil.which("mpicxx") is None:
        pytest.skip("no mpicxx (apt-get install libopenmpi-dev)")
    done = run(["make", "horovod"], timeout=300)
    assert done.returncode == 0, done.stdout
    check = done.stdout[done.stdout.index("Available Frameworks"):]
    assert "[X] PyTorch" in check and "[X] Gloo" in check and "[X] MPI" in check, check
    from dpcourse.explore.launch import _horovod_built
    # what the notebooks' horovodrun is told instead of probing: the same
    assert _horovod_built() == "gloo,mpi"


@needs_horovod
def test_the_notebooks_horovodrun_takes_the_build_it_is_told_instead_of_probing():
    """dpcourse.explore.launch.horovodrun starts horovodrun less its start-up probe
    (src/dpcourse/lab/horovodrun.py): told that this Horovod has no Gloo, it refuses --gloo at once,
    as horovodrun does where Gloo is missing; told nothing, it is horovodrun, probe and all."""
    cmd = [*HOROVODRUN_NB, "--gloo", "-np", "2", "true"]
    told = run(cmd, env={"DPCOURSE_HOROVOD_BUILT": "mpi"}, timeout=60)
    assert told.returncode == 1 and "Gloo support has not been built" in told.stdout, told.stdout
    untold = {k: v for k, v in os.environ.items() if k != "DPCOURSE_HOROVOD_BUILT"}
    plain = subprocess.run(cmd, env=untold, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0, plain.stdout + plain.stderr


def test_notebook_11_without_horovod_shows_the_committed_run(tmp_path, monkeypatch):
    """Where Horovod is not installed, notebook 11 runs to its end: it says how to get Horovod,
    draws the committed logs, and its check says it did not run (make check: not checked)."""
    from dpcourse.kit.course import check_results, execute

    (tmp_path / "horovod").mkdir()
    (tmp_path / "horovod" / "__init__.py").write_text(
        "raise ImportError('no Horovod here (test)')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the notebook's kernel cannot import horovod
    nb, seconds, error = execute(ROOT / "solutions" / "11_horovod.ipynb")
    assert error is None, error
    said = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.outputs)
    assert "Horovod is not installed here: `make horovod`" in said and "results/11_horovod" in said
    assert check_results(nb) == [("○", "exercise 1 — the Horovod lines of labs/fashion_horovod.py: "
                                        "averaged gradients, the broadcasts, the metric, "
                                        "set_epoch — not checked: Horovod is not installed here "
                                        "(make horovod, then restart the kernel)")]
    # nothing trained: the committed run is shown
    assert "$ horovodrun" not in said and "$ mpirun" not in said, said
    print(f"notebook 11 without Horovod: {seconds:.1f} s")


@needs_horovod
def test_notebook_11s_measure_branch_runs_one_round(tmp_path, capsys):
    """Notebook 11 shows the committed study unless MEASURE = True, which measures on the learner's
    machine: that branch runs here, one round of short runs (the four runs of a round, 60 steps
    each), from its imports cell, and gives the same table and verdicts as the committed study
    does."""
    import nbformat

    nb = nbformat.read(ROOT / "solutions" / "11_horovod.ipynb", as_version=4)
    cell = next(c for c in nb.cells
                if c.cell_type == "code" and c.source.startswith("MEASURE = False"))
    source = cell.source.replace("MEASURE = False", "MEASURE = True", 1)
    source = source.replace("ROUNDS, STEPS = 3, 600", "ROUNDS, STEPS = 1, 60", 1)
    assert "ROUNDS, STEPS = 1, 60" in source, \
        "the MEASURE cell no longer sets ROUNDS and STEPS on its second line"
    shown = []
    namespace = {"__name__": "__main__"}
    cwd = os.getcwd()
    os.chdir(ROOT / "solutions")
    try:
        exec(compile(nb.cells[1].source, "imports cell", "exec"), namespace)
        namespace["display"] = shown.append  # the verdict, as Markdown
        exec(compile(source, "MEASURE cell", "exec"), namespace)
    finally:
        os.chdir(cwd)
    out = capsys.readouterr().out
    assert "from results/11_horovod" not in out, out  # measured here, not read from the study
    assert {k: len(v) for k, v in namespace["rounds"].items()} == dict.fromkeys(
        ["DDP plain", "DDP wrapped", "Horovod plain", "Horovod wrapped"], 1)
    assert all(v > 0 for v in namespace["overhead"].values()), namespace["overhead"]
    for lib in ("DDP", "Horovod"):
        assert f"{lib:8s} plain" in out, out
    assert len(shown) == 1 and "**DDP:**" in shown[0].data and "**Horovod:**" in shown[0].data, \
        shown
