"""One skeleton for the labs, kept aligned (issue 27, item 3): every lab's ``setup()`` and
``cleanup()`` are the course's own, line for line, or the lab is named below with the reason it
differs; a lab without them is named too. A reason that no longer holds (the lab has come back to
the skeleton, or left the course) fails as well, so the list cannot go stale. Reads the labs' text
(ast): no lab is imported or run."""
import argparse
import ast

import pytest

from conftest import ROOT
from dpcourse.lab import options

LABS = sorted((ROOT / "solutions" / "labs").glob("*.py"))

# The skeleton, as solutions/labs/hello.py has it (docstrings and comments aside).
SETUP = """env = world.prepare(backend=args.backend, device=args.device)
if env.device.type == 'cuda':
    torch.cuda.set_device(env.device)
dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size, \
timeout=timedelta(seconds=args.timeout))
return env"""
CLEANUP = "dist.destroy_process_group()"

# lab: why its setup() differs from the skeleton's
SETUP_DIFFERS = {
    "collectives_tour.py": "gloo's collectives run on CPU tensors even where GPUs are: device cpu "
                           "with --backend gloo",
    "probe_collectives.py": "the same: device cpu with --backend gloo, a GPU only for NCCL",
    "comm_patterns.py": "the same: device cpu with --backend gloo, a GPU only for NCCL",
    "compose_allreduce.py": "the same: device cpu with --backend gloo, a GPU only for NCCL",
    "fashion_ddp.py": "a training lab: the skeleton, then the roll call of each rank's GPU "
                      "(gpu_roll_call)",
    "fashion_single.py": "the one-process twin of fashion_ddp.py: no process group, setup() "
                         "only picks the device",
    "imagenet_ddp.py": "a training lab: the skeleton, then the roll call of each rank's GPU "
                       "(gpu_roll_call)",
    "fashion_horovod.py": "Horovod's own set-up: hvd.init() instead of a process group, its fusion "
                          "threshold first",
    "hang.py": "its runs end at a short --timeout (a hang, shown): the group is joined with a "
               "minute for a late rank to arrive, then dist.set_timeout sets --timeout",
    "uneven_inputs.py": "the same: a short --timeout for its hang, a minute to arrive first",
    "io_race.py": "a race for files: gloo on the CPU whatever the machine has, no options for "
                  "either",
}
# lab: why its cleanup() differs
CLEANUP_DIFFERS = {
    "fsdp_fashion.py": "a barrier first: no rank leaves while FSDP's background collectives of "
                       "another still run",
}
# lab: why it has no setup() and cleanup() of its own
WITHOUT = {
    "ddp_tour.py": "a tour of process groups: it joins and leaves groups itself, several times, to "
                   "show how",
    "sweep.py": "runs fashion_study.main once per configuration, in one launch: that lab's "
                "set-up",
    "fashion_study.py": "imports fashion_ddp.py's setup() and cleanup(): notebooks 07-08's "
                        "instruments on top of the lesson, not a second copy of it",
    "fashion_elastic.py": "imports fashion_ddp.py's setup() and cleanup(): notebook 14's "
                          "checkpoints on top of the lesson, not a second copy of it",
    "fashion_single.py": "(cleanup only) one process: no group to leave",
    "fashion_horovod.py": "(cleanup only) hvd.shutdown() in main, after the last collective",
}


