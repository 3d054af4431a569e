"""``python -m dpcourse.lab.horovodrun ARGS``: horovodrun itself (``horovod.runner.launch``), run as
``horovodrun ARGS`` runs it, less its start-up probe when the caller has already asked.

Before it starts a single worker, horovodrun asks whether Horovod was built with Gloo (``--gloo``)
or MPI (``--mpi``) in a forked process that imports ``horovod.torch``, and so torch: about 2.5 s
of every launch on the course's 2-core machine (``horovod/common/util.py``,
``_check_extension_lambda``), before the workers import torch again.
``dpcourse.explore.launch.horovodrun`` asks once, in its own process, where torch is loaded already,
and passes the answer down in ``DPCOURSE_HOROVOD_BUILT`` ("gloo,mpi", "gloo", …). Without that
variable this is horovodrun unchanged, probe included. The exit status is horovodrun's own.
"""
import os
import sys

from horovod.runner import launch

BUILT = "DPCOURSE_HOROVOD_BUILT"


def main() -> int:
    built = os.environ.pop(BUILT, None)  # the workers need not see it
    if built is not None:
        have = set(built.split(","))
        # launch.py imported these two names from horovod.common.util: its checks call them there
        launch.gloo_built = lambda verbose=False: "gloo" in have
        launch.mpi_built = lambda verbose=False: "mpi" in have
    sys.argv[0] = "horovodrun"
    return launch.run_commandline() or 0


if __name__ == "__main__":
    sys.exit(main())
