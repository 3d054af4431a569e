"""Plausible wrong answers to notebook 08's exercises (the learning-rate rule of labs/fashion_ddp.py,
and federated averaging); tests/test_exercises.py checks that the notebook's checks reject each one."""
from answers import Lab

HINT = '"linear" (Goyal et al.)'

WRONG = {
    ("08_large_batches.ipynb", "exercise 1"): {
        "one worker's batch, not the global one": Lab("fashion_ddp.py", HINT, """
            ratio = batch / REFERENCE_BATCH
            return args.lr * (ratio if args.lr_scaling == "linear" else math.sqrt(ratio))"""),
        "linear and sqrt swapped": Lab("fashion_ddp.py", HINT, """
            ratio = batch * world_size / REFERENCE_BATCH
            return args.lr * (math.sqrt(ratio) if args.lr_scaling == "linear" else ratio)"""),
        "the ratio inverted": Lab("fashion_ddp.py", HINT, """
            ratio = REFERENCE_BATCH / (batch * world_size)
            return args.lr * (ratio if args.lr_scaling == "linear" else math.sqrt(ratio))"""),
        "scaled by the number of workers only": Lab("fashion_ddp.py", HINT, """
            return args.lr * (world_size if args.lr_scaling == "linear" else math.sqrt(world_size))"""),
        "sqrt forgotten: linear for both": Lab("fashion_ddp.py", HINT, """
            return args.lr * batch * world_size / REFERENCE_BATCH"""),
    },
    ("08_large_batches.ipynb", "exercise 2"): {
        "a plain mean of the clients": """
            return {key: sum(state[key] for state in states) / len(states) for key in states[0]}""",
        "weighted by the samples, never divided by their total": """
            return {key: sum(state[key] * n for state, n in zip(states, sizes)) for key in states[0]}""",
        "small clients weighted most (1 / samples)": """
            norm = sum(1 / n for n in sizes)
            return {key: sum(state[key] / n for state, n in zip(states, sizes)) / norm for key in states[0]}""",
        "the weights in the wrong order": """
            total = sum(sizes)
            return {key: sum(state[key] * (n / total) for state, n in zip(states, reversed(sizes))) for key in states[0]}""",
    },
}
