# The course's commands. Each bootstraps .venv on first use (Python 3.10+; 3.11 preferred).
#   make course    install, stage FashionMNIST, run every solution notebook into build/, print a table
#   make test      the whole test suite
#   make lab       JupyterLab on your notebooks (notebooks/00_setup.ipynb first)
#   make student   regenerate notebooks/ and labs/ from solutions/ (instructors)
#   make check     run your notebooks and report which exercises pass

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup data course lab test student check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "No python3 found: install Python 3.11 (sudo apt-get install python3 python3-venv)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || { echo "Could not create $(VENV): on Debian/Ubuntu run  sudo apt-get install python3-venv"; rm -rf $(VENV); exit 1; }
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

data: setup
	$(BIN)/python -m dpcourse.data fetch

course: data
	$(BIN)/python -m dpcourse.course run

lab: data
	$(BIN)/jupyter lab notebooks/00_setup.ipynb

test: setup
	OMP_NUM_THREADS=1 TQDM_DISABLE=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

student: setup
	$(BIN)/python -m dpcourse.course student

check: setup
	$(BIN)/python -m dpcourse.course check

clean:
	rm -rf build .pytest_cache
