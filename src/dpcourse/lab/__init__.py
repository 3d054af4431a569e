"""What a lab imports: the plumbing of one training run, nothing a learner must not see.

Who am I and the process group around me (``world``), the data (``data``, ``images``), the models,
optimizers and options, the run log (``metrics``), checkpoints and stopping (``training``,
``preemption``), the launchers' own entry points (``torchrun``, ``horovodrun``). Imports only
``dpcourse.lab``: the lab runtime is the bottom layer (tests/test_layout.py).
"""
