"""Notebook 15's labs outside the notebook: what its text says of runs it does not make itself.

nbval runs the notebook: the compile cuts on 2 ranks with aot_eager, the skipped step found by the
flight recorder and by py-spy, Join on uneven files against a padded sampler, a skipped optimizer
step caught by the checksum. Here: the reader on a rank that evaluates alone (it blames the rank
that did right), the uneven run without Join ending at its timeout in one line per rank, padding
counted on 3 ranks, the faults the checksum must not stop on (BatchNorm's buffers, a shared dropout
stream) and its cost on a large model, and compile's two other modes (the model whose forward is
nn.Sequential's: no graph at all; compiled autograd: the backward in one graph)."""
import json
import pickle
import re
import subprocess
import sys

import pytest

from conftest import ROOT, run, torchrun_cmd

LABS = ROOT / "solutions" / "labs"


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_reader_blames_rank_1_when_rank_0_evaluates_alone(tmp_path):
    """Rank 0 makes an all-reduce that rank 1 does not (an evaluation under `if rank == 0:`). Both
    ranks end within the timeout, each in one line naming where it waited; each leaves its dump;
    PyTorch's reader finds the tenth collective (eight training all-reduces, a barrier, then the
    evaluation) and names rank 1, the rank that did right, as its culprit: notebook 15 says so."""
    traces = tmp_path / "traces"
    result = run(torchrun_cmd(2, LABS / "hang.py", "--bug", "evaluate-alone", "--timeout", 5,
                              "--trace-dir", traces), timeout=120)
    assert result.returncode != 0, result.stdout
    # Each rank's line says where it waited. The rank whose timeout ends first exits, and the
    # other's collective may then end as a lost peer before its own timeout (arrival order under
    # load): either line names the same place. Counted in the whole output, not line by line: two
    # ranks writing at once can share a line.
    out = result.stdout
    assert out.count("waited its whole timeout") + out.count("lost another rank in the middle "
                                                             "of") == 2, out
    assert "waited its whole timeout" in out, out  # the first to end
    assert re.search(r"all_reduce at hang\.py:\d+ \(evaluate\)", out), out  # rank 0's
    assert re.search(r"barrier at hang\.py:\d+ \(main\)", out), out  # rank 1's
    ranks = [line for line in result.stdout.splitlines() if line.startswith("[rank")]
    assert not [line for line in ranks if "Traceback" in line], result.stdout  # one line each
    assert sorted(p.name for p in traces.iterdir()) == ["rank_0", "rank_1"]
    db = tmp_path / "db.pkl"
    reader = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                             str(traces), "-o", str(db)], capture_output=True, text=True,
                            timeout=120)
    report = reader.stdout + reader.stderr
    assert "Collective sequence number: 10 has errors" in report, report
    assert "Culprit rank 1" in report and "'all_reduce' does not match found collective type: " \
        "'barrier'" in report, report
    _, parsed = pickle.loads(db.read_bytes())
    failing = [c for c in parsed.collectives if not c.pass_check]
    assert [(c.collective_seq_id, c.collective_name) for c in failing] == \
        [(10, "gloo:all_reduce")], failing


def test_uneven_files_without_join_end_at_the_timeout_in_one_line_per_rank(tmp_path):
    result = run(torchrun_cmd(2, LABS / "uneven_inputs.py", "--mode", "hang", "--timeout", 5),
                 timeout=120)
    assert result.returncode != 0, result.stdout
    assert "after step 47 a rank is out of batches" in result.stdout, result.stdout
    said = [line for line in result.stdout.splitlines()
            if line.startswith(("[rank0]: ", "[rank1]: "))]
    # the rank that times out first ends the run; torchrun may stop the other before it speaks
    assert 1 <= len(said) <= 2 and any("waited its whole timeout" in line for line in said), said
    assert not [line for line in said if "Traceback" in line], said


