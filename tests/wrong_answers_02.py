"""Plausible wrong answers to the exercises of solutions/02_gradient_averaging.ipynb
(loaded by tests/test_exercises.py): each one must make its check fail."""
from answers import Lab

HINT = "backpropagate loss"  # the exercise region of average_gradients in grad_average.py

WRONG = {
    ("02_gradient_averaging.ipynb", "exercise 1"): {
        "plain mean of the shard gradients (unequal shards)": ("return sum(grads) / len(grads)",
            "how much should each shard's gradient weigh?"),
        "weights m_k not divided by n": ("return sum(m * g for m, g in zip(sizes, grads))",
            "how much should each shard's gradient weigh?"),
        "a sum, without any weights": ("return sum(grads)",
            "how much should each shard's gradient weigh?"),
        "weights 1/m_k (the shard sizes inverted)": ("""
            n = sum(sizes)
            return sum(g / m for m, g in zip(sizes, grads)) * n / len(grads) ** 2""",
            "how much should each shard's gradient weigh?"),
        "weighted, then divided by K once more": ("""
            n = sum(sizes)
            return sum(m / n * g for m, g in zip(sizes, grads)) / len(grads)""",
            "how much should each shard's gradient weigh?"),
    },
    ("02_gradient_averaging.ipynb", "exercise 2"): {
        "a sum without /K": (Lab("grad_average.py", HINT, """
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)"""),
            "divided by the number of ranks once?"),
        "divided by K twice": (Lab("grad_average.py", HINT, """
            loss.backward()
            for p in model.parameters():
                p.grad /= world_size
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= world_size"""), "divided by the number of ranks once?"),
        "all_reduce with op=MAX": (Lab("grad_average.py", HINT, """
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.MAX)
                p.grad /= world_size"""), "divided by the number of ranks once?"),
        "the loss averaged, not the gradient": (Lab("grad_average.py", HINT, """
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)
            loss /= world_size
            loss.backward()"""), "every rank must end with the same .grad"),
        "each rank's own gradient divided by K, nothing sent": (Lab("grad_average.py", HINT, """
            loss.backward()
            for p in model.parameters():
                p.grad /= world_size"""), "every rank must end with the same .grad"),
    },
}
