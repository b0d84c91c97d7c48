# Trainyard: `make demo` and `make test` are all a newcomer needs (see README.md).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU wheel by default. On a CUDA machine: make install TORCH_INDEX=https://download.pytorch.org/whl/cu128
# The torch build is part of the environment: the choice is recorded in $(TORCH_RECORD) and sticks
# (a later `make test` keeps the CUDA torch) until a command line names another; TORCH_INDEX= goes back to CPU.
TORCH_RECORD = $(VENV)/torch-source
TORCH_SPEC ?= $(or $(shell sed -n 1p $(TORCH_RECORD) 2>/dev/null),torch==2.13.0)
TORCH_INDEX ?= $(shell sed -n 2p $(TORCH_RECORD) 2>/dev/null)
TORCH_CHOICE = $(TORCH_SPEC)|$(TORCH_INDEX)
STAMP = $(BIN)/.installed-$(shell printf '%s' '$(TORCH_CHOICE)' | cksum | cut -d' ' -f1)
TRAINYARD_HOME ?= $(CURDIR)/.trainyard
export TRAINYARD_HOME
# The embedded defaults; with TRAINYARD_ENV=cluster (or cluster+slurm) both come from the environment or
# from the file `make cluster-up` writes (pipelines/environment.py).
ifeq ($(filter cluster%,$(TRAINYARD_ENV)),)
export DAGSTER_HOME ?= $(TRAINYARD_HOME)/dagster_home
export MLFLOW_TRACKING_URI ?= sqlite:///$(TRAINYARD_HOME)/mlflow/mlflow.db
endif
PYTEST_ARGS ?=
# make test runs the suite in this many pytest-xdist workers, each module whole on one worker, longest
# modules first (tests/conftest.py, docs/testing.md); PYTEST_WORKERS=0 runs it in this one process.
PYTEST_WORKERS ?= 2

.PHONY: install demo test mutants lint ui lock clean bench slurm-up slurm-down cluster-up cluster-down

# The stamp is newer than every file that decides the environment and is named by the torch
# choice, so install is idempotent and another TORCH_SPEC/TORCH_INDEX installs again.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	rm -f $(BIN)/.installed $(BIN)/.installed-*
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# pip takes an installed 2.13.0+cpu as torch==2.13.0 from any index: a changed (or unrecorded) choice
	@# removes the installed build first.
	if [ "$$(paste -sd'|' $(TORCH_RECORD) 2>/dev/null)" != '$(TORCH_CHOICE)' ]; then \
	  $(BIN)/python -m pip uninstall --quiet --yes torch; fi
	$(BIN)/python -m pip install --quiet '$(TORCH_SPEC)' $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	printf '%s\n%s\n' '$(TORCH_SPEC)' '$(TORCH_INDEX)' > $(TORCH_RECORD)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]' --config-settings editable_mode=compat
	touch $@

install: $(STAMP)

demo: install
	$(BIN)/trainyard demo

ui: install
	$(BIN)/python -c "from pipelines.instance import ensure_dagster_home; ensure_dagster_home()"
	$(BIN)/dagster dev -w workspace.yaml

test: install
	$(BIN)/python -m pytest $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

# Does the suite catch plausible bugs? Applies each tests/mutants/*.patch in a temporary copy of this
# checkout and runs the tests its header names; prints the score and fails if any mutant survives
# (docs/testing.md). Not part of `make test`; MUTANTS="name ..." runs some, JOBS=2 two at once.
mutants: install
	$(BIN)/python tests/mutants/run.py $(if $(MUTANTS),--only $(MUTANTS)) $(if $(JOBS),--jobs $(JOBS))

# ruff's rules are in pyproject.toml ([tool.ruff]); CI runs this before the tests.
lint: install
	$(BIN)/ruff check .

# A real SLURM cluster on this machine (as root): munge, MariaDB + slurmdbd, slurmctld, slurmd;
# NODES=N adds N compute nodes, each a network namespace with its own slurmd and CPU (docs/slurm.md).
# tests/test_slurm.py, tests/test_slurm_nodes.py and TRAINYARD_ENV=slurm use it.
NODES ?= 0
slurm-up:
	NODES=$(NODES) bash deploy/slurm/up.sh

slurm-down:
	bash deploy/slurm/down.sh

# The team deployment's services on this machine: PostgreSQL, SeaweedFS (S3), the MLflow server,
# dagster-daemon and the webserver; then `TRAINYARD_ENV=cluster make demo` runs on them (docs/cluster.md).
cluster-up: install
	bash deploy/cluster/up.sh

cluster-down:
	bash deploy/cluster/down.sh

# Every benchmark at full size (tens of minutes on 2 cores); each JSON line is appended, with the commit,
# date and machine, to benchmarks/results/<commit>.jsonl, which is committed so that every figure quoted in
# docs/status.md can be traced. BENCH=step limits it to some. CI runs each with --smoke instead
# (tests/test_benchmarks_smoke.py).
bench: install
	$(BIN)/python -m benchmarks.harness record $(if $(BENCH),--only $(BENCH))

# Re-pin every dependency from the current environment.
lock: install
	$(BIN)/python -m pip freeze --exclude-editable | sed 's/+cpu//' > constraints.txt.new
	{ head -2 constraints.txt; cat constraints.txt.new; } > constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt && rm constraints.txt.new

clean:
	rm -rf $(TRAINYARD_HOME)