def test_padding_counts_repeated_test_images_on_3_ranks(tmp_path):
    """7,001 training images and 10,000 test images on 3 ranks: the padded sampler repeats one
    training image and two test images, which its evaluation counts (10,002)."""
    log = tmp_path / "pad.jsonl"
    result = run(torchrun_cmd(3, LABS / "uneven_inputs.py", "--mode", "pad", "--log-json", log),
                 timeout=180)
    assert result.returncode == 0, result.stdout
    (done,) = records(log)
    assert done["test_images"] == 10_002 and done["duplicates"] == 1 and done["unseen"] == 0, done
    assert len(set(done["steps_per_rank"])) == 1 and done["replicas_max_diff"] == 0.0, done


@pytest.mark.parametrize("fault", ["buffer", "dropout-seed"])
def test_the_checksum_does_not_stop_on_what_is_not_a_divergence(tmp_path, fault):
    """BatchNorm's running statistics differ between the ranks by design: reported, the run goes on.
    A dropout stream seeded alike on every rank gives every rank the same masks, and equal weights:
    the checksum cannot see it, and rank 0 says how alike the masks are (1.0, against about a half
    with a stream per rank)."""
    log = tmp_path / "div.jsonl"
    result = run(torchrun_cmd(2, LABS / "divergence.py", "--fault", fault, "--steps", 30,
                              "--log-json", log), timeout=180)
    assert result.returncode == 0, result.stdout
    (done,) = [r for r in records(log) if r["event"] == "done"]
    assert not [r for r in records(log) if r["event"] == "diverged"]
    if fault == "buffer":
        assert done["buffers_differ"] and all(".running_" in name
                                              for name in done["buffers_differ"]), done
    else:
        assert done["masks_agree"] == 1.0 and not done["buffers_differ"], done


def test_a_check_of_ten_million_weights_is_timed_against_a_step(tmp_path):
    log = tmp_path / "bench.jsonl"
    result = run(torchrun_cmd(2, LABS / "divergence.py", "--bench", "--repeats", 3,
                              "--log-json", log), timeout=240)
    assert result.returncode == 0, result.stdout
    bench = records(log)
    assert [r["parameters"] for r in bench] == [20_538, 10_020_874], bench
    assert all(r["check_ms"] > 0 and r["step_ms"] > 0 for r in bench), bench


@pytest.mark.parametrize("mode", ["--as-sequential", "--compiled-autograd"])
def test_compile_without_a_graph_and_with_compiled_autograd(tmp_path, mode):
    """torch.compile(DDP(FashionCNN())) hands the backend no graph (Dynamo skips nn.Sequential's
    forward behind DDP's) and runs eager; with compiled autograd the backward is one graph of its
    own, with one all-reduce per parameter, whatever the bucket size. Equal to eager DDP."""
    log = tmp_path / "compile.jsonl"
    result = run(torchrun_cmd(2, LABS / "ddp_compile.py", mode, "--bucket-cap-mb", 25, 1e-5,
                              "--warmup", 1, "--steps", 2, "--log-json", log), timeout=240)
    assert result.returncode == 0, result.stdout
    configs = [r for r in records(log) if r["event"] == "config"]
    assert [r["bucket_cap_mb"] for r in configs] == [25, 1e-5], configs
    for r in configs:
        assert r["max_abs_dweight"] == 0.0, r
        if mode == "--as-sequential":
            assert r["graphs"] == 0, r
        else:
            assert r["graphs"] == 2 and r["graph_all_reduces"] == [0, 8], r


@pytest.mark.parametrize("script, args, collectives", [
    ("hang.py", ("--bug", "skip"), {"[rank0]": "ALLREDUCE (sequence number 7, shape [8])",
                                    "[rank1]": "BARRIER (sequence number 7)"}),
    ("bugs/shape_mismatch.py", (), {"[rank0]": "ALLGATHER (sequence number 2, shape [",
                                    "[rank1]": "ALLGATHER (sequence number 2, shape ["})])
