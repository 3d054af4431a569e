"""Every exercise check rejects plausible wrong answers (that it accepts the solution, nbval shows).

For each ``check`` cell of each solution notebook, the exercise it checks is filled in with a
wrong answer that a learner could write, the notebook's cheap cells run in this process, and
the check must raise, and say why: each wrong answer is registered as ``(answer, says)``, and the
check's error must contain ``says``, the part of its message that names this mistake (a crash, a
broken environment or a timeout says something else, and fails the test). An answer is either the
code for the solution region of the nearest exercise cell above the check (a string), or
``Lab(file, hint, code)``: the code for the region of ``solutions/labs/<file>`` whose hint contains
``hint``, for checks that run a lab (the check then runs a copy of the labs with that region
replaced, through $DPCOURSE_LABS). A check cell without a registered wrong answer fails the suite:
add one when you add an exercise.

The positive control: the same path with the solution must pass. For checks whose exercise is a
notebook cell, the harness runs the check on the solution's namespace; for checks that run a lab,
it proves that the copy it makes of the labs, with the solution's own code in the region, is the
labs byte for byte (so a wrong answer's copy differs only in its region), runs the first such check
of each notebook through that copy, and the solution's run of every check is make course's (nbval
compares it).
"""
import importlib.util
import os
import re
import shutil
import tempfile
import textwrap
from pathlib import Path

import matplotlib
import nbformat
import pytest

from answers import Lab
from conftest import ROOT
from dpcourse.kit.course import BEGIN, END
from dpcourse.lab.errors import CourseError

matplotlib.use("Agg")

