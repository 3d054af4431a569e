"""dpcourse.lab.allreduce: six all-reduce algorithms over send/recv, their α-β-γ model (on one level
and on two: the node hierarchy), the bench CLI, and the ring lab (solutions/labs/ring_allreduce.py),
in real processes under torchrun and srun.
"""
import json
import math
import re
import sys

import pytest

import dpcourse.lab.allreduce as ar
from conftest import ROOT, run, torchrun_cmd
from dpcourse.explore import widgets
from dpcourse.kit.course import STUB_RAISE, student_script

MODULE = ROOT / "src" / "dpcourse" / "lab" / "allreduce.py"
LAB = ROOT / "solutions" / "labs" / "ring_allreduce.py"
SUMMARY = re.compile(r"(\d+) ranks \((\d+) node\(s\) of (\d+)\): (\d+) of (\d+) cases agree "
                     r"with dist.all_reduce")


# ---------------------------------------------------------------- the model (pure)
def test_known_values_for_four_ranks():
    """Hand-counted: P = 4, M = 4 MiB (float32), α = 10 µs, β = 1 ns/B, γ = 0.1 ns/B."""
    M, a, b, g = 2**22, 1e-5, 1e-9, 1e-10
    assert (ar.cost("ring", 4, M, a, b, g)
            == pytest.approx(6 * a + 6 * (M / 4) * b + 3 * (M / 4) * g))
    assert (ar.cost("parameter_server", 4, M, a, b, g)
            == pytest.approx(6 * a + 6 * M * b + 3 * M * g))
    assert ar.cost("naive_ring", 4, M, a, b, g) == pytest.approx(3 * (a + M * b + M * g))
    assert ar.cost("tree", 4, M, a, b, g) == pytest.approx(4 * (a + M * b) + 2 * M * g)
    assert (ar.cost("halving_doubling", 4, M, a, b, g)
            == pytest.approx(4 * a + 1.5 * M * b + 0.75 * M * g))
    assert ar.cost("ring", 4, M, a, b) == pytest.approx(0.00635146)  # plain α-β: 6α + 1.5·M·β


@pytest.mark.parametrize("P", [2, 4, 8, 16])
def test_ring_and_butterfly_match_the_textbook_where_they_should(P):
    M, a, b = 2**24, 3e-5, 2e-9
    assert ar.cost("ring", P, M, a, b) == pytest.approx(2 * (P - 1) * (a + M / P * b))
    # Rabenseifner: 2·log₂P·α + 2(P−1)/P·M·β (the textbook's log₂P(α + Mβ) is recursive doubling)
    assert (ar.cost("halving_doubling", P, M, a, b)
            == pytest.approx(2 * math.log2(P) * a + 2 * (P - 1) / P * M * b))


def test_where_the_implementation_differs_from_the_textbook():
    M, a, b = 2**20, 1e-5, 1e-9
    # 2(P−1), not 2
    assert ar.cost("parameter_server", 5, M, a, b) == pytest.approx(8 * (a + M * b))
    assert [sum(ar._tree_steps(P)) for P in range(2, 9)] == [2, 4, 4, 6, 6, 8, 8]
    assert sum(ar._tree_steps(16)) == 12  # textbook 2·log₂16 = 8
    # P = 3 is not a power of two: fold in (M), halve (⌈M/2⌉) and double, fold out (M)
    assert (ar.critical_path("halving_doubling", 3, 1001)
            == (4, (2 * 1001 + 2 * 501) * 4, (1001 + 501) * 4))


def test_ring_counts_the_largest_chunk_for_lengths_p_does_not_divide():
    assert ar.critical_path("ring", 3, 1001) == (4, 4 * 334 * 4, 2 * 334 * 4)
    assert ar.critical_path("ring", 4, 1, itemsize=8) == (6, 6 * 8, 3 * 8)
    assert ar.critical_path("ring", 1, 10) == (0, 0, 0)


def test_busbw_factor():
    assert [ar.busbw_factor(P) for P in (2, 4, 8)] == [1.0, 1.5, 1.75]


def test_fit_recovers_alpha_and_beta():
    sizes = [4 * 4**k for k in range(13)]  # 4 B … 64 MiB
    alpha, beta = 50e-6, 0.8e-9
    a, b = ar.fit_alpha_beta(sizes, [alpha + m * beta for m in sizes])
    assert a == pytest.approx(alpha, rel=0.05) and b == pytest.approx(beta, rel=0.02)
    assert ar.fit_gamma(sizes, [m * 2e-10 for m in sizes]) == pytest.approx(2e-10)


