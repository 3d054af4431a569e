"""docs/design.md, the architecture page, stays true to the code it describes.

Structural checks that read files only (one `git ls-files`, no other process): every module of
src/dpcourse/ is on the page; every repository path the page writes in backticks exists; nothing
else in the repository cites the course's external rules page (the code cites docs/design.md);
every common lab option the page lists is one that solutions/labs/fashion_ddp.py's parser accepts;
every "docs/design.md §N" that the library cites is a section of the page.
"""
import importlib.util
import re
import subprocess
from functools import lru_cache

import pytest

from conftest import ROOT

DOC = ROOT / "docs" / "design.md"
THIS = "tests/test_design_doc.py"
LAB = ROOT / "solutions" / "labs" / "fashion_ddp.py"
# What makes a word in backticks a repository path: a "/" in it, or one of these endings.
SUFFIXES = (".py", ".md", ".sbatch", ".def", ".toml", ".yml")
# Placeholders: folders that the course's commands write and .gitignore ignores, so that a fresh
# clone lacks them and a path under them is a place the page names, not a file that must
# already be there.
GENERATED = {
    "build": "make course's executed notebooks, build/times.json and build/executed.json; make "
             "gpu-check's figures; the browser test's screenshots",
    "data": "FashionMNIST, staged by make data (or the tests' fashion_root fixture)",
    "runs": "the labs' and the scaling studies' run folders",
    ".venv": "the environment make setup creates",
}
# Words the page cites the external rules page by, which no file of the repository may hold.
EXTERNAL = (b"DESIGN.md", b"../shared")


@lru_cache(maxsize=None)
def repository_files(untracked: bool = False) -> tuple[str, ...]:
    """`git ls-files`: the tracked files (and, with ``untracked``, those git does not ignore)."""
    cmd = ["git", "ls-files", "-z"] + (["--cached", "--others", "--exclude-standard"]
                                       if untracked else [])
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as err:
        pytest.skip(f"not a git checkout ({err})")
    return tuple(sorted(name for name in out.decode().split("\0") if name))


def page() -> str:
    return DOC.read_text()


def inline_code(text: str) -> list[str]:
    """The page's inline code spans (`...`), fenced code blocks left out."""
    prose = re.sub(r"^[ \t]*```.*?^[ \t]*```[^\n]*$", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`]+)`", prose)


def path_words(text: str) -> list[str]:
    """The words of the inline code spans that look like repository paths: a "/" in them or a file
    ending of SUFFIXES; not URLs, absolute paths, variables or options."""
    words = []
    for span in inline_code(text):
        for word in span.split():
            word = word.strip("\"'(),;:").split("::")[0]  # tests/x.py::test_y names tests/x.py
            if (not word or word.startswith(("-", "/", "~")) or "$" in word or "://" in word
                    or "=" in word):
                continue
            if re.fullmatch(r"\.\w+", word):  # a file ending (`.py` labs), not a file
                continue
            if "/" in word or word.endswith(SUFFIXES):
                words.append(word)
    return words


def test_every_library_module_is_named_on_the_page():
    library = ROOT / "src" / "dpcourse"
    modules = [f"src/dpcourse/{p.relative_to(library).as_posix()}"
               for p in sorted(library.rglob("*.py")) if p.name != "__init__.py"]
    modules += [f"src/dpcourse/{p.name}/" for p in sorted(library.iterdir())
                if p.is_dir() and (p / "__init__.py").exists()]  # the layers
    assert len(modules) > 10, modules
    named = {word for span in inline_code(page()) for word in span.split()}
    missing = [m for m in modules if m not in named]
    assert not missing, \
        f"docs/design.md §2 does not name these modules (as `src/dpcourse/layer/x.py`): {missing}"


def test_every_path_the_page_names_exists():
    names = {name.rsplit("/", 1)[-1] for name in repository_files(untracked=True)}
    words = path_words(page())
    assert len(words) > 30, words  # the page names its paths in backticks
    missing = []
    for word in dict.fromkeys(words):
        if word.split("/", 1)[0] in GENERATED:
            continue
        if "*" in word:  # a family of files: the glob must match one
            found = any(ROOT.glob(word))
        elif "/" not in word:  # a bare file name (a lab, a template): a file of the repository
            found = (ROOT / word).exists() or word in names
        else:
            found = (ROOT / word).exists()
        if not found:
            missing.append(word)
    assert not missing, (f"docs/design.md names paths that do not exist: {missing} (a family of "
                         f"files is written as a glob; placeholders are only paths under "
                         f"{sorted(GENERATED)})")


def test_nothing_in_the_repository_cites_the_external_rules_page():
    """The code and the other documents cite docs/design.md, never the course's rules page outside
    the repository. This file, which must spell what it looks for, and the page itself are
    left out."""
    offenders = []
    for name in repository_files():
        if name in (THIS, "docs/design.md"):
            continue
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        for word in EXTERNAL:
            if word in data:
                lines = [n for n, line in enumerate(data.splitlines(), 1) if word in line]
                offenders.append(f"{name}:{lines[0]} ({word.decode()})")
    assert not offenders, \
        f"these cite the external rules page; cite docs/design.md and its section: {offenders}"


def test_the_pages_common_options_are_the_ddp_labs(capsys):
    """Each option in the page's **Common options** paragraph is one that fashion_ddp.py's own
    parser (its parse_args, the lab imported as a module: its main() does not run) accepts, with the
    choices the page writes."""
    found = re.search(r"\*\*Common options\.\*\*(.*?)\n\s*\n", page(), re.S)
    assert found, "docs/design.md §3 has no **Common options.** paragraph"
    listed = re.findall(r"`(--[\w-]+)(?: (\{[^}]*\}))?`", found.group(1))
    assert len(listed) >= 15, listed

    spec = importlib.util.spec_from_file_location("design_doc_fashion_ddp", LAB)
    lab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lab)
    capsys.readouterr()
    with pytest.raises(SystemExit) as ended:
        lab.parse_args(["--help"])
    assert ended.value.code == 0
    # no colours, should a terminal ask
    shown = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    accepted = {m.group(1): m.group(2)
                for m in re.finditer(r"^  (--[\w-]+)(?: (\{[^}]*\}))?", shown, re.M)}
    assert "--log-json" in accepted, shown  # the help was read
    unknown = [option for option, _ in listed if option not in accepted]
    assert not unknown, \
        f"docs/design.md lists common options that fashion_ddp.py does not take: {unknown}"
    other = {option: (choices, accepted[option]) for option, choices in listed
             if choices and choices != accepted[option]}
    assert not other, f"docs/design.md's choices differ from the lab's (page, lab): {other}"


def test_the_sections_the_library_cites_are_on_the_page():
    headings = set(re.findall(r"^## (\d+)\. ", page(), re.M))
    cited = {}
    for path in sorted((ROOT / "src" / "dpcourse").rglob("*.py")):
        for section in re.findall(r"docs/design\.md §(\d+)", path.read_text()):
            cited.setdefault(section, []).append(path.relative_to(ROOT).as_posix())
    assert cited, "the library cites no section of docs/design.md"
    dangling = {section: files for section, files in cited.items() if section not in headings}
    assert not dangling, \
        f"docs/design.md has no such section (it has {sorted(headings)}): {dangling}"
