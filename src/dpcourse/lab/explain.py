"""When something goes wrong on a rank: one line that says what happened, not a traceback from
every rank.

``explain_errors()`` installs the excepthook: an unfinished exercise of a learner's lab (said once,
by rank 0), a collective whose peer died, one that waited its whole timeout (a hang, with where
this rank waits), ranks that called different collectives, as TORCH_DISTRIBUTED_DEBUG=DETAIL
finds before they hang, or DDP's parameters that got no gradient; any other error is rank 0's
traceback, and one line from each rank that met the same. And at exit, what still holds a
destroyed process group is let go, so that gloo's threads do not outlive the interpreter.
"""
from __future__ import annotations

import atexit
import gc
import os
import re
import sys
import time
import traceback
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from dpcourse.lab.whoami import env_info


def _report_threads_at_exit() -> None:
    """$DPCOURSE_EXIT_THREADS=1: this process's threads as it exits, in one line (the tests read
    it). Registered before ``_release_destroyed_groups``, so it runs after it (atexit runs in
    reverse)."""
    if os.environ.get("DPCOURSE_EXIT_THREADS") != "1":
        return
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    os.write(1, f"[exit] rank {os.environ.get('RANK', '?')} threads: "
                f"{' '.join(sorted(names))}\n".encode())

def _release_destroyed_groups() -> None:
    """At exit, once a lab has called ``destroy_process_group``: let go of what still holds its
    groups.

    torch 2.14's DTensor keeps every DeviceMesh it has seen in module-level caches (sharding
    propagation, redistribution plans, mesh topology), and a mesh keeps its process groups. So after
    FSDP (``fully_shard``) the destroyed group and gloo's threads live on into the interpreter's
    exit, where a rank can abort ("terminate called without an active exception"; 3 gloo ranks of
    labs/fsdp_fashion.py, in CI). Emptied here, the group is freed and its threads end before Python
    does. Each of the four is needed: with any one left full, the threads outlive Python
    (tests/test_sharded.py leaves each full in turn). The sharding cache is per thread: this
    empties the main thread's, which is all of it on the CPU (backward runs there), not what
    autograd's GPU threads filled. A group still initialized (no cleanup) is left as it is."""
    if not dist.is_available() or dist.is_initialized() \
            or "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import _collective_utils, _redistribute, debug

    for clear in (debug._clear_sharding_prop_cache, _redistribute.clear_redistribute_planner_cache,
                  _redistribute._gen_transform_infos.cache_clear,
                  _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear):
        clear()
    gc.collect()

atexit.register(_report_threads_at_exit)

atexit.register(_release_destroyed_groups)

# What gloo, NCCL and the TCPStore say when the rank on the other end of a collective is gone.
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "Socket Timeout", "Timed out waiting", "timed out", "NCCL communicator was aborted")

# What TORCH_DISTRIBUTED_DEBUG=DETAIL raises on every rank when the ranks' next collectives differ
# (op, shapes, dtypes), and each rank's fingerprint in it: its own first ("Rank 0 is running
# collective: CollectiveFingerPrint(SequenceNumber=7, OpType=ALLREDUCE, TensorShape=[8], ...),
# but Rank 1 is running ..."; torch 2.14 writes "SequenceNumber=7OpType=BARRIER" without shapes).
# The other rank's fingerprint can be one of the check's own collectives: only this rank's is said.
_MISMATCH = "Detected mismatch between collectives on ranks"
_FINGERPRINT = re.compile(r"CollectiveFingerPrint\(SequenceNumber=(?P<seq>\d+),? ?"
                          r"OpType=(?P<op>\w+)(?:, TensorShape=\[(?P<shape>[^\]]*)\])?")

# What DDP raises at the next forward when the last backward left parameters without a gradient
# (with TORCH_DISTRIBUTED_DEBUG=INFO or DETAIL their names too), and with static_graph=True when
# the set of parameters used has changed.
_UNUSED = "Expected to have finished reduction in the prior iteration"
_UNUSED_NAMES = re.compile(r"Parameters which did not receive grad for rank \d+: (?P<names>[^\n]*)")
_UNUSED_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: "
                             r"(?P<indices>[\d ]*)")

# set in the group's store by rank 0 once it has said the unfinished exercise
_SAID = "dpcourse/exercise_said"

_SAID_WAIT_S = 30.0

