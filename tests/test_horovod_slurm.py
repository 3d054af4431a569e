"""slurm/horovod.sbatch on the real test Slurm: the Horovod lab (tests/test_horovod.py) as a job.
Apart from tests/test_horovod.py so that only this test waits for the cluster's worker
(tests/workgroups.py: SLURM_MODULES)."""
import time

import pytest

from conftest import ROOT
from dpcourse.cluster import localslurm
from dpcourse.lab.metrics import read_log
from test_horovod import horovod  # noqa: F401 (the fixture needs_horovod asks for)

pytestmark = [pytest.mark.slow]
needs_horovod = pytest.mark.usefixtures("horovod")


@needs_horovod
def test_horovod_template_runs_under_srun(slurm, tmp_path):
    """slurm/horovod.sbatch on the test cluster: srun --mpi=pmix starts the ranks, MPI inside
    Horovod reads them from Slurm. One node × 2 tasks: the emulated nodes share one host, where two
    PMIx servers of one job collide (a real cluster has one per host)."""
    runs = tmp_path / "runs"
    start = time.monotonic()
    job = slurm.sbatch(ROOT / "slurm" / "horovod.sbatch", "--nodes=1", "--ntasks-per-node=2",
                       "--gpus-per-node=2", "--cpus-per-task=1",
                       args=["--max-steps", "30", "--eval-every", "15", "--global-batch-size", "64",
                             *localslurm.ON_THE_CPU],
                       timeout=240, env={"RUNS": str(runs)})
    assert job.returncode == 0, job.log + job.output
    done = read_log(runs / "log.jsonl")[-1]
    assert done["event"] == "done" and done["world_size"] == 2 and done["controller"] == "mpi", \
        job.output
    assert done["test_images"] == 10_000 and done["replicas_max_diff"] == 0.0
    assert "0: step 30: test accuracy" in job.output and (runs / "last.pt").exists()
    print(f"horovod.sbatch: 1 node × 2 tasks under srun --mpi=pmix, "
          f"{time.monotonic() - start:.1f} s")