# (notebook, check name) → {what the learner got wrong: (the code between the solution markers,
# what the check must say)}
WRONG = {
    ("01_minibatch_sgd.ipynb", "exercise 1"): {
        "gradient not cleared": ("p -= lr * p.grad", "the gradient must be cleared"),
        "step uphill": ("p += lr * p.grad\np.grad = None", "got [2.5, -4.0]"),
        "a new tensor, not an in-place update": ("p = p - lr * p.grad\np.grad = None",
            "got [1.0, -2.0]"),
        "lr forgotten": ("p -= p.grad\np.grad = None", "got [-2.0, 2.0]"),
    },
    ("01_minibatch_sgd.ipynb", "exercise 2"): {
        "the batch gradient repeated B times": ("""
            gW, gb = torch.autograd.grad(loss_fn(W, b, X, y), (W, b))
            return gW.expand(len(X), *gW.shape), gb.expand(len(X), *gb.shape)""",
            "are not the gradient of that example's own loss"),
        "each example's gradient times B (a sum for a mean)": ("""
            gW, gb = [], []
            for i in range(len(X)):
                gi = torch.autograd.grad(loss_fn(W, b, X[i:i + 1], y[i:i + 1]), (W, b))
                gW.append(gi[0] * len(X)); gb.append(gi[1] * len(X))
            return torch.stack(gW), torch.stack(gb)""",
            "are not the gradient of that example's own loss"),
        "examples paired with the wrong labels": ("""
            gW, gb = [], []
            for i in range(len(X)):
                gi = torch.autograd.grad(loss_fn(W, b, X[i:i + 1], y.roll(1)[i:i + 1]), (W, b))
                gW.append(gi[0]); gb.append(gi[1])
            return torch.stack(gW), torch.stack(gb)""",
            "are not the gradient of that example's own loss"),
    },
}
WRONG.update({
    ("06_data_sharding.ipynb", "exercise 1"): {
        "contiguous blocks, not every K-th index": ("""
            order = torch.randperm(n, generator=torch.Generator().manual_seed(
                seed + epoch)).tolist() if shuffle else list(range(n))
            if drop_last:
                order = order[:n - n % num_replicas]
            else:
                total = math.ceil(n / num_replicas) * num_replicas
                while len(order) < total:
                    order += order[:total - len(order)]
            per = len(order) // num_replicas
            return order[rank * per:(rank + 1) * per]""",
            "n=12, 3 ranks, rank 0, epoch 0, shuffle=True, drop_last=False: "
            "DistributedSampler gives"),
        "seeded without the epoch": ("""
            order = torch.randperm(n, generator=torch.Generator().manual_seed(
                seed)).tolist() if shuffle else list(range(n))
            if drop_last:
                order = order[:n - n % num_replicas]
            else:
                total = math.ceil(n / num_replicas) * num_replicas
                while len(order) < total:
                    order += order[:total - len(order)]
            return order[rank::num_replicas]""",
            "n=12, 1 rank, rank 0, epoch 1, shuffle=True, drop_last=False: "
            "DistributedSampler gives"),
        "a different shuffle on each rank": ("""
            order = torch.randperm(n, generator=torch.Generator().manual_seed(
                seed + epoch + rank)).tolist() if shuffle else list(range(n))
            if drop_last:
                order = order[:n - n % num_replicas]
            else:
                total = math.ceil(n / num_replicas) * num_replicas
                while len(order) < total:
                    order += order[:total - len(order)]
            return order[rank::num_replicas]""",
            "n=12, 3 ranks, rank 1, epoch 0, shuffle=True, drop_last=False: "
            "DistributedSampler gives"),
        "neither padded nor cut": ("""
            order = torch.randperm(n, generator=torch.Generator().manual_seed(
                seed + epoch)).tolist() if shuffle else list(range(n))
            return order[rank::num_replicas]""", "rank_indices gives [1, 7]"),
        "padded with the last index": ("""
            order = torch.randperm(n, generator=torch.Generator().manual_seed(
                seed + epoch)).tolist() if shuffle else list(range(n))
            if drop_last:
                order = order[:n - n % num_replicas]
            else:
                total = math.ceil(n / num_replicas) * num_replicas
                order += [order[-1]] * (total - len(order))
            return order[rank::num_replicas]""", "rank_indices gives [1, 7, 5]"),
        "padded once only (too short when n < K)": ("""
            order = torch.randperm(n, generator=torch.Generator().manual_seed(
                seed + epoch)).tolist() if shuffle else list(range(n))
            if drop_last:
                order = order[:n - n % num_replicas]
            else:
                total = math.ceil(n / num_replicas) * num_replicas
                order += order[:total - len(order)]
            return order[rank::num_replicas]""",
            "n=2, 5 ranks, rank 4, epoch 0, shuffle=True, drop_last=False: "
            "DistributedSampler gives [0], rank_indices gives []"),
        "drop_last ignored: always padded": ("""
            order = torch.randperm(n, generator=torch.Generator().manual_seed(
                seed + epoch)).tolist() if shuffle else list(range(n))
            total = math.ceil(n / num_replicas) * num_replicas
            while len(order) < total:
                order += order[:total - len(order)]
            return order[rank::num_replicas]""",
            "drop_last=True: DistributedSampler gives [10, 11], rank_indices gives [10, 11, 8]"),
    },
    ("06_data_sharding.ipynb", "exercise 2"): {
        "every rank at once (no guard)": (Lab("io_race.py", "on rank 0 first",
                                              "downloaded = fetch_if_missing(source, dest, args)"),
            "downloaded the file: only rank 0 should"),
        "rank 0 fetches, the others do not wait": (Lab("io_race.py", "on rank 0 first",
            "downloaded = fetch_if_missing(source, dest, args) if dist.get_rank() == 0 else False"),
            "read a missing or half-written file"),
        "a barrier before the fetch, not between": (Lab("io_race.py", "on rank 0 first", """
            dist.barrier()
            downloaded = fetch_if_missing(source, dest, args)"""),
            "downloaded the file: only rank 0 should"),
        "rank 0 fetches, then every rank again without waiting": (Lab(
            "io_race.py", "on rank 0 first", """
            if dist.get_rank() == 0:
                fetch_if_missing(source, dest, args)
            downloaded = fetch_if_missing(source, dest, args)"""),
            "downloaded the file: only rank 0 should"),
    },
})
WRONG.update({
    # Each of these reruns the notebook up to the check (its verdicts come from an earlier cell's
    # run of ddp_by_hand.py --check): one or two here prove the cells' wiring;
    # tests/test_ddp_by_hand.py feeds the lab's --check every other wrong answer (nine of them)
    # directly.
    ("05_one_process_to_ddp.ipynb", "exercise 1"): {
        "summed, never divided by the world size": (Lab(
            "ddp_by_hand.py", "sum p.grad over all ranks",
            "dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)"),
            "NaiveDDP: WRONG — weights differ from one process"),
    },
    ("05_one_process_to_ddp.ipynb", "exercise 2"): {
        "never sent during backward (finish sends it)": (Lab(
            "ddp_by_hand.py", "once no gradient of the bucket", "pass"),
            "had no all-reduce work when backward ended"),
        "waited for at once (no overlap)": (Lab(
            "ddp_by_hand.py", "once no gradient of the bucket",
            "if bucket.waiting == 0:\n"
            "    bucket.work = dist.all_reduce(bucket.buffer, async_op=True)\n"
            "    bucket.work.wait()"),
            "wait() on an all-reduce inside backward"),
    },
    ("05_one_process_to_ddp.ipynb", "exercise 3"): {
        "the model never wrapped": (Lab("fashion_ddp.py", "wrap model in DDP", "pass"),
            "is the model wrapped in DDP?"),
        "set_epoch forgotten": (Lab("fashion_ddp.py", "tell the sampler which epoch", "pass"),
            "does the lab call sampler.set_epoch(epoch) every epoch?"),
        "every rank samples the whole set": (Lab(
            "fashion_ddp.py", "a DistributedSampler over train_set", """
            sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True,
                                         seed=args.seed, drop_last=True)"""),
            "does each rank get 3,000 of the 6,000 images?"),
        "the evaluation's all_reduce forgotten": (Lab(
            "fashion_ddp.py", "sum the three totals", "pass"),
            "sum the totals over all ranks"),
        # rank 0's log is right; the other ranks hold partial sums (found by a learner's trial)
        "the totals reduced to rank 0 only": (Lab(
            "fashion_ddp.py", "sum the three totals", "dist.reduce(totals, dst=0)"),
            "every rank must hold the global sums (dist.all_reduce, not a reduce to rank 0)"),
    },
    ("06_data_sharding.ipynb", "exercise 3"): {
        "the DataLoader shuffles on its own": (Lab(
            "fashion_ddp.py", "a DataLoader over torchvision_fashion_mnist", """
            loader = DataLoader(torchvision_fashion_mnist(args.data_root, train=True),
                                batch_size=batch, shuffle=True, num_workers=args.workers,
                                drop_last=True)"""),
            "give the DataLoader the sampler (sampler=...)"),
        "no sampler, no shuffle": (Lab(
            "fashion_ddp.py", "a DataLoader over torchvision_fashion_mnist", """
            loader = DataLoader(torchvision_fashion_mnist(args.data_root, train=True),
                                batch_size=batch, num_workers=args.workers, drop_last=True)"""),
            "give the DataLoader the sampler (sampler=...)"),
        "the global batch per worker": (Lab(
            "fashion_ddp.py", "a DataLoader over torchvision_fashion_mnist", """
            loader = DataLoader(torchvision_fashion_mnist(args.data_root, train=True),
                                batch_size=args.global_batch_size, sampler=sampler,
                                num_workers=args.workers, drop_last=True)"""),
            "each DataLoader batch must be this rank's share of the global batch"),
    },
})
# More wrong answers live beside this file, one module per notebook: tests/wrong_answers_NN.py,
# each with a dict WRONG of the same shape (so that notebooks can be written side by side).
for _path in sorted(Path(__file__).parent.glob("wrong_answers_*.py")):
    _spec = importlib.util.spec_from_file_location(_path.stem, _path)
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    WRONG.update(_module.WRONG)
SKIP = "check-skip"  # timing, plot and widget cells that no check needs: tagged so in the notebooks


