# Two commands on a fresh machine: `make demo` runs the main job, `make test` runs the tests.
# Both create (or reuse) the virtual environment in $(VENV) and install what they need.
# torch is asked for in the same pip command as everything else, so pip takes the CPU build on
# this machine; on a GPU machine override it: `make test TORCH_SPEC="torch==2.9.1"`.
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= all,dev,docs
STAMP := $(VENV)/.fp8track-installed
BIN := $(VENV)/bin

.PHONY: install system-deps bytecode demo test test-gpu bench bench-gpu lint check docs

# Debian packages the tests use: PostgreSQL (two sweep workers on one study) and Chromium (the
# report and the MLflow UI rendered headless). Installed only when missing and only as root with
# apt-get (CI); elsewhere the tests say what to install.
system-deps:
	@missing=""; \
	if ! command -v initdb >/dev/null && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then missing="postgresql"; fi; \
	if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then missing="$$missing chromium"; fi; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "note: missing Debian packages:$$missing (apt-get install -y$$missing); their tests will skip"; fi; \
	fi

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

# The package's bytecode, written once: with PYTHONDONTWRITEBYTECODE set (this machine sets it) every process
# would compile fp8track's sources again, about 1 s of CPU in each trial program, CLI and
# torchrun rank the tests start. compileall only rewrites what changed.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q fp8track

demo: $(STAMP) bytecode
	$(BIN)/fp8track demo

# --durations=25: the slowest tests in every run's output (CI's too), so a slow test shows at once.
# -n 2 --dist loadfile (pytest-xdist): two workers, one test file per worker at a time, so a
# module's shared trained fixtures are built once; most tests are single-threaded Python, so two
# workers keep both cores busy; --no-loadscope-reorder keeps tests/conftest.py's order, longest
# files first (tests/helpers/file_order.py), so both workers finish together.
PYTEST_WORKERS ?= 2
test: $(STAMP) system-deps bytecode check docs
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

HAS_CUDA = $(BIN)/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"

# On a machine with CUDA (and Transformer Engine for the TE tests): only the gpu-marked tests
# (under 5 minutes). Without CUDA: "skipped: no CUDA", exit 0.
test-gpu: $(STAMP)
	@if $(HAS_CUDA); then timeout 300 $(BIN)/python -m pytest -q -p no:cacheprovider -m gpu tests/gpu tests/integration/test_nvdlfw_bridge.py; \
	else echo "skipped: no CUDA"; fi

# CPU benchmarks (gpu_bench.py prints {"skipped": "no CUDA"} here); bench-gpu: the GPU one alone.
bench: $(STAMP)
	for b in bench/*_bench.py; do $(BIN)/python $$b; done

bench-gpu: $(STAMP)
	$(BIN)/python bench/gpu_bench.py

lint: $(STAMP)
	$(BIN)/python -m ruff check fp8track tests bench examples

# Lint (ruff, 110-column lines) and type-check the maths and the records (mypy, [tool.mypy]).
# tools/fix_long_lines.py shortens over-long lines without reformatting whole files.
check: lint
	$(BIN)/python -m mypy fp8track/numerics fp8track/monitoring

# The documentation site from docs/ (mkdocs.yml) into site/; --strict: a dead link, a page missing
# from the navigation or a docstring the reference cannot render fails the build (and `make test`).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --quiet
