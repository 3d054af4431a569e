"""solutions/labs/fashion_elastic.py as it is, with each rank appending the training images it
trains on to INDEX_LOG.<rank> (one JSON line a step: its epoch and indices), for
tests/test_elastic.py to count: every image once per epoch, across a stop and a resume on another
world size."""
import json
import os
import sys
from pathlib import Path

from torch.utils.data import BatchSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "solutions" / "labs"))
import fashion_elastic as lab


class Counted(lab.ElasticTrainer):
    def batches(self, epoch):
        batches = super().batches(epoch)  # the sampler is set to this epoch here
        order = list(BatchSampler(self.data.sampler, self.batch, drop_last=True))
        first = self.progress["step_in_epoch"]  # run_epoch skips the batches done before
        with open(f"{os.environ['INDEX_LOG']}.{self.rank}", "a") as f:
            for i, batch in enumerate(batches):
                if i >= first:
                    f.write(json.dumps({"epoch": epoch, "indices": order[i]}) + "\n")
                    f.flush()
                yield batch


lab.ElasticTrainer = Counted
if __name__ == "__main__":
    lab.main(lab.parse_args())