def _body(path, name):
    """The function's statements as ast.unparse writes them (its docstring left out), or None."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            body = [s for s in node.body
                    if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            return ast.unparse(ast.Module(body=body, type_ignores=[]))
    return None


def test_the_skeleton_is_the_course_s_own():
    """hello.py, the first lab a learner reads, is the skeleton itself."""
    hello = ROOT / "solutions" / "labs" / "hello.py"
    assert (_body(hello, "setup"), _body(hello, "cleanup")) == (SETUP, CLEANUP)


@pytest.mark.parametrize("name, skeleton, differs", [("setup", SETUP, SETUP_DIFFERS),
                                                     ("cleanup", CLEANUP, CLEANUP_DIFFERS)])
def test_every_lab_keeps_the_skeleton_or_says_why_not(name, skeleton, differs):
    wrong, stale, missing = [], [], []
    for path in LABS:
        body = _body(path, name)
        if body is None:
            if path.name not in WITHOUT:
                missing.append(path.name)
        elif body != skeleton and path.name not in differs:
            wrong.append(f"{path.name}:\n{body}")
        elif body == skeleton and path.name in differs:
            stale.append(path.name)
    gone = sorted(set(differs) - {p.name for p in LABS})
    assert not wrong, (f"{name}() differs from the skeleton's in these labs; align it, or say why "
                       f"in the test:\n" + "\n\n".join(wrong))
    assert not missing, f"labs without a {name}(): add one, or say why in WITHOUT: {missing}"
    assert not stale and not gone, \
        f"reasons that no longer hold: back to the skeleton {stale}, no such lab {gone}"


def test_every_lab_without_the_skeleton_still_lacks_it():
    """A lab named in WITHOUT that has the functions now should leave the list."""
    has = {path.name for path in LABS
           if _body(path, "setup") is not None and _body(path, "cleanup") is not None}
    assert not has & set(WITHOUT), \
        f"these labs have setup() and cleanup() now: {sorted(has & set(WITHOUT))}"
    assert set(WITHOUT) <= {p.name for p in LABS}, sorted(set(WITHOUT) - {p.name for p in LABS})


# ---------------------------------------------------------------- the training labs' shared options
TRAINING = ("fashion_ddp.py", "fashion_study.py", "fashion_horovod.py", "imagenet_ddp.py")
# option: why the training labs that have it may give it other defaults (choices must still agree)
RECIPE_DEFAULTS = {
    "--epochs": "each data set's recipe: FashionMNIST's few epochs, ImageNet's 90 (Goyal et al.)",
    "--global-batch-size": "each recipe's reference batch: 128 here, Goyal et al.'s 256 for "
                           "ImageNet",
    "--lr": "the rate of each recipe's reference batch",
    "--lr-scaling": "notebook 08 starts from none (its exercise is the rule); ImageNet's recipe is "
                    "linear",
    "--warmup-epochs": "Goyal et al.'s 5 of 90 epochs for ImageNet; a fraction of an epoch for "
                       "FashionMNIST",
    "--weight-decay": "each recipe's: Goyal et al.'s 1e-4 for ImageNet",
    "--workers": "JPEG decoding needs more workers per rank than FashionMNIST's torchvision loader",
    "--log-every": "an ImageNet step takes far longer: a record every 20 steps, not 50",
    "--timeout": "ImageNet's first collectives wait for node-local staging and larger steps: "
                 "120 s, not 60",
}
# option: why the labs that have it may take other choices (or a flag in one, a choice in another)
OTHER_CHOICES = {
    "--amp": "FashionMNIST's labs: bfloat16 autocast on or off (a flag); ImageNet's recipe picks "
             "the precision per GPU, fp16 with loss scaling (a choice)",
}


def lab_parser(path) -> argparse.ArgumentParser:
    """The lab's own parser: its parse_args() is taken from its text (ast) and run against
    dpcourse.lab.options, so that the Horovod lab needs no Horovod. The options dpcourse.lab.options
    adds count as the lab's."""
    tree = ast.parse(path.read_text())
    namespace = {"argparse": argparse, "__doc__": "a lab", **vars(options), "options": options,
                 "REFERENCE_BATCH": None}
    for node in tree.body:
        if (isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == ["REFERENCE_BATCH"]):
            namespace["REFERENCE_BATCH"] = ast.literal_eval(node.value)
        if isinstance(node, ast.FunctionDef) and node.name == "parse_args":
            exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
    parser = argparse.ArgumentParser()
    namespace["argparse"] = _Capture(parser)
    namespace["parse_args"]([])
    return parser


def _options(path):
    """{--option: {"default": ..., "choices": ..., "action": ..., "type": ...}} of the lab's
    parser."""
    out = {}
    for action in lab_parser(path)._actions:
        if (action.option_strings and action.option_strings[0].startswith("--")
                and action.dest != "help"):
            out[action.option_strings[0]] = {"default": action.default, "choices": action.choices,
                                             "action": type(action).__name__,
                                             "type": getattr(action.type, "__name__", None)}
    return out


class _Capture:
    """argparse, except that ArgumentParser() gives the one parser the test inspects."""

    def __init__(self, parser):
        self.parser = parser

    def __getattr__(self, name):
        return getattr(argparse, name)

    def ArgumentParser(self, *args, **kwargs):  # argparse's name
        return self.parser


