"""Plausible wrong answers to notebook 13's exercises: the memory formula (a notebook cell),
ShardedOptimizer (labs/sharded_optimizer.py), Gather.backward (labs/fsdp_by_hand.py) and
SumOverRanks (labs/beyond_dp.py); tests/test_exercises.py checks that the notebook's checks reject
each one."""
from answers import Lab

FORMULA = """
    bytes_per_param = {{"fp32": (4, 4, 8), "mixed": {mixed}}}[precision]
    weights, grads, optimizer = (b * params for b in bytes_per_param)
    P = world_size
    return {{"weights": weights / P if stage >= {w} else weights,
            "grads": grads / P if stage >= {g} else grads,
            "optimizer": optimizer / P if stage >= {o} else optimizer}}"""
STEP = "step this rank's own optimizer"
LOCAL = "build optimizer_cls"
SUM = "the sum of every rank's partial output"
PIECE = "rank r needs the average over the ranks of piece r"
# Each lab answer is a 2-process run (about 4 s). Left out for time, rejected when last tried on the
# same line as "no broadcast": every parameter broadcast from rank 0. Also left out: exercise 3's
# partial outputs swapped with rank 1 - rank (isend/irecv), right on 2 ranks; the check's 3-rank run
# rejects it, but only after the lab's collective timeout (20 s in the check, 67 s with the
# default).

WRONG = {
    ("13_sharded_dp.ipynb", "exercise 1"): {
        "mixed precision without the fp32 master weights (K = 8)": (
            FORMULA.format(mixed="(2, 2, 8)", w=3, g=2, o=1),
            "the optimizer state 8.0 GB, expected 12.0 GB"),
        "ZeRO-1 shards the gradients too": (FORMULA.format(mixed="(2, 2, 12)", w=3, g=1, o=1),
            "Stage 1 does not shard the gradients"),
        "plain DP divided by P as well": (FORMULA.format(mixed="(2, 2, 12)", w=0, g=0, o=0),
            "Stage 0 is plain DDP: nothing is divided"),
        "ZeRO-3 leaves the weights whole": (FORMULA.format(mixed="(2, 2, 12)", w=4, g=2, o=1),
            "Stage 3 shards the weights"),
    },
    ("13_sharded_dp.ipynb", "exercise 2"): {
        "no broadcast: every rank keeps its old copy of the others' shares": (
            Lab("sharded_optimizer.py", STEP, "self.local.step()"),
            "every parameter must reach every rank from its owner"),
        "the parameters all-reduced (summed) instead of broadcast": (
            Lab("sharded_optimizer.py", STEP, """
            self.local.step()
            for p in self.params:
                dist.all_reduce(p)"""), "every parameter must reach every rank from its owner"),
        "every rank's optimizer over all the parameters": (Lab("sharded_optimizer.py", LOCAL,
            "self.local = optimizer_cls(self.params, **kwargs)"),
            "each rank's optimizer must hold its own parameters (self.mine) only"),
        "the groups flattened into one list of my parameters": (Lab("sharded_optimizer.py", LOCAL,
            'self.local = optimizer_cls([p for group in self.mine '
            'for p in group["params"]], **kwargs)'),
            "one group for each of the parameter groups"),
        "AdamW written in, optimizer_cls ignored": (Lab("sharded_optimizer.py", LOCAL,
            "self.local = torch.optim.AdamW(self.mine, **kwargs)"),
            "unexpected keyword argument 'momentum'"),
    },
    ("13_sharded_dp.ipynb", "exercise 3"): {
        "the reduce-scatter's sum, never divided": (Lab("fsdp_by_hand.py", PIECE, """
        piece = flat.new_empty(per_rank)
        dist.reduce_scatter_single(piece, flat)"""),
            "the gradient was summed over the ranks, not averaged"),
        "this rank's piece of its own gradient, never reduced": (Lab("fsdp_by_hand.py", PIECE, """
        rank = dist.get_rank()
        piece = flat[rank * per_rank:(rank + 1) * per_rank].clone()"""),
            "each rank must step the average over the ranks of its own piece"),
        "an all-reduce, then this rank's piece of the average": (Lab("fsdp_by_hand.py", PIECE, """
        dist.all_reduce(flat)
        rank = dist.get_rank()
        piece = flat[rank * per_rank:(rank + 1) * per_rank] / world_size"""),
            "the right weights, through an all_reduce"),
        "the whole gradient all-reduced and returned whole": (Lab("fsdp_by_hand.py", PIECE, """
        dist.all_reduce(flat)
        piece = flat / world_size"""),
            "it must return this rank's piece of the gradient (per_rank numbers)"),
    },
    ("13_sharded_dp.ipynb", "exercise 4"): {
        "the partial output returned as it is": (Lab("beyond_dp.py", SUM, "return partial"),
            "not the whole MLP's. Each rank's partial output is its hidden units' share"),
        "the mean of the partial outputs": (Lab("beyond_dp.py", SUM, """
            total = partial.clone()
            dist.all_reduce(total)
            return total / dist.get_world_size()"""),
            "not the whole MLP's. Each rank's partial output is its hidden units' share"),
        "summed on rank 0 only (reduce)": (Lab("beyond_dp.py", SUM, """
            total = partial.clone()
            dist.reduce(total, dst=0)
            return total"""),
            "not the whole MLP's. Each rank's partial output is its hidden units' share"),
    },
}
