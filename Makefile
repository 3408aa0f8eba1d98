# Two commands for everything:  make up  (run the mesh)  and  make test  (run the tests).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# tritonclient pins an older grpcio/protobuf than servemesh: it gets a venv of its own, used
# by the OIP compatibility test (tests/model/test_model_tritonclient.py) and nothing else.
TRITON_VENV  := .venv-triton
TRITON_STAMP := $(TRITON_VENV)/.installed
# Triton itself (nvidia-pytriton ships a tritonserver binary), for `servemesh bench model
# --against triton` only: pytriton pins its own grpcio/protobuf, and the model runs with torch
# on the CPU inside it (pinned: an unpinned torch pulls a multi-GB CUDA build).
PYTRITON_VENV  := .venv-pytriton
PYTRITON_STAMP := $(PYTRITON_VENV)/.installed

# The fast lane: every test that starts no Envoy and is not slow (tests/conftest.py MESH_PATHS,
# SLOW_PATHS), in under three minutes.
# Both lanes run on TEST_WORKERS pytest-xdist workers; each test's group (a module, a shared
# mesh's modules, the network-namespace tests) runs whole on one worker (tests/conftest.py).
# Three on a 2-core machine: much of a mesh test's time is waiting (health intervals, a
# drill's timed phases), and a third worker fills it (docs/testing.md, 2026-12-02).
TEST_WORKERS ?= 3
PYTEST := $(BIN)/pytest -n $(TEST_WORKERS) --dist loadgroup
.PHONY: up test test-fast typecheck lint install triton-venv pytriton-venv protos check-protos bench fuzz clean

up: $(STAMP)
	$(BIN)/servemesh up

# The type check and the linter run first: a type error fails the run in seconds.
test: $(STAMP) $(TRITON_STAMP) typecheck lint
	$(PYTEST)

test-fast: $(STAMP) $(TRITON_STAMP) typecheck lint
	$(PYTEST) -m "not mesh and not slow"

typecheck: $(STAMP)
	$(BIN)/python -m servemesh.typecheck

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

install: $(STAMP)

# Re-install only when the dependencies change.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

triton-venv: $(TRITON_STAMP)

$(TRITON_STAMP):
	test -x $(TRITON_VENV)/bin/python || $(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/pip install --quiet 'tritonclient[grpc]>=2.50,<3' 'numpy<3'
	touch $(TRITON_STAMP)

pytriton-venv: $(PYTRITON_STAMP)

$(PYTRITON_STAMP):
	test -x $(PYTRITON_VENV)/bin/python || $(PYTHON) -m venv $(PYTRITON_VENV)
	$(PYTRITON_VENV)/bin/pip install --quiet --upgrade pip
	$(PYTRITON_VENV)/bin/pip install --quiet 'torch==2.13.0'
	$(PYTRITON_VENV)/bin/pip install --quiet 'nvidia-pytriton==0.7.0'
	touch $(PYTRITON_STAMP)

# The long fuzz campaign on a mesh of its own (docs/security.md, "Fuzzing"); tests/fuzz/
# runs a short one in `make test`.
fuzz: $(STAMP)
	$(BIN)/servemesh fuzz --requests 10000 --json-out fuzz-report.json

protos: $(STAMP)
	$(BIN)/python -m servemesh.protogen

check-protos: $(STAMP)
	$(BIN)/python -m servemesh.protogen --check

clean:
	rm -rf $(VENV) $(TRITON_VENV) $(PYTRITON_VENV) .servemesh .pytest_cache .mypy_cache