def test_the_explorer_picks_latency_then_bandwidth():
    a, b = 1e-4, 1e-9
    assert ar.winner(3, 1024, a, b) == "naive_ring"  # 2 messages beat 4
    assert ar.winner(3, 2**26, a, b) == "ring"  # 4M/3 bytes beat 2M
    # same bytes as the ring, 8 messages not 30
    assert ar.winner(16, 2**26, a, b) == "halving_doubling"
    table = ar.model_table(3, [2**10, 2**26], a, b)
    assert (set(table) == set(ar.FLAT) == set(ar.ALGORITHMS) - {"hierarchical"}
            and table["ring"][1] == pytest.approx(ar.cost("ring", 3, 2**26, a, b)))


def test_explorer_builds_with_four_sliders():
    box = widgets.allreduce_explorer(1e-4, 1e-9)
    (P, M), (alpha, beta) = (h.children for h in box.children[:2])
    assert (P.description, M.description, alpha.value) == ("P", "M (bytes)", pytest.approx(1e-4))
    P.value = 64  # redraws without error
    beta.value = 1e-10


def test_replay_of_hand_made_traces():
    # a ping-pong: 0 → 1, then 1 → 0; and an exchange, both directions at once
    pingpong = [[[("send", 1, 100)], [("recv", 1, 100)]], [[("recv", 0, 100)], [("send", 0, 100)]]]
    assert ar.replay(pingpong, 1.0, 0.01) == pytest.approx(2 * (1 + 1))
    both = [[[("send", 1, 100), ("recv", 1, 50)]], [[("send", 0, 50), ("recv", 0, 100)]]]
    assert ar.replay(both, 1.0, 0.01) == pytest.approx(2.0)
    with pytest.raises(RuntimeError, match="deadlock"):
        ar.replay([[[("recv", 1, 8)]], [[("recv", 0, 8)]]], 1, 0)


# ---------------------------------------------------------------- the node hierarchy (pure)
def test_two_level_counts_by_hand():
    """P = 4 as 2 nodes × 2, 1000 float32: the ring crosses a node boundary in each of its 6 steps;
    the hierarchical one sends half the vector within the node in 2 steps, a quarter across in 2."""
    assert ar.two_level_path("ring", 4, 2, 1000) == ((0, 0), (6, 6 * 250 * 4), 3 * 250 * 4)
    assert (ar.two_level_path("hierarchical", 4, 2, 1000)
            == ((2, 2 * 500 * 4), (2, 2 * 250 * 4), (500 + 250) * 4))
    # P = 6 as 2 × 3, 1200 float32: a third within (4 steps), a sixth across (2 steps)
    assert (ar.two_level_path("hierarchical", 6, 3, 1200)
            == ((4, 4 * 400 * 4), (2, 2 * 200 * 4), (2 * 400 + 200) * 4))
    # one node
    assert ar.two_level_path("ring", 6, 6, 1200) == ((10, 10 * 200 * 4), (0, 0), 5 * 200 * 4)
    with pytest.raises(ValueError, match="must divide"):
        ar.two_level_path("hierarchical", 6, 4, 1200)
    with pytest.raises(KeyError, match="ring and hierarchical"):
        ar.two_level_path("tree", 4, 2, 1000)


@pytest.mark.parametrize("P, G", [(4, 2), (6, 3), (6, 2), (8, 4), (16, 4), (32, 8)])
def test_on_one_kind_of_link_the_hierarchy_sends_the_rings_bytes_in_fewer_messages(P, G):
    n, N = 5040 * 32, P // G
    ring, hier = ar.critical_path("ring", P, n), ar.critical_path("hierarchical", P, n, G=G)
    assert hier[1] == ring[1] and hier[2] == ring[2]  # 2(G−1)/G·M + 2(N−1)/(NG)·M = 2(P−1)/P·M
    assert hier[0] == 2 * (G - 1) + 2 * (N - 1) < ring[0] == 2 * (P - 1)
    a, b = 1e-5, 1e-9  # one level: the two-level cost with equal links is the one-level cost
    assert ar.two_level_cost("hierarchical", P, G, 4 * n, (a, b), (a, b)) == pytest.approx(
        ar.cost("hierarchical", P, 4 * n, a, b, G=G))


