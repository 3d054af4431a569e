"""``python -m dpcourse.lab.torchrun ARGS``: torchrun itself (``torch.distributed.run``), run as
``torchrun ARGS`` runs it, that leaves without the interpreter's teardown once it has finished.

``dpcourse.explore.launch.torchrun`` starts this instead of ``python -m torch.distributed.run``. By
the time torchrun's ``main()`` returns, its workers have exited and it has said everything it will
say; what is left is Python tearing down the torch that the agent imported, about a quarter of a
second per launch on the course's 2-core machine, and the notebooks and tests launch torchrun
hundreds of times. The exit status is torchrun's own; an error it raises is printed as Python would
print it. The workers, which run the labs, exit normally.
"""
import os
import runpy
import sys
import traceback


def main() -> int:
    sys.argv[0] = "torchrun"
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as end:
        return end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
    except BaseException as err:  # noqa: BLE001 - torchrun's ChildFailedError, a signal: as Python would end
        # as `python -m torch.distributed.run` prints it: from runpy's frames on, not this file's
        traceback.print_exception(type(err), err, err.__traceback__.tb_next)
        return 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
