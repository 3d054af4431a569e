"""Plausible wrong answers to notebook 04's exercise (the reduce-scatter of labs/ring_allreduce.py);
tests/test_exercises.py checks that the notebook's check rejects each one."""
from answers import Lab

HINT = "at each step send one chunk to the right"

WRONG = {
    ("04_allreduce_algorithms.ipynb", "exercise 1"): {
        "chunk indices one step off": (Lab("ring_allreduce.py", HINT, """
            send = chunks[(rank - step - 1) % world_size]
            recv = chunks[(rank - step - 2) % world_size]
            incoming = buffer[:recv.numel()]
            exchange(send, right, incoming, left)
            recv += incoming"""), "your ring differs from dist.all_reduce"),
        "the received chunk overwrites instead of adding": (Lab("ring_allreduce.py", HINT, """
            send = chunks[(rank - step) % world_size]
            recv = chunks[(rank - step - 1) % world_size]
            incoming = buffer[:recv.numel()]
            exchange(send, right, incoming, left)
            recv.copy_(incoming)"""), "your ring differs from dist.all_reduce"),
        "passes on the chunk it received, not its sum": (Lab("ring_allreduce.py", HINT, """
            recv = chunks[(rank - step - 1) % world_size]
            send = chunks[rank] if step == 0 else last
            incoming = torch.empty_like(recv)
            exchange(send, right, incoming, left)
            recv += incoming
            last = incoming"""), "your ring differs from dist.all_reduce"),
        "received straight into the chunk (own numbers lost)": (Lab("ring_allreduce.py", HINT, """
            send = chunks[(rank - step) % world_size]
            recv = chunks[(rank - step - 1) % world_size]
            exchange(send, right, recv, left)"""), "your ring differs from dist.all_reduce"),
        "sent to the left, received from the right": (Lab("ring_allreduce.py", HINT, """
            send = chunks[(rank - step) % world_size]
            recv = chunks[(rank - step - 1) % world_size]
            incoming = buffer[:recv.numel()]
            exchange(send, left, incoming, right)
            recv += incoming"""), "Received data size doesn't match expected size"),
    },
}
