"""Plausible wrong answers to notebook 11's exercise (the Horovod lines of labs/fashion_horovod.py);
tests/test_exercises.py checks that the notebook's check rejects each one. Each costs one to four
Horovod runs (about 8 s each): the check tests its first run before it starts the others."""
from answers import Lab

LAB = "fashion_horovod.py"
EVAL = "sum the three totals over all ranks"
WRAP = "wrap opt in Horovod's DistributedOptimizer"
BCAST = "every rank starts from rank 0's optimizer state"
EPOCH = "tell the sampler which epoch"

WRONG = {
    ("11_horovod.ipynb", "exercise 1"): {
        "the totals averaged, not summed": (Lab(
            LAB, EVAL, 'totals = hvd.allreduce(totals, op=hvd.Average, name="eval_totals")'),
            "sum the totals over all ranks (op=hvd.Sum)"),
        "hvd.allreduce taken for in place (its result dropped)": (Lab(
            LAB, EVAL, 'hvd.allreduce(totals, op=hvd.Sum, name="eval_totals")'),
            "sum the totals over all ranks (op=hvd.Sum), "
            "and keep the tensor hvd.allreduce returns"),
        "the optimizer never wrapped": (Lab(LAB, WRAP, "pass"),
            "is the optimizer wrapped in hvd.DistributedOptimizer"),
        # The unassigned wrapper lives on only until Python's cycle collector frees it (its hooks
        # and it refer to each other): while it lives, Horovod stops the run (more backward passes
        # than backward_passes_per_step); once freed, the plain optimizer trains each rank alone and
        # the weights drift apart. Both messages name the fix, and the test asks for it, not for
        # which of the two a collector's timing gave (CI saw both).
        "the wrapper built but not assigned (opt stays the plain optimizer)": (Lab(LAB, WRAP, """
            hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     backward_passes_per_step=args.accumulate, op=hvd.Average)"""),
            "opt = hvd.DistributedOptimizer("),
        "the gradients summed (op=hvd.Sum)": (Lab(LAB, WRAP, """
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           compression=compression,
                                           backward_passes_per_step=args.accumulate,
                                           op=hvd.Sum)"""),
            "average the gradients (hvd.Average), do not sum them"),
        "no broadcasts": (Lab(LAB, BCAST, "pass"), "only rank 0 read the checkpoint"),
        "the weights first, then the optimizer state (Horovod's examples' order)": (Lab(
            LAB, BCAST, """
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(opt, root_rank=0)"""), "only rank 0 read the checkpoint"),
        "set_epoch forgotten": (Lab(LAB, EPOCH, "pass"),
            "does the lab call sampler.set_epoch(epoch) every epoch?"),
    },
}
