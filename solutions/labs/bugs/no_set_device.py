"""Bug hunt: every rank loads the same checkpoint. Where do its tensors go?

    torchrun --standalone --nproc-per-node 2 solutions/labs/bugs/no_set_device.py \
        --ckpt /tmp/gpu0.pt

Rank 0 first writes a checkpoint the way a GPU job writes one: its tensors saved from cuda:0
(on a machine without a GPU they are only tagged cuda:0, which is what torch.save records on a
GPU). Then every rank takes its device (cuda:LOCAL_RANK where there is a GPU for each process),
loads the checkpoint and reports where the tensors landed and, on GPUs, how much memory each GPU
holds. Lines there because of distribution: `# DDP:`.
"""
import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from dpcourse.lab import world
from dpcourse.lab.metrics import JsonLog

# DDP: a GPU for each process here
GPUS = torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
AS_IF_ON_GPU0 = []  # while not empty, torch.save records CPU tensors as saved from cuda:0
torch.serialization.register_package(5, lambda storage: "cuda:0" if AS_IF_ON_GPU0 else None,
                                     lambda obj, location: None)


def setup(args):
    # DDP: rank and world size from the launcher
    env = world.prepare(backend="gloo", device="cpu")
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=args.timeout))
    return env


def cleanup():
    dist.destroy_process_group()  # DDP: leave the group so every rank exits cleanly


def write_gpu_checkpoint(path):
    """A 64 MB checkpoint whose tensors were saved from cuda:0 (or are tagged so, without a GPU)."""
    state = {"weight": torch.randn(4096, 4096), "bias": torch.zeros(4096)}
    if GPUS:
        torch.save({k: v.to("cuda:0") for k, v in state.items()}, path)
    else:
        AS_IF_ON_GPU0.append(True)
        torch.save(state, path)
        AS_IF_ON_GPU0.clear()


def use_and_load(device, path):
    """Make ``device`` this rank's device, and load the checkpoint's tensors."""
    return torch.load(path)


def main(args):
    env = setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        write_gpu_checkpoint(args.ckpt)
    dist.barrier()  # DDP: the others read the checkpoint once it is written

    # DDP: one GPU per rank
    device = torch.device("cuda", env.local_rank) if GPUS else torch.device(args.cpu_device)
    try:
        state = use_and_load(device, args.ckpt)
    except NotImplementedError:
        raise
    except RuntimeError as err:  # e.g. tensors saved from a GPU, on a machine without one
        state = None
        print(f"rank {rank} could not load the checkpoint: {str(err).splitlines()[0]}", flush=True)
    where = sorted({str(t.device) for t in state.values()}) if state else []
    used = [round(torch.cuda.memory_allocated(d) / 2**20)
            for d in range(torch.cuda.device_count())] if GPUS else []
    print(f"rank {rank}: device {device}, checkpoint on {where or 'nothing'}"
          + (f", this process's MiB on each GPU {used}" if GPUS else ""), flush=True)

    report = [None] * world_size
    dist.all_gather_object(report, {"rank": rank, "device": str(device), "loaded_on": where,  # DDP
                                    "mib_per_gpu": used})
    if rank == 0:  # DDP: one rank reports
        JsonLog(args.log_json).write("done", world_size=world_size, gpus=torch.cuda.device_count(),
                                     ranks=report)
        os.remove(args.ckpt)
    cleanup()
    if state is None:
        raise SystemExit(1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True,
                        help="where rank 0 writes the checkpoint (a folder every rank sees)")
    parser.add_argument("--cpu-device", default="cpu",
                        help="each rank's device without GPUs (the check uses meta: a stand-in "
                             "for a device that is not where the tensors were saved)")
    parser.add_argument("--timeout", type=float, default=30, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
