"""Every figure a notebook measures comes from its run (issue 26, "Numbers typed by hand").

A number that a notebook measures (a time, a share, a ratio, a size, a throughput, an accuracy) is
printed by a code cell, or rendered into Markdown from the value by one
(`display(Markdown(f"… {ratio:.0f}× …"))`): it cannot go stale, and a learner who runs the notebook
reads their own. Only published figures are typed, and their sentence cites them the way the
course does: an author and a year ("Goyal et al., 2017", "McCandlish et al. (2018"), the Horovod
scaling study by its author ("P. Orlob"), or a link.

The scanner reads the Markdown cells of every solutions/*.ipynb and README.md (its prose, and the
comments in its code blocks), leaves out code spans and LaTeX, and finds numbers next to a
measured quantity's unit (s, ms, min, %, ×, -fold, KB/MiB/GB, steps, epochs, images/s, …), ratios
in words ("ten times as many"), approximations in words ("about a millisecond", "about a tenth"),
and numbers after accuracy, efficiency, speedup or throughput. Each one must be cited in its
sentence, or be in ALLOWED with the reason it may be typed: a setting of the run (with the text
that sets it), a definition, arithmetic from a design count, or a published figure. A figure of
another notebook still typed by hand is listed as "TODO issue 26: measured, typed by hand".
No notebook is executed: this runs in well under a second.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from fnmatch import fnmatch

from conftest import ROOT

# ---------------------------------------------------------------- the scanner

_NUM = r"\d[\d,]*(?:\.\d+)?"
NUMBER = rf"(?<![\w.,/^])(?<![−+=·/]\s){_NUM}(?:\s?[–-]\s?{_NUM})?"
# "a bigger/smaller/… quantity than": what makes "N times" or "ten times" a ratio, not a count
COMPARATIVE = (r"(?:as|more|less|fewer|faster|slower|larger|smaller|longer|shorter|bigger|higher|"
               r"lower|the|this|that|its|their|a|an)\b")
UNIT = "|".join((
    r"(?:images?|img|samples?|tokens?)/s\b", r"(?:images?|samples?|tokens?) (?:per|a) second\b",
    r"(?:[KMGT]i?B|[GMT]b(?:it)?)/s\b", r"[GTP]?FLOP/?s\b", r"[GTP]?FLOPS\b",
    r"[KMGTP]i?B\b", r"kB\b", r"bytes?\b",
    r"µs\b", r"us\b", r"ns\b", r"ms\b", r"s\b", r"secs?\b", r"seconds?\b",
    r"min\b", r"mins\b", r"minutes?\b", r"h\b", r"hrs?\b", r"hours?\b", r"days?\b",
    r"%", r"per ?cent\b", r"×(?!\s?[\d(])", r"x\b(?!\s?[\d(])", r"fold\b",
    rf"times(?= {COMPARATIVE})",
    r"steps?\b", r"epochs?\b", r"iterations?\b",
))
DIGITS = re.compile(rf"(?P<figure>{NUMBER})(?:[ \u00a0\u202f-]?(?=[%×x]|[KMGTP]i?B|kB)"
                    rf"|[ \u00a0\u202f-])(?:{UNIT})")
WORD_NUMBER = (r"(?:two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|fifteen|twenty|"
               r"thirty|forty|fifty|a hundred|a thousand|hundreds of|thousands of|twice|half)")
IN_WORDS = re.compile(rf"\b{WORD_NUMBER}[ -]times(?= {COMPARATIVE})|\b{WORD_NUMBER}-fold\b"
                      rf"|\b(?:twice|half) as (?:many|much|fast|long|large|slow|far)\b", re.I)
APPROXIMATE = re.compile(r"\b(?:about|around|roughly|nearly|almost|approximately|some)\s+"
                         r"(?:a|an|one|half an?|a few)\s+(?:tenth|third|quarter|fifth|half|"
                         r"(?:micro|milli|nano)?seconds?|minutes?|hours?|days?)\b", re.I)
QUANTITY = re.compile(rf"\b(?:accuracy|accuracies|efficiency|efficiencies|speedup|speed-up|"
                      rf"throughput|overhead)"
                      rf"(?:\s+(?:of|at|near|about|around|is|was|were|to|reached|reaches|above|below|only|just|"
                      rf"over|under|from|by))*\s+(?P<figure>(?>{NUMBER}))", re.I)
PATTERNS = (DIGITS, IN_WORDS, APPROXIMATE, QUANTITY)

# How the course cites: an author and a year ("Goyal et al., 2017", "Hoffer et al. (2017",
# "Krizhevsky, 2014", "You, Gitman and Ginsburg, 2017"), the Horovod scaling study by its author,
# or a link.
# Once a cell has cited an author with a year, "Goyal et al." alone cites them in its other
# sentences; a table row cites with its author ("X et al.") in one column and its year in another.
_AUTHOR = r"[A-Z][\w'’-]+"
_YEAR = r"\b(?:19|20)\d\d[a-z]?\b"
CITATION = re.compile(rf"\b{_AUTHOR}(?: et al\.?| and {_AUTHOR}| & {_AUTHOR})?,?\s\(?{_YEAR}|\bP\. Orlob\b|https?://")
AUTHOR_WITH_YEAR = re.compile(rf"\b({_AUTHOR})(?: et al\.?| and {_AUTHOR}| & {_AUTHOR})?"
                              rf",?\s\(?{_YEAR}")
ET_AL = re.compile(rf"\b({_AUTHOR}) et al\.")


def cited_authors(sentences: list[str]) -> set[str]:
    """The authors a text cites with a year somewhere: in a sentence, or in a table row that has a
    year."""
    names = {m.group(1) for s in sentences for m in AUTHOR_WITH_YEAR.finditer(s)}
    names |= {m.group(1) for s in sentences if s.startswith("|") and re.search(_YEAR, s)
              for m in ET_AL.finditer(s)}
    return names


def cites(sentence: str, authors: set[str]) -> bool:
    return (bool(CITATION.search(sentence))
            or any(m.group(1) in authors for m in ET_AL.finditer(sentence)))


# Where a sentence does not end: after an initial, "et al.", "e.g.", "i.e.", "vs.", "cf.", "Fig.",
# "no."
_NOT_AN_END = re.compile(r"(?:\b[A-Z]|\bal|\be\.g|\bi\.e|\bvs|\bcf|\bFig|\bno|\bapprox|\bSec)\.$")


@dataclass(frozen=True)
class Finding:
    where: str     # README.md, or solutions/NN_name.ipynb cell N
    file: str      # the file, relative to the course folder
    sentence: str  # the sentence, as the scanner reads it (code spans out, whitespace collapsed)
    start: int     # the figure's span in the sentence
    end: int

    @property
    def figure(self) -> str:
        return self.sentence[self.start:self.end]

    def __str__(self):
        return f"{self.where}: «{self.figure}» in: {self.sentence}"


def readable(markdown: str) -> str:
    """The prose a learner reads: code spans, LaTeX and HTML comments out; of a code block, its
    comments."""
    def comments(block: re.Match) -> str:
        found = re.findall(r"(?:^|\s)#\s+(.+)$", block.group(1), re.M)
        return "\n\n" + "\n\n".join(found) + "\n\n"

    text = re.sub(r"<!--.*?-->", " ", markdown, flags=re.S)
    text = re.sub(r"^\s*```[^\n]*\n(.*?)^\s*```[^\n]*$", comments, text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", " … ", text)
    text = re.sub(r"\$[^$\n]+\$", " … ", text)
    return text


def sentences(markdown: str) -> list[str]:
    """The sentences of a Markdown text: paragraphs, headings, list items and table rows split
    first."""
    out = []
    text = readable(markdown)
    blocks = re.split(r"\n\s*\n|\n(?=\s*(?:#|\||[*+-]\s|\d+\.\s))", text)
    for block in blocks:
        block = re.sub(r"\*\*|(?<!\w)\*|\*(?!\w)", "", " ".join(block.split()))
        block = re.sub(r"^(?:#+|[*+-]|\d+\.)\s+", "", block)
        if not block:
            continue
        current = ""
        for piece in re.split(r"(?<=[.!?])\s+(?=[A-Z(“\"*])", block):
            current = f"{current} {piece}".strip()
            if not _NOT_AN_END.search(current):
                out.append(current)
                current = ""
        if current:
            out.append(current)
    return out


def scan(markdown: str, where: str = "", file: str = "") -> list[Finding]:
    """The figures next to a measured quantity that their sentence does not cite."""
    found = []
    said = sentences(markdown)
    authors = cited_authors(said)
    for sentence in said:
        if cites(sentence, authors):
            continue
        spans = sorted((m.start(), m.end()) for pattern in PATTERNS
                       for m in pattern.finditer(sentence))
        merged = []  # a figure that two patterns found ("accuracy of 90", "90 %"), once
        for start, end in spans:
            if merged and start < merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((start, end))
        found += [Finding(where, file, sentence, start, end) for start, end in merged]
    return found


def course_texts() -> list[tuple[str, str, str]]:
    """(where, file, Markdown) for every Markdown cell of solutions/*.ipynb, and README.md."""
    texts = []
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        rel = path.relative_to(ROOT).as_posix()
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "markdown":
                source = (cell["source"] if isinstance(cell["source"], str)
                          else "".join(cell["source"]))
                texts.append((f"{rel} cell {i}", rel, source))
    texts.append(("README.md", "README.md", (ROOT / "README.md").read_text()))
    return texts


def source(path) -> str:
    """A file's text; of a notebook, its cells' sources."""
    if path.suffix != ".ipynb":
        return path.read_text()
    cells = json.loads(path.read_text())["cells"]
    return "\n".join(c["source"] if isinstance(c["source"], str) else "".join(c["source"])
                     for c in cells)


def findings() -> list[Finding]:
    return [f for where, file, text in course_texts() for f in scan(text, where, file)]


# ---------------------------------------------------------------- what may be typed, and why


@dataclass(frozen=True)
class Allow:
    files: str       # a glob, relative to the course folder
    texts: tuple     # the words around each figure, as the sentence has them (a regex after "re:")
    why: str
    # (file, text): where the setting or count is defined, checked
    evidence: tuple[str, str] | None = None

    def covering(self, f: Finding) -> str | None:
        """The text of this entry that covers the finding, if one does."""
        if not fnmatch(f.file, self.files):
            return None
        for text in self.texts:
            pattern = text[3:] if text.startswith("re:") else re.escape(text)
            if any(m.start() <= f.start and f.end <= m.end()
                   for m in re.finditer(pattern, f.sentence)):
                return text
        return None


def allow(files: str, texts, why: str, evidence: tuple[str, str] | None = None) -> Allow:
    return Allow(files, (texts,) if isinstance(texts, str) else tuple(texts), why, evidence)


TODO = "TODO issue 26: measured, typed by hand"
SETTING = "a setting of the run, not a measurement"
STUDY_08 = "results/08_large_batches/study.py"
OPTIONS = "src/dpcourse/lab/options.py"  # the training labs' shared options and their defaults

ALLOWED = [
    # --- every notebook
    allow("solutions/*.ipynb", r"re:^What you will do \(≈ \d+ min\)",
          "the planned length of the session, as docs/instructor.md schedules it: a design figure"),

    # --- README.md
    allow("README.md", ("about 5.9 GiB", "3.1 GiB"), "measured with du on .venv after make setup "
          "(pinned CUDA wheels, without Horovod), as the README says: a README runs no code"),
    allow("README.md", "add up to 19 minutes", "measured: the sum of the study's logs' elapsed_s, "
          "checked against results/08_large_batches/*.jsonl by "
          "test_the_readme_gives_the_08_study_time_its_logs_give"),
    allow("README.md", "(60 s at most", SETTING + ": the roll call's timeout",
          ("src/dpcourse/lab/world.py", '"DPCOURSE_RDZV_TIMEOUT_S", 60')),
    allow("README.md", "(256 MiB,", SETTING + ": what gpucheck all-reduces",
          ("src/dpcourse/cluster/gpucheck.py", "256 MiB")),
    allow("README.md", "time to 90 % test accuracy", SETTING + ": the target gpucheck times",
          ("src/dpcourse/cluster/gpucheck.py", "target = 0.90")),

    # --- notebooks 07, 08, 11: settings, definitions, arithmetic
    allow("solutions/0[78]_*.ipynb", "82 KB", "the course CNN's gradient, 20,538 float32 = 82,152 "
          "bytes: a fact of dpcourse.lab.models.FashionCNN, counted in every log of the lab",
          ("results/08_large_batches/batch-128.jsonl", '"comm_bytes": 82152')),
    allow("solutions/07_*.ipynb", "1 MiB",
          "torch's default first bucket (_DEFAULT_FIRST_BUCKET_BYTES): a definition"),
    allow("solutions/07_*.ipynb", "efficiency above 1", "the ideal efficiency, 1: a definition"),
    allow("solutions/07_*.ipynb", "4 GB of each", "arithmetic: 10⁹ float32 parameters × 4 bytes"),
    allow("solutions/07_*.ipynb", "35 steps", SETTING + ": STUDY_ARGS",
          ("solutions/07_scaling_study.ipynb", '"--max-steps", 35')),
    allow("solutions/07_*.ipynb", "300 steps",
          SETTING + ": the full study's command, in the same cell",
          ("solutions/07_scaling_study.ipynb", "--max-steps 300")),
    allow("solutions/08_*.ipynb", "2 epochs", SETTING + ": the study's --epochs",
          (STUDY_08, '"--epochs", "2"')),
    allow("solutions/08_*.ipynb", "2 seconds", SETTING + ": BUDGET_S",
          ("solutions/08_large_batches.ipynb", "BUDGET_S = 2")),
    allow("solutions/08_*.ipynb", "0.75 epochs", "the lab's default --warmup-epochs",
          (OPTIONS, '"warmup_epochs": 0.75')),
    allow("solutions/08_*.ipynb", "first 10 steps", "the lab's default --powersgd-start",
          (OPTIONS, '"--powersgd-start", type=int, default=10')),
    allow("solutions/08_*.ipynb", "4× ", "arithmetic: one all-reduce per 4 micro-batches",
          (STUDY_08, '"--accumulate", "4"')),
    allow("solutions/08_*.ipynb", "grow 8-fold",
          "arithmetic: the linear rule's factor at a global batch of 1,024 (1,024 / 128)"),
    allow("solutions/11_*.ipynb", "10 steps per epoch",
          SETTING + ": the check's N, G = 6000, 600 and --epochs 2",
          ("solutions/11_horovod.ipynb", "N, G = 6000, 600")),
    allow("solutions/11_*.ipynb", "240 steps", SETTING,
          ("solutions/11_horovod.ipynb", '"--max-steps", 240')),
    allow("solutions/11_*.ipynb", "600 steps", SETTING + ": the study's runs",
          ("results/11_horovod/study.py", '"--max-steps", "600"')),
    allow("solutions/11_*.ipynb", "0.5 %", "the tolerance of the lab's tests: a definition",
          ("tests/test_horovod.py", "<= 0.005")),
    allow("solutions/11_*.ipynb", ("(128 MB)", "1 ms"), "Horovod's documented defaults "
          "(horovodrun --help: --fusion-threshold-mb 128, --cycle-time-ms 1): definitions"),

    # --- the other notebooks, as they stand (not edited here)
    allow("solutions/01_*.ipynb", "same 1.5 s", SETTING + ": sweep_point's seconds"),
    allow("solutions/02_*.ipynb", "100 %", "by construction: the same seed draws the same masks on "
          "every rank (the lab's table below prints the agreement it measured)"),
    allow("solutions/02_*.ipynb", "4 times as long", "arithmetic: K = 4 summed gradients are 4 × "
          "their mean; the cell above asserts the ratio",
          ("solutions/02_gradient_averaging.ipynb", "abs(ratio - 4) < 1e-9")),
    allow("solutions/02_*.ipynb", "about 50 % agreement",
          "the expected agreement of two independent dropout masks (p = 0.5)"),
    allow("solutions/03_*.ipynb", ("8 MiB", "4 KiB", "16 MiB", "200 steps"),
          SETTING + ": sizes and steps of the runs"),
    allow("solutions/03_*.ipynb", "three times a worker's",
          "arithmetic: 2(P−1)M against a worker's 2M, at P = 4"),
    allow("solutions/04_*.ipynb", ("1 KiB", "8 MiB", "64 MiB", "1 MiB", "1 GiB"),
          SETTING + ": message sizes of the benchmark, of the fit and of the two-level model"),
    allow("solutions/04_*.ipynb", ("450 GB/s", "300 GB/s", "31 GB/s", "400 Gb/s", "50 GB/s",
                                   "200 Gb/s", "25 GB/s", "100 Gb/s", "12.5 GB/s", "0.6 µs"),
          "published: the vendors' figures as S. Bekman's Machine Learning Engineering Open Book "
          "gathers them (its network chapter, linked under the table); 100 Gb/s Ethernet by "
          "its name",
          ("solutions/04_allreduce_algorithms.ipynb", '"InfiniBand NDR": (14e-6, 1 / 50e9)')),
    allow("solutions/04_*.ipynb", ("3.4 µs", "5.7 µs", "14 µs"), "published: hwLat of NCCL "
          "2.20.3's src/graph/tuning.cc (ring, Simple protocol), named under the table; the "
          "model cell uses the same",
          ("solutions/04_allreduce_algorithms.ipynb", '"NVLink 4": (3.4e-6, 1 / 450e9)')),
    allow("solutions/04_*.ipynb", "twice as many",
          "arithmetic: an exchange copies both directions"),
    allow("solutions/04_*.ipynb", ("α ≈ 100 µs", "β ≈ 1 ns"), "example values in a formula; "
          "the cell computes the crossover from the fitted ones"),
    allow("solutions/05_*.ipynb", "1 MiB",
          "torch's default first bucket (_DEFAULT_FIRST_BUCKET_BYTES): a definition"),
    allow("solutions/0[56]_*.ipynb", "10 steps per epoch",
          "arithmetic: --train-images 6000 / a global batch of 600"),
    allow("solutions/06_*.ipynb", "7.8 MB",
          "the size of FashionMNIST's test-image file: a fact of the data set"),
    allow("solutions/06_*.ipynb", ("20 MB/s", "0.15 s", "6 steps"),
          SETTING + ": the simulated download and the run"),
    allow("solutions/06_*.ipynb", "3 steps", SETTING + ": the check's TV_STEPS",
          ("solutions/06_data_sharding.ipynb", "TV_STEPS = 3")),
    allow("solutions/09_*.ipynb", ("120 s before", "100 steps", "60 steps", "60 s"),
          SETTING + ": the templates' --signal and --checkpoint-every, the short run, the lab's "
          "--timeout and roll call"),
    allow("solutions/09_*.ipynb", "120 s by default",
          "Slurm's documented default (the job credential's lifetime): a definition"),
    allow("solutions/10_*.ipynb", ("guessing gives 10 %", "50 % top-5"),
          "chance level over 10 classes: a definition"),
    allow("solutions/10_*.ipynb", "5 epochs",
          "Goyal et al. (2017)'s warm-up, cited in section 4: published"),
    allow("solutions/10_*.ipynb", ("4 epochs", "6 steps"), SETTING),
    allow("solutions/10_*.ipynb", "75–76 %",
          "published: the papers of the table that follows, each cited there"),
    allow("solutions/10_*.ipynb", "102 MB", "arithmetic: 25.6 million float32 parameters"),
    allow("solutions/12_*.ipynb", ("3 epochs", "7.8 MB", "40 MB/s", "64 MB", "1 second", "60 s",
                                   "120 s", "30 s", "3-second"),
          SETTING + ": the bug scripts' data, sizes and timeouts"),
    allow("solutions/12_*.ipynb", ("10 minutes", "30 minutes"), "torch's documented defaults "
          "(init_process_group's docstring, named in the sentence): definitions"),
    allow("solutions/12_*.ipynb", ("half as many", "half as far"),
          "arithmetic: a global batch twice as large"),
    allow("solutions/13_*.ipynb", ("2.8 TB", "1.5 ×"), "arithmetic: 175 × 10⁹ parameters × 4 or "
          "16 bytes; 3Ψ against 2Ψ"),
    allow("solutions/13_*.ipynb", "80 GB GPUs",
          "a GPU model's memory (A100/H100 80 GB): a definition"),
    allow("solutions/13_*.ipynb", ("within 80 %", "5 steps", "within 10 %"),
          SETTING + ": the explorer's rule and the check's"),
    allow("solutions/15_*.ipynb", ("every 10 steps",), SETTING + ": divergence.py's --check-every",
          ("solutions/labs/divergence.py",
           'parser.add_argument("--check-every", type=int, default=10')),
    allow("solutions/14_*.ipynb", ("saving every 2 steps", "saved every 2 steps"),
          SETTING + ": the first two runs' --checkpoint-every",
          ("solutions/14_checkpoints.ipynb", '"--checkpoint-every", 2')),
    allow("solutions/14_*.ipynb", ("every 5 steps",),
          SETTING + ": the failures' --checkpoint-every",
          ("solutions/14_checkpoints.ipynb", '"--checkpoint-every", 5')),
    allow("solutions/14_*.ipynb", ("its 2 epochs", "10-step epoch", "is 2 steps, 1,200 images"),
          SETTING + ": SMALL, 6,000 images in global batches of 600 for 2 epochs; step 12 is 2 "
          "steps of 600 into the second",
          ("solutions/14_checkpoints.ipynb", '"--global-batch-size", 600, "--epochs", 2')),
    allow("solutions/14_*.ipynb", ("a restart of 10 s",), SETTING + ": the explorer's restart_s",
          ("solutions/14_checkpoints.ipynb", "restart_s=10.0")),
]


# ---------------------------------------------------------------- the tests


def test_the_scanner_flags_a_hand_typed_figure_and_passes_a_cited_or_computed_one():
    bad = ["And the accuracy after the same 2 seconds: the smallest batch took about ten times as "
           "many steps as the largest.",
           "DDP still runs its hook, and `--time-split` times it: about a millisecond.",
           "On one process, Horovod's wrapper cost about 17 % here.",
           "PowerSGD at rank 1 sends about a tenth of the bytes, and the study took 19× longer.",
           "The smallest batch reached an accuracy of 0.86 after 268 steps, at 9,273 images/s.",
           "**28 %** of the runtime went to the all-reduce (82 KB per step, 1.7 ms)."]
    for sentence in bad:
        assert scan(sentence), f"not flagged: {sentence}"
    assert [f.figure for f in scan(bad[0])] == ["2 seconds", "ten times"]
    assert [f.figure for f in scan(bad[4])] == ["accuracy of 0.86", "268 steps", "9,273 images/s"]
    good = ["The Horovod scaling study (P. Orlob, a thesis talk on Horovod's scaling, ZIH, "
            "TU Dresden) found **28 %** of the runtime in gradient synchronisation.",
            "Goyal et al. (2017) trained ResNet-50 for 90 epochs in one hour, with a warm-up of 5.",
            "LAMB (You et al., 2019: BERT pre-training in 76 minutes with batches of 64K) is next.",
            "about 0.9 from 8 to 256 GPUs (<https://arxiv.org/abs/1706.02677>).",
            "The check runs the lab four times, and `--max-steps 300` trains for longer.",
            "Two workers, 2 × 64 = global batch 128, 4 × 32 accumulated; ln 10 ≈ 2.30.",
            "The smallest batch took the steps the cell above printed."]
    for sentence in good:
        assert not scan(sentence), f"flagged: {[str(f) for f in scan(sentence)]}"


def test_the_scanner_reads_prose_and_solutions_not_code():
    text = ("Run it:\n\n```bash\nmake horovod   # Horovod from source: about 3 minutes on 2 cores\n"
            "torchrun --max-steps 300 lab.py\n```\n\n"
            "<!-- BEGIN SOLUTION -->\nIt took 5 s.\n<!-- END SOLUTION -->\n"
            "Then `sleep 10 s` and $t = 2 s$.")
    assert [f.figure for f in scan(text)] == ["3 minutes", "5 s"]  # a solution's text is prose too


def test_every_measured_figure_is_computed_cited_or_allowed():
    loose = [str(f) for f in findings() if not any(a.covering(f) for a in ALLOWED)]
    assert not loose, (
        "figures typed by hand next to a measured quantity: print or render each from the run "
        "(display(Markdown(f'…'))), cite a published one (author, year), or add it to ALLOWED "
        "with its reason:\n"
        + "\n".join(loose))


def test_every_allowed_figure_is_still_there_and_its_evidence_holds():
    found = findings()
    for a in ALLOWED:
        used = {a.covering(f) for f in found}
        for text in a.texts:
            assert text in used, \
                f"ALLOWED lists a figure no longer found in {a.files} (remove it): {text!r}"
        if a.evidence:
            path, text = a.evidence
            assert text in source(ROOT / path), \
                f"{a.texts!r}: {path} no longer says {text!r}: is the figure still true?"


def test_the_readme_gives_the_08_study_time_its_logs_give():
    readme = (ROOT / "README.md").read_text()
    said = int(re.search(r"add up to (\d+) minutes", readme).group(1))
    seconds = 0.0
    for log in sorted((ROOT / "results" / "08_large_batches").glob("*.jsonl")):
        seconds += json.loads(log.read_text().strip().splitlines()[-1])["elapsed_s"]
    assert said == round(seconds / 60), \
        f"README says {said} minutes; the study's logs add up to {seconds / 60:.1f}"
