# Build and test scaffolding for jax-overlap.
#
#   make test          the test suite on the newest supported jax this machine can run
#   make test-all      the test suite on every supported jax (0.10.2, 0.11.0, 0.12.0.1)
#   make lint          ruff over the repository (its settings: pyproject.toml's [tool.ruff])
#   make test-jaxX     the test suite on jax X alone
#   make fuzz N=500    the differential fuzz tests on N random programs each, on the newest jax
#   make demo          `jax-overlap demo` on the newest jax (DEMO_ARGS: e.g. --steps 50)
#   make bench         benchmarks/bench.py on every supported jax, then make bench-aot and bench-moe
#   make bench-aot     benchmarks/bench_vs_xla.py: fsdp_scan against XLA's own overlap on the
#                      real TPU v5e / H100 compilers, ahead of time, in .venv-aot
#   make bench-moe     benchmarks/bench_moe.py: expert_parallel's chunks against a synchronous
#                      all-to-all dispatch, one MoE block on the real H100 compiler, in .venv-aot
#   make conformance   ../shared/conformance/run.sh against jax_overlap on jax 0.12.0.1
#   make test-aot      tests/aot/ (the real TPU and GPU compilers, ahead of time) in .venv-aot
#   make test-aot-jaxX tests/aot/'s older-jax subset on jax X (0.10.2, 0.11.0) in .venv-aot-jaxX
#   make venvs         create/refresh every venv without testing
#   make clean         remove the venvs and build leftovers
#
# Variables: PYTEST_ARGS (extra pytest arguments), PYTEST_XDIST (pytest worker processes
# for the test targets: a number, `auto` (the default: one a core) or 0 for one process
# without xdist), CONFORMANCE_ARGS (e.g. --lift-gates),
# DEMO_ARGS (e.g. --steps 50), BENCH_ARGS (e.g. --quick), BENCH_AOT_ARGS (e.g. --layers 4),
# BENCH_MOE_ARGS (e.g. --targets gpu_h100 tpu_v5e), N (random programs per fuzz
# test), PY311 / PY312 (override the interpreters found below).
#
# Each jax version gets its own venv, .venv-jaxX, built from nothing by its stamp
# .venv-jaxX/.installed (remade when pyproject.toml or constraints/jax-X.txt changes):
# jax 0.10.2 on Python 3.11, jax 0.11.0 and 0.12.0.1 on Python >= 3.12 (they need it).

SHELL := /bin/bash
.DEFAULT_GOAL := test
.DELETE_ON_ERROR:

JAX_VERSIONS := 0.10.2 0.11.0 0.12.0.1

# --- interpreters -------------------------------------------------------------
# A pyenv shim such as `python3.12` may exist on PATH and still answer "command not
# found", so every candidate is run (`X -c 'import sys'`) and the first that works wins.
ifndef PYENV_ROOT
PYENV_ROOT := $(shell pyenv root 2>/dev/null)
endif
# $(call pyenv_pythons,3.12): pyenv's versions/3.12*/bin/python3.12, newest first.
pyenv_pythons = $(if $(PYENV_ROOT),$(shell ls -1d $(PYENV_ROOT)/versions/$(1)*/bin/python$(1) 2>/dev/null | sort -rV))
# $(call first_working,CANDIDATES): the first candidate that runs.
first_working = $(firstword $(foreach c,$(1),$(if $(shell $(c) -c 'import sys' >/dev/null 2>&1 && echo ok),$(c))))

ifndef PY311
PY311 := $(call first_working,python3.11 $(call pyenv_pythons,3.11))
endif
ifndef PY312
PY312 := $(call first_working,python3.12 $(call pyenv_pythons,3.12) python3.13 $(call pyenv_pythons,3.13))
endif

# The interpreter each jax version's venv is made with.
PY_FOR_0.10.2   := $(PY311)
PY_FOR_0.11.0   := $(PY312)
PY_FOR_0.12.0.1 := $(PY312)

# The newest jax this machine can run: 0.12.0.1 with Python >= 3.12, else 0.10.2.
NEWEST := $(if $(PY312),0.12.0.1,0.10.2)

venv  = .venv-jax$(1)
stamp = .venv-jax$(1)/.installed
STAMPS := $(foreach v,$(JAX_VERSIONS),$(call stamp,$(v)))

# Packages go in with uv (from PyPI, pinned; kept in .venv-uv): a venv takes about 10 s
# where pip took 70 s here (jax 0.12.0.1's, uv with an empty cache, pip with a full one),
# and .ci/run builds six. `$(UV_PIP) ARGS` in a venv's recipe installs ARGS into it.
UV_VERSION := 0.13.9
UV := .venv-uv/bin/uv
$(UV):
	@echo "--- .venv-uv: uv $(UV_VERSION)"
	@test -x .venv-uv/bin/python || $(firstword $(PY312) $(PY311) python3) -m venv .venv-uv
	.venv-uv/bin/python -m pip install -q uv==$(UV_VERSION)
