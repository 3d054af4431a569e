"""pyproject.toml and environment.yml must list the same packages with the same pins."""
import re

import pytest
import tomllib

# conda-forge names that differ from PyPI's
CONDA_TO_PIP = {"pytorch": "torch", "matplotlib-base": "matplotlib"}
NOT_PACKAGES = {"python", "pip"}


def pip_requirements(pyproject_text: str) -> dict[str, str]:
    project = tomllib.loads(pyproject_text)["project"]
    extras = project["optional-dependencies"]
    reqs = project["dependencies"] + extras["dev"]
    for req in list(reqs):  # dev names other extras of the course itself: dpcourse[room]
        if m := re.fullmatch(r"dpcourse\[([\w,-]+)\]", req.strip()):
            reqs.remove(req)
            reqs += [r for extra in m.group(1).split(",") for r in extras[extra]]
    out = {}
    for req in reqs:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(.*)", req.strip())
        out[m.group(1).lower()] = m.group(2).replace(" ", "")
    return out


def conda_requirements(env_text: str) -> dict[str, str]:
    out = {}
    deps = env_text.split("\ndependencies:", 1)[1]  # the channels list is not packages
    for line in deps.splitlines():
        m = re.fullmatch(r"\s*-\s+([A-Za-z0-9_.-]+)\s*([=<>!~][^#\s]*)?\s*(#.*)?", line)
        if not m or m.group(1) in NOT_PACKAGES:
            continue
        name = CONDA_TO_PIP.get(m.group(1).lower(), m.group(1).lower())
        out[name] = (m.group(2) or "").replace(" ", "")
    return out


def disagreements(pyproject_text: str, env_text: str) -> list[str]:
    pip, conda = pip_requirements(pyproject_text), conda_requirements(env_text)
    problems = [f"{n}: only in pyproject.toml" for n in pip.keys() - conda.keys()]
    problems += [f"{n}: only in environment.yml" for n in conda.keys() - pip.keys()]
    problems += [f"{n}: pyproject says {pip[n]!r}, environment.yml says {conda[n]!r}"
                 for n in pip.keys() & conda.keys() if pip[n] != conda[n]]
    return sorted(problems)


def test_pyproject_and_environment_agree(root):
    problems = disagreements((root / "pyproject.toml").read_text(),
                             (root / "environment.yml").read_text())
    assert not problems, "pyproject.toml and environment.yml disagree:\n" + "\n".join(problems)


def test_torch_pins_are_exact(root):
    pip = pip_requirements((root / "pyproject.toml").read_text())
    assert pip["torch"] == "==2.14.1" and pip["torchvision"] == "==0.29.1"


@pytest.mark.parametrize("edit", [
    lambda t: t.replace("  - tqdm>=4.66\n", ""),                      # a package dropped
    lambda t: t.replace("torchvision==0.29.1", "torchvision==0.28.0"),  # a pin changed
    lambda t: t + "  - scipy>=1.11\n",                                 # a package added
])
def test_the_check_catches_a_disagreement(root, edit):
    env = (root / "environment.yml").read_text()
    env = env.replace("  - pip:\n      - -e .\n", "")  # keep appended lines in the list
    assert disagreements((root / "pyproject.toml").read_text(), edit(env))