def test_hierarchy_degenerates_to_the_ring():
    for G in (1, 4):  # one rank per node, or one node: nothing is left of the hierarchy
        assert ar.critical_path("hierarchical", 4, 1001, G=G) == ar.critical_path("ring", 4, 1001)
    # G=None: one node
    assert ar.critical_path("hierarchical", 4, 1001) == ar.critical_path("ring", 4, 1001)


def test_where_the_hierarchy_wins_on_nvlink_and_infiniband():
    """4 nodes × 8 GPUs; α, β from the notebook's table (NCCL 2.20.3's per-step latencies; NVLink 4
    and one NDR NIC per GPU, one direction). The ring pays the network at every step."""
    nvlink, ib = (3.4e-6, 1 / 450e9), (14e-6, 1 / 50e9)
    for M in (2**10, 2**20, 2**30):
        assert (ar.two_level_cost("hierarchical", 32, 8, M, nvlink, ib)
                < ar.two_level_cost("ring", 32, 8, M, nvlink, ib))
    # large messages: the flat ring sends 2(P−1) messages of M/P through one card;
    # the hierarchy 2(N−1) on each
    big = 2**30
    ring, hier = (ar.two_level_cost(a, 32, 8, big, nvlink, ib) for a in ("ring", "hierarchical"))
    assert ring == pytest.approx(62 * 14e-6 + 62 * big / 32 / 50e9)
    assert hier == pytest.approx(14 * 3.4e-6 + 14 * big / 8 / 450e9
                                 + 6 * 14e-6 + 6 * big / 32 / 50e9)


def test_replay_charges_a_transfer_between_nodes_the_network_price():
    both = [[[("send", 1, 100), ("recv", 1, 100)]], [[("send", 0, 100), ("recv", 0, 100)]]]
    assert ar.replay(both, 1.0, 0.01) == pytest.approx(2.0)  # one node
    assert ar.replay(both, 1.0, 0.01, node_size=1, inter=(10.0, 0.1)) == pytest.approx(20.0)  # two


def test_parse_sizes():
    assert ar.parse_sizes("1KiB,3") == [1024, 3]
    assert ar.parse_sizes("1KiB:16KiB:4") == [1024, 4096, 16384]
    with pytest.raises(Exception, match="not a size"):
        ar.parse_sizes("lots")


