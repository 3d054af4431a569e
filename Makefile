# The course's commands. Each bootstraps .venv on first use (Python 3.10+; 3.11 preferred).
#   make course    install, stage FashionMNIST, run every solution notebook into build/, print a table
#   make test      the whole test suite
#   make lab       JupyterLab on your notebooks (notebooks/00_setup.ipynb first)
#   make student   regenerate notebooks/ and labs/ from solutions/ (instructors)
#   make check     run your notebooks and report which exercises pass; make check NB=01: notebook 01 only
#                  make check ROOM=DIR: also leave your verdicts in DIR for the instructor's view of the room
#   make slurm-demo  a two-node Slurm on this machine (as root), one multi-node job, then a clean stop;
#                  make slurm-demo KEEP=1: no job, the cluster stays up for your own sbatch until Ctrl-C
#   make horovod   build Horovod into .venv (notebook 11; a few minutes; not part of make course)
#   make gpu-check on a GPU node: NCCL bandwidth, the labs' speed and memory, one table (build/gpu-check.json)
#
# No GPU? On Linux, PyPI's torch brings 3.2 GB of CUDA libraries. On a fresh clone (or after
# rm -rf .venv), take PyTorch's CPU-only wheels instead:
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu

PYTHON      ?= $(shell command -v python3.11 || command -v python3)
TORCH_INDEX ?=
VENV        := .venv
BIN         := $(VENV)/bin
STAMP       := $(VENV)/.installed-stamp
INSTALL     := $(BIN)/python -m pip install --quiet --disable-pip-version-check
# torch and torchvision exactly as pyproject.toml pins them (torch==… torchvision==…)
TORCH_PINS := $(shell sed -n 's/^ *"\(torch[a-z]*==[^"]*\)",*$$/\1/p' pyproject.toml)
# nbgrader is the instructors' tool (make student, the tests): keep its menus and panels out of
# the learners' JupyterLab. Disabled at .venv's level, a reinstall does not bring them back.
NBGRADER_SERVER_EXTENSIONS := $(addprefix nbgrader.server_extensions.,formgrader validate_assignment assignment_list course_list)
# No "get notified about Jupyter news?" pop-up over the learners' plots, and no calls to the web.
LAB_SETTINGS  := $(VENV)/share/jupyter/lab/settings
LAB_OVERRIDES := {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": false}}

.PHONY: setup data course lab test lint student check slurm-demo horovod gpu-check clean room-setup room-demo

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -n "$(PYTHON)" || { echo "No python3 found: install Python 3.11 (sudo apt-get install python3 python3-venv)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || { echo "Could not create $(VENV): on Debian/Ubuntu run  sudo apt-get install python3-venv"; rm -rf $(VENV); exit 1; }
	$(if $(TORCH_INDEX),$(INSTALL) --index-url $(TORCH_INDEX) $(TORCH_PINS))
	$(INSTALL) -e '.[dev]'
	@$(BIN)/jupyter server extension disable --sys-prefix $(NBGRADER_SERVER_EXTENSIONS) >/dev/null 2>&1
	@$(BIN)/jupyter labextension disable --level=sys_prefix @jupyter/nbgrader >/dev/null 2>&1
	@mkdir -p $(LAB_SETTINGS) && echo '$(LAB_OVERRIDES)' > $(LAB_SETTINGS)/overrides.json
	@touch $(STAMP)

data: setup
	$(BIN)/python -m dpcourse.lab.data fetch

course: data
	$(BIN)/python -m dpcourse.kit.course run

# JupyterLab at the top of the course folder (notebooks/ and labs/ both in its file browser),
# opening notebook 00; as root (containers) it needs --allow-root.
lab: data
	$(BIN)/jupyter lab --ServerApp.root_dir=. --LabApp.default_url=/lab/tree/notebooks/00_setup.ipynb$(if $(filter 0,$(shell id -u)), --allow-root)

# Two pytest-xdist workers (TEST_WORKERS=0: one process): while one test waits on a launcher, a daemon
# or a kernel, the other worker's test has the core; tests/workgroups.py keeps tests that share state on one.
TEST_WORKERS ?= 2
test: setup
	OMP_NUM_THREADS=1 TQDM_DISABLE=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# ruff with pyproject.toml's [tool.ruff] (tests/test_lint.py runs it too)
lint: setup
	$(BIN)/ruff check .

# Refuses to overwrite edited copies in notebooks/ and labs/ (a learner's work) unless FORCE=1.
student: setup
	$(BIN)/python -m dpcourse.kit.course student$(if $(FORCE), --force)

# An unfinished exercise is not a crash: after the summary, end make with SIGPIPE, which neither
# make nor the shell reports (status 141), instead of make's "*** [Makefile:NN: check] Error 1".
# Where SIGPIPE is ignored, `exit 1` still fails the usual way.
check: setup
	@$(BIN)/python -m dpcourse.kit.course check $(if $(NB),--notebook '$(NB)') $(if $(ROOM),--room '$(ROOM)') || { kill -PIPE $$PPID; exit 1; }

# The room's hub (room/jupyterhub_config.py) needs configurable-http-proxy, JupyterHub's proxy: from
# npm, into build/room/ (Debian: apt-get install nodejs npm), exactly as room/proxy/package-lock.json
# has it (every package's version and sha512; npm ci refuses anything else), with no install scripts.
room-setup:
	@command -v npm >/dev/null || { echo "npm is missing: apt-get install nodejs npm"; exit 1; }
	mkdir -p build/room && cp room/proxy/package.json room/proxy/package-lock.json build/room/
	npm ci --prefix build/room --ignore-scripts --no-audit --no-fund --loglevel=error

# The room on this machine (as root): a local two-node Slurm, three test learners with fresh
# passwords and the hub on http://127.0.0.1:8000, until Ctrl-C stops what it started.
room-demo: setup data room-setup
	$(BIN)/python -m dpcourse.cluster.hub demo

# A real two-node Slurm on this machine (root; Debian: apt-get install slurm-wlm munge), one job of
# slurm/multi_node.sbatch across both nodes, then a clean stop: how to try the templates on a laptop.
slurm-demo: data
	$(BIN)/python -m dpcourse.cluster.slurm demo$(if $(KEEP), --keep)

# Horovod 0.28.1 from source, for the torch in .venv: gloo always, MPI where mpicxx is found
# (Debian: apt-get install libopenmpi-dev), NCCL with HOROVOD_GPU_OPERATIONS=NCCL on GPU nodes.
# tools/install_horovod.sh says why a CMake toolchain file is needed (C++14 vs torch's C++20).
horovod: setup
	FORCE=$(FORCE) HOROVOD_GPU_OPERATIONS=$(HOROVOD_GPU_OPERATIONS) tools/install_horovod.sh $(BIN)/python

# On a GPU node, the week before a workshop: the NCCL bus bandwidth, the DDP lab to 90 %, ResNet-50's
# images/s (synthetic and from JPEG files), FSDP vs DDP memory, the clinic's no_set_device, the doctor:
# one table, the figures in build/gpu-check.json. Without a GPU: one line, and a failure (see check:).
gpu-check: setup
	@$(BIN)/python -m dpcourse.cluster.gpucheck --json build/gpu-check.json || { kill -PIPE $$PPID; exit 1; }

clean:
	rm -rf build .pytest_cache
