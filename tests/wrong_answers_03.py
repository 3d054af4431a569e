"""Wrong answers to notebook 03's exercise (all_reduce = reduce_scatter + all_gather), each a
plausible slip; tests/test_exercises.py checks that the check cell rejects every one."""
from answers import Lab

HINT = "reduce_scatter needs P equal chunks"
PAD = """
    flat = t.reshape(-1)
    chunk = -(-flat.numel() // world_size)
    buffer = torch.zeros(chunk * world_size, dtype=t.dtype, device=t.device)
    buffer[:flat.numel()] = flat
    mine = torch.empty(chunk, dtype=t.dtype, device=t.device)
"""

WRONG = {
    ("03_collectives.ipynb", "exercise 1"): {
        "the all_gather forgotten": (Lab("compose_allreduce.py", HINT, PAD + """
    dist.reduce_scatter_single(mine, buffer)
    t.copy_(buffer[:flat.numel()].view_as(t))"""), "t still holds this rank's own values"),
        "averaged instead of summed": (Lab("compose_allreduce.py", HINT, PAD + """
    dist.reduce_scatter_single(mine, buffer, op=dist.ReduceOp.AVG)
    dist.all_gather_single(buffer, mine)
    t.copy_(buffer[:flat.numel()].view_as(t))"""), "the average, not the sum"),
        "the chunks gathered in the wrong order": (Lab("compose_allreduce.py", HINT, PAD + """
    dist.reduce_scatter_single(mine, buffer)
    dist.all_gather(list(buffer.chunk(world_size))[::-1], mine)
    t.copy_(buffer[:flat.numel()].view_as(t))"""), "values differ from dist.all_reduce's"),
        "no padding (sizes P does not divide)": (Lab("compose_allreduce.py", HINT, """
    chunks = list(t.reshape(-1).tensor_split(world_size))
    mine = torch.empty_like(chunks[dist.get_rank()])
    dist.reduce_scatter(mine, chunks)
    dist.all_gather(chunks, mine)"""), "values do not split evenly over 2 ranks: pad t"),
        "the result bound to a new name, t left alone": (Lab("compose_allreduce.py", HINT, PAD + """
    dist.reduce_scatter_single(mine, buffer)
    dist.all_gather_single(buffer, mine)
    t = buffer[:flat.numel()].view_as(t)"""), "t still holds this rank's own values"),
    },
}
