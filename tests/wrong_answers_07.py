"""Plausible wrong answers to notebook 07's exercise (scaling_numbers: throughput, speedup and
efficiency from the study's logs); tests/test_exercises.py checks that the check rejects each one.

Each differs from the right answer by one mistake, and each gives other numbers than the right one
on the notebook's live logs: their runs log windows of 10, 10, 10 and 5 steps at rates that
differ from window to window.
"""

RATES = """
rates = {}
for key, records in logs.items():
    windows, last = [], 0
    for r in records:
        if r["event"] in RATE_EVENTS:
            steps, last = r["step"] - last, r["step"]
            if steps > 0 and r["samples_per_s"]:
                samples = steps * r["global_batch"]
                windows.append((samples, samples / r["samples_per_s"]))
    steady = windows[1:]
    rates[key] = sum(n for n, _ in steady) / sum(t for _, t in steady)
"""

RIGHT_RATIOS = """
numbers = {}
for (mode, k), rate in rates.items():
    base = rates[(mode, 1)]
    numbers[(mode, k)] = (rate, rate / base, rate / (k * base))
return numbers
"""

WRONG = {
    ("07_scaling_study.ipynb", "exercise 1"): {
        "weak efficiency not divided by K": (RATES + """
numbers = {}
for (mode, k), rate in rates.items():
    base = rates[(mode, 1)]
    numbers[(mode, k)] = (rate, rate / base, rate / base if mode == "weak" else rate / (k * base))
return numbers
""", "T(K) / (K · T(1)), for weak scaling too"),
        "the warm-up window kept": (
            RATES.replace("steady = windows[1:]", "steady = windows") + RIGHT_RATIOS,
            "That is the warm-up window kept"),
        "throughput from elapsed_s (start-up and logging inside)": ("""
rates = {}
for key, records in logs.items():
    last = records[-1]
    rates[key] = last["step"] * last["global_batch"] / last["elapsed_s"]
""" + RIGHT_RATIOS, "That is elapsed_s used"),
        "a plain mean of the windows' rates": ("""
rates = {}
for key, records in logs.items():
    windows, last = [], 0
    for r in records:
        if r["event"] in RATE_EVENTS:
            steps, last = r["step"] - last, r["step"]
            if steps > 0 and r["samples_per_s"]:
                windows.append(r["samples_per_s"])
    steady = windows[1:]
    rates[key] = sum(steady) / len(steady)
""" + RIGHT_RATIOS, "That is a plain mean of the windows' rates"),
        "the rates averaged with the steps as weights": ("""
rates = {}
for key, records in logs.items():
    windows, last = [], 0
    for r in records:
        if r["event"] in RATE_EVENTS:
            steps, last = r["step"] - last, r["step"]
            if steps > 0 and r["samples_per_s"]:
                windows.append((steps, r["samples_per_s"]))
    steady = windows[1:]
    rates[key] = sum(s * rate for s, rate in steady) / sum(s for s, _ in steady)
""" + RIGHT_RATIOS, "That is the rates averaged with the steps as weights"),
    },
}