UV_PIP = VIRTUAL_ENV=$(abspath $(@D)) $(UV) pip install -q

# --- venvs --------------------------------------------------------------------
.venv-jax%/.installed: pyproject.toml constraints/jax-%.txt | $(UV)
	@if [ -z "$(PY_FOR_$*)" ]; then \
	  echo "error: no Python interpreter for jax $* (0.10.2 needs python3.11; 0.11.0 and 0.12.0.1 need python3.12 or 3.13)." >&2; \
	  echo "       Install one (e.g. with pyenv) or pass PY311=/path/to/python3.11 / PY312=/path/to/python3.12." >&2; \
	  exit 1; fi
	@echo "--- $(@D): jax $* on $(PY_FOR_$*)"
	@test -x $(@D)/bin/python || $(PY_FOR_$*) -m venv $(@D)
	$(UV_PIP) -c constraints/jax-$*.txt -e '.[test,report,demo]'
	@touch $@

.PHONY: venvs
venvs: $(STAMPS)

# --- tests --------------------------------------------------------------------
# pytest's exit status (5 when no test was collected) is the recipe's own status.
#
# The tests are spread over PYTEST_XDIST worker processes (pytest-xdist), a test file a
# worker at a time (--dist loadfile: a file's jit caches and module fixtures are built once,
# in one process). One pytest process keeps at most one core busy (XLA:CPU compiles on one
# thread), so on the 2-core machine `auto` (2 workers) halves `make test`'s time. .ci/run
# runs `make test` so (its largest step) and passes PYTEST_XDIST=0 to the older jax's steps,
# which run beside it.
PYTEST_XDIST ?= auto
XDIST_ARGS = $(if $(filter 0,$(PYTEST_XDIST)),-p no:xdist,-n $(PYTEST_XDIST) --dist loadfile)

.PHONY: test test-all
test: $(call stamp,$(NEWEST))
	$(call venv,$(NEWEST))/bin/python -m pytest -q $(XDIST_ARGS) tests $(PYTEST_ARGS)

test-all: $(foreach v,$(JAX_VERSIONS),test-jax$(v))

define per_version
.PHONY: test-jax$(1) bench-jax$(1)
test-jax$(1): $(call stamp,$(1))
	$(call venv,$(1))/bin/python -m pytest -q $$(XDIST_ARGS) tests $$(PYTEST_ARGS)
bench-jax$(1): $(call stamp,$(1))
	$(call venv,$(1))/bin/python benchmarks/bench.py $$(BENCH_ARGS)
endef
$(foreach v,$(JAX_VERSIONS),$(eval $(call per_version,$(v))))

# --- lint ---------------------------------------------------------------------
.PHONY: lint
lint: $(call stamp,$(NEWEST))
	$(call venv,$(NEWEST))/bin/ruff check .

# --- the real TPU and GPU compilers, ahead of time ---------------------------------
# .venv-aot: jax 0.12.0.1 plus libtpu and the CUDA compile wheels (the `aot` extra, about
# 1.2 GB), kept apart from .venv-jax0.12.0.1 so the main suite never loads a plugin.
# tests/aot/ compiles for TPU v5e / v5p and GPU H100 / A100 without any accelerator.
AOT_VENV := .venv-aot
AOT_PINS := constraints/jax-0.12.0.1.txt constraints/aot-jax-0.12.0.1.txt

$(AOT_VENV)/.installed: pyproject.toml $(AOT_PINS) | $(UV)
	@if [ -z "$(PY312)" ]; then \
	  echo "error: no Python >= 3.12 for $(AOT_VENV) (jax 0.12.0.1 needs it); pass PY312=/path/to/python3.12." >&2; \
	  exit 1; fi
	@echo "--- $(@D): jax 0.12.0.1 + the aot extra on $(PY312)"
	@test -x $(@D)/bin/python || $(PY312) -m venv $(@D)
	$(UV_PIP) $(foreach c,$(AOT_PINS),-c $(c)) -e '.[test,aot]'
	@touch $@

.PHONY: test-aot
test-aot: $(AOT_VENV)/.installed
	$(AOT_VENV)/bin/python -m pytest -q tests/aot $(PYTEST_ARGS)