# ---------------------------------------------------------------- real processes
@pytest.mark.parametrize("P", [2, 3, 4])
def test_every_algorithm_equals_dist_all_reduce_and_the_model(P, tmp_path):
    """Every algorithm × lengths 1 … 65537 × float32/float64 against dist.all_reduce, and the
    transfers each made, replayed, against the model's counts. P = 2 adds a 64 MiB vector;
    P = 4 runs as 2 nodes of 2, so that the hierarchical all-reduce is one."""
    log = tmp_path / "check.jsonl"
    extra = ["--large", "64MiB"] if P == 2 else ["--ranks-per-node", "2"] if P == 4 else []
    result = run(torchrun_cmd(P, MODULE, "check", "--json", log, *extra), timeout=240)
    assert result.returncode == 0, result.stdout[-3000:]
    m = SUMMARY.search(result.stdout)
    G = 2 if P == 4 else P
    assert m and m.groups()[:3] == (str(P), str(P // G), str(G)) and m.group(4) == m.group(5), \
        result.stdout[-2000:]
    cases = [json.loads(line) for line in log.read_text().splitlines() if '"case"' in line]
    assert {c["algo"] for c in cases} == set(ar.ALGORITHMS)
    assert all(c["ok"] and c["counts_ok"] and c["ranks_per_node"] == G for c in cases)
    assert ({1, 2, 3, 1001, 65537} <= {c["n"] for c in cases}
            and {c["dtype"] for c in cases} == {"float32", "float64"})
    # replayed on two levels: the model's
    two_level = {(c["algo"], c["n"]) for c in cases if c["two_level_ok"]}
    assert {("ring", 5040), ("hierarchical", 5040)} <= two_level
    assert not any(c["two_level_ok"] is False for c in cases)
    if P == 2:
        assert any(c["n"] == 2**24 for c in cases)  # the 64 MiB case ran


def test_hierarchical_as_two_nodes_of_three(tmp_path):
    log = tmp_path / "check.jsonl"
    result = run(torchrun_cmd(6, MODULE, "check", "--algo", "ring,hierarchical",
                              "--ranks-per-node", "3", "--json", log), timeout=240)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "6 ranks (2 node(s) of 3): 40 of 40 cases agree" in result.stdout, result.stdout[-2000:]
    cases = [json.loads(line) for line in log.read_text().splitlines() if '"case"' in line]
    assert ({(c["algo"], c["n"]) for c in cases if c["two_level_ok"]}
            == {("ring", 5040), ("hierarchical", 5040)})


def test_ranks_that_do_not_divide_into_nodes_are_one_clear_line():
    result = run([sys.executable, str(MODULE), "check", "--algo", "hierarchical",
                  "--ranks-per-node", "3"], timeout=60)
    assert result.returncode != 0 and "3 ranks per node do not divide 1 ranks" in result.stdout, \
        result.stdout
    assert "Traceback" not in result.stdout


def test_bench_writes_pingpong_fit_and_every_algorithm(tmp_path):
    log = tmp_path / "bench.jsonl"
    result = run(torchrun_cmd(2, MODULE, "bench", "--algo", "all", "--sizes", "1KiB,64KiB",
                              "--repeats", "2", "--pingpong-sizes", "4B:1MiB:16",
                              "--json", log), timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    events = {r["event"] for r in records}
    assert {"pingpong", "fit", "add", "allreduce"} <= events
    runs = [r for r in records if r["event"] == "allreduce"]
    assert {(r["algo"], r["bytes"]) for r in runs} == {(a, m) for a in [*ar.ALGORITHMS, "native"]
                                                       for m in (1024, 65536)}
    for r in runs:
        assert (r["seconds"] > 0
                and r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * ar.busbw_factor(2)))
        assert (r["model_s"] is None) == (r["algo"] == "native")
    assert "algbw GB/s" in result.stdout and "model err" in result.stdout


def test_bench_refuses_an_unknown_algorithm():
    result = run([sys.executable, str(MODULE), "bench", "--algo", "ring,rign"], timeout=60)
    assert result.returncode != 0 and "unknown algorithm 'rign'" in result.stdout


def test_ring_lab_check_passes():
    """(2 and 3 ranks: the notebook's check, run by tests/test_exercises.py, runs both.)"""
    result = run(torchrun_cmd(3, LAB, "--check"), timeout=90)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "3 ranks: 14 of 14 cases equal dist.all_reduce" in result.stdout


def test_ring_lab_runs_as_one_process():
    result = run([sys.executable, str(LAB), "--check"], timeout=60)
    assert result.returncode == 0 and "1 ranks: 12 of 12 cases" in result.stdout, result.stdout


def test_ring_lab_show_prints_each_step(tmp_path):
    log = tmp_path / "show.jsonl"
    result = run(torchrun_cmd(3, LAB, "--show", "--reference", "--log-json", log), timeout=90)
    assert result.returncode == 0, result.stdout[-3000:]
    states = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(s["phase"], s["step"]) for s in states] == [("start", None), ("reduce-scatter", 0),
                                                          ("reduce-scatter", 1), ("all-gather", 0),
                                                          ("all-gather", 1)]
    assert states[-1]["values"] == [[111.0, 222.0, 333.0, 444.0, 555.0, 666.0]] * 3
    assert "rank 0: | 111 222 | 333 444 | 555 666 |" in result.stdout


def test_ring_lab_rejects_a_wrong_reduce_scatter(tmp_path):
    """Overwriting instead of adding: --check says WRONG and every rank exits non-zero."""
    text = LAB.read_text().replace("        recv += incoming  # my numbers",
                                   "        recv.copy_(incoming)  # my numbers")
    assert "recv.copy_(incoming)" in text
    wrong = tmp_path / "ring_allreduce.py"
    wrong.write_text(text)
    result = run(torchrun_cmd(3, wrong, "--check", "--timeout", "20"), timeout=90)
    assert result.returncode != 0 and "WRONG" in result.stdout and "reduce-scatter" in result.stdout


def test_student_lab_stops_at_the_stub(tmp_path):
    student = tmp_path / "ring_allreduce.py"
    student.write_text(student_script(LAB.read_text()))
    assert STUB_RAISE in student.read_text() and "recv += incoming" not in student.read_text()
    result = run(torchrun_cmd(2, student, "--check", "--timeout", "20"), timeout=90)
    assert result.returncode != 0 and "Exercise: see the hint above" in result.stdout