def test_the_training_labs_share_their_options_names_choices_and_defaults():
    """An option two training labs share has the same kind (flag or value), choices and default in
    both, unless it is named above with its reason; a reason for an option they no longer share
    fails."""
    options = {name: _options(ROOT / "solutions" / "labs" / name) for name in TRAINING}
    assert all(len(o) > 20 for o in options.values()), {name: len(o) for name, o in options.items()}
    drift, shared = [], set()
    for option in sorted(set().union(*options.values())):
        having = {name: o[option] for name, o in options.items() if option in o}
        if len(having) < 2:
            continue
        shared.add(option)
        for key in ("action", "type", "choices", "default"):
            values = {name: spec.get(key) for name, spec in having.items()}
            if len({repr(v) for v in values.values()}) > 1:
                exempt = option in OTHER_CHOICES or (key == "default" and option in RECIPE_DEFAULTS)
                if not exempt:
                    drift.append(f"{option} {key}: {values}")
    assert not drift, "the training labs' shared options have drifted apart:\n" + "\n".join(drift)
    assert shared > {"--backend", "--device", "--timeout", "--seed", "--lr-scaling"}, sorted(shared)
    stale = sorted((set(RECIPE_DEFAULTS) | set(OTHER_CHOICES)) - shared)
    assert not stale, f"reasons for options the training labs no longer share: {stale}"


# ------------------------------------------------------------ the training labs read in one sitting
# Issue 27, item 1: main() at most 80 lines, no other function over 60, the file at most 350 lines.
MAIN_LINES, FUNCTION_LINES, FILE_LINES = 80, 60, 350
# The lessons that stay in each training lab, as calls (tokens of code, strings and comments aside).
# The agreement on when to stop is the lab's own collective, every step (issue 44): each rank's
# votes, all-reduced with MAX in the lab, read back by the library.
LESSONS = {
    "fashion_ddp.py": ("dist.init_process_group(", "torch.cuda.set_device(", "DDP(",
                       "DistributedSampler(", ".set_epoch(", "dist.all_reduce(",
                       "dist.destroy_process_group(", "rank == 0",
                       "dist.all_reduce(votes, op=dist.ReduceOp.MAX)"),
    # notebooks 07-08 on top of the lesson: the wrap with its buckets, micro-batches, the hooks
    "fashion_study.py": ("DDP(", "bucket_cap_mb=", ".no_sync(", "register_comm_hook(",
                         "average_parameters(", "rank == 0"),
    "imagenet_ddp.py": ("dist.init_process_group(", "torch.cuda.set_device(", "DDP(",
                        "DistributedSampler(", ".set_epoch(", "dist.all_reduce(",
                        "dist.destroy_process_group(", "rank == 0",
                        "dist.all_reduce(votes, op=dist.ReduceOp.MAX)"),
    "fashion_horovod.py": ("hvd.init(", "torch.cuda.set_device(", "hvd.DistributedOptimizer(",
                           "DistributedSampler(", ".set_epoch(", "hvd.allreduce(",
                           "hvd.broadcast_parameters(",
                           "hvd.broadcast_optimizer_state(", "hvd.shutdown(", "rank == 0",
                           "largest(votes"),
}


def _code(path):
    """The lab's code, its comments and strings left out (tokenize)."""
    import io
    import tokenize

    kept = [tok.string for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
            if tok.type not in (tokenize.COMMENT, tokenize.STRING, tokenize.NL, tokenize.NEWLINE,
                                tokenize.INDENT, tokenize.DEDENT)]
    return " ".join(kept).replace(" . ", ".").replace(" (", "(").replace(". ", ".")


@pytest.mark.parametrize("name", TRAINING)
def test_the_training_labs_read_in_one_sitting(name):
    path = ROOT / "solutions" / "labs" / name
    text = path.read_text()
    assert len(text.splitlines()) <= FILE_LINES, \
        f"{name}: {len(text.splitlines())} lines, more than {FILE_LINES}"
    long = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.FunctionDef)}
    assert long.get("main", 0) <= MAIN_LINES, \
        f"{name}: main() is {long['main']} lines, more than {MAIN_LINES}"
    over = {f: n for f, n in long.items() if f != "main" and n > FUNCTION_LINES}
    assert not over, f"{name}: functions over {FUNCTION_LINES} lines: {over}"


@pytest.mark.parametrize("name", TRAINING)
def test_the_lessons_stay_in_the_training_labs(name):
    """What a learner comes to read is a call in the lab itself, not in dpcourse (the marks test
    holds each one to its `# DDP:` / `# Horovod:` reason)."""
    code = _code(ROOT / "solutions" / "labs" / name)
    missing = [call for call in LESSONS[name] if call.replace(" ", "") not in code.replace(" ", "")]
    assert not missing, f"{name} no longer makes these calls itself: {missing}"
