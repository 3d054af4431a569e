"""What a lab imports: the plumbing of one training run, nothing a learner must not see.

The process group around me (``world``; ``whoami``, ``rendezvous`` and ``explain`` below it), the
data (``data``, ``fashion_tensors``, ``images``, ``paths``), the models, optimizers and options,
the run log (``metrics``), checkpoints and stopping (``training``, ``preemption``), AllReduce over
send/recv (``allreduce``), a slower link emulated (``links``), the graders of ``ddp_by_hand.py``
(``checks``), the one error a learner sees (``errors``), the launchers' own entry points
(``torchrun``, ``horovodrun``). Imports only ``dpcourse.lab``: the lab runtime is the bottom layer
(tests/test_layout.py).
"""
import atexit
import gc

# A process that has loaded torch spends most of its last 0.6 s (on the course's 2-core machine) in
# the interpreter's final garbage collections, which walk every object torch created: on every rank
# of every run, after its work is done, with the launcher waiting for it. gc.freeze() at exit leaves
# the objects alive then out of those collections. They are still freed when their last reference
# goes (modules, files, process groups, as before); only reference cycles still alive at exit are
# left to the operating system with the rest of the process's memory. tests/test_launch.py holds it.
atexit.register(gc.freeze)