def test_detail_names_the_mismatch_before_it_hangs_in_one_line_per_rank(script, args, collectives):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL: the ranks' next collectives are compared before they run, and
    each rank ends at once (no timeout: --timeout 120) with one line that says its own collective;
    torch's message, with every rank's fingerprint and traceback, is DPCOURSE_TRACEBACK's."""
    result = run(torchrun_cmd(2, LABS / script, *args, "--timeout", 120), timeout=100,
                 env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert result.returncode != 0, result.stdout
    lines = [line for line in result.stdout.splitlines() if line.startswith("[rank")]
    assert len(lines) == 2 and not [line for line in lines if "Traceback" in line], result.stdout
    for line in lines:
        tag = line.split(":")[0]
        assert "the ranks called different collectives here" in line, line
        assert f"this rank's is {collectives[tag]}" in line, line


@pytest.mark.parametrize("args, env, said", [
    # the head never called: one line per rank, with the names where TORCH_DISTRIBUTED_DEBUG asks
    ((), {"TORCH_DISTRIBUTED_DEBUG": "INFO"},
     "the parameters flipped.bias, flipped.weight got no gradient in the last backward"),
    # the head every other step under static_graph: the set of unused parameters changes
    (("--aux-every", 2, "--ddp", "static-graph"), {},
     "the parameters used changed from one step to the next, which static_graph=True does not "
     "allow: pass find_unused_parameters=True")])
def test_unused_parameters_end_in_one_line_per_rank_that_says_what_to_do(args, env, said):
    """DDP's "Expected to have finished reduction in the prior iteration", raised at the next
    forward on every rank, is one line per rank naming the line of the lab and the way out."""
    result = run(torchrun_cmd(2, LABS / "unused_parameters.py", *args), timeout=120, env=env)
    assert result.returncode != 0, result.stdout
    lines = [line for line in result.stdout.splitlines() if line.startswith("[rank")]
    assert len(lines) == 2 and not [line for line in lines if "Traceback" in line], result.stdout
    for line in lines:
        assert "DDP's forward at unused_parameters.py:" in line and "(step)" in line, line
        assert said in line, line


def test_find_unused_parameters_trains_with_the_head_in_some_steps_only(tmp_path):
    """What static_graph refuses, find_unused_parameters allows: the head every other step, six
    steps, and the replicas' losses finite."""
    log = tmp_path / "log.jsonl"
    result = run(torchrun_cmd(2, LABS / "unused_parameters.py", "--aux-every", 2, "--ddp",
                              "find-unused", "--log-json", log), timeout=120)
    assert result.returncode == 0, result.stdout
    done = records(log)[-1]
    assert done["event"] == "done" and done["steps"] == 6 and done["aux_every"] == 2, done
    assert done["loss"] == done["loss"] and abs(done["loss"]) < 100, done  # finite, not NaN


def test_a_refused_ptrace_is_said_at_the_first_look_not_as_a_run_that_did_not_hang(tmp_path,
                                                                                 monkeypatch):
    """Where the kernel refuses py-spy ptrace (a non-root learner, kernel.yama.ptrace_scope=1),
    stacks_while_hung says so with what to do, and stops the run: it does not look again until its
    patience runs out and then blame the lab for not hanging."""
    from dpcourse.explore import hangs

    fake = tmp_path / "py-spy"  # what py-spy prints, exit 1, when the kernel refuses it
    fake.write_text("#!/bin/sh\necho \"Permission Denied: Try running again with elevated "
                    "permissions by going 'sudo env \\\"PATH=\\$PATH\\\" !!'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(hangs, "py_spy", lambda: str(fake))
    script = LABS / "hang.py"
    with pytest.raises(hangs.PtraceRefused, match="It needs ptrace: run as root"):
        hangs.stacks_while_hung(script, "--bug", "skip", "--timeout", "60", patience=50)
    assert hangs.workers(script) == {}, "the workers outlived the refusal"
