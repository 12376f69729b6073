# Two commands for a new user: `make demo` and `make test`.  Both create .venv when
# missing and install the package editable with every backend (CPU builds).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.abstractdiff-installed
# torch==2.13.0 resolves to the CPU wheel on these machines; a looser spec can pull a
# multi-GB CUDA build.  Everything else comes from pyproject's extras.
TORCH_SPEC ?= torch==2.13.0
PYTEST_WORKERS ?= 2

.PHONY: demo test wheel-test lint docs bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PY)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" -e ".[all,test,docs]"
	touch $@

# PyTensor's default mode compiles each new function with Numba (about a second each, cached
# in ~/.pytensor): the check compiles hundreds, so it uses FAST_COMPILE unless you set the flags.
demo: $(STAMP)
	PYTENSOR_FLAGS="$${PYTENSOR_FLAGS:-mode=FAST_COMPILE}" $(VENV)/bin/abstractdiff check

# --dist worksteal: a worker out of tests takes the other's pending ones (a few tests take
# 30-60 s; with fixed shares one core can sit idle at the end)
test: $(STAMP)
	$(PY) -m ruff check abstractdiff adapters tests conformance_tests benchmarks examples
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist worksteal --doctest-modules abstractdiff tests conformance_tests

# The package as users install it: build the wheel, install it into a fresh virtualenv (the
# backends borrowed from .venv through a .pth file, so nothing is downloaded again) and run
# tests/wheel/smoke.py from outside the tree, where only the installed package can be imported.
WHEEL_DIR := build/wheel-test
wheel-test: $(STAMP)
	rm -rf $(WHEEL_DIR) && mkdir -p $(WHEEL_DIR)
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation -w $(WHEEL_DIR)/dist .
	$(PYTHON) -m venv $(WHEEL_DIR)/venv
	$(WHEEL_DIR)/venv/bin/python -m pip install --quiet --no-deps --no-index $(WHEEL_DIR)/dist/abstractdiff-*.whl
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
		"$$($(WHEEL_DIR)/venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/abstractdiff-deps.pth"
	cd $(WHEEL_DIR) && PYTENSOR_FLAGS="$${PYTENSOR_FLAGS:-mode=FAST_COMPILE}" venv/bin/python $(CURDIR)/tests/wheel/smoke.py

lint: $(STAMP)
	$(PY) -m ruff check abstractdiff adapters tests conformance_tests benchmarks examples

# The documentation site, into site/ (gitignored).  --strict: a broken link, a missing
# anchor or any warning fails the build; tests/test_docs.py runs the same build in
# `make test`, and runs every code example of the docs and README.
docs: $(STAMP)
	$(PY) -m mkdocs build --strict

bench: $(STAMP)
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) site build *.egg-info
