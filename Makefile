# Two commands on a fresh machine: `make demo` (the main job, CPU) and `make test`.
# Both create or reuse the virtual environment at .venv in the checkout.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.verl-dppo-installed

.PHONY: venv test demo staleness bench clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch 2.13.0; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/verl-dppo demo --out out/demo

# Not part of `make demo`: each demo method with rollouts 0, 1, 2, 4, 8 versions stale (docs/staleness.md).
staleness: $(STAMP)
	$(VENV)/bin/verl-dppo staleness --out out/staleness

test: $(STAMP)
	$(PY) -m pytest -q --durations=15 tests

bench: $(STAMP)
	$(PY) bench/bench_loss.py --repeats 25

clean:
	rm -rf $(VENV) *.egg-info
