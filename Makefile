# tensorkv: `make run` runs MXNet's KVStore tutorial on the embedded store;
# `make test` sets up .venv, installs everything and runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint breaking breaking-baseline proto clean

include bench/mxnet.mk

$(STAMP): pyproject.toml setup.py $(wildcard protos/tensorkv/v1/*.proto)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) examples/tutorial.py

lint: breaking
	$(VENV)/bin/buf lint

# `make breaking`: protos/ against protos/baseline.json, the wire contract of the last release
# (a buf image; there is no release tag yet: it is v1 as of 2026-11-23, after shared memory moved
# to sealed memfds (SharedMemoryRegion.name removed) and calls gained incarnations). Added
# fields, methods and messages pass; a renamed, renumbered or removed one fails. A committed
# file works in any clone, shallow or not, on any branch. `make breaking-baseline` rewrites
# it when a release is cut.
BUF_BASELINE := protos/baseline.json

breaking: $(STAMP)
	$(VENV)/bin/buf breaking --against $(BUF_BASELINE)

breaking-baseline: $(STAMP)
	$(VENV)/bin/buf build --exclude-source-info -o -#format=json | $(PY) -m json.tool --indent 1 > $(BUF_BASELINE)

# Four pytest processes at once (pytest-xdist), on two cores too: most of a test's time is spent
# waiting on server and worker processes. A module whose tests share a server runs in one of them
# (pytest.mark.xdist_group, --dist loadgroup).
test: lint
	$(PY) -m pytest -q -n 4 --dist loadgroup

# `make test-slow`: the tests marked slow (minutes each, e.g. waits longer than keepalive
# periods), which `make test` leaves out.
.PHONY: test-slow
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# `make robustness SEEDS=N`: every scenario of tests/robustness with seeds 1..N (`make test`
# runs seed 1); `make robustness SEED=S` replays one seed.
SEEDS ?= 20
.PHONY: robustness
robustness: $(STAMP)
	$(PY) -m pytest -q tests/robustness $(if $(SEED),--seed $(SEED),--seeds $(SEEDS))

# `make test-gpu`: the GPU suite (tests/test_gpu.py) on a machine with a CUDA device, run by
# GPU_PYTHON (one that has CuPy, and torch for its torch tests) on the tree as it is, without
# installing it; the generated modules must be there (`make proto` where grpcio-tools is).
GPU_PYTHON ?= python3
.PHONY: test-gpu
test-gpu:
	PYTHONPATH=$(CURDIR)/client:$(CURDIR)/server$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m pytest -q -rs -m gpu tests/test_gpu.py

# `make bench-gpu`: the GPU baseline (bench/gpu.py) run by GPU_PYTHON on the tree as it is, as
# test-gpu: the machine's limits (device copy, pinned and pageable H2D/D2H, host memcpy) and
# push+pull from CuPy, NumPy and torch values to GPU and CPU servers on this host, Adam on each,
# and a ResNet-50 step through tensorkv.Trainer per route next to torch's own SGD step
# (bench/resnet_step.py); -> bench-results/gpu.{json,md}. Without a CUDA device it measures the
# CPU rows alone and says so. GPU_PYTHON needs, besides CuPy (and torch for the torch and
# ResNet-50 rows), what pyproject.toml pins:
# grpcio 1.85.1, grpcio-health-checking 1.85.1, grpcio-reflection 1.85.1, protobuf 7.36.2 and
# cryptography, whose wheels are carried to a GPU machine whose image lacks them (numpy, numba,
# ml_dtypes, prometheus-client too where missing). `make bench-gpu BENCH_ARGS=--quick`: a smoke run.
.PHONY: bench-gpu
bench-gpu:
	PYTHONPATH=$(CURDIR)/client:$(CURDIR)/server$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) bench/gpu.py $(BENCH_ARGS)

proto: $(STAMP)
	$(PY) -c 'import setup; setup.generate_protos()'

clean:
	rm -rf $(VENV) $(MXNET_VENV) build *.egg-info client/tensorkv/v1/*_pb2*.py client/tensorkv/v1/*_pb2*.pyi

# ---- the server ----------------------------------------------------------------------
# `make server` runs one server in the foreground (PORT, SERVER_ARGS); `make run-dist`
# starts a one-worker server on a free loopback port, runs the tutorial against it
# through TENSORKV_SERVERS, then stops that server by its PID.
PORT ?= 50051
SERVER_ARGS ?= --num-workers 1 --mode sync
FREE_PORT := import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])
# Waits (30 s at most) until something listens on 127.0.0.1:PORT: a worker started before its
# server is refused at once.
WAIT_PORT := import socket, sys, time; sys.exit(None if any(socket.socket().connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 or time.sleep(0.1) for _ in range(300)) else "no server on port " + sys.argv[1])

.PHONY: server run-dist

server: $(STAMP)
	$(PY) -m tensorkv_server --port $(PORT) $(SERVER_ARGS)

run-dist: $(STAMP)
	@port=$$($(PY) -c '$(FREE_PORT)'); \
	$(PY) -m tensorkv_server --port $$port --num-workers 1 --mode sync --log-level WARNING & pid=$$!; \
	trap 'kill $$pid; wait $$pid' EXIT; \
	$(PY) -c '$(WAIT_PORT)' $$port && \
	TENSORKV_SERVERS=127.0.0.1:$$port $(PY) examples/tutorial_dist.py

# `make bench`: tensorkv next to raw TCP, plain gRPC and (once `make bench-mxnet` has
# made .venv-mxnet) MXNet 1.9.1, taking turns row by row, measured on 127.0.0.1;
# writes bench-results/bench.json and bench-results/throughput.png; then the update
# engine's rows (bench/engine.py: CuPy on a GPU, else NumPy) -> bench-results/engine.md;
# then the Trainer's (bench/trainer.py) -> bench-results/trainer.md; then row_sparse_pull's
# (bench/row_sparse.py) -> bench-results/row_sparse.md; then 2-bit gradient compression's
# (bench/compression.py) -> bench-results/compression.md; then push+pull with --metrics-port
# next to without (bench/metrics_overhead.py) -> bench-results/metrics_overhead.md; then the
# failure rows (bench/failures.py) -> bench-results/failures.md.
# `make bench BENCH_ARGS=--quick` is a fast smoke run.
BENCH_STAMP := $(VENV)/.bench-installed
BENCH_ARGS ?=

.PHONY: bench

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $@

# MXNet's columns are measured in the same run once `make bench-mxnet` has made its venv:
# run.py's rows take turns with MXNet's; bench-mxnet's JSON gives compression.py MXNet's 2-bit push.
bench: $(BENCH_STAMP)
	@if [ -x $(MXNET_VENV)/bin/python ]; then $(MAKE) --no-print-directory bench-mxnet; fi
	$(PY) bench/run.py $(BENCH_ARGS) $(if $(wildcard $(MXNET_VENV)/bin/python),--mxnet-python $(MXNET_VENV)/bin/python)
	$(PY) bench/engine.py $(BENCH_ARGS)
	$(PY) bench/trainer.py $(BENCH_ARGS)
	$(PY) bench/row_sparse.py $(BENCH_ARGS)
	$(PY) bench/compression.py $(BENCH_ARGS)
	$(PY) bench/metrics_overhead.py $(BENCH_ARGS)
	$(PY) bench/failures.py $(BENCH_ARGS)

# The server image; ENGINE=docker works too. `make image-smoke` runs the image's server with TLS
# and a token (deploy/image-smoke.sh): health, the tutorial, status, a metrics scrape, a clean stop.
ENGINE ?= podman
IMAGE ?= tensorkv:dev
.PHONY: image image-smoke

image:
	$(ENGINE) build --network=host -t $(IMAGE) .

image-smoke: image $(STAMP)
	deploy/image-smoke.sh $(ENGINE) $(IMAGE) $(PY)

# `make cluster`: two servers and two workers training examples/train.py, from the image, under
# podman-compose (COMPOSE="docker compose" ENGINE=docker works too): deploy/compose/cluster.sh.
COMPOSE ?= podman-compose
.PHONY: cluster cluster-reshard

cluster: image
	ENGINE=$(ENGINE) COMPOSE="$(COMPOSE)" TENSORKV_IMAGE=$(IMAGE) deploy/compose/cluster.sh

# `make cluster-reshard`: a job moved mid-training from 2 servers to 3 and then to 1 with `tensorkv
# reshard` (Adam, its weights sliced over the servers) ends with the same bits (weights and
# optimizer states) as one that never moved, from the image, in plain containers on a network of
# their own (deploy/compose/cluster-reshard.sh; no compose).
cluster-reshard: image
	ENGINE=$(ENGINE) TENSORKV_IMAGE=$(IMAGE) deploy/compose/cluster-reshard.sh
