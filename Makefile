# mm-serve: the two commands are `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Pinned pair: a CUDA build that also runs on CPU; on the dev machines it comes from local disk.
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install serve test lint typecheck bench docs clean

# The venv takes about 6 GB (torch's CUDA build); say so up front rather than fail half-way with ENOSPC.
NEED_KB := 6500000
$(VENV)/.installed: pyproject.toml
	@free_kb=$$(df -Pk . | awk 'NR==2 {print $$4}'); \
	if [ -n "$$free_kb" ] && [ "$$free_kb" -lt $(NEED_KB) ]; then \
	  echo "warning: $$((free_kb / 1024)) MiB free here; the install needs about 6.5 GB (torch's CUDA build)" >&2; fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH_PINS)
	$(PIP) install -q -e '.[dev]' $(TORCH_PINS)
	$(PY) -m mm_serve.kernels.cpu_extension || echo "(continuing on the plain-torch CPU kernels)"
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/mm-serve serve $(ARGS)

# ruff, then the layering contracts of pyproject.toml [tool.importlinter] (imports run downward only)
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

typecheck: install
	$(VENV)/bin/mypy -p mm_serve

test: install lint
	$(VENV)/bin/pytest tests

# docs/configuration.md is generated from mm_serve/config.py's field descriptions (tests check it is current).
docs: install
	$(PY) -m mm_serve.config_reference > docs/configuration.md.new && mv docs/configuration.md.new docs/configuration.md

# Benchmarks print their figures; they are not tests (benchmarks/README.md lists every script).
bench: install
	$(PY) benchmarks/cpu_gemm.py
	$(PY) benchmarks/decode_throughput.py
	$(PY) benchmarks/ring_throughput.py
	$(PY) benchmarks/api_overhead.py

-include Makefile.peers

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
