"""solutions/labs/ddp_by_hand.py: DDP by hand (naive, overlapped, bucketed), in real processes.

--check must pass for 2 and 3 ranks, reject plausible wrong answers to both exercises, and stop
at the student copy's stubs with their hint; the training mode must match torch's DDP, and fail
on every rank where a variant does not.
"""
import itertools
import json
import re
import sys
import textwrap

import pytest

from conftest import ROOT, run, torchrun_cmd
from dpcourse.kit.course import STUB_RAISE, student_script

SOLUTION = ROOT / "solutions" / "labs" / "ddp_by_hand.py"
STUDENT = ROOT / "labs" / "ddp_by_hand.py"
VARIANTS = ["NaiveDDP", "OverlapDDP", "BucketDDP (1 bucket)", "BucketDDP (4 buckets)",
            "BucketDDP (9 buckets, 1 parameter each)"]
# "<variant>: ok (max |Δ| 3e-08)", "<variant>: WRONG — why" or "<variant>: not done yet — ...";
# rank 0's lines, tagged "[rank0]:" when launched through dpcourse.explore.launch.
VERDICT = re.compile(r"^(?:\[rank0\]:)?(.+?): (ok \(max \|Δ\| \S+\)|WRONG — .*|not done yet — .*)$",
                     re.M)
# The code between a region's markers: exercise A in NaiveDDP, exercise B in BucketDDP.
REGION = re.compile(r"^([ \t]*)### BEGIN SOLUTION.*\n(?:.*\n)*?[ \t]*### END SOLUTION\n", re.M)

# What a learner could plausibly write instead, per exercise (code between the markers). Exercise A
# is NaiveDDP's and B is BucketDDP's, and --check gives each class its own verdict: so one 2-process
# run (about 5 s) tries a wrong A and a wrong B together, and each must be blamed on its own class.
WRONG = {
    "A": {
        "summed, not divided by the world size": "dist.all_reduce(p.grad)",
        "only the first parameter reduced": """
            if p is self.params[0]:
                dist.all_reduce(p.grad)
                p.grad /= world_size""",
        "a copy reduced, the rank's own .grad left alone": """
            total = p.grad.clone()
            dist.all_reduce(total)
            total /= world_size""",
        "each rank's own gradient divided, nothing sent": "p.grad /= world_size",
        "all_reduce's return value taken for the result": "p.grad = dist.all_reduce(p.grad)",
    },
    "B": {
        "flushed before the bucket is full (on every gradient)":
            "bucket.work = dist.all_reduce(bucket.buffer, async_op=True)",
        "flushed one gradient early": """
            if bucket.waiting == 1:
                bucket.work = dist.all_reduce(bucket.buffer, async_op=True)""",
        "never flushed": "pass",
        "flushed without keeping the work to wait on": """
            if bucket.waiting == 0:
                dist.all_reduce(bucket.buffer, async_op=True)""",
        "flushed synchronously (no work to wait on)": """
            if bucket.waiting == 0:
                dist.all_reduce(bucket.buffer)""",
        "waited for at once (no overlap)": """
            if bucket.waiting == 0:
                bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
                bucket.work.wait()""",
    },
}


def verdicts(output: str) -> dict[str, str]:
    """{variant: "ok (...)" | "WRONG — ..." | "not done yet — ..."} from --check's output."""
    return dict(VERDICT.findall(output))


def with_answer(exercise: str, code: str) -> str:
    """The solution lab with the code between exercise ``exercise``'s markers replaced."""
    return with_answers({exercise: code})


def with_answers(codes: dict[str, str]) -> str:
    """The solution lab with each exercise's region ("A", "B") in ``codes`` replaced by its code."""
    text = SOLUTION.read_text()
    regions = list(REGION.finditer(text))
    assert len(regions) == 2, "ddp_by_hand.py should have exactly two exercises"
    for exercise in sorted(codes, reverse=True):  # B first: it lies below A, so A's place stays put
        region = regions["AB".index(exercise)]
        assert ("bucket" in region.group(0)) == (exercise == "B")
        body = textwrap.indent(textwrap.dedent(codes[exercise]).strip() + "\n", region.group(1))
        text = text[:region.start()] + body + text[region.end():]
    return text


# One run per pair: the i-th wrong A with the i-th wrong B
# (the solution's own where one list is shorter).
PAIRS = list(itertools.zip_longest(WRONG["A"], WRONG["B"]))


