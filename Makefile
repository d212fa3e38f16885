# Two commands do everything on a fresh clone:  make serve   and   make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
CONFIG ?= configs/default.yaml
PYTEST_ARGS ?=

.PHONY: setup serve test lint loadtest bench clean

setup: $(STAMP)

# The virtual environment is made if missing and re-installed when the pins change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24"
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/dstack serve --config $(CONFIG)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
