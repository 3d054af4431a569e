"""What the guides name exists as they name it: every job log `dpcourse-…-<job id>.out` they mention
is a template's (its --job-name, and --output=%x-%j.out, or %x-%A_%a.out for an array), the
instructor guide lists every template's job name, and its learner's times are the notebooks' own."""
import json
import re

from conftest import ROOT

DOCS = [ROOT / "README.md", ROOT / "docs" / "instructor.md", ROOT / "slurm" / "README.md",
        ROOT / "container" / "README.md"]


def job_names() -> dict[str, str]:
    """{job name: template} from the templates' #SBATCH lines; each must log to %x-%j.out."""
    names = {}
    for template in sorted((ROOT / "slurm").glob("*.sbatch")):
        text = template.read_text()
        names[re.search(r"^#SBATCH --job-name=(\S+)", text, re.M).group(1)] = template.name
        assert re.search(r"^#SBATCH --output=%x-(%j|%A_%a)\.out", text, re.M), \
            f"{template.name}: not --output=%x-%j.out"
    return names


def test_every_job_log_the_docs_name_is_a_templates():
    names = job_names()
    for doc in DOCS:
        for name in re.findall(r"\b(dpcourse-[\w-]+?)-(?:<job id>|<id>|JOBID|\d+)"
                               r"(?:_<task>)?\.out\b", doc.read_text()):
            assert name in names, (f"{doc.relative_to(ROOT)} names the log of a job called {name}: "
                                   "no template has that name")


def test_the_instructor_guide_lists_every_job_name():
    guide = (ROOT / "docs" / "instructor.md").read_text()
    listed = re.search(r"Every template's job name starts with `dpcourse-`: (.*?); each writes",
                       guide, re.S).group(1)
    assert sorted(re.findall(r"`([\w-]+)`", listed)) == sorted(job_names())


def test_the_guide_gives_each_notebook_the_learners_time_its_first_cell_announces():
    """docs/instructor.md's table and total against "What you will do (≈ N min)" of every
    notebook."""
    guide = (ROOT / "docs" / "instructor.md").read_text()
    table = {row[0]: int(row[1])
             for row in re.findall(r"^\| (\d\d) \| [^|]+ \| (\d+) min \|", guide, re.M)}
    announced = {}
    for nb in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        first = "".join(json.loads(nb.read_text())["cells"][0]["source"])
        announced[nb.name[:2]] = int(re.search(r"What you will do \(≈ (\d+) min\)", first).group(1))
    assert table == announced, \
        f"the guide's learner's times {table} differ from the notebooks' {announced}"
    h, m = map(int, re.search(r"add up to about (\d+) h (\d+) min of learner's time",
                              guide).groups())
    assert 60 * h + m == sum(announced.values()), \
        f"the guide's total {h} h {m} min is not {sum(announced.values())} min"
