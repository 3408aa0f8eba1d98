# Two commands for everything:  make up  (run the mesh)  and  make test  (run the tests).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: up test install protos check-protos bench clean

up: $(STAMP)
	$(BIN)/servemesh up

test: $(STAMP)
	$(BIN)/pytest

install: $(STAMP)

# Re-install only when the dependencies change.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

protos: $(STAMP)
	$(BIN)/python -m servemesh.protogen

check-protos: $(STAMP)
	$(BIN)/python -m servemesh.protogen --check

clean:
	rm -rf $(VENV) .servemesh .pytest_cache