def _rank0_said_it() -> bool:
    """A rank other than 0 at an unfinished exercise: wait until rank 0 has said it (it meets the
    same stub, but on a loaded machine it can come there seconds later). True once it has, or once
    the store has gone with rank 0 (srun, mpirun, by hand: rank 0 serves it; under torchrun the
    agent does, and ends this rank when rank 0 fails); False if rank 0 has not said it within
    _SAID_WAIT_S (busy elsewhere, in a collective this rank will never join, say): then this rank
    says it. Without a process group: 3 s, then this rank says it."""
    store = (dist.distributed_c10d._get_default_store()
             if dist.is_available() and dist.is_initialized() else None)
    if store is None:
        time.sleep(3.0)
        return False
    try:
        store.wait([_SAID], timedelta(seconds=_SAID_WAIT_S))
        return True
    # the store has gone with rank 0; or Ctrl-C: quietly
    except (dist.DistNetworkError, KeyboardInterrupt):
        return True
    except RuntimeError:  # DistStoreError: the wait's timeout
        return False

def _tell_the_others() -> None:
    """Rank 0, once it has said the unfinished exercise: the other ranks may end without a word."""
    try:
        if dist.is_available() and dist.is_initialized():
            dist.distributed_c10d._get_default_store().set(_SAID, "1")
    except RuntimeError:
        pass  # nobody left to tell

def _explain_lost_peer(kind, err, tb, fallback=sys.excepthook) -> None:
    """sys.excepthook of a rank in a group: a collective whose peer died is one line, not a
    traceback; so is an unfinished exercise of a learner's lab, which every rank meets alike: rank 0
    says it.

    (torch's own hook, installed by init_process_group around this one, adds the "[rankN]:" tag.)
    """
    text = str(err)
    if isinstance(err, NotImplementedError) and text.startswith("Exercise:") \
            and not os.environ.get("DPCOURSE_TRACEBACK"):
        if env_info().rank != 0 and _rank0_said_it():
            return  # exit status 1, without a word: rank 0 has said it
        where = traceback.extract_tb(tb)[-1]
        try:
            path = os.path.relpath(where.filename)
        except ValueError:
            path = where.filename
        print(f'File "{path}", line {where.lineno}, in {where.name}: {text}. This exercise of the '
              "lab is not done yet: complete it (its notebook's check says when it is right), or "
              "run the complete lab in solutions/labs/.", file=sys.stderr, flush=True)
        # once torch's hook around this one has written the line (atexit runs after it)
        if env_info().rank == 0:
            atexit.register(_tell_the_others)
        return
    if isinstance(err, RuntimeError) and _MISMATCH in text \
            and not os.environ.get("DPCOURSE_TRACEBACK"):
        collective, where = _waiting_in(tb)
        own = _FINGERPRINT.search(text)  # this rank's own comes first in its message
        mine = (f"{own['op']} (sequence number {own['seq']}"
                + (f", shape [{own['shape']}])" if own["shape"] is not None else ")")
                if own else "not named")
        print(f"{collective} at {where}: the ranks called different collectives here, found before "
              "it ran by TORCH_DISTRIBUTED_DEBUG=DETAIL (it compares each collective across the "
              f"ranks first): this rank's is {mine}. Compare with the other ranks' lines; "
              "DPCOURSE_TRACEBACK=1 shows this rank's traceback.", file=sys.stderr, flush=True)
        return
    if isinstance(err, RuntimeError) and _UNUSED in text \
            and not os.environ.get("DPCOURSE_TRACEBACK"):
        _, where = _waiting_in(tb)
        names, indices = _UNUSED_NAMES.search(text), _UNUSED_INDICES.search(text)
        which = (f"{names['names'].strip()} " if names else
                 f"number {', '.join(indices['indices'].split())} of model.parameters() "
                 if indices else "")
        if "graph has changed" in text:
            print(f"DDP's forward at {where}: the parameters used changed from one step to the "
                  "next, which static_graph=True does not allow: pass find_unused_parameters=True "
                  "instead (DDP then looks for unused parameters after every forward). "
                  "DPCOURSE_TRACEBACK=1 shows this rank's traceback.", file=sys.stderr, flush=True)
        else:
            print(f"DDP's forward at {where}: the parameters {which}got no gradient in the last "
                  "backward on this rank, and DDP waits for every gradient of a bucket before it "
                  "sends it. Take what forward does not use out of the model (or out of DDP), or "
                  "pass DistributedDataParallel(..., find_unused_parameters=True) (a walk over "
                  "the autograd graph every step), or static_graph=True where the same parameters "
                  "go unused in every step. "
                  + ("" if names else "TORCH_DISTRIBUTED_DEBUG=INFO names the parameters; ")
                  + "DPCOURSE_TRACEBACK=1 shows this rank's traceback.",
                  file=sys.stderr, flush=True)
        return
    if isinstance(err, RuntimeError) and any(s in text for s in _LOST_PEER) \
            and not os.environ.get("DPCOURSE_TRACEBACK"):
        first = next((line.strip() for line in text.splitlines() if line.strip()), "")
        first = re.sub(r"^(\[[^\]]*\]:?\s*)+", "", first).split(". ")[0][:120]  # no source paths
        collective, where = _waiting_in(tb)
        # nobody answered: most often a hang, not a crash
        if "imed out" in text or "Timeout" in text:
            print(f"{collective} at {where} waited its whole timeout and no other rank joined it "
                  f"({first}). This is a hang: another rank is not calling the same collective: it "
                  "called a different one or none (a collective under `if rank == 0:`, ranks that "
                  "take different numbers of steps), or it is stuck or gone. Compare where each "
                  "rank waits (this line, on each rank); "
                  "DPCOURSE_TRACEBACK=1 shows this rank's traceback.",
                  file=sys.stderr, flush=True)
        else:
            print(f"lost another rank in the middle of {collective} at {where} ({first}). It "
                  "probably crashed, was killed or ran out of time (its own output says why), or "
                  "it ended without calling this collective. "
                  "(DPCOURSE_TRACEBACK=1 shows this rank's traceback.)",
                  file=sys.stderr, flush=True)
        return
    _once_for_every_rank(kind, err, tb, fallback)