def check_cells(nb):
    """(index of the check cell, its name, index of the exercise cell it checks)."""
    out, exercise = [], None
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if BEGIN in cell.source:
            exercise = i
        if "check" in cell.metadata.get("tags", []):
            name = re.match(r"# CHECK: (exercise \d+)", cell.source).group(1)
            out.append((i, name, exercise))
    return out


def with_answer(source: str, body: str, hint: str = "") -> str:
    """``source`` with the code between the solution markers (the first region whose hint
    contains ``hint``) replaced by ``body``."""
    lines = source.splitlines()
    begin = next(i for i, line in enumerate(lines) if BEGIN in line and hint in line)
    end = next(i for i, line in enumerate(lines) if END in line and i > begin)
    indent = lines[begin][:len(lines[begin]) - len(lines[begin].lstrip())]
    body = textwrap.indent(textwrap.dedent(body).strip("\n"), indent)
    return "\n".join(lines[:begin] + [body] + lines[end + 1:]) + "\n"


# The solution's namespace before the last check run, per notebook: (index of that check,
# namespace). Checks run in notebook order, so the next check of a notebook goes on from there
# instead of running every cell from the top again (a notebook with three exercises ran its first
# cells three times), and a check asked for again (its wrong answers after its positive control,
# on the same worker: one group) starts from that very namespace.
SOLVED: dict[str, tuple[int, dict]] = {}
# The solution's namespace just before an exercise cell, per (notebook, index of the exercise cell):
# a wrong answer written in that cell runs from there (the cell, the cells after it, the check)
# instead of from the notebook's top. Forked for each answer, so that one cannot change the next's.
BEFORE: dict[tuple[str, int], dict] = {}


