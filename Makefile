# Trainyard: `make demo` and `make test` are all a newcomer needs (see README.md).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU wheel by default. On a CUDA machine: make install TORCH_SPEC="torch==2.13.0" TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
TRAINYARD_HOME ?= $(CURDIR)/.trainyard
export TRAINYARD_HOME
export DAGSTER_HOME ?= $(TRAINYARD_HOME)/dagster_home
export MLFLOW_TRACKING_URI ?= sqlite:///$(TRAINYARD_HOME)/mlflow/mlflow.db
PYTEST_ARGS ?=

.PHONY: install demo test lint ui lock clean bench

# The stamp is newer than every file that decides the environment, so install is idempotent.
$(BIN)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]' --config-settings editable_mode=compat
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/trainyard demo

ui: install
	$(BIN)/python -c "from pipelines.instance import ensure_dagster_home; ensure_dagster_home()"
	$(BIN)/dagster dev -w workspace.yaml

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# ruff's rules are in pyproject.toml ([tool.ruff]); CI runs this before the tests.
lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/python -m benchmarks.manifest_scale

# Re-pin every dependency from the current environment.
lock: install
	$(BIN)/python -m pip freeze --exclude-editable | sed 's/+cpu//' > constraints.txt.new
	{ head -2 constraints.txt; cat constraints.txt.new; } > constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt && rm constraints.txt.new

clean:
	rm -rf $(TRAINYARD_HOME)
