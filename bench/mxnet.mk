# `make bench-mxnet`: MXNet 1.9.1 in a venv of its own (.venv-mxnet), as MXNet 1.9.1
# needs numpy<1.24 and tensorkv needs numpy>=1.24; `make bench` then has bench/run.py's
# rows take turns with MXNet's clusters of that venv.  The target itself writes MXNet's
# plain and 2-bit pushes (bench/mxnet_ref.py), which bench/compression.py prints.
# Included by the main Makefile.
MXNET_PYTHON ?= python3
MXNET_VENV := .venv-mxnet
MXNET_STAMP := $(MXNET_VENV)/.installed
MXNET_JSON ?= bench-results/mxnet.json

.PHONY: bench-mxnet

$(MXNET_STAMP):
	@$(MXNET_PYTHON) -c 'import sys; sys.exit(sys.version_info >= (3, 12))' || { \
	  echo "bench-mxnet: $(MXNET_PYTHON) is Python 3.12 or newer; mxnet==1.9.1 needs" \
	    "numpy<1.24, which has no wheels for it: set MXNET_PYTHON to a Python 3.8-3.11" >&2; \
	  exit 1; }
	$(MXNET_PYTHON) -m venv $(MXNET_VENV)
	$(MXNET_VENV)/bin/python -m pip install --quiet --only-binary=:all: \
	  mxnet==1.9.1 'numpy<1.24' || { \
	  echo "bench-mxnet: could not install mxnet==1.9.1 and numpy<1.24 into" \
	    "$(MXNET_VENV) (pip's error is above)" >&2; \
	  exit 1; }
	$(MXNET_VENV)/bin/python -c 'import mxnet' || { \
	  echo "bench-mxnet: mxnet==1.9.1 installed but does not import (error above)" >&2; \
	  exit 1; }
	touch $@

bench-mxnet: $(MXNET_STAMP)
	mkdir -p $(dir $(MXNET_JSON))
	$(MXNET_VENV)/bin/python bench/mxnet_ref.py --json $(MXNET_JSON)