# The same compilers for the older jax: .venv-aot-jaxX (jax X, its own CUDA plugin wheels and
# the libtpu its `jax[tpu]` extra names, pinned in constraints/aot-jax-X.txt) and
# `make test-aot-jaxX`, which runs tests/aot's older-jax subset (the `newest_jax` marker: the
# written order, the five futures and fsdp_scan on TPU v5e and GPU H100, named in
# tests/aot/real_compilers_test.py; the rest skip there).
AOT_OLDER := 0.10.2 0.11.0
aot_venv = .venv-aot-jax$(1)
AOT_OLDER_STAMPS := $(foreach v,$(AOT_OLDER),$(call aot_venv,$(v))/.installed)

.venv-aot-jax%/.installed: pyproject.toml constraints/jax-%.txt constraints/aot-jax-%.txt | $(UV)
	@if [ -z "$(PY_FOR_$*)" ]; then \
	  echo "error: no Python interpreter for jax $* (see PY311 / PY312)." >&2; exit 1; fi
	@echo "--- $(@D): jax $* + its TPU/GPU compile wheels on $(PY_FOR_$*)"
	@test -x $(@D)/bin/python || $(PY_FOR_$*) -m venv $(@D)
	$(UV_PIP) -c constraints/jax-$*.txt -r constraints/aot-jax-$*.txt -e '.[test]'
	@touch $@

.PHONY: aot-venvs
aot-venvs: $(AOT_VENV)/.installed $(AOT_OLDER_STAMPS)

define aot_per_version
.PHONY: test-aot-jax$(1)
test-aot-jax$(1): $(call aot_venv,$(1))/.installed
	$(call aot_venv,$(1))/bin/python -m pytest -q tests/aot $$(PYTEST_ARGS)
endef
$(foreach v,$(AOT_OLDER),$(eval $(call aot_per_version,$(v))))

# --- fuzzing --------------------------------------------------------------------
# `make test` runs tests/integration/fuzz_test.py on a fixed, derandomized budget; `make fuzz` runs N
# new random programs per fuzz test (hypothesis prints how to reproduce a failure). Each
# program is written to out/fuzz-last-program.py before it is compiled: if XLA takes the
# process down, that file holds the program that did it.
N ?= 200

.PHONY: fuzz
fuzz: $(call stamp,$(NEWEST))
	@mkdir -p out
	JAX_OVERLAP_FUZZ_EXAMPLES=$(N) JAX_OVERLAP_FUZZ_LOG=out/fuzz-last-program.py \
	  $(call venv,$(NEWEST))/bin/python -m pytest -q tests/integration/fuzz_test.py \
	  --hypothesis-show-statistics $(PYTEST_ARGS)

# --- demo, benchmarks ---------------------------------------------------------
.PHONY: demo bench
demo: $(call stamp,$(NEWEST))
	$(call venv,$(NEWEST))/bin/jax-overlap demo $(DEMO_ARGS)

bench: $(foreach v,$(JAX_VERSIONS),bench-jax$(v)) bench-aot bench-moe

# Writes benchmarks/results/bench-vs-xla.{md,json} and the generated parts of
# docs/bench-vs-xla.md and docs/benchmarks.md; one compile a process (46 min on 2 busy cores).
.PHONY: bench-aot
bench-aot: $(AOT_VENV)/.installed
	PYTHONPATH=$(CURDIR)/src $(AOT_VENV)/bin/python benchmarks/bench_vs_xla.py $(BENCH_AOT_ARGS)

# Writes benchmarks/results/bench-moe.{md,json}; one compile a process (about a minute).
.PHONY: bench-moe
bench-moe: $(AOT_VENV)/.installed
	PYTHONPATH=$(CURDIR)/src $(AOT_VENV)/bin/python benchmarks/bench_moe.py $(BENCH_MOE_ARGS)

# --- conformance --------------------------------------------------------------
CONFORMANCE_RUN := ../shared/conformance/run.sh

.PHONY: conformance
ifneq ($(wildcard $(CONFORMANCE_RUN)),)
conformance: $(call stamp,0.12.0.1)
	bash $(CONFORMANCE_RUN) $(abspath $(call venv,0.12.0.1)/bin/python) jax_overlap $(CONFORMANCE_ARGS)
else
conformance:
	@echo "conformance: $(CONFORMANCE_RUN) is absent; skipped."
endif

# --- misc ---------------------------------------------------------------------
.PHONY: clean print-%
clean:
	rm -rf .venv-uv $(foreach v,$(JAX_VERSIONS),$(call venv,$(v))) $(AOT_VENV) $(foreach v,$(AOT_OLDER),$(call aot_venv,$(v))) build dist src/*.egg-info

# `make -s print-PY312` prints a variable (used by .ci/run).
print-%:
	@echo '$($*)'