def test_check_refuses_one_process():
    """With one rank every wrong answer (no all-reduce, a sum for a mean) would look right."""
    result = run([sys.executable, str(SOLUTION), "--check"], timeout=60)
    assert result.returncode != 0 and "--check needs at least 2 ranks" in result.stdout, \
        result.stdout
    assert "Traceback" not in result.stdout


@pytest.mark.parametrize("nproc", [2, 3])
def test_check_passes_for_every_variant(nproc):
    """2 and 3 ranks: each class matches one process on the global batch."""
    cmd = torchrun_cmd(nproc, SOLUTION, "--check")
    result = run(cmd, timeout=90)
    assert result.returncode == 0, result.stdout
    found = verdicts(result.stdout)
    assert list(found) == VARIANTS, result.stdout
    assert all(v.startswith("ok") for v in found.values()), result.stdout
    assert len(VERDICT.findall(result.stdout)) == len(VARIANTS)  # rank 0 alone prints


def test_training_mode_matches_torch_ddp(tmp_path, fashion_root):
    log = tmp_path / "log.jsonl"
    result = run(torchrun_cmd(2, SOLUTION, "--steps", 3, "--global-batch-size", 64,
                              "--log-json", log), timeout=90)
    assert result.returncode == 0, result.stdout
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["name"] for r in records] == ["DistributedDataParallel", "NaiveDDP", "OverlapDDP",
                                            "BucketDDP (1 bucket)"]
    for r in records:
        assert r["event"] == "variant" and r["steps"] == 3 and r["world_size"] == 2, r
        assert r["max_abs_diff"] < 1e-5 and r["ms_per_step"] > 0, r
    assert result.stdout.count("max |Δweight| vs DDP") == 1  # rank 0's table, once
    assert result.stdout.count("≤ --tolerance 1.0e-02: ok") == 1, result.stdout  # and its verdict


def test_training_mode_fails_where_a_variant_ends_off_torch_ddp(fashion_root, tmp_path):
    """The training mode's verdict is a check, not a display: a NaiveDDP that sums the gradients and
    never divides them (a wrong exercise A) ends about 0.14 from torch's DDP after 3 steps, past the
    default --tolerance of 1e-2, and the run ends non-zero with rank 0's verdict naming it."""
    lab = tmp_path / "ddp_by_hand.py"
    lab.write_text(with_answer("A", WRONG["A"]["summed, not divided by the world size"]))
    result = run(torchrun_cmd(2, lab, "--steps", 3, "--global-batch-size", 64), timeout=120)
    assert result.returncode != 0, result.stdout
    verdict = re.findall(r"^(?:\[rank0\]:)?largest max \|Δweight\| (\S+) > --tolerance 1\.0e-02: "
                         r"WRONG — NaiveDDP did not end on torch's DDP's weights$",
                         result.stdout, re.M)
    assert len(verdict) == 1 and float(verdict[0]) > 1e-2, result.stdout


@pytest.mark.parametrize("wrong_a, wrong_b", PAIRS,
                         ids=[f"A: {a or 'solution'} + B: {b or 'solution'}" for a, b in PAIRS])
def test_check_rejects_a_wrong_answer(tmp_path, wrong_a, wrong_b):
    lab = tmp_path / "ddp_by_hand.py"
    lab.write_text(with_answers({e: WRONG[e][w] for e, w in (("A", wrong_a), ("B", wrong_b))
                                 if w is not None}))
    # A wrong answer must fail, not hang: one that leaves a rank waiting ends at the 20-s
    # collective timeout.
    result = run(torchrun_cmd(2, lab, "--check", "--timeout", 20), timeout=300)
    assert result.returncode != 0, result.stdout
    found = verdicts(result.stdout)
    assert list(found) == VARIANTS, result.stdout
    wrong_ones = [name for name, v in found.items() if v.startswith("WRONG")]
    # A's mistake, and only A's, on NaiveDDP
    assert ("NaiveDDP" in wrong_ones) == (wrong_a is not None), result.stdout
    buckets = [name for name in wrong_ones if name.startswith("BucketDDP")]
    assert bool(buckets) == (wrong_b is not None), result.stdout
    assert set(wrong_ones) <= {"NaiveDDP", *buckets}, result.stdout
    assert found["OverlapDDP"].startswith("ok"), result.stdout  # the check blames the right class


