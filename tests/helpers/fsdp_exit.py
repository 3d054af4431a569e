"""One process trains a small FSDP model (fully_shard on a 1-rank gloo mesh) for two steps, calls
world.cleanup() and exits, for tests/test_sharded.py. With an argument (0-3), one of the DTensor
caches that dpcourse.lab.explain empties at exit is left full: its cache_clear does nothing.
$DPCOURSE_EXIT_THREADS=1 makes the process list its threads as it exits."""
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import _collective_utils, _redistribute, debug

from dpcourse.lab import world


def keep(which):
    """Make one of explain's four clears do nothing."""
    def nothing():
        return None
    if which == "0":
        debug._clear_sharding_prop_cache = nothing
    elif which == "1":
        _redistribute.clear_redistribute_planner_cache = nothing
    elif which == "2":
        _redistribute._gen_transform_infos.cache_clear = nothing
    elif which == "3":
        _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear = nothing


def main():
    world.setup(backend="gloo", device="cpu")
    mesh = init_device_mesh("cpu", (1,))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GroupNorm(4, 32),
                                torch.nn.Linear(32, 4))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    world.cleanup()


if __name__ == "__main__":
    keep(sys.argv[1] if len(sys.argv) > 1 else None)
    main()