def _fork(namespace: dict) -> dict:
    """A copy of a notebook's namespace whose data (tensors, models, lists) a cell may change
    without touching the original; modules, functions, classes and what cannot be copied are
    shared."""
    import copy
    import types

    shared = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type)
    forked = {}
    for name, value in namespace.items():
        if name.startswith("__") or isinstance(value, shared):
            forked[name] = value
            continue
        try:
            forked[name] = copy.deepcopy(value)
        except Exception:  # noqa: BLE001 - a process group, a file, a generator: shared, as before
            forked[name] = value
    return forked


def run_check(nb, check, exercise, answer=None, prefix=None, key=None, run_the_check=True):
    """Run the cheap cells up to the check (the exercise with ``answer``);
    the check's error or None.

    A wrong answer in a lab (``Lab``) does not change the notebook's cells: give ``prefix``, the
    namespace those cells left with the solution, and only the check runs again, on the wrong lab
    (which finds the mistake only when the check runs the lab itself). With ``key`` (the solution
    itself), the cells run on from the namespace an earlier check of the same notebook left, when
    there is one. Returns (error or None, the namespace before the check).
    """
    start = 0
    # an earlier check's namespace, or this check's (the positive control's, then its wrong
    # answers': a notebook whose cells launch runs ran them twice)
    if key is not None and answer is None and prefix is None \
            and SOLVED.get(key, (check + 1,))[0] <= check:
        start, prefix = SOLVED[key]
    # from the exercise cell on
    if isinstance(answer, str) and key is not None and (key, exercise) in BEFORE:
        start, prefix = exercise, _fork(BEFORE[(key, exercise)])
    namespace = dict(prefix) if prefix is not None else {"__name__": "__main__"}
    cwd, labs = os.getcwd(), None
    os.chdir(ROOT / "solutions")
    if isinstance(answer, Lab):  # the check runs a lab: give it a copy with the wrong region
        labs = tempfile.mkdtemp(prefix="wrong-labs-")
        # labs, job scripts, bugs/
        shutil.copytree(ROOT / "solutions" / "labs", labs, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
        target = os.path.join(labs, answer.file)
        with open(target) as f:
            text = f.read()
        with open(target, "w") as f:
            f.write(with_answer(text, answer.code, answer.hint))
        os.environ["DPCOURSE_LABS"] = labs
    try:
        for i, cell in enumerate(nb.cells[:check] if prefix is None or start else []):
            if i < start or cell.cell_type != "code" or SKIP in cell.metadata.get("tags", []) \
                    or "check" in cell.metadata.get("tags", []):
                continue
            if i == exercise and answer is None and key is not None:
                BEFORE[(key, exercise)] = _fork(namespace)
            wrong_here = i == exercise and isinstance(answer, str)
            source = with_answer(cell.source, answer) if wrong_here else cell.source
            exec(compile(source, f"cell {i}", "exec"), namespace)
        before = dict(namespace)
        if key is not None and answer is None:
            SOLVED[key] = (check, before)
        if not run_the_check:
            return None, before
        try:
            exec(compile(nb.cells[check].source, f"cell {check}", "exec"), namespace)
        except (Exception, CourseError) as err:  # noqa: BLE001 - any failure (a failed lab run too) rejects
            return err, before
        return None, before
    finally:
        os.chdir(cwd)
        if labs:
            os.environ.pop("DPCOURSE_LABS", None)
            shutil.rmtree(labs, ignore_errors=True)


NOTEBOOKS = sorted((ROOT / "solutions").glob("*.ipynb"))
CHECKS = [(path.name, *c) for path in NOTEBOOKS
          for c in check_cells(nbformat.read(path, as_version=4))]


def test_every_check_has_wrong_answers_registered():
    assert CHECKS, "no check cells found"
    missing = [(nb, name) for nb, _, name, _ in CHECKS if not WRONG.get((nb, name))]
    assert not missing, f"add plausible wrong answers for these checks to WRONG: {missing}"


def test_every_notebook_after_00_has_an_exercise_with_its_check():
    """The course's rule: each notebook after 00 has at least one exercise, and its check cell."""
    checked = {nb for nb, *_ in CHECKS}
    missing = [path.name for path in NOTEBOOKS
               if not path.name.startswith("00_") and path.name not in checked]
    assert len(NOTEBOOKS) >= 14 and not missing, f"notebooks without a check cell: {missing}"


def test_the_solutions_checks_run_under_nbval(request):
    """That each check accepts its solution is nbval's part: it runs every solution notebook, check
    cells included, and fails on any error. So the test below does not run the solution's check
    again (that halved the slowest of them); this makes sure nbval is on."""
    assert request.config.getoption("nbval"), \
        "run the suite with --nbval (pyproject's addopts): it runs the solutions' checks"


def test_every_wrong_answer_says_what_its_check_must_say():
    for (notebook, name), answers in WRONG.items():
        for what, entry in answers.items():
            assert isinstance(entry, tuple) and len(entry) == 2, (
                f"{notebook} {name}, {what}: register (answer, says), "
                "says being what the check must say")
            body, says = entry
            assert isinstance(body, (str, Lab)) and isinstance(says, str) and says.strip(), \
                (notebook, name, what)


def test_a_labs_copy_with_the_solution_in_its_region_is_the_lab():
    """The positive control of the checks that run a lab: the copy of the labs that run_check makes,
    with the solution's own code in the answer's region, is the labs byte for byte."""
    regions = {(body.file, body.hint) for answers in WRONG.values() for body, _ in answers.values()
               if isinstance(body, Lab)}
    assert len(regions) > 10, regions
    for file, hint in sorted(regions):
        text = (ROOT / "solutions" / "labs" / file).read_text()
        lines = text.splitlines()
        begin = next(i for i, line in enumerate(lines) if BEGIN in line and hint in line)
        end = next(i for i, line in enumerate(lines) if END in line and i > begin)
        kept = with_answer(text, _solution_of(file, hint), hint)
        # the markers go, the rest stays: the same file as make student's learners get,
        # less its stub
        assert kept.splitlines() == lines[:begin] + lines[begin + 1:end] + lines[end + 1:], \
            (file, hint)


def _solution_of(file: str, hint: str) -> str:
    """The solution's own code in the region of ``solutions/labs/<file>`` whose hint holds
    ``hint``."""
    lines = (ROOT / "solutions" / "labs" / file).read_text().splitlines()
    begin = next(i for i, line in enumerate(lines) if BEGIN in line and hint in line)
    end = next(i for i, line in enumerate(lines) if END in line and i > begin)
    return "\n".join(lines[begin + 1:end])


# The first check of each notebook that runs a lab: the positive control below runs it
# through the harness.
LAB_CHECKS = {}
for _c in CHECKS:
    _lab = next((body for body, _ in WRONG.get((_c[0], _c[2]), {}).values()
                 if isinstance(body, Lab)), None)
    if _lab is not None and _c[0] not in LAB_CHECKS:
        LAB_CHECKS[_c[0]] = (*_c, _lab)


@pytest.mark.parametrize("notebook, check, name, exercise, wrong", LAB_CHECKS.values(),
                         ids=[f"{c[0][:2]}-{c[2]}" for c in LAB_CHECKS.values()])
def test_the_harness_passes_the_solution_through_a_labs_copy(notebook, check, name, exercise,
                                                             wrong):
    """The positive control of the harness's lab path, once per notebook: a copy of the labs
    ($DPCOURSE_LABS) whose region holds the solution's own code, and the check run in this process
    as a wrong answer's is, accepts it. (Every region's copy is the lab byte for byte: the test
    above; nbval runs every check.)"""
    nb = nbformat.read(ROOT / "solutions" / notebook, as_version=4)
    _, prefix = run_check(nb, check, exercise, key=notebook, run_the_check=False)
    solution = Lab(wrong.file, wrong.hint, _solution_of(wrong.file, wrong.hint))
    err, _ = run_check(nb, check, exercise, solution, prefix=prefix)
    assert err is None, \
        f"{name}: through the harness's copy of the labs, the check rejects the solution: {err!r}"


@pytest.mark.parametrize("notebook, check, name, exercise", CHECKS,
                         ids=[f"{c[0][:2]}-{c[2]}" for c in CHECKS])
def test_check_rejects_wrong_answers(notebook, check, name, exercise, capsys):
    nb = nbformat.read(ROOT / "solutions" / notebook, as_version=4)
    # The cells before the check, with the solution: the namespace a wrong lab's check runs in.
    _, prefix = run_check(nb, check, exercise, key=notebook, run_the_check=False)
    answers = WRONG[(notebook, name)]
    # the exercise is a cell: the check runs here
    if all(isinstance(body, str) for body, _ in answers.values()):
        err, _ = run_check(nb, check, exercise, prefix=_fork(prefix))
        assert err is None, \
            f"{name}: through this harness, the check rejects the solution itself: {err!r}"
    for what, (body, says) in answers.items():
        err = None
        if isinstance(body, Lab):  # most checks run their lab themselves: try the check alone first
            err, _ = run_check(nb, check, exercise, body, prefix=prefix)
        # a string answer (from its exercise cell on), or a lab that an earlier cell runs:
        # the whole way
        if err is None:
            err, _ = run_check(nb, check, exercise, body,
                               key=None if isinstance(body, Lab) else notebook)
        assert isinstance(err, (AssertionError, CourseError)), \
            f"{name}: the check accepts a wrong answer ({what}): {err!r}"
        # A lab run the launcher stopped at its timeout (dpcourse.explore.launch) is not the check's
        # verdict: it would pass here whatever the check does (a slow machine, or a wrong answer
        # that hangs).
        assert "took longer than" not in str(err), \
            f"{name}: a run timed out instead of being checked ({what}): {err}"
        assert says in str(err), \
            f"{name}: rejected ({what}), but not for its reason: {says!r} is not in {str(err)!r}"


def test_with_answer_replaces_only_the_solution_region():
    src = ("def f(x):\n    ### BEGIN SOLUTION (hint: double it)\n    return 2 * x\n"
           "    ### END SOLUTION\n")
    assert with_answer(src, "return x") == "def f(x):\n    return x\n"