def test_a_right_answer_written_differently_passes(tmp_path):
    """Exercise A with the division first and a new tensor: still the average, still ok."""
    lab = tmp_path / "ddp_by_hand.py"
    lab.write_text(with_answer("A", "p.grad = p.grad / world_size\ndist.all_reduce(p.grad)"))
    result = run(torchrun_cmd(2, lab, "--check"), timeout=300)
    assert result.returncode == 0, result.stdout
    assert verdicts(result.stdout)["NaiveDDP"].startswith("ok"), result.stdout


@pytest.mark.parametrize("fault, args", [
    ("if dist.get_rank() == 1:\n    raise RuntimeError('rank 1 breaks')", []),
    # rank 0 waits at most 5 s
    ("if dist.get_rank() == 1:\n    time.sleep(3600)", ["--timeout", 5]),
], ids=["a rank raises", "a rank is stuck"])
def test_a_failing_or_stuck_rank_ends_the_run_on_every_rank(tmp_path, fault, args):
    """Rank 0's failure (its error, or its 5-s timeout) ends rank 1 too: the run ends in well under
    the hour rank 1 would sleep, and under the 300 s the test allows, whatever the machine's
    load."""
    lab = tmp_path / "ddp_by_hand.py"
    lab.write_text(with_answer("A", fault + "\ndist.all_reduce(p.grad)\np.grad /= world_size"))
    result = run(torchrun_cmd(2, lab, "--check", *args), timeout=300)
    assert result.returncode != 0, result.stdout
    assert "rank 1 breaks" in result.stdout or "Timed out" in result.stdout, result.stdout


def test_student_copy_stops_at_its_stubs_with_the_hint():
    text = STUDENT.read_text()
    assert text == student_script(SOLUTION.read_text()), \
        "labs/ddp_by_hand.py is stale: regenerate it"
    assert text.count(STUB_RAISE) == 2 and text.count("# Hint: ") == 2
    result = run(torchrun_cmd(2, STUDENT, "--check"), timeout=300)
    assert result.returncode != 0, result.stdout
    found = verdicts(result.stdout)
    assert list(found) == VARIANTS, result.stdout
    assert found["OverlapDDP"].startswith("ok")  # no exercise in it
    stubbed = [name for name, v in found.items() if v.startswith("not done yet")]
    assert stubbed == [v for v in VARIANTS if v != "OverlapDDP"], result.stdout
    # the stubs' lines
    raises = [i for i, line in enumerate(text.splitlines(), 1) if STUB_RAISE in line]
    assert found["NaiveDDP"] == \
        f"not done yet — NotImplementedError: Exercise: see the hint above (line {raises[0]})"
    assert found["BucketDDP (1 bucket)"].endswith(f"(line {raises[1]})")


def test_buckets_hooks_and_overlap():
    """Buckets in reverse parameter order under a byte cap (None: one bucket); frozen weights left
    out, a tied weight once; all-reduces started inside backward, except where a skipped layer's
    parameters keep a bucket from filling up."""
    result = run([sys.executable, str(ROOT / "tests/helpers/by_hand_layout.py"), str(SOLUTION)],
                 timeout=60)
    assert result.returncode == 0, result.stdout
    out = json.loads(result.stdout.strip().splitlines()[-1])
    trainable = [n for n in out["parameters"] if n != "frozen.weight"]
    assert out["overlap_params"] == trainable  # hidden.weight (tied to again.weight) once
    # None: one bucket, no cap
    assert out["buckets"]["100"] == out["buckets"]["None"] == [trainable[::-1]]
    assert out["buckets"]["0"] == [[n] for n in trainable[::-1]]
    # 0.0012 MiB = 1258 bytes: head (16 + 256 B) + extra.bias (64 B);
    # extra.weight (1 KiB) + hidden.bias; ...
    assert out["buckets"]["0.0012"] == [["head.bias", "head.weight", "extra.bias"],
                                        ["extra.weight", "hidden.bias"],
                                        ["hidden.weight", "frozen.bias", "embed.bias"],
                                        ["embed.weight"]]
    # A step without the extra layer: its two parameters get no gradient and no hook call.
    assert out["started"] == {"BucketDDP 100": [1, 0, 1], "BucketDDP None": [1, 0, 1],
                              "BucketDDP 0.0012": [4, 2, 4], "BucketDDP 0": [9, 7, 9],
                              "OverlapDDP": [9, 7, 9]}
