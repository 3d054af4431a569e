"""slurm/imagenet.sbatch on the real two-node test Slurm, from folders and from shards: the ImageNet
lab (tests/test_imagenet.py) as a job. Apart from tests/test_imagenet.py so that only these tests
wait for the cluster's worker (tests/workgroups.py: SLURM_MODULES)."""
import time

import pytest

from conftest import ROOT
from dpcourse.cluster import localslurm
from dpcourse.lab import images
from dpcourse.lab.metrics import read_log
from test_imagenet import SMALL


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["folders", "shards"])
def test_imagenet_template_runs_on_two_nodes(slurm, tree, layout, tmp_path):
    runs, local = tmp_path / "runs", tmp_path / "local"
    t0 = time.monotonic()
    job = slurm.sbatch(ROOT / "slurm" / "imagenet.sbatch", *localslurm.FIT,
                       args=[*SMALL, "--epochs", "2", "--batch-size", "8",  # 4 ranks × 8
                             *localslurm.ON_THE_CPU],
                       timeout=300, env={"RUNS": str(runs), "IMAGENET": str(tree[layout]),
                                         "LOCAL_DATA": str(local)})
    seconds = time.monotonic() - t0
    assert job.returncode == 0, job.log + job.output
    done = read_log(runs / "log.jsonl")[-1]
    assert (done["event"] == "done" and done["world_size"] == 4
            and done["test_images"] == 100), job.output
    # rank 0's last line, in the job's log
    assert "[rank0]:step 12: top-1" in job.output, job.output
    assert (local / images.STAGED).exists(), "the data was not staged to node-local disk"
    # so it is left in place
    assert f"LOCAL_DATA={local} is not a node-local folder named for this job" in job.output, \
        job.output
    assert (runs / "last.pt").exists()
    print(f"imagenet.sbatch from {layout}: world size 4 on 2 nodes, "
          f"{seconds:.1f} s from sbatch to the end")
