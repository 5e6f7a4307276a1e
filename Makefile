# `make bench`: set up .venv and run the benchmark (GPU if there is one, else a small CPU run).
# `make test`:  set up .venv and run the whole test suite (CPU, and the Triton kernels under the
#               Triton interpreter in two round-robin shards, as three concurrent processes: tools/run_tests.sh).
PY := .venv/bin/python
.PHONY: setup bench test test-fast test-interpret clean

setup: .venv/.recfuse-setup

.venv/.recfuse-setup: tools/setup_env.sh pyproject.toml
	bash tools/setup_env.sh
	touch $@

bench: setup
	$(PY) benchmarks/split_stack_vs_combined.py $(BENCH_ARGS)

test: setup
	PY=$(PY) bash tools/run_tests.sh $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not interpret and not slow" -x $(PYTEST_ARGS)

test-interpret: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m interpret $(PYTEST_ARGS)

clean:
	rm -rf .venv .pytest_cache .hypothesis
