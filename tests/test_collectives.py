"""Notebook 03's labs in real processes: collectives_tour.py's logged tables are what each
primitive promises, comm_patterns.py logs sound timelines and counts the server's traffic,
compose_allreduce.py passes its own check and its student copy stops at the stub."""
import json
import sys
import time

import pytest

from conftest import AT_ONCE_S, ROOT, run, torchrun_cmd
from dpcourse.kit.course import STUB_RAISE, student_script

LABS = ROOT / "solutions" / "labs"
TOUR, PATTERNS, COMPOSE = (LABS / "collectives_tour.py", LABS / "comm_patterns.py",
                           LABS / "compose_allreduce.py")


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def expected_tables(P):
    """(before, after) per primitive, from the definitions, for rows 10·r + j."""
    row = [[10 * r + j for j in range(P)] for r in range(P)]
    col = [sum(row[r][j] for r in range(P)) for j in range(P)]
    none = [None] * (P - 1)
    diag = [[11 * r] for r in range(P)]
    return {
        "broadcast": (row, [row[0]] * P),
        "scatter": ([row[0]] + none, [[r] for r in range(P)]),
        "gather": (diag, [[11 * r for r in range(P)]] + none),
        "reduce": (row, [col] + none),
        "all_reduce": (row, [col] * P),
        "all_gather": (diag, [[11 * r for r in range(P)]] * P),
        "reduce_scatter": (row, [[col[r]] for r in range(P)]),
        "all_to_all": (row, [[10 * k + r for k in range(P)] for r in range(P)]),
        "send_recv": (row, [row[(r - 1) % P] for r in range(P)]),
    }


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_tour_logs_every_primitive_right(tmp_path, nproc):
    """One process (plain python), 2 and 3 ranks: every table is what the primitive promises."""
    log = tmp_path / "tour.jsonl"
    cmd = [sys.executable, str(TOUR)] if nproc == 1 else torchrun_cmd(nproc, TOUR)
    result = run([*cmd, "--log-json", log], timeout=90)
    assert result.returncode == 0, result.stdout
    records = {r["op"]: r for r in read(log)}
    want = expected_tables(nproc)
    assert list(records) == [*want, "barrier"], result.stdout
    for op, (before, after) in want.items():
        assert records[op]["world_size"] == nproc
        assert records[op]["before"] == before, (op, records[op])
        assert records[op]["after"] == after, (op, records[op])
    arrived = [a for [a] in records["barrier"]["before"]]
    left = [l for [l] in records["barrier"]["after"]]
    # rank r is 40·r ms late
    assert arrived == sorted(arrived) and arrived[-1] >= 40 * (nproc - 1) - 1
    assert min(left) >= max(arrived) - 0.1, records["barrier"]  # nobody left before the last came
    assert result.stdout.count("all_reduce: the sum of all rows") == 1  # rank 0 alone prints
    if nproc == 2:  # the printed table: all_to_all transposes
        assert "rank 0     0   1      0  10\nrank 1    10  11      1  11" in result.stdout, \
            result.stdout


def test_async_timelines(tmp_path):
    log = tmp_path / "async.jsonl"
    result = run(torchrun_cmd(2, PATTERNS, "async", "--mib", 1, "--repeats", 1, "--log-json", log),
                 timeout=90)
    assert result.returncode == 0, result.stdout
    records = read(log)
    assert [r["mode"] for r in records] == ["blocking all_reduce", "async all_reduce",
                                            "blocking send/recv", "isend/irecv"]
    for r in records:
        assert len(r["segments"]) == 2, r  # one timeline per rank
        for segments in r["segments"]:
            starts = [s for _, s, _ in segments]
            assert all(s <= e for _, s, e in segments) and starts == sorted(starts), r
        phases = [[w for w, _, _ in segments] for segments in r["segments"]]
        if r["mode"].startswith(("async", "isend")):
            assert all(p == ["start", "compute", "wait"] for p in phases), r
        else:
            assert all(p == ["communicate", "compute"] for p in phases), r
        assert r["total_ms"] >= max(e for segs in r["segments"] for _, _, e in segs) - 1e-3


def test_parameter_server_counts_its_traffic(tmp_path):
    log = tmp_path / "ps.jsonl"
    sizes = [10, 1000]
    result = run(torchrun_cmd(3, PATTERNS, "ps", "--sizes", *sizes, "--repeats", 1,
                              "--log-json", log), timeout=90)
    assert result.returncode == 0, result.stdout
    records = read(log)
    assert [r["values"] for r in records] == sizes
    for r in records:
        mib = r["values"] * 4 / 2**20
        assert r["sent_mib"] == pytest.approx([2 * mib, mib, mib])  # the server sends P − 1 copies
        assert r["received_mib"] == pytest.approx([2 * mib, mib, mib])
        assert r["max_abs_diff"] <= 1e-5 and r["server_ms"] > 0 and r["all_reduce_ms"] > 0, r


def test_comm_patterns_needs_two_ranks():
    result = run([sys.executable, str(PATTERNS), "async"], timeout=60)
    assert result.returncode != 0
    assert "needs at least 2 ranks" in result.stdout, result.stdout


@pytest.mark.parametrize("nproc", [2, 3])
def test_composed_all_reduce_passes_its_check(tmp_path, nproc):
    log = tmp_path / "check.jsonl"
    result = run(torchrun_cmd(nproc, COMPOSE, "--check", "--log-json", log), timeout=90)
    assert result.returncode == 0, result.stdout
    [record] = read(log)
    assert record["ok"] and record["calls"] == {"reduce_scatter_single": 1,
                                                "all_gather_single": 1}, record
    assert result.stdout.count("all_reduce_by_parts: ok") == 1, result.stdout


def test_student_copies_are_current_and_stop_at_the_stub(tmp_path):
    for name in ("collectives_tour.py", "comm_patterns.py", "compose_allreduce.py"):
        assert (ROOT / "labs" / name).read_text() == student_script((LABS / name).read_text()), \
            f"labs/{name} is stale: regenerate it"
    student = ROOT / "labs" / "compose_allreduce.py"
    text = student.read_text()
    assert (text.count(STUB_RAISE) == 1 and "# Hint: " in text
            and "reduce_scatter_single(mine" not in text)
    start = time.perf_counter()
    result = run(torchrun_cmd(2, student, "--check"), timeout=2 * AT_ONCE_S)
    assert time.perf_counter() - start < AT_ONCE_S
    assert result.returncode != 0, result.stdout
    line = next(i for i, s in enumerate(text.splitlines(), 1) if STUB_RAISE in s)
    assert (f"all_reduce_by_parts: not done yet — NotImplementedError: Exercise: see the hint "
            f"above (line {line})") in result.stdout, result.stdout
