# tensorkv: `make run` runs MXNet's KVStore tutorial on the embedded store;
# `make test` sets up .venv, installs everything and runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint proto clean

include bench/mxnet.mk

$(STAMP): pyproject.toml setup.py $(wildcard protos/tensorkv/v1/*.proto)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) examples/tutorial.py

lint: $(STAMP)
	$(VENV)/bin/buf lint

test: lint
	$(PY) -m pytest -q

proto: $(STAMP)
	$(PY) -c 'import setup; setup.generate_protos()'

clean:
	rm -rf $(VENV) $(MXNET_VENV) build *.egg-info client/tensorkv/v1/*_pb2*.py client/tensorkv/v1/*_pb2*.pyi

# `make bench`: tensorkv next to raw TCP, plain gRPC and (when `make bench-mxnet`
# has written bench-results/mxnet.json) MXNet 1.9.1, measured on 127.0.0.1;
# writes bench-results/bench.json and bench-results/throughput.png.
# `make bench BENCH_ARGS=--quick` is a fast smoke run.
BENCH_STAMP := $(VENV)/.bench-installed
BENCH_ARGS ?=

.PHONY: bench

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $@

bench: $(BENCH_STAMP)
	$(PY) bench/run.py $(BENCH_ARGS)
