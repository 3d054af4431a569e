"""The emulated links (src/dpcourse/lab/links.py): the α-β costs they charge, a ping-pong that
fits the link back from inside a run, and a DDP run whose gradient all-reduce pays the link with
its numbers unchanged (tests/helpers/link_probe.py, on 2 ranks under torchrun)."""
import json

import pytest

from conftest import ROOT, run, torchrun_cmd
from dpcourse.lab import allreduce
from dpcourse.lab.links import PRESETS, EmulatedLink, Link, emulable

LINK = Link("test", alpha=1e-3, bandwidth=1e6, source="")  # β = 1 µs per byte


@pytest.mark.parametrize("op, P, seconds", [
    ("send", 4, 1e-3 + 1000e-6),
    ("all_reduce", 2, 2 * 1e-3 + 1000e-6),  # 2(P−1)α + 2(P−1)/P·nβ
    ("all_reduce", 4, 6 * 1e-3 + 1500e-6),
    ("all_gather", 4, 3 * 1e-3 + 750e-6),  # (P−1)α + (P−1)/P·nβ
    ("reduce_scatter", 4, 3 * 1e-3 + 750e-6),
    ("broadcast", 4, 2 * (1e-3 + 1000e-6)),  # ⌈log₂P⌉(α + nβ)
    ("all_reduce", 1, 0.0),
])
def test_a_collective_costs_what_the_alpha_beta_model_says(op, P, seconds):
    assert EmulatedLink(LINK, P).seconds(op, 1000) == pytest.approx(seconds)
    if op == "all_reduce" and P > 1:  # notebook 04's ring, in bytes
        assert seconds == pytest.approx(allreduce.cost("ring", P, 1000, 1e-3, 1e-6, itemsize=1))


@pytest.mark.parametrize("op, P, sent", [
    ("send", 4, 1000), ("all_reduce", 2, 1000), ("all_reduce", 4, 1500),
    ("all_gather", 4, 750), ("broadcast", 4, 2000), ("all_reduce", 1, 0)])
def test_the_bytes_a_rank_sends_are_the_beta_term_of_its_cost(op, P, sent):
    link = EmulatedLink(LINK, P)
    assert link.sent(op, 1000) == pytest.approx(sent)
    assert link.seconds(op, 2000) - link.seconds(op, 1000) == pytest.approx(sent * LINK.beta)
    link.wait(op, 1000)
    assert link.bytes == {op: sent} if sent else link.bytes[op] == 0


def test_off_the_link_a_collective_pays_nothing_and_is_not_counted():
    link = EmulatedLink(LINK, 2)
    with link.off():
        assert link.wait("all_reduce", 10**6) == 0.0
    assert link.added == 0.0 and not link.bytes
    assert link.wait("all_reduce", 8) > 0 and link.bytes == {"all_reduce": 8}


def test_an_unknown_collective_is_refused_by_name():
    with pytest.raises(ValueError, match="no model for 'all_to_all'"):
        EmulatedLink(LINK, 2).seconds("all_to_all", 8)
    with pytest.raises(ValueError, match="no model for 'all_to_all'"):
        EmulatedLink(LINK, 2).sent("all_to_all", 8)


def test_every_preset_says_where_its_figures_come_from():
    for name, link in PRESETS.items():
        assert link.alpha > 0 and link.bandwidth > 0 and len(link.source) > 40, name


def test_only_links_well_above_the_machines_own_are_emulable():
    """This machine over loopback: about 100 µs and 0.5 ns a byte (link_probe's "machine")."""
    here = {name for name, link in PRESETS.items() if emulable(link, 100e-6, 0.5e-9)}
    assert here == {"wan"}  # 1 GbE's 50 µs is below the machine's own latency
    assert {n for n, lk in PRESETS.items() if emulable(lk, 1e-6, 0.5e-9)} == {"wan", "1gbe"}
    assert not emulable(PRESETS["nvlink4"], 1e-6, 1e-12)  # 2.2 ps a byte: no machine here


@pytest.fixture(scope="module")
def probe(fashion_root):
    result = run(torchrun_cmd(2, ROOT / "tests/helpers/link_probe.py"), timeout=240)
    assert result.returncode == 0, result.stdout
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("preset, what", [("wan", 0), ("wan", 1), ("1gbe", 1)])
def test_a_ping_pong_fits_the_link_back_within_ten_percent(probe, preset, what):
    """α (what=0) and β (what=1) fitted from what the link added to each ping-pong (each
    measured beside one without it), against what the preset sets. The 1 GbE link's α (50 µs)
    is within this machine's own latency over loopback and is not fitted."""
    got = probe[preset]["added"][what]
    assert got == pytest.approx(probe[preset]["set"][what], rel=0.10), probe[preset]


def test_ddp_pays_the_link_for_its_gradients_and_computes_the_same_numbers(probe):
    ddp = probe["ddp"]
    assert ddp["max_abs_diff"] == 0.0, ddp
    # every step's gradient all-reduce, counted once per step
    assert ddp["bytes"] == {"all_reduce": 3 * ddp["params_bytes"]}, ddp
    # three steps: at least one bucket each, 2(P − 1)α = 60 ms a bucket on 2 ranks
    assert ddp["added"] >= 3 * 2 * PRESETS["wan"].alpha
    plain, slow = ddp["seconds"]
    assert slow - plain >= 0.9 * ddp["added"], ddp
