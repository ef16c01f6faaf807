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