# set in the group's store by rank 0 once it has printed a traceback: its error's last line
_ERROR = "dpcourse/error_said"

_ERROR_WAIT_S = 3.0
_DIGITS = re.compile(r"\d+")

def _once_for_every_rank(kind, err, tb, fallback) -> None:
    """Any other error: rank 0 prints its traceback; a rank that meets the same error (the same
    type and message up to their numbers: a wrong answer every rank runs alike; its own message,
    numbers included, is in its line) says so in one line instead of
    printing the same traceback again. A rank whose error differs, or that hears nothing from rank
    0 within _ERROR_WAIT_S, prints its own traceback."""
    said = "".join(traceback.format_exception_only(kind, err)).strip().splitlines()[-1][:300]
    store = (dist.distributed_c10d._get_default_store()
             if dist.is_available() and dist.is_initialized() else None)
    if store is None or os.environ.get("DPCOURSE_TRACEBACK"):
        fallback(kind, err, tb)
        return
    if env_info().rank == 0:
        fallback(kind, err, tb)
        try:
            store.set(_ERROR, said)
        except RuntimeError:
            pass  # nobody left to tell
        return
    try:  # one call that waits for the key and reads it: rank 0 may be gone right after its set
        store.set_timeout(timedelta(seconds=_ERROR_WAIT_S))
        # the same up to its numbers: a message can name its rank, a time, an address
        same = _DIGITS.sub("N", store.get(_ERROR).decode(errors="replace")) \
            == _DIGITS.sub("N", said)
    except (RuntimeError, KeyboardInterrupt):  # rank 0 said nothing in time, or has gone
        same = False
    if not same:
        fallback(kind, err, tb)
        return
    _, where = _waiting_in(tb)
    print(f"the same error as rank 0, at {where}: {said} (rank 0's traceback is above; "
          "DPCOURSE_TRACEBACK=1 shows every rank's).", file=sys.stderr, flush=True)

def _waiting_in(tb) -> tuple[str, str]:
    """(the collective, "file:line (function)" of the code that called it) from a traceback."""
    frames = traceback.extract_tb(tb)
    torch_dir = os.path.dirname(torch.__file__)
    ours = [f for f in frames if not f.filename.startswith(torch_dir)]
    collective = next(
        (f.name for f in reversed(frames) if f.filename.endswith("distributed_c10d.py")
         and f.name != "wrapper"), "a collective")
    if not ours:
        return collective, "?"
    return collective, f"{os.path.basename(ours[-1].filename)}:{ours[-1].lineno} ({ours[-1].name})"

def explain_errors() -> None:
    """From now on, an unfinished exercise of a lab, or a collective whose peer died, ends this
    rank with one line (rank 0's, for an exercise) instead of a traceback per rank. ``prepare``
    calls it; a lab without ``prepare`` (Horovod's) calls it itself."""
    if env_info().world_size > 1:
        sys.excepthook = partial(_explain_lost_peer, fallback=sys.__excepthook__)
