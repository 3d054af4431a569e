"""Every distributed call in the labs carries its mark: the course's rule is that each line that
exists because of distribution says why, in a comment `# DDP: <reason>` (`# ZeRO: …`, `# FSDP: …`,
`# Horovod: …`, `# DCP: …`, `# DiLoCo: …`, `# LINK: …` for an emulated network's, where those
are the reason), on the line itself or on a comment-only line directly above.

The calls are found with tokenize, so strings, docstrings and comments never count:
`dist.<name>…(`, `dcp.<name>…(` and `hvd.<name>…(` (not `dist.ReduceOp.SUM`, not a bare
`hvd.allgather_object` passed as a value), `DDP(`, `DistributedSampler(`, `.set_epoch(`,
`set_device(`, `fully_shard(`, `get_state_dict(`, `set_state_dict(` and `.no_sync(`; import
lines never count. A call inside an f-string's replacement field counts (on every Python: before
3.12 tokenize gives an f-string as one STRING token, so its fields are tokenized here one by one).

Light by design: it reads the labs' text, imports neither torch nor the labs."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABS = sorted((ROOT / "solutions" / "labs").glob("*.py"))

MARK = re.compile(r"#\s*(DDP|ZeRO(?:-\d)?|FSDP|Horovod|DCP|DiLoCo|LINK):\s*\S")
# a mark without its colon and reason
BARE = re.compile(r"#\s*(DDP|ZeRO(?:-\d)?|FSDP|Horovod|DCP|DiLoCo|LINK)(?![-\w])(?!:\s*\S)")
SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
        tokenize.ENCODING, tokenize.ENDMARKER}
MODULES = {"dist", "dcp", "hvd"}  # dist.<name>…(, dcp.<name>…( and hvd.<name>…(
CALLED = {"DDP", "DistributedSampler", "set_device", "fully_shard", "get_state_dict",
          "set_state_dict"}  # NAME(
METHODS = {"set_epoch", "no_sync"}  # .NAME(
# Calls the patterns catch that distribution does not explain, each with why (lab: its code, as it
# begins).
NOT_DISTRIBUTED = {
    # the ImageNet dataset's own set_epoch: new random crops each epoch, as in one process (the
    # sampler's is marked)
    "imagenet_ddp.py": ["self.train_set.set_epoch(epoch)"],
}


def _is_fstring(tok: tokenize.TokenInfo) -> bool:
    return tok.type == tokenize.STRING and "f" in re.match(r"[A-Za-z]*", tok.string).group().lower()


def _fields(fstring: str) -> list[str]:
    """The source of each replacement field of an f-string literal (Python < 3.12 tokenizes it
    whole)."""
    return [ast.unparse(node.value) for node in ast.walk(ast.parse(fstring, mode="eval"))
            if isinstance(node, ast.FormattedValue)]


def _has_call(toks: list[tokenize.TokenInfo]) -> list[tokenize.TokenInfo]:
    """The tokens (of one logical line, comments and line breaks left out) where a distributed call
    starts."""
    found = []
    for i, tok in enumerate(toks):
        if _is_fstring(tok):
            for field in _fields(tok.string):
                inner = [t for t in tokenize.generate_tokens(io.StringIO(field).readline)
                         if t.type not in SKIP]
                if _has_call(inner):
                    found.append(tok)
            continue
        if tok.type != tokenize.NAME:
            continue
        prev = toks[i - 1].string if i else ""
        nxt = toks[i + 1].string if i + 1 < len(toks) else ""
        if prev in ("def", "class"):
            continue
        if tok.string in MODULES:
            j = i + 1
            while j + 1 < len(toks) and toks[j].string == "." and toks[j + 1].type == tokenize.NAME:
                j += 2
            if j > i + 1 and j < len(toks) and toks[j].string == "(":
                found.append(tok)
        elif (tok.string in CALLED or (tok.string in METHODS and prev == ".")) and nxt == "(":
            found.append(tok)
    return found


def unmarked_calls(source: str) -> list[tuple[int, str]]:
    """(line, code) of every distributed call whose statement has no mark: none on any of its
    lines, and none on a comment-only line directly above its first line."""
    lines = source.splitlines()
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    marks = {tok.start[0] for tok in tokens
             if tok.type == tokenize.COMMENT and MARK.search(tok.string)}
    mark_only = {row for row in marks if lines[row - 1].lstrip().startswith("#")}
    found, statement = {}, []
    for tok in tokens:
        if tok.type == tokenize.NEWLINE or tok.type == tokenize.ENDMARKER:
            if statement and statement[0].string not in ("import", "from"):
                first, last = statement[0].start[0], tok.start[0]
                if not (marks & set(range(first, last + 1)) or first - 1 in mark_only):
                    for call in _has_call(statement):
                        found[call.start[0]] = lines[call.start[0] - 1].strip()
            statement = []
        elif tok.type not in SKIP:
            statement.append(tok)
    return sorted(found.items())


def bare_marks(source: str) -> list[tuple[int, str]]:
    """(line, code) of every comment holding a mark without its colon and reason (`# DDP`)."""
    lines = source.splitlines()
    return sorted({tok.start[0]: lines[tok.start[0] - 1].strip()
                   for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                   if tok.type == tokenize.COMMENT and BARE.search(tok.string)}.items())


def _offences(check, excused=lambda lab, code: False) -> list[str]:
    assert LABS, "no solutions/labs/*.py found"
    return [f"{lab.relative_to(ROOT)}:{line}: {code}"
            for lab in LABS for line, code in check(lab.read_text())
            if not excused(lab.name, code)]


def _not_distributed(lab: str, code: str) -> bool:
    return code.startswith(tuple(NOT_DISTRIBUTED.get(lab, ())))


def test_every_distributed_call_is_marked_with_its_reason():
    offences = _offences(unmarked_calls, excused=_not_distributed)
    assert not offences, ("these distributed calls carry no `# DDP: <reason>` (`# FSDP:`, "
                          "`# Horovod:`, `# DCP:`) mark, on their line or a comment-only line "
                          "directly above:\n" + "\n".join(offences))


def test_the_exceptions_are_still_there():
    """Each NOT_DISTRIBUTED call still stands, unmarked, in its lab: a stale entry would excuse a
    new call."""
    for lab, calls in NOT_DISTRIBUTED.items():
        found = [code for _, code in
                 unmarked_calls((ROOT / "solutions" / "labs" / lab).read_text())]
        for call in calls:
            assert any(code.startswith(call) for code in found), \
                f"solutions/labs/{lab}: no unmarked {call} any more"


def test_no_mark_lacks_its_reason():
    offences = _offences(bare_marks)
    assert not offences, ("these comments hold a bare mark: write `# DDP: <reason>` "
                          "(`# FSDP:`, `# Horovod:`, `# DCP:`):\n" + "\n".join(offences))


SAMPLE = '''\
"""A docstring that names dist.all_reduce(x) without calling it."""
import torch.distributed as dist
from torch.distributed import all_reduce


def step(x, hvd):
    dist.all_reduce(x)
    dist.all_reduce(x)  # DDP: the sum of every rank's x
    # DDP: the largest x on every rank
    dist.all_reduce(x,
                    op=dist.ReduceOp.MAX)
    call(x, op=dist.ReduceOp.SUM, group=dist.group.WORLD, gather=hvd.allgather_object)
    print("dist.barrier()")  # dist.barrier()
'''


def test_the_checker_reports_exactly_the_unmarked_call():
    assert unmarked_calls(SAMPLE) == [(7, "dist.all_reduce(x)")]


def test_the_checker_finds_every_kind_of_call():
    calls = ["dist.barrier()", "hvd.allreduce(x, name='n')", "DDP(model)",
             "DistributedSampler(data)", "sampler.set_epoch(epoch)",
             "torch.cuda.set_device(device)", "fully_shard(layer)", "model.no_sync()",
             "f'{dist.get_rank()}'", "gather(x, gather=hvd.allgather_object(x))",
             "dcp.save(state, checkpoint_id=path)", "get_state_dict(model, opt)",
             "set_state_dict(model, opt, model_state_dict=m, optim_state_dict=o)"]
    assert [line for line, _ in unmarked_calls("\n".join(calls) + "\n")] == \
        list(range(1, len(calls) + 1))
    assert unmarked_calls("def set_device(d):\n    pass\n"
                          "class DDP(Base):\n    pass\nf'{rank}'\n") == []


def test_the_checker_reports_exactly_the_bare_marks():
    source = ("a = 1  # DDP\nb = 2  # DDP: a reason\n# FSDP:\nc = 3  # Horovod: a reason  # FSDP\n"
              "d = 4  # DCP\ne = 5  # DCP: a reason\n")
    assert [line for line, _ in bare_marks(source)] == [1, 3, 4, 5]
