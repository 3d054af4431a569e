"""Plausible wrong answers to notebook 15's exercises: a matrix cell's comparison and reading the
flight recorder's dumps (notebook cells), and the Join fix (labs/uneven_inputs.py);
tests/test_exercises.py checks that the notebook's checks reject each one."""
from answers import Lab

JOIN = "run the same train_loop inside torch's Join"

WRONG = {
    ("15_prove_it.ipynb", "exercise 1"): {
        "rank 0's weights only": ("""
    worst = torch.stack([(ranks[0][name] - reference[name]).abs().max()
                         for name in reference]).max().item()
    return worst, worst <= tolerance""", "compare every rank's weights, not rank 0's alone"),
        "the first tensor only": ("""
    name = next(iter(reference))
    worst = torch.stack([(weights[name] - reference[name]).abs().max()
                         for weights in ranks]).max().item()
    return worst, worst <= tolerance""", "compare every tensor of the reference"),
        "a signed difference": ("""
    worst = torch.stack([(weights[name] - reference[name]).max()
                         for weights in ranks for name in reference]).max().item()
    return worst, worst <= tolerance""", "take the absolute difference"),
        "the mean difference": ("""
    worst = torch.stack([(weights[name] - reference[name]).abs().mean()
                         for weights in ranks for name in reference]).max().item()
    return worst, worst <= tolerance""", "the largest difference, not a mean"),
        "the sum of the differences": ("""
    worst = torch.stack([(weights[name] - reference[name]).abs().sum()
                         for weights in ranks for name in reference]).max().item()
    return worst, worst <= tolerance""", "a sum of the differences grows with the model's size"),
        "torch.allclose with its relative tolerance": ("""
    worst = torch.stack([(weights[name] - reference[name]).abs().max()
                         for weights in ranks for name in reference]).max().item()
    return worst, all(torch.allclose(weights[name], reference[name], atol=tolerance)
                      for weights in ranks for name in reference)""",
            "a relative tolerance (torch.allclose's rtol) lets real faults through"),
        "Python's max, and not worst > tolerance": ("""
    worst = max((weights[name] - reference[name]).abs().max().item()
                for weights in ranks for name in reference)
    return worst, not worst > tolerance""", "a NaN must give NaN and False"),
    },
    ("15_prove_it.ipynb", "exercise 2"): {
        "by position, up to the shorter list": ("""
    ranks = sorted(dumps)
    for here in zip(*(dumps[rank] for rank in ranks)):
        calls = {rank: (e["profiling_name"], e["input_sizes"]) for rank, e in zip(ranks, here)}
        if len({repr(c) for c in calls.values()}) > 1:
            return here[0]["collective_seq_id"], calls
    return None""", "what it called there is None, and that disagrees"),
        "the collectives' names only": ("""
    called = {rank: {e["collective_seq_id"]: e["profiling_name"] for e in entries}
              for rank, entries in dumps.items()}
    sizes = {rank: {e["collective_seq_id"]: e["input_sizes"] for e in entries}
             for rank, entries in dumps.items()}
    first = max(min(seqs, default=1) for seqs in called.values())
    last = max(max(seqs, default=0) for seqs in called.values())
    for seq in range(first, last + 1):
        names = {rank: seqs.get(seq) for rank, seqs in called.items()}
        if len(set(names.values())) > 1:
            return seq, {rank: (names[rank], sizes[rank][seq]) if names[rank] else None
                         for rank in names}
    return None""", "Compare the sizes too"),
        "by position, the shorter list padded with None": ("""
    import itertools
    ranks = sorted(dumps)
    for here in itertools.zip_longest(*(dumps[rank] for rank in ranks)):
        calls = {rank: (e["profiling_name"], e["input_sizes"]) if e else None
                 for rank, e in zip(ranks, here)}
        if len({repr(c) for c in calls.values()}) > 1:
            return next(e for e in here if e)["collective_seq_id"], calls
    return None""", "Match entries by collective_seq_id, not by their position"),
        # a learner's trial: every number any rank holds, as if a rank called nothing before its
        # recorder's window
        "from the smallest of the ranks' first numbers": ("""
    called = {rank: {e["collective_seq_id"]: (e["profiling_name"], e["input_sizes"])
                     for e in entries}
              for rank, entries in dumps.items()}
    first = min(min(seqs, default=1) for seqs in called.values())
    last = max(max(seqs, default=0) for seqs in called.values())
    for seq in range(first, last + 1):
        here = {rank: seqs.get(seq) for rank, seqs in called.items()}
        if len({repr(c) for c in here.values()}) > 1:
            return seq, here
    return None""", "Start from the largest of the ranks' first numbers"),
    },
    ("15_prove_it.ipynb", "exercise 3"): {
        "Join with the model only, the meter left out": (Lab("uneven_inputs.py", JOIN, """
    with Join([model]):
        done = train_loop(model, opt, train_set, batches, seen, args, meter)"""),
            "a rank waited for a collective no other rank made"),
        "Join told to stop every rank when one runs out": (Lab("uneven_inputs.py", JOIN, """
    with Join([model, *more], throw_on_early_termination=True):
        done = train_loop(model, opt, train_set, batches, seen, args, meter)"""),
            "throw_on_early_termination=True stops every rank"),
        "every rank cut to the fewest batches": (Lab("uneven_inputs.py", JOIN, """
    fewest = torch.tensor([len(batches)])
    dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
    done = train_loop(model, opt, train_set, batches[:int(fewest)], seen, args, meter)"""),
            "cutting every rank to the fewest is drop_last, not Join"),
    },
}
