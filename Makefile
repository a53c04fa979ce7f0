# Two entry points on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU build where no CUDA driver is present, so a CPU box never pulls the CUDA wheels.
TORCH_SPEC := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch>=2.4,<3" || echo "torch==2.13.0")

.PHONY: install lint test serve clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,clients]"
	touch $@

install: $(VENV)/.installed

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q -x tests

HOST ?= 127.0.0.1
PORT ?= 8000

serve: install
	$(PY) -m brisk.cli serve --host $(HOST) --port $(PORT)

clean:
	rm -rf $(VENV) build *.egg-info
