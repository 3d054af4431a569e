"""What a lab imports: the plumbing of one training run, nothing a learner must not see.

The process group around me (``world``; ``whoami``, ``rendezvous`` and ``explain`` below it), the
data (``data``, ``fashion_tensors``, ``images``, ``paths``), the models, optimizers and options,
the run log (``metrics``), checkpoints and stopping (``training``, ``preemption``), AllReduce over
send/recv (``allreduce``), the graders of ``ddp_by_hand.py`` (``checks``), the one error a learner
sees (``errors``), the launchers' own entry points (``torchrun``, ``horovodrun``). Imports only
``dpcourse.lab``: the lab runtime is the bottom layer (tests/test_layout.py).
"""
