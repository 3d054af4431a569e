"""Plausible wrong answers to notebook 08's exercises (the learning-rate rule of
labs/fashion_study.py, and federated averaging); tests/test_exercises.py checks that the notebook's
checks reject each one."""
from answers import Lab

HINT = '"linear" (Goyal et al.)'

WRONG = {
    ("08_large_batches.ipynb", "exercise 1"): {
        "one worker's batch, not the global one": (Lab("fashion_study.py", HINT, """
            ratio = batch / REFERENCE_BATCH
            return lr * (ratio if rule == "linear" else math.sqrt(ratio))"""),
            "That is the rule applied to ONE worker's batch"),
        "linear and sqrt swapped": (Lab("fashion_study.py", HINT, """
            ratio = batch * world_size / REFERENCE_BATCH
            return lr * (math.sqrt(ratio) if rule == "linear" else ratio)"""),
            "scaled_lr gives 0.1732, not 0.2 × (2 × 48 / 128) = 0.15. "
            "That is the other rule's value"),
        "the ratio inverted": (Lab("fashion_study.py", HINT, """
            ratio = REFERENCE_BATCH / (batch * world_size)
            return lr * (ratio if rule == "linear" else math.sqrt(ratio))"""),
            "scaled_lr gives 0.2667, not"),
        "scaled by the number of workers only": (Lab("fashion_study.py", HINT, """
            return lr * (world_size if rule == "linear"
                              else math.sqrt(world_size))"""),
            "scaled_lr gives 0.4, not"),
        "sqrt forgotten: linear for both": (Lab("fashion_study.py", HINT, """
            return lr * batch * world_size / REFERENCE_BATCH"""),
            "scaled_lr gives 0.15, not 0.2 × √(2 × 48 / 128) = 0.1732. "
            "That is the other rule's value"),
    },
    ("08_large_batches.ipynb", "exercise 2"): {
        "a plain mean of the clients": ("""
            return {key: sum(state[key] for state in states) / len(states) for key in states[0]}""",
            "weight each client by its samples / all the samples"),
        "weighted by the samples, never divided by their total": ("""
            return {key: sum(state[key] * n for state, n in zip(states, sizes))
                    for key in states[0]}""",
            "weight each client by its samples / all the samples"),
        "small clients weighted most (1 / samples)": ("""
            norm = sum(1 / n for n in sizes)
            return {key: sum(state[key] / n for state, n in zip(states, sizes)) / norm
                    for key in states[0]}""",
            "weight each client by its samples / all the samples"),
        "the weights in the wrong order": ("""
            total = sum(sizes)
            return {key: sum(state[key] * (n / total) for state, n in zip(states, reversed(sizes)))
                    for key in states[0]}""",
            "weight each client by its samples / all the samples"),
    },
}
