# pdlb developer entry points. Everything installs into ./.venv from this repo's own files.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv test compare clean

$(BIN)/pdlb: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(BIN)/pdlb

venv: $(BIN)/pdlb

## make compare: every routing policy on the embedded Mooncake trace (default scenario)
compare: venv
	$(BIN)/pdlb sim compare

## make test: the whole test suite
test: venv
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) results
